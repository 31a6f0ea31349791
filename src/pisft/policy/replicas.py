"""The thread front end of the batching rule (`pisft.policy.batching`): policy replicas that
answer the closed loop's and the collection's chunk requests in batches, one thread per replica.

The rollout scheduler (`pisft.rollout.scheduler`) asks the pool's rule who joins the next
forward and how long to hold it, and hands the batch to an idle replica, which runs it through
one forward (`Policy.predict_many`, each request with the noise of its own seed) while the
scheduler keeps receiving the other environments' observations, and answers through a pipe the
scheduler waits on beside the workers' pipes. So while a forward runs, the requests that arrive
meanwhile queue up and go together into the next.

A model's replica computes every forward at the stage's fixed number of rows (`eval.policy_batch`,
`pisft.policy.fixed_shape`): which requests share a forward changes no bit of their answers.

With N accelerators there are N replicas, one per device (`policy_devices`); any idle replica
takes the oldest waiting requests. A replica's thread selects its device first (the current
device is per thread in CUDA and torch-npu). On the CPU there is one replica.

A forward that raises is retried request by request (`batching.answer_each`): one bad request
errs alone (the rollout runs its episode again on a fresh worker, up to its attempts).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pisft import config as config_mod
from pisft import device as device_mod
from pisft.errors import PisftError
from pisft.policy.batching import BatchRule, answer_each, error_text
from pisft.policy.fixed_shape import FixedShape
from pisft.policy.interface import Policy, as_policy
from pisft.policy.rtc import RtcSettings


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
    forward_times_s: list[float] = field(default_factory=list)  # each forward's, for its percentiles

    def to_dict(self) -> dict:
        times = np.asarray(self.forward_times_s) * 1000.0
        return {
            # the policy's time per forward (a chunk, or a batch of chunks), as openpi's policy_timing
            "policy_forward_ms_p50": float(np.percentile(times, 50)) if len(times) else None,
            "policy_forward_ms_p99": float(np.percentile(times, 99)) if len(times) else None,
            "policy_forwards": self.forwards,
            "policy_requests": self.requests,
            "mean_policy_batch": self.requests / self.forwards if self.forwards else None,
            "max_policy_batch": self.max_batch_seen,
            "policy_ms_per_forward": 1000.0 * self.forward_s / self.forwards if self.forwards else None,
            "policy_ms_per_request": 1000.0 * self.forward_s / self.requests if self.requests else None,
            "requests_per_replica": list(self.per_replica_requests),
        }


def answer_batch(policy: Any, requests: Sequence[Request]) -> list[tuple[np.ndarray | None, str | None]]:
    """(actions, None) or (None, error) per request: one forward (`batching.answer_each`) when
    the policy batches, else one request at a time."""
    policy = as_policy(policy)
    prepared: list = []
    out: list[tuple[np.ndarray | None, str | None] | None] = []
    for r in requests:  # a request that cannot be prepared errs alone
        try:
            prepared.append(policy.prepare(r.obs))
            out.append(None)
        except Exception as exc:  # noqa: BLE001 - this request's error, its episode is run again
            out.append((None, error_text(exc)))
    ok = [i for i, o in enumerate(out) if o is None]
    seeds = [requests[i].seed for i in ok]
    if getattr(policy, "one_at_a_time", False):
        outcomes = [answer_each(policy.predict_many, [x], lambda _, s=s: policy.new_noise(s))[0]
                    for x, s in zip(prepared, seeds, strict=True)]
    else:  # a fresh generator from its seed for every attempt
        outcomes = answer_each(policy.predict_many, prepared, lambda k: policy.new_noise(seeds[k]))
    for i, o in zip(ok, outcomes, strict=True):
        out[i] = (np.asarray(o.reply["actions"]), None) if o.error is None else (None, error_text(o.error))
    return out  # type: ignore[return-value]


class PolicyPool:
    """`replicas`: policies (`pisft.policy.interface`; stand-ins through `as_policy`);
    `max_batch`: at most this many requests per forward (0: no limit); `wait_ms`: the rule's
    hand-set hold (0: measured, `batching.BatchRule`); `select_device(i)`, when given, runs first
    in replica i's thread."""

    def __init__(self, replicas: Sequence[Any], *, max_batch: int = 0, wait_ms: float = 0.0,
                 devices: Sequence[str] | None = None,
                 select_device: Callable[[int], None] | None = None) -> None:
        if not replicas:
            raise ValueError("PolicyPool: no policy replica")
        if max_batch < 0:
            raise ValueError(f"PolicyPool: max_batch must be 0 (no limit) or positive, got {max_batch}")
        self.replicas = list(replicas)
        self.rule = BatchRule(max_batch=max_batch, wait_s=wait_ms / 1000.0)
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

    @property
    def max_batch(self) -> int:
        return self.rule.max_batch

    def batch_limit(self, waiting: int) -> int:
        return self.rule.limit(waiting)

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
                self.rule.forward_done(elapsed)
                self.stats.forwards += 1
                self.stats.requests += len(job)
                self.stats.forward_s += elapsed
                self.stats.forward_times_s.append(elapsed)
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
                raise RuntimeError(f"a policy replica could not select its device: {error_text(item)}") from item
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


def policy_threads() -> int:
    """CPU threads of the policy: `PISFT_NUM_THREADS` when set, else 1.

    The environment workers take the cores (`eval.num_envs` defaults to one per core), and a
    multi-threaded PyTorch forward among busy cores stalls at every parallel region waiting for
    a descheduled thread: measured here, the tiny model took 3-13 s per chunk with 2 threads
    beside 2 simulating workers and 0.3 s with 1 (about 0.1 CPU-s). A fixed count (not what
    the driver exported: Snakemake the rule's threads, DVC nothing; not derived from
    eval.num_envs) also keeps the numbers the same under either driver and any num_envs.
    On a GPU host the count hardly matters."""
    if os.environ.get(device_mod.THREADS_ENV, "").strip():
        return device_mod.threads_per_process(1)
    return 1


def policy_devices(cfg: config_mod.PisftConfig) -> list[str]:
    """Devices of the closed-loop policy replicas, one replica each: every visible accelerator of
    `device`'s kind (`eval.policy_devices` > 0: that many of them); on the CPU, one."""
    kind = device_mod.resolve_kind(cfg.device)
    wanted = cfg.eval.policy_devices
    if not device_mod.row(kind).accelerator:
        problem = config_mod.cpu_replicas_problem(wanted)  # the config check asks it of device: cpu
        if problem:
            raise PisftError(problem)
        return ["cpu"]
    count = device_mod.device_count(kind)
    if wanted > count:
        raise PisftError(f"eval.policy_devices: {wanted} policy replicas asked for, but {count} {kind} "
                         f"device(s) are visible; set at most {count} (0: every visible device)")
    return [f"{kind}:{i}" for i in range(wanted or count)]


@contextlib.contextmanager
def open_policy_pool(cfg: config_mod.PisftConfig, given: Any, *, model_dir: Path, trained_on: Path,
                     seed: int, rows: int, wait_ms: float, stage: str,
                     rtc: RtcSettings | None = None) -> Iterator[PolicyPool]:
    """The stage's policy, closed on exit: `given` (tests, a caller's own) as one replica, else the
    model in `model_dir` as `LiberoPolicy` replicas (the code `serve` runs), one per device of
    `policy_devices`, with `eval.cfg_scale`, `eval.precision`, `eval.compile`, real-time chunking
    with `rtc` (eval.rtc's, built once by `rollout.Settings.for_evaluation`; None: off) and
    `policy_threads` CPU threads (the caller's count is given back on exit). Every forward of a policy in the
    protocol (a model) has `rows` rows (`fixed_shape.FixedShape`: results do not depend on which
    requests share a forward); a stand-in given by a test is used as it is. Says once, before the
    rollouts, which classifier-free guidance is in effect (`LiberoPolicy.guidance`)."""
    def fixed(policy: Any) -> Any:
        return FixedShape(policy, rows, name=stage) if isinstance(policy, Policy) else policy

    with contextlib.ExitStack() as stack:
        if given is not None:
            pool = PolicyPool([fixed(given)], max_batch=rows, wait_ms=wait_ms, devices=["given"])
        else:
            from pisft.model.guidance import check_scale
            from pisft.policy.compiled import Trial
            from pisft.policy.libero import LiberoPolicy

            stack.enter_context(device_mod.intra_op_threads(policy_threads()))
            scale = check_scale(cfg.eval.cfg_scale, "eval.cfg_scale")
            devices = policy_devices(cfg)
            kind = device_mod.resolve_kind(cfg.device)
            trial = Trial()  # eval.compile null on an accelerator: one decision for every replica
            replicas = [fixed(LiberoPolicy.from_model_dir(model_dir, device=kind, device_index=i, seed=seed,
                                                          trained_on=trained_on, cfg_scale=scale,
                                                          precision=cfg.eval.precision, compiled=cfg.eval.compile,
                                                          rtc=rtc, trial=trial,
                                                          note=lambda line: print(f"{stage}: {line}", flush=True)))
                        for i in range(len(devices))]
            if len(devices) > 1:
                print(f"{stage}: {len(devices)} policy replicas, one per device ({', '.join(devices)})", flush=True)
            select = functools.partial(device_mod.local_device, kind) if device_mod.row(kind).accelerator else None
            pool = PolicyPool(replicas, max_batch=rows, wait_ms=wait_ms, devices=devices, select_device=select)
        with pool:
            guided = guidance_of(pool)
            if guided is not None and (guided["note"] or guided["guided"]):
                print(f"{stage}: {'note: ' + guided['note'] if guided['note'] else guided['describe']}", flush=True)
            yield pool


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def guidance_of(pool: PolicyPool) -> dict | None:
    """The classifier-free guidance in effect (`LiberoPolicy.guidance`; replicas share it), if any."""
    return getattr(pool.replicas[0], "guidance", None)


def policy_record(pool: PolicyPool) -> dict:
    """What a stage's output records of its policy (a `LiberoPolicy`'s; none for a stand-in): how
    the task becomes the prompt (`prompt`), the guidance scale in effect (`cfg_scale`, 1 for a
    plain model), the guidance (`guidance`), and the rows of its forwards and its CPU threads
    (`forward`: the results depend on both)."""
    out: dict = {}
    if isinstance(pool.replicas[0], FixedShape):
        out["forward"] = {**pool.replicas[0].record(), "cpu_threads": _torch_threads()}
    cond = getattr(pool.replicas[0], "conditioning", None)
    if cond is not None:
        out["prompt"] = {**cond.to_dict(), "describe": cond.describe()}
    guided = guidance_of(pool)
    if guided is not None:
        out["cfg_scale"] = guided["cfg_scale"]
        out["guidance"] = guided
    predictor = getattr(pool.replicas[0], "predictor", None)
    if predictor is not None:  # precision, the compiled chunk, RTC (its compile times: `inference_timing`)
        described = predictor.describe()
        described["compile"] = {k: v for k, v in described["compile"].items() if k not in COMPILE_TIMING}
        out["inference"] = described
    return out


# What the compiled chunk records of how long it took (its compiles; eval.compile null's trial, whose
# decision stays in the output): the timing record's (`inference_timing`), not the output's.
COMPILE_TIMING = ("first_call_s", "trial")


def inference_timing(pool: PolicyPool) -> dict:
    """The compiled chunk's compile times, per replica's model (the timing record; they vary run to run)."""
    predictor = getattr(pool.replicas[0], "predictor", None)
    if predictor is None:
        return {}
    compile_record = predictor.describe()["compile"]
    return {"compile": {k: compile_record[k] for k in COMPILE_TIMING if k in compile_record}}
