"""Policy replicas that answer closed-loop chunk requests in batches, one thread per replica.

`closed_loop.run_episodes` hands the pool the requests of every environment waiting at that
moment (up to `eval.policy_batch`); an idle replica runs them through one forward
(`LiberoPolicy.infer_batch`) while the main loop keeps receiving the other environments'
observations, and answers through a pipe the main loop waits on beside the workers' pipes. So
while a forward runs, the requests that arrive meanwhile queue up and go together into the next:
the batch grows with the number of environments waiting, without a timer.

Each request carries its own noise seed (the episode's and the chunk's, `closed_loop.chunk_seed`)
and `infer_batch` draws each request's noise from its own generator: a chunk does not depend on
the requests it is batched with, nor on the replica that computes it. A policy without
`infer_batch` (test stand-ins) is asked one request at a time (`reset(seed)`, `infer`).

With N accelerators there are N replicas, one per device (`closed_loop.policy_devices`); any idle
replica takes the oldest waiting requests. A replica's thread selects its device first (the
current device is per thread in CUDA and torch-npu). On the CPU there is one replica.

A forward that raises answers every request of its batch with an error only after each was
tried alone: one bad request must not cost its batch-mates an attempt (`closed_loop` runs an
episode whose request errs again on a fresh worker, up to its attempts).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Request:
    key: int  # the caller's id of the request (closed_loop: the worker index)
    obs: dict
    seed: int  # the noise seed of this chunk


@dataclass(frozen=True)
class Answer:
    key: int
    actions: np.ndarray | None
    error: str | None
    policy_s: float  # this request's share of its forward's time
    batch: int  # requests in its forward


@dataclass
class PoolStats:
    forwards: int = 0
    requests: int = 0
    forward_s: float = 0.0  # summed over replicas
    max_batch_seen: int = 0
    per_replica_requests: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "policy_forwards": self.forwards,
            "policy_requests": self.requests,
            "mean_policy_batch": self.requests / self.forwards if self.forwards else None,
            "max_policy_batch": self.max_batch_seen,
            "policy_ms_per_forward": 1000.0 * self.forward_s / self.forwards if self.forwards else None,
            "policy_ms_per_request": 1000.0 * self.forward_s / self.requests if self.requests else None,
            "requests_per_replica": list(self.per_replica_requests),
        }


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def answer_batch(policy: Any, requests: Sequence[Request]) -> list[tuple[np.ndarray | None, str | None]]:
    """(actions, None) or (None, error) per request: one forward when the policy batches."""
    batched = getattr(policy, "infer_batch", None)
    if callable(batched) and len(requests) > 1:
        try:
            replies = batched([r.obs for r in requests], [r.seed for r in requests])
            if len(replies) != len(requests):
                raise RuntimeError(f"infer_batch answered {len(replies)} of {len(requests)} requests")
            return [(np.asarray(reply["actions"]), None) for reply in replies]
        except Exception:  # noqa: BLE001 - each request alone below: the bad one errs, the others are answered
            pass
    out: list[tuple[np.ndarray | None, str | None]] = []
    for r in requests:
        try:
            if callable(batched):
                reply = batched([r.obs], [r.seed])[0]
            else:
                policy.reset(r.seed)
                reply = policy.infer(r.obs)
            out.append((np.asarray(reply["actions"]), None))
        except Exception as exc:  # noqa: BLE001 - this request's error, its episode is run again
            out.append((None, _error(exc)))
    return out


class PolicyPool:
    """`replicas`: policies with `infer_batch(requests, seeds)` (or `reset`/`infer`);
    `max_batch`: at most this many requests per forward (0: no limit); `select_device(i)`, when
    given, runs first in replica i's thread."""

    def __init__(self, replicas: Sequence[Any], *, max_batch: int = 0, devices: Sequence[str] | None = None,
                 select_device: Callable[[int], None] | None = None) -> None:
        if not replicas:
            raise ValueError("PolicyPool: no policy replica")
        if max_batch < 0:
            raise ValueError(f"PolicyPool: max_batch must be 0 (no limit) or positive, got {max_batch}")
        self.replicas = list(replicas)
        self.max_batch = max_batch
        self.devices = list(devices) if devices is not None else ["?"] * len(self.replicas)
        self.stats = PoolStats(per_replica_requests=[0] * len(self.replicas))
        self.notify, self._notify_w = mp.Pipe(duplex=False)  # the main loop waits on `notify`
        self._answers: queue.SimpleQueue[tuple[int, list[Answer]] | BaseException] = queue.SimpleQueue()
        self._jobs = [queue.SimpleQueue() for _ in self.replicas]
        self._idle = list(range(len(self.replicas)))
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._serve, args=(i, select_device), daemon=True,
                                          name=f"policy-replica{i}") for i in range(len(self.replicas))]
        for t in self._threads:
            t.start()

    @property
    def in_flight(self) -> int:
        return len(self.replicas) - len(self._idle)

    def has_idle_replica(self) -> bool:
        return bool(self._idle)

    def batch_limit(self, waiting: int) -> int:
        return min(waiting, self.max_batch) if self.max_batch else waiting

    def submit(self, requests: list[Request]) -> None:
        """Give `requests` to an idle replica (`has_idle_replica` first)."""
        if not self._idle:
            raise RuntimeError("PolicyPool.submit: every replica is busy")
        i = self._idle.pop(0)
        self._jobs[i].put(requests)

    def _serve(self, i: int, select_device: Callable[[int], None] | None) -> None:
        try:
            if select_device is not None:
                select_device(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the next collect()
            self._answers.put(exc)
            self._notify_w.send_bytes(b"!")
            return
        while True:
            job = self._jobs[i].get()
            if job is None:
                return
            t0 = time.perf_counter()
            answers = answer_batch(self.replicas[i], job)
            elapsed = time.perf_counter() - t0
            with self._lock:
                self.stats.forwards += 1
                self.stats.requests += len(job)
                self.stats.forward_s += elapsed
                self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(job))
                self.stats.per_replica_requests[i] += len(job)
            share = elapsed / len(job)
            self._answers.put((i, [Answer(key=r.key, actions=a, error=e, policy_s=share, batch=len(job))
                                   for r, (a, e) in zip(job, answers, strict=True)]))
            self._notify_w.send_bytes(b".")

    def collect(self) -> list[Answer]:
        """The answers of every forward that ended since the last call (after `notify` was
        readable); frees their replicas."""
        out: list[Answer] = []
        while self.notify.poll():
            self.notify.recv_bytes()
            item = self._answers.get()
            if isinstance(item, BaseException):
                raise RuntimeError(f"a policy replica could not select its device: {_error(item)}") from item
            replica, answers = item
            self._idle.append(replica)
            out.extend(answers)
        return out

    def __enter__(self) -> PolicyPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for jobs in self._jobs:
            jobs.put(None)
        for t in self._threads:
            t.join(timeout=60)
        self.notify.close()
        self._notify_w.close()
