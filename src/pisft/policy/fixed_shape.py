"""The batch-invariant forward of the closed loop and the rollout collection: every forward has
the same number of rows, so a request's actions do not depend on which requests, or how many,
share its forward (issue 47).

**What varies.** Measured on this 2-core CPU (PyTorch 2.11, the tiny pi0.5 after training; the
random-init tiny model hides it: its adaRMS projections start at zero, so the flow time, whose
MLP sees one row per request, never reaches the action expert), a request's actions are a
function of
- its own content, its noise and the CPU thread count, as expected;
- the number of rows of its forward: one policy thread gives three classes here, 1 row, 2-3 rows
  and 4-32 rows, whose actions differ by 1-4 float32 steps (a matrix product of one row takes
  another kernel than one of two or of four, and its sums round differently); a closed loop
  feeds the difference back, so an episode's later chunks drift (up to 8.7e-6 in actions in
  the issue) and every camera frame after it differs;
- with two threads, also its place in the forward at some row counts (5 and 6 here; 2-4, 8 and
  16 rows are alike at every place), as the threads split the rows;
- never the content of the other rows (checked with 1 and 2 threads, 4 to 16 rows).

**So** every forward computes exactly `rows` rows (`FixedShape`): fewer requests are padded with
copies of the first, whose answers are dropped, more are computed `rows` at a time. Which
requests share a forward then changes nothing, and the closed loop's batching by arrival time
(`pisft.policy.batching`) keeps its speed without deciding any result. Before its first
forward, `FixedShape` checks on that forward's first request that `rows` copies of it answer
the same bits at every place (`places_agree`); where they do not (two threads at 5 rows), it
computes each request alone, one row per forward, and says so once: slower, and as exact.

The cost is the padding: a forward of `rows` rows when fewer wait (docs/libero.md has the
figures). `serve` keeps batching by arrival time (a robot server is not a reproducible stage).
"""

from __future__ import annotations

from typing import Any

# The noise seed of the rows that only pad a forward (their answers are dropped) and of the probe.
PAD_SEED = 0


class FixedShape:
    """`policy` (`pisft.policy.interface.Policy`) whose every forward computes `rows` rows (module
    docstring). `name`: who says so when the rows' places disagree (the stage)."""

    def __init__(self, policy: Any, rows: int, *, name: str = "policy") -> None:
        if rows < 1:
            raise ValueError(f"FixedShape: rows must be >= 1, got {rows}")
        self.inner = policy
        self.rows = rows
        self.name = name
        self.places_agree: bool | None = None if rows > 1 else True  # checked before the first forward

    def __getattr__(self, name: str) -> Any:  # the policy's own attributes (guidance, conditioning, ...)
        return getattr(self.inner, name)

    @property
    def rows_in_use(self) -> int:
        """The rows of every forward: `rows`, or 1 where their places disagree."""
        return self.rows if self.places_agree in (None, True) else 1

    def new_noise(self, seed: int | None = None) -> Any:
        return self.inner.new_noise(seed)

    def prepare(self, obs: Any) -> Any:
        return self.inner.prepare(obs)

    def _forward(self, prepared: list, noises: list) -> list[dict]:
        rows = self.rows_in_use
        fill = rows - len(prepared)
        replies = list(self.inner.predict_many(list(prepared) + [prepared[0]] * fill,
                                               list(noises) + [self.new_noise(PAD_SEED) for _ in range(fill)]))
        if len(replies) != rows:
            raise RuntimeError(f"the policy answered {len(replies)} replies for a forward of {rows} rows")
        return replies[:len(prepared)]

    def _check_places(self, request: Any) -> None:
        """`rows` copies of `request` with the same noise: the same bits at every place, or one row
        per forward from now on."""
        import numpy as np

        replies = self.inner.predict_many([request] * self.rows, [self.new_noise(PAD_SEED) for _ in range(self.rows)])
        first = np.asarray(replies[0]["actions"])
        self.places_agree = all(np.array_equal(np.asarray(r["actions"]), first) for r in replies[1:])
        if not self.places_agree:
            print(f"{self.name}: note: a forward of {self.rows} rows rounds a request differently by its place "
                  f"among them on this device and thread count, so each request is computed alone (one "
                  f"row per forward: the same results whatever the timing, more forwards)", flush=True)

    def predict_many(self, prepared: list, noises: list) -> list[dict]:
        """One reply per request, computed in forwards of `rows_in_use` rows each. Requests the
        policy computes in separate forwards (`forward_group`: real-time chunking's groups, each
        its own forward) fill their own forwards, so every forward still has `rows` rows."""
        if len(prepared) != len(noises) or not prepared:
            raise ValueError(f"predict_many: {len(prepared)} requests and {len(noises)} noise generators")
        if self.places_agree is None:
            self._check_places(prepared[0])
        rows = self.rows_in_use
        group_of = getattr(self.inner, "forward_group", lambda _batch: None)
        groups: dict = {}
        for i, request in enumerate(prepared):
            groups.setdefault(group_of(request), []).append(i)
        replies: dict[int, dict] = {}
        for members in groups.values():
            for start in range(0, len(members), rows):
                part = members[start:start + rows]
                replies.update(zip(part, self._forward([prepared[i] for i in part], [noises[i] for i in part]),
                                   strict=True))
        return [replies[i] for i in range(len(prepared))]

    def infer_batch(self, requests: list[dict], seeds: list[int]) -> list[dict]:
        """`predict_many` of raw requests, each from its own seed (the closed loop's stand-in form)."""
        return self.predict_many([self.prepare(r) for r in requests], [self.new_noise(s) for s in seeds])

    def record(self) -> dict:
        """What an output records of the forward's shape (deterministic: fixed by the config, the
        device and the thread count)."""
        return {"rows": self.rows, "rows_in_use": self.rows_in_use,
                "places_agree": self.places_agree}
