"""The one batching rule of the policy: who joins a forward, how long a batch is held, each
request's own noise, and what a failed forward does. Two front ends drive it:
`pisft.policy.replicas.PolicyPool` (threads, the closed loop and the rollout collection) and
`pisft.serve.policy_server.PolicyServer` (asyncio, the websocket server).

**Who joins.** The requests waiting, oldest first, at most `max_batch` (0: no limit), at most one
per key (a connection, an environment): a second request of a key already in the batch waits for
the next forward (`BatchRule.take`).

**How long a batch is held.** A batch that could still grow (fewer waiting than could join) may
be held for the others:
- `wait_s > 0`: until its oldest request has waited `wait_s` (a hand-set window: `serve
  --policy-batch-wait-ms`, `eval.policy_batch_wait_ms`);
- `wait_s == 0` with `adaptive`: from what the rule measures. It keeps a running mean of the
  forward's time and of the simulation time of a chunk (from the actions sent to an environment
  to its next request) and of an episode's start (to its first request). A batch is held while
  an environment still simulating is expected back (when it was sent its actions or its episode,
  plus that mean) before the oldest request has waited one forward,
  and never longer: a request that misses a forward waits a whole forward for the next, so
  holding for less pays (`BatchRule.hold_s`). Where the simulation is much longer than a forward
  (LIBERO's renders), an environment is seldom expected within a forward and a hold, when there
  is one, costs at most a forward; where the forward dominates (a fast simulator, a large model),
  the environments answered together come back together and share the next forward;
- `wait_s == 0` without `adaptive` (a server, which does not know its clients' simulation):
  never held.

**Each request's own noise.** The caller hands each request's noise generator (or seed) with it;
`Policy.predict_many` draws each request's noise from its own, so a chunk does not depend on the
requests it is batched with nor on the replica that computes it, to float32 rounding: a forward
rounds by its number of rows. The thread front end's stages fix those rows
(`pisft.policy.fixed_shape`), so there the bits do not depend on the batches either; the server
batches by arrival time.

**One failure rule.** A forward that raises (or answers the wrong number of replies) is retried
request by request (`answer_each`): the bad request errs alone, its batch-mates are answered.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

# Weight of the newest measurement in the running means (about the last 5 count).
SMOOTHING = 0.2


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Outcome:
    """One request's answer: the reply, or the exception its forward raised (alone)."""

    reply: dict | None
    error: BaseException | None


def answer_each(forward: Callable[[list, list], Sequence[dict]], items: Sequence[Any],
                noise_of: Callable[[int], Any]) -> list[Outcome]:
    """`forward(items, noises)` once; when it raises or answers a different number of replies,
    each request alone, so one bad request errs alone (the rule's one failure rule).
    `noise_of(i)`: request i's noise as it is before any draw, asked again for every attempt (a
    failed forward may have drawn from it), so a request retried alone gets the chunk it gets
    alone."""
    if len(items) > 1:
        try:
            replies = list(forward(list(items), [noise_of(i) for i in range(len(items))]))
            if len(replies) != len(items):
                raise RuntimeError(f"the policy answered {len(replies)} replies for {len(items)} requests")
            return [Outcome(reply, None) for reply in replies]
        except Exception:  # noqa: BLE001 - each request alone below: the bad one errs, the others are answered
            pass
    out = []
    for i, item in enumerate(items):
        try:
            replies = list(forward([item], [noise_of(i)]))
            if len(replies) != 1:
                raise RuntimeError(f"the policy answered {len(replies)} replies for 1 request")
            out.append(Outcome(replies[0], None))
        except Exception as exc:  # noqa: BLE001 - this request's error
            out.append(Outcome(None, exc))
    return out


def rewinding(noises: Sequence[Any]) -> Callable[[int], Any]:
    """`noise_of` for stateful generators (a server connection's): each attempt starts from the
    state the generator had before the first (`torch.Generator.get_state/set_state`)."""
    states = [n.get_state() if hasattr(n, "get_state") else None for n in noises]

    def noise_of(i: int) -> Any:
        if states[i] is not None:
            noises[i].set_state(states[i])
        return noises[i]

    return noise_of


class BatchRule:
    """The rule (module docstring). `max_batch`: requests in one forward at most (0: no limit);
    `wait_s`: a hand-set hold (0: measured when `adaptive`, else none)."""

    def __init__(self, *, max_batch: int = 0, wait_s: float = 0.0, adaptive: bool = True) -> None:
        if max_batch < 0:
            raise ValueError(f"max_batch must be 0 (no limit) or positive, got {max_batch}")
        if not wait_s >= 0:
            raise ValueError(f"wait_s must be a number of seconds >= 0, got {wait_s!r}")
        self.max_batch = max_batch
        self.wait_s = float(wait_s)
        self.adaptive = adaptive
        self.forward_s: float | None = None  # running mean of a forward's seconds
        # running means of the simulation's seconds: "chunk" (actions to the next request) and
        # "start" (an episode's start to its first request)
        self.simulation_s: dict[str, float] = {}

    def limit(self, waiting: int) -> int:
        """Requests the next forward takes of `waiting`."""
        return min(waiting, self.max_batch) if self.max_batch else waiting

    def take(self, waiting: Iterable[T], key: Callable[[T], Hashable] = id,
             batch: list[T] | None = None) -> tuple[list[T], list[T]]:
        """(the batch, the rest in order): oldest first, one per key, up to `max_batch`; `batch`:
        requests already in it."""
        batch = [] if batch is None else batch
        keys = {key(job) for job in batch}
        rest: list[T] = []
        for job in waiting:
            if (self.max_batch and len(batch) >= self.max_batch) or key(job) in keys:
                rest.append(job)
                continue
            batch.append(job)
            keys.add(key(job))
        return batch, rest

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new

    def forward_done(self, seconds: float) -> None:
        self.forward_s = self._mean(self.forward_s, seconds)

    def simulated(self, seconds: float, kind: str = "chunk") -> None:
        """An environment's request came `seconds` after what it was sent: `"chunk"`, a chunk's
        actions; `"start"`, an episode's start (its reset and wait steps)."""
        self.simulation_s[kind] = self._mean(self.simulation_s.get(kind), seconds)

    def expected(self, sent_at: float, kind: str = "chunk") -> float | None:
        """When an environment sent a `kind` at `sent_at` is expected back (None: not measured yet)."""
        mean = self.simulation_s.get(kind)
        return None if mean is None else sent_at + mean

    def hold_s(self, *, now: float, oldest: float, waiting: int, could_join: int,
               expected: Sequence[float | None] = ()) -> float | None:
        """Seconds to hold the batch of the `waiting` requests (the oldest queued at `oldest`)
        before its forward; None: go now. `could_join`: requests that could be in it (those
        waiting and the environments still simulating); `expected`: when each environment still
        simulating is expected back (`expected()`; None: no forecast), the measured rule's."""
        if waiting >= self.limit(could_join):
            return None  # nobody else can join
        if self.wait_s > 0:
            left = oldest + self.wait_s - now
            return left if left > 0 else None
        if not self.adaptive or self.forward_s is None:
            return None
        deadline = oldest + self.forward_s
        if deadline <= now or not any(t is not None and t <= deadline for t in expected):
            return None
        return deadline - now
