"""Closed-loop LIBERO evaluation: roll the policy out in the simulator, count successes.

The loop is openpi's LIBERO evaluation (`examples/libero/main.py`): for every task of every
suite, `trials_per_task` episodes, episode i starting from the task's fixed initial state
number i; `num_wait_steps` dummy actions while objects settle; then the policy is asked for an
action chunk, the first `replan_steps` actions are executed, and it is asked again; an episode
succeeds when the environment reports `done` within the step limit (openpi's per suite, or
`eval.max_steps`). An episode that ends in an error (an exception in the simulator, a worker
process that died, a policy that failed or answered with non-finite actions) is not a failed
trial: it is run again from its start on a fresh worker, up to `EPISODE_ATTEMPTS` in all (its
seeds fixed, so any attempt that runs to its end gives the same result), and one that errs on
every attempt fails the stage naming the episodes and their errors; a success rate counts only
episodes that ran to their end (`retried` counts those that needed another attempt).

**Where what runs.** Environments run in `eval.num_envs` worker processes
(`pisft.evaluate.rollout_workers`; default: the cores available), each keeping the environment
of its current task and building the policy's requests itself. The policy runs in this (the
parent) process, as one replica per accelerator (`eval.policy_devices`; on the CPU one), each in
a thread of its own (`pisft.evaluate.policy_pool`): the requests of every environment waiting
at that moment go to a free replica as one forward (at most `eval.policy_batch`), and while it
computes, the other environments simulate and their requests queue up for the next forward; a
batch that could still grow may wait `eval.policy_batch_wait_ms` for the environments still
simulating. On this 2-core CPU a chunk is 5 simulator steps of about 0.2 CPU-s each (both
256×256 cameras rendered in software) and the tiny policy about 0.05 CPU-s per request on one
thread (`policy_threads`), so N workers keep N cores simulating; on an accelerator node a
batched pi0.5 forward serves many environments at once (docs/libero.md, "The full protocol").

**Same results for any `eval.num_envs`, `eval.policy_batch` and number of replicas.** Episodes
are listed in a fixed order (suite, task, trial); each gets its environment seed
(`eval.closed_loop_seed`, set before every reset, so an episode does not depend on what its
worker ran before) and, for the k-th chunk of the episode, a policy noise seed derived from
(run seed, suite, task, initial state = trial, k) (`chunk_seed`), from which its request draws
its noise whatever it is batched with. Which worker runs an episode, which requests share a
forward, which replica computes it and in which order replies arrive change nothing (on this
CPU, one policy thread, the batched actions are bit-identical; an accelerator's kernels may
round differently with the batch size); results are written in episode order.

The policy is anything with `infer(request) -> {"actions": (horizon, 7)}` and
`reset(seed)`: by default `pisft.serve.libero_policy.LiberoPolicy` (the same code that
`python -m pisft serve` runs), so the in-process and the served model answer the same
requests the same way.

Stage output, `results/closed_loop/` (atomic): `metrics.json` (success overall, per suite and
per task with 95% Wilson intervals, episode lengths, simulator steps/s, policy ms per chunk,
the simulator package and version), `episodes.jsonl` (one line per episode), `videos/`
(agent view | wrist camera MP4 of the first episode of each task), `report.md`,
`pisft_config.json`. See docs/libero.md.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait as wait_for_replies
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pisft import config as config_mod
from pisft import device as device_mod
from pisft import logs as logs_mod
from pisft.errors import PisftError
from pisft.evaluate import libero_sim
from pisft.evaluate import video as video_mod
from pisft.evaluate.intervals import wilson_interval
from pisft.evaluate.policy_pool import Answer as PolicyAnswer
from pisft.evaluate.policy_pool import PolicyPool
from pisft.evaluate.policy_pool import Request as PolicyRequest
from pisft.evaluate.rollout_workers import (
    EpisodeOutcome,
    EpisodeSpec,
    InlineWorker,
    ProcessWorker,
    WorkerDied,
)
from pisft.io import atomic_dir, write_json_atomic, write_text_atomic

log = logging.getLogger("pisft.closed_loop")

OUTPUT_DIR = "closed_loop"
VIDEO_DIR = "videos"
CONFIDENCE = 0.95


class ChunkPolicy(Protocol):
    def infer(self, obs: dict) -> dict: ...

    def reset(self, seed: int | None = None) -> None: ...


@dataclass(frozen=True)
class Settings:
    suites: tuple[str, ...]
    trials_per_task: int
    replan_steps: int
    num_wait_steps: int
    seed: int
    resize_size: int
    max_steps: int = 0  # 0: openpi's limit of each suite (libero_sim.SUITE_MAX_STEPS)
    task_ids: tuple[int, ...] = ()  # empty: every task of each suite
    num_envs: int = 1
    videos: bool = True
    # Initial state of each task's first trial (trial i starts from state first_init_state + i):
    # 0 for the evaluation; the RECAP rollout collection starts after the evaluation's states.
    first_init_state: int = 0
    # At most this many requests per policy forward (0: every environment waiting at that moment);
    # results do not depend on it (each request's noise is its own; policy_pool).
    policy_batch: int = 0
    # A batch that could still grow waits at most this long for the environments still simulating.
    policy_batch_wait_ms: float = 0.0

    @classmethod
    def from_config(cls, cfg: config_mod.PisftConfig, stage: str | None = None) -> Settings:
        e = cfg.eval
        return cls(suites=tuple(e.libero_suites), trials_per_task=e.trials_per_task,
                   replan_steps=e.replan_steps, num_wait_steps=e.num_wait_steps,
                   seed=e.closed_loop_seed, resize_size=e.resize_size, max_steps=e.max_steps,
                   task_ids=tuple(e.task_ids), num_envs=resolve_num_envs(e.num_envs, stage=stage),
                   videos=e.videos, policy_batch=e.policy_batch,
                   policy_batch_wait_ms=e.policy_batch_wait_ms)

    def steps_for(self, suite: str) -> int:
        return self.max_steps or libero_sim.SUITE_MAX_STEPS[suite]


# Memory one LIBERO environment process may take: one peaked at 3.2 GB (issue 22; MuJoCo, both
# cameras' render buffers, robosuite's imports), with a margin.
ENV_MEMORY_BYTES = int(3.5 * (1 << 30))


def auto_num_envs(cores: int | None = None, available: int | None = None) -> tuple[int, str]:
    """`eval.num_envs: 0`: one environment per available core, as many as the memory available
    now holds at `ENV_MEMORY_BYTES` each (at least one); (the number, a sentence saying why)."""
    cores = device_mod.usable_cores() if cores is None else cores
    available = device_mod.available_memory() if available is None else available
    gib = 1 << 30
    if available is None:
        return cores, f"{cores} (one per available core; the available memory is unknown)"
    fit = max(1, available // ENV_MEMORY_BYTES)
    n = min(cores, fit)
    why = (f"{n} ({cores} available cores, {available / gib:.1f} GiB of memory available, about "
           f"{ENV_MEMORY_BYTES / gib:.1f} GiB per LIBERO environment process")
    if fit < cores:
        why += f"; the memory holds {fit}"
    if available < ENV_MEMORY_BYTES:
        why += ", less than one environment needs: it may run out of memory"
    return n, why + "; set eval.num_envs to choose)"


def resolve_num_envs(num_envs: int, *, stage: str | None = None) -> int:
    """`eval.num_envs`: a positive number as given; 0 picks `auto_num_envs` and, with `stage`,
    says what it picked and why."""
    if num_envs < 0:
        raise PisftError(f"eval.num_envs: must be 0 (one per available core that memory allows) or a "
                         f"positive number of environment processes, got {num_envs}")
    if num_envs:
        return num_envs
    n, why = auto_num_envs()
    if stage:
        print(f"{stage}: eval.num_envs 0 -> {why}", flush=True)
    return n


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
    if kind == "cpu":
        if wanted > 1:
            raise PisftError(f"eval.policy_devices: {wanted} policy replicas asked for, but the policy runs on "
                             "the CPU, where it is one (the environments take the cores); set "
                             "eval.policy_devices: 0, or run on accelerators (device: cuda or npu)")
        return ["cpu"]
    count = device_mod.device_count(kind)
    if wanted > count:
        raise PisftError(f"eval.policy_devices: {wanted} policy replicas asked for, but {count} {kind} "
                         f"device(s) are visible; set at most {count} (0: every visible device)")
    return [f"{kind}:{i}" for i in range(wanted or count)]


@contextlib.contextmanager
def open_policy_pool(cfg: config_mod.PisftConfig, given: ChunkPolicy | None, *, model_dir: Path, trained_on: Path,
                     seed: int, settings: Settings, stage: str) -> Iterator[PolicyPool]:
    """The stage's policy, closed on exit: `given` (tests, a caller's own) as one replica, else the
    model in `model_dir` as `LiberoPolicy` replicas (the code `serve` runs), one per device of
    `policy_devices`, with `eval.cfg_scale` and `policy_threads` CPU threads. Says once, before the
    rollouts, which classifier-free guidance is in effect (`LiberoPolicy.guidance`)."""
    if given is not None:
        pool = PolicyPool([given], max_batch=settings.policy_batch, devices=["given"])
    else:
        import torch

        from pisft.model.guidance import check_scale
        from pisft.serve.libero_policy import LiberoPolicy

        torch.set_num_threads(policy_threads())
        scale = check_scale(cfg.eval.cfg_scale, "eval.cfg_scale")
        devices = policy_devices(cfg)
        kind = device_mod.resolve_kind(cfg.device)
        replicas = [LiberoPolicy.from_model_dir(model_dir, device=kind, device_index=i, seed=seed,
                                                trained_on=trained_on, cfg_scale=scale)
                    for i in range(len(devices))]
        if len(devices) > 1:
            print(f"{stage}: {len(devices)} policy replicas, one per device ({', '.join(devices)})", flush=True)
        select = None if kind == "cpu" else functools.partial(device_mod.local_device, kind)
        pool = PolicyPool(replicas, max_batch=settings.policy_batch, devices=devices, select_device=select)
    with pool:
        guided = guidance_of(pool)
        if guided is not None and (guided["note"] or guided["guided"]):
            print(f"{stage}: {'note: ' + guided['note'] if guided['note'] else guided['describe']}", flush=True)
        yield pool


def guidance_of(pool: PolicyPool) -> dict | None:
    """The classifier-free guidance in effect (`LiberoPolicy.guidance`; replicas share it), if any."""
    return getattr(pool.replicas[0], "guidance", None)


def policy_record(pool: PolicyPool) -> dict:
    """What a stage's output records of its policy (a `LiberoPolicy`'s; none for a stand-in): how
    the task becomes the prompt (`prompt`), the guidance scale in effect (`cfg_scale`, 1 for a
    plain model) and the guidance (`guidance`)."""
    out: dict = {}
    cond = getattr(pool.replicas[0], "conditioning", None)
    if cond is not None:
        out["prompt"] = {**cond.to_dict(), "describe": cond.describe()}
    guided = guidance_of(pool)
    if guided is not None:
        out["cfg_scale"] = guided["cfg_scale"]
        out["guidance"] = guided
    return out


def progress(stage: str, total: int, label: Callable[[EpisodeResult], str],
             logger: logging.Logger = log) -> Callable[[EpisodeResult], None]:
    """A callback for `roll_out`'s `on_episode`: each episode logged as `label(result)` says, the
    count printed every 10 episodes and at the end."""
    done: list[EpisodeResult] = []

    def record(r: EpisodeResult) -> None:
        done.append(r)
        logger.info("%s: %s (%d steps)", label(r), "success" if r.success else "failure", r.steps)
        if len(done) % 10 == 0 or len(done) == total:
            print(f"{stage}: {len(done)}/{total} episodes, {sum(x.success for x in done)} successes", flush=True)

    return record


@dataclass
class EpisodeResult:
    suite: str
    task_id: int
    task: str
    trial: int
    success: bool
    steps: int  # policy steps executed (wait steps not counted)
    policy_calls: int
    wall_time_s: float
    error: str | None = None
    sim_steps: int = 0  # env.step calls, wait steps included
    sim_step_time_s: float = 0.0
    env_create_s: float = 0.0
    reset_s: float = 0.0
    policy_ms: float = 0.0  # total policy time of the episode
    video: str | None = None  # relative to the stage's output folder
    video_frames: int = 0
    # errors of earlier attempts of this episode (each ended in an error and was run again on a
    # fresh worker); this result is of the attempt that ran to its end
    retried_errors: list[str] = field(default_factory=list)


def episode_seed(seed: int, suite: str, task_id: int, init_state: int) -> int:
    """Seed of the policy's noise for one episode: fixed by the run seed and the episode (its
    task and initial state number, which is the trial number in the evaluation)."""
    words = [seed, task_id, init_state] + [ord(c) for c in suite]
    return int(np.random.SeedSequence(words).generate_state(1)[0])


def chunk_seed(episode: int, call: int) -> int:
    """Noise seed of an episode's call-th chunk: independent of what else runs meanwhile."""
    return int(np.random.SeedSequence([episode, call]).generate_state(1)[0])


def video_name(suite: str, task_id: int) -> str:
    return f"{VIDEO_DIR}/{suite}_task{task_id:02d}.mp4"


def plan_episodes(simulator: libero_sim.Simulator, settings: Settings, out_dir: Path | None,
                  record_dir: Path | None = None) -> tuple[list[EpisodeSpec], dict[tuple[str, int], str]]:
    """The run's episodes in order, and each task's instruction; checked before any rollout.
    `record_dir`: every episode records its executed steps in `record_dir/episode_<index>/`."""
    specs: list[EpisodeSpec] = []
    languages: dict[tuple[str, int], str] = {}
    # absolute: a worker process runs in the stage's log folder (MuJoCo's log, rollout_workers)
    out_dir = None if out_dir is None else Path(out_dir).absolute()
    record_dir = None if record_dir is None else Path(record_dir).absolute()
    if not settings.suites or len(set(settings.suites)) != len(settings.suites):
        raise PisftError(f"eval.libero_suites: {list(settings.suites)}: give one or more distinct suites "
                         "(a repeat runs the same episodes twice)")
    for suite_name in settings.suites:
        if suite_name not in libero_sim.SUITE_MAX_STEPS:
            raise PisftError(f"eval.libero_suites: unknown suite '{suite_name}'; one of "
                             f"{', '.join(libero_sim.SUITE_MAX_STEPS)}")
        suite = simulator.suite(suite_name)
        task_ids = settings.task_ids or tuple(range(suite.n_tasks))
        bad = [t for t in task_ids if not 0 <= t < suite.n_tasks]
        if bad:
            raise PisftError(f"eval.task_ids: {suite_name} has tasks 0..{suite.n_tasks - 1}, not {bad}; "
                             "pick ids in that range (or [] for every task)")
        for task_id in task_ids:
            languages[(suite_name, task_id)] = suite.get_task(task_id).language
            n_init = len(suite.get_task_init_states(task_id))
            if settings.first_init_state == 0 and n_init < settings.trials_per_task:
                raise PisftError(
                    f"{suite_name} task {task_id} has {n_init} initial states, fewer than "
                    f"eval.trials_per_task={settings.trials_per_task}; lower eval.trials_per_task")
            if n_init < settings.first_init_state + settings.trials_per_task:
                raise PisftError(
                    f"{suite_name} task {task_id} has {n_init} initial states; {settings.trials_per_task} "
                    f"episodes from initial state {settings.first_init_state} on (after the evaluation's "
                    f"eval.trials_per_task) need {settings.first_init_state + settings.trials_per_task}: "
                    "lower recap.episodes_per_task or eval.trials_per_task")
            for trial in range(settings.trials_per_task):
                video = None
                if settings.videos and trial == 0 and out_dir is not None:
                    video = str(out_dir / video_name(suite_name, task_id))
                index = len(specs)
                specs.append(EpisodeSpec(
                    index=index, suite=suite_name, task_id=task_id, trial=trial,
                    max_steps=settings.steps_for(suite_name), num_wait_steps=settings.num_wait_steps,
                    env_seed=settings.seed, resize_size=settings.resize_size, video=video,
                    init_state=settings.first_init_state + trial,
                    record=None if record_dir is None else str(record_dir / f"episode_{index:06d}")))
    return specs, languages


@dataclass
class _InFlight:
    spec: EpisodeSpec
    seed: int
    start: float
    calls: int = 0
    policy_s: float = 0.0
    error: str | None = None
    attempt: int = 1
    earlier_errors: tuple[str, ...] = ()  # the errors of this episode's earlier attempts


# An episode that ends in an error (the simulator raised, its worker process died, the policy
# failed or answered with non-finite actions) runs again from its start, on a fresh worker, up
# to this many attempts in all; one that errs on every attempt fails the stage. Its seeds are
# fixed by the episode, so an attempt that runs to its end gives the result of any other.
EPISODE_ATTEMPTS = 3


@dataclass(frozen=True)
class CrashedEpisode:
    spec: EpisodeSpec
    task: str
    steps: int  # policy steps of the last attempt
    errors: tuple[str, ...]  # one per attempt

    def describe(self) -> str:
        s = self.spec
        return (f"episode {s.index} ({s.suite} task {s.task_id} \"{self.task}\", initial state "
                f"{s.initial_state}, environment seed {s.env_seed}) crashed after {self.steps} steps: "
                f"{self.errors[-1]}")


class EpisodeErrors(PisftError):
    """Episodes ended in an error on every attempt: the run has no result (a crash is not a
    failed trial). `crashed`: those episodes; `not_run`: episodes not started after the first."""

    def __init__(self, crashed: list[CrashedEpisode], not_run: int, stage: str, attempts: int) -> None:
        self.crashed, self.not_run, self.attempts = crashed, not_run, attempts
        super().__init__(
            f"{stage}: {self.describe()}. A crash is not a failed trial, so no success rate was "
            f"computed and no output written. {self.attempts_note()} Fix the cause (the simulator "
            "install: `make setup`; the model; the host's memory) and rerun the stage")

    def describe(self) -> str:
        return "; ".join(c.describe() for c in self.crashed)

    def attempts_note(self) -> str:
        who = "The episode" if len(self.crashed) == 1 else f"Each of these {len(self.crashed)} episodes"
        text = (f"{who} ran {self.attempts} times, on a fresh environment worker each time, and ended in "
                "an error every time")
        if self.not_run:
            text += f"; the {self.not_run} episodes not yet started then were not run"
        return text + "."


def check_chunk(chunk: np.ndarray, settings: Settings) -> np.ndarray:
    """The first `replan_steps` actions of a policy's chunk, after checking its shape and that
    every value is finite (non-finite actions never reach the simulator)."""
    chunk = np.asarray(chunk)
    if chunk.ndim != 2 or len(chunk) < settings.replan_steps or chunk.shape[1] != 7:
        raise PisftError(
            f"the policy returned actions of shape {chunk.shape}; LIBERO needs (chunk, 7) with at "
            f"least eval.replan_steps={settings.replan_steps} actions (lower eval.replan_steps)")
    chunk = chunk[: settings.replan_steps]
    if not np.issubdtype(chunk.dtype, np.number) or not np.isfinite(chunk).all():
        bad = int(chunk.size - np.isfinite(chunk).sum()) if np.issubdtype(chunk.dtype, np.number) else chunk.size
        raise PisftError(
            f"the policy returned non-finite actions ({bad} of the {chunk.size} values to execute are "
            f"NaN or infinite, dtype {chunk.dtype}); they were not sent to the simulator. The model "
            "diverged or its normalization statistics are broken: check the training log and the "
            "model's norm stats")
    return chunk


def run_episodes(specs: list[EpisodeSpec], policy: ChunkPolicy | PolicyPool, settings: Settings, *,
                 workers: list, respawn: Callable[[int], Any] | None = None,
                 languages: dict[tuple[str, int], str],
                 on_episode: Callable[[EpisodeResult], None] | None = None,
                 attempts: int = EPISODE_ATTEMPTS, stage: str = "closed_loop") -> list[EpisodeResult]:
    """Drive the workers through `specs`; results in the order of `specs`.

    A free worker takes the next pending episode of the task whose environment it holds, else
    the first pending episode of a task no other worker holds, else the first pending episode
    (building an environment costs seconds; which worker runs an episode changes no result).
    The requests of every worker waiting for the policy go to an idle replica of `policy` (a
    `PolicyPool`, or one policy, then pooled here with `settings.policy_batch`), at most
    `settings.policy_batch` per forward, oldest first, each with its chunk's seed: while a
    forward runs, the others' requests queue up for the next (`policy_pool`).
    An episode that ends in an error (the simulator raised, the
    worker died, the policy failed) is run again from its start, up to `attempts` in all, on a
    fresh worker (`respawn(i)` replaces worker i; without `respawn`, the same worker, whose
    environment was closed); one that errs on every attempt stops the run: no new episode is
    started, those in flight end, and `EpisodeErrors` names the episodes and their errors. So
    every result returned ran to its end (`error` is None); `retried_errors` keeps what failed
    on the way.
    """
    ours = not isinstance(policy, PolicyPool)  # a pool we make for one policy, we close; a given pool, its owner
    with PolicyPool([policy], max_batch=settings.policy_batch) if ours else contextlib.nullcontext(policy) as pool:
        return _run_episodes(specs, pool, settings, workers=workers, respawn=respawn, languages=languages,
                             on_episode=on_episode, attempts=attempts, stage=stage)


def _run_episodes(specs: list[EpisodeSpec], pool: PolicyPool, settings: Settings, *, workers: list,
                  respawn: Callable[[int], Any] | None, languages: dict[tuple[str, int], str],
                  on_episode: Callable[[EpisodeResult], None] | None, attempts: int,
                  stage: str) -> list[EpisodeResult]:
    pending = list(specs)
    results: dict[int, EpisodeResult] = {}
    busy: dict[int, _InFlight] = {}  # worker index -> its episode
    last_task: dict[int, tuple[str, int]] = {}
    crashed: list[CrashedEpisode] = []
    waiting: dict[int, tuple[dict, float]] = {}  # worker index -> (its request, when it came), oldest first
    asked: set[int] = set()  # workers whose request is in a forward
    window_s = settings.policy_batch_wait_ms / 1000.0

    def start(i: int, spec: EpisodeSpec, attempt: int = 1, earlier: tuple[str, ...] = ()) -> None:
        busy[i] = _InFlight(spec=spec, seed=episode_seed(settings.seed, spec.suite, spec.task_id,
                                                         spec.initial_state), start=time.monotonic(),
                            attempt=attempt, earlier_errors=earlier)
        last_task[i] = (spec.suite, spec.task_id)
        workers[i].send("start", spec)

    def replace(i: int) -> None:
        if respawn is None:
            return
        try:
            workers[i].close()
        except Exception:  # noqa: BLE001 - a broken worker is replaced either way
            pass
        workers[i] = respawn(i)
        last_task.pop(i, None)

    def finish(i: int, outcome: EpisodeOutcome, *, died: bool = False) -> None:
        ep = busy.pop(i)
        s = ep.spec
        error = ep.error or outcome.error
        task = languages[(s.suite, s.task_id)]
        if error:
            if s.video:  # the video of an attempt that erred is not the episode's
                Path(s.video).unlink(missing_ok=True)
            errors = (*ep.earlier_errors, error)
            if not died:
                replace(i)
            if ep.attempt < attempts:
                log.warning("%s: %s task %d trial %d: attempt %d of %d ended in an error (%s); running it "
                            "again on a fresh worker", stage, s.suite, s.task_id, s.trial, ep.attempt,
                            attempts, error)
                start(i, s, ep.attempt + 1, errors)
            else:
                log.error("%s: %s task %d trial %d ended in an error on all %d attempts: %s", stage,
                          s.suite, s.task_id, s.trial, attempts, error)
                crashed.append(CrashedEpisode(spec=s, task=task, steps=outcome.steps, errors=errors))
            return
        r = EpisodeResult(
            suite=s.suite, task_id=s.task_id, task=task, trial=s.trial,
            success=bool(outcome.success), steps=outcome.steps,
            policy_calls=ep.calls, wall_time_s=time.monotonic() - ep.start, error=None,
            sim_steps=outcome.sim_steps, sim_step_time_s=outcome.step_time_s,
            env_create_s=outcome.env_create_s, reset_s=outcome.reset_s,
            policy_ms=1000.0 * ep.policy_s,
            video=(video_name(s.suite, s.task_id) if s.video and outcome.video_frames else None),
            video_frames=outcome.video_frames, retried_errors=list(ep.earlier_errors))
        results[s.index] = r
        if on_episode is not None:
            on_episode(r)

    def assign(i: int) -> None:
        key = last_task.get(i)
        pick = next((k for k, s in enumerate(pending) if (s.suite, s.task_id) == key), None)
        if pick is None:  # a task no other worker holds: each task's environment built once, not per worker
            held = {t for j, t in last_task.items() if j != i}
            pick = next((k for k, s in enumerate(pending) if (s.suite, s.task_id) not in held), 0)
        start(i, pending.pop(pick))

    def handle(i: int) -> None:
        """Worker i replied: its episode ended, or it waits for actions."""
        try:
            kind, payload = workers[i].recv()
        except WorkerDied as exc:
            if respawn is None:
                raise
            workers[i] = respawn(i)
            last_task.pop(i, None)
            finish(i, EpisodeOutcome(False, 0, 0, 0.0, 0.0, 0.0, error=str(exc)), died=True)
            return
        if kind in ("done", "error"):
            finish(i, payload)
        else:
            waiting[i] = (payload, time.monotonic())

    def dispatch() -> float | None:
        """The waiting requests, oldest first, to the idle replicas. A batch that could still
        grow (environments still simulating, below the batch limit) is held back until its
        oldest request has waited `settings.policy_batch_wait_ms`; returns the seconds left
        until then (None: nothing held back)."""
        while waiting and pool.has_idle_replica():
            could_join = len(busy) - len(asked)  # waiting or simulating
            if pool.max_batch:
                could_join = min(could_join, pool.max_batch)
            waited = time.monotonic() - next(iter(waiting.values()))[1]
            if len(waiting) < could_join and waited < window_s:
                return window_s - waited
            batch = []
            for i in list(waiting)[: pool.batch_limit(len(waiting))]:
                ep = busy[i]
                batch.append(PolicyRequest(key=i, obs=waiting.pop(i)[0], seed=chunk_seed(ep.seed, ep.calls)))
                ep.calls += 1
                asked.add(i)
            pool.submit(batch)
        return None

    def answered(a: PolicyAnswer) -> None:
        i = a.key
        asked.discard(i)
        ep = busy[i]
        ep.policy_s += a.policy_s
        error = a.error
        if error is None:
            try:
                workers[i].send("act", check_chunk(a.actions, settings))
                return
            except PisftError as exc:
                error = f"{type(exc).__name__}: {exc}"
        ep.error = error  # the policy failing is this episode's error
        workers[i].send("abort", ep.error)

    while (pending and not crashed) or busy:
        for i in range(len(workers)):
            if i not in busy and pending and not crashed:
                assign(i)
        hold = dispatch()
        simulating = [i for i in busy if i not in waiting and i not in asked]
        inline = [i for i in simulating if workers[i].has_reply()]
        if inline:
            for i in inline:
                handle(i)
            continue
        objs: dict[Any, int | None] = {workers[i].conn: i for i in simulating if hasattr(workers[i], "conn")}
        if pool.in_flight:
            objs[pool.notify] = None
        if not objs:
            raise RuntimeError(f"{stage}: nothing to wait for with {len(busy)} episodes in flight (a bug)")
        ready = wait_for_replies(list(objs), timeout=hold)
        for i in sorted(objs[c] for c in ready if objs[c] is not None):
            handle(i)
        if pool.notify in ready:
            for a in pool.collect():
                answered(a)
    if crashed:
        raise EpisodeErrors(sorted(crashed, key=lambda c: c.spec.index), len(pending), stage, attempts)
    return [results[s.index] for s in specs]


def mujoco_note(log_dir: Path, stage: str) -> None:
    """Say where MuJoCo's warnings went, when it wrote any (an unstable simulation)."""
    log_file = Path(log_dir) / "MUJOCO_LOG.TXT"
    if log_file.is_file():
        print(f"{stage}: note: MuJoCo logged warnings (an unstable simulation) to {log_file}", flush=True)


def env_count(settings: Settings, specs: list[EpisodeSpec], *, stage: str) -> int:
    """Environment processes for `specs`: `settings.num_envs`, at most one per episode; a note
    when they outnumber the cores."""
    num_envs = max(1, min(settings.num_envs, len(specs)))
    cores = device_mod.usable_cores()
    if num_envs > cores:
        print(f"{stage}: note: {num_envs} environment processes on {cores} cores "
              "(eval.num_envs); they will share them", flush=True)
    return num_envs


def roll_out(specs: list[EpisodeSpec], policy: ChunkPolicy | PolicyPool, settings: Settings, *,
             factory: Callable[[], libero_sim.Simulator], simulator: libero_sim.Simulator, num_envs: int,
             inline: bool, languages: dict[tuple[str, int], str],
             on_episode: Callable[[EpisodeResult], None] | None = None,
             name: str = "closed_loop", log_dir: Path | None = None) -> tuple[list[EpisodeResult], float]:
    """Run `specs` in `num_envs` workers (spawned processes built by `factory`, or, `inline`, in
    this process, the first on `simulator`); (results in the order of `specs`, wall seconds).
    Workers are closed whatever happens; one whose episode ended in an error is replaced by a
    fresh one (inline: a fresh simulator in this process) and the episode run again
    (`run_episodes`). Worker processes run in `log_dir` (MuJoCo writes its log into the working
    folder)."""
    workdir = None if log_dir is None else str(log_dir)

    def spawn(i: int):
        w = ProcessWorker(factory, name=f"{name}-env{i}", workdir=workdir)
        w.wait_ready()
        return w

    def respawn_inline(i: int):  # a fresh simulator in this process
        return InlineWorker(factory(), name=f"inline{i}")

    start = time.monotonic()
    workers: list = []
    try:
        if inline:
            workers = [InlineWorker(simulator if i == 0 else factory(), name=f"inline{i}")
                       for i in range(num_envs)]
        else:
            for i in range(num_envs):  # started together, then waited for (imports take seconds)
                workers.append(ProcessWorker(factory, name=f"{name}-env{i}", workdir=workdir))
            for w in workers:
                w.wait_ready()
        results = run_episodes(specs, policy, settings, workers=workers,
                               respawn=respawn_inline if inline else spawn, languages=languages,
                               on_episode=on_episode, stage=name)
    finally:
        for w in workers:
            w.close()
    return results, time.monotonic() - start


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "min": None, "max": None}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "median": float(np.median(a)), "min": float(a.min()),
            "max": float(a.max())}


def _rate(entry: dict) -> None:
    """success_rate and its 95% Wilson interval as two scalars (`success_rate_ci_low/_high`,
    like the evaluate stage's `action_mse_ci_low/_high`), so `dvc metrics diff` compares them."""
    entry["success_rate"] = entry["successes"] / entry["trials"] if entry["trials"] else None
    ci = wilson_interval(entry["successes"], entry["trials"], CONFIDENCE) if entry["trials"] else None
    entry["success_rate_ci_low"] = ci.low if ci else None
    entry["success_rate_ci_high"] = ci.high if ci else None


def summarize(results: list[EpisodeResult]) -> dict:
    """Success per task, per suite and overall (suites in the order they were run), 95% Wilson
    intervals, episode lengths. Deterministic: timings are kept apart (`timing`).

    Only over episodes that ran to their end: a result with an error is refused (a crash is not
    a failed trial; `run_episodes` retries it or stops the run). `errors` stays in the output
    (0: none counted), `retried` counts episodes that needed another attempt."""
    crashed = [r for r in results if r.error is not None]
    if crashed:
        r = crashed[0]
        raise PisftError(f"{len(crashed)} episode(s) ended in an error (e.g. {r.suite} task {r.task_id} "
                         f"trial {r.trial}: {r.error}); a success rate counts only episodes that ran "
                         "to their end")
    suites: dict[str, dict] = {}
    for r in results:
        s = suites.setdefault(r.suite, {"per_task": {}, "successes": 0, "trials": 0, "errors": 0,
                                        "retried": 0, "_steps": []})
        # keyed by task id: LIBERO-90 repeats instructions across scenes
        t = s["per_task"].setdefault(str(r.task_id), {"task_id": r.task_id, "task": r.task, "successes": 0,
                                                      "trials": 0, "errors": 0, "retried": 0, "_steps": [],
                                                      "video": None})
        for entry in (s, t):
            entry["successes"] += int(r.success)
            entry["trials"] += 1
            entry["retried"] += int(bool(r.retried_errors))
            entry["_steps"].append(r.steps)
        if r.video and t["video"] is None:
            t["video"] = r.video
    for s in suites.values():
        for entry in (s, *s["per_task"].values()):
            _rate(entry)
            entry["episode_steps"] = _stats(entry.pop("_steps"))
    total = sum(s["trials"] for s in suites.values())
    successes = sum(s["successes"] for s in suites.values())
    out = {"successes": successes, "trials": total}
    _rate(out)
    out.update({
        # Mean of the suites' rates: how LIBERO results are usually quoted.
        "mean_suite_success_rate": (float(np.mean([s["success_rate"] for s in suites.values()]))
                                    if suites else None),
        "episodes": total,
        "errors": 0,  # episodes that ended in an error are never counted (see above)
        "retried": sum(s["retried"] for s in suites.values()),
        "episode_steps": _stats([r.steps for r in results]),
        "successful_episode_steps": _stats([r.steps for r in results if r.success]),
        "confidence_interval": "success_rate_ci_low/_high: 95% Wilson score interval over the episodes",
        "suites": suites,
    })
    return out


def timing(results: list[EpisodeResult], wall_time_s: float, num_envs: int, pool: PolicyPool | None = None) -> dict:
    """Throughput of the simulator and the policy (these vary run to run; results do not)."""
    sim_steps = sum(r.sim_steps for r in results)
    step_time = sum(r.sim_step_time_s for r in results)
    calls = sum(r.policy_calls for r in results)
    policy_ms = sum(r.policy_ms for r in results)
    out = {
        "num_envs": num_envs,
        "wall_time_s": wall_time_s,
        "simulator_steps": sim_steps,
        # per environment: steps / time inside env.step (physics and both camera renders)
        "simulator_steps_per_s": sim_steps / step_time if step_time > 0 else None,
        # all environments together over the rollout's wall time (what num_envs buys)
        "simulator_steps_per_s_all_envs": sim_steps / wall_time_s if wall_time_s > 0 else None,
        "policy_calls": calls,
        # a request's share of its forward (a forward of B requests counts 1/B of its time to each)
        "policy_ms_per_chunk": policy_ms / calls if calls else None,
        "env_create_s": _stats([r.env_create_s for r in results if r.env_create_s > 0]),
        "reset_s": _stats([r.reset_s for r in results if r.sim_steps]),
    }
    if pool is not None:  # the forwards of every attempt, also of episodes run again
        out["policy_devices"] = list(pool.devices)
        out["policy_replicas"] = len(pool.replicas)
        out["policy_batch_limit"] = pool.max_batch
        out.update(pool.stats.to_dict())
    return out


def simulator_info(simulator: Any) -> dict:
    """Which simulator produced the numbers: `hf-libero` and its version only when the `libero`
    package in use is that distribution's; a stand-in says what it is (`describe()`)."""
    describe = getattr(simulator, "describe", None)
    if callable(describe):
        return dict(describe())
    if not isinstance(simulator, libero_sim.LiberoSimulator):
        return {"package": f"unknown ({type(simulator).__module__}.{type(simulator).__qualname__})",
                "version": None}
    import libero

    info: dict = {"package": "libero (not from the hf-libero distribution)", "version": None,
                  "path": str(Path(libero.__file__).parent)}
    try:
        dist = importlib.metadata.distribution("hf-libero")
        if Path(dist.locate_file("libero/__init__.py")).resolve() == Path(libero.__file__).resolve():
            info = {"package": "hf-libero", "version": dist.version}
    except importlib.metadata.PackageNotFoundError:
        pass
    for name in ("robosuite", "mujoco"):
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    info["MUJOCO_GL"] = os.environ.get("MUJOCO_GL")
    return info


def expectation(cfg: config_mod.PisftConfig, settings: Settings) -> str | None:
    """What a reader should expect of these numbers, when the run is the embedded default."""
    notes = []
    if cfg.model.source == "tiny" and cfg.uses_demo_data:
        notes.append(
            f"This model is the embedded default: the tiny pi0.5-architecture model (random init), "
            f"fine-tuned for {cfg.train.steps} steps on synthetic LIBERO-like data whose images and "
            f"actions do not come from the simulator. Expect a success rate of about 0: this check "
            f"shows that the loop runs (the simulator steps and renders both cameras, requests are "
            f"built as openpi's LIBERO client builds them, the model answers, its actions are "
            f"executed), not what the model can do.")
    short = [s for s in settings.suites if settings.steps_for(s) < libero_sim.SUITE_MAX_STEPS[s]]
    if short:
        notes.append(
            f"Episodes are cut at {settings.max_steps} steps (eval.max_steps), below openpi's limit "
            f"for {', '.join(f'{s} ({libero_sim.SUITE_MAX_STEPS[s]})' for s in short)}: even a good "
            f"policy rarely finishes a task that quickly, so these rates are not comparable with "
            f"published LIBERO results (eval.max_steps: 0 restores openpi's limits).")
    return " ".join(notes) or None


def _fmt_ci(entry: dict) -> str:
    low, high = entry.get("success_rate_ci_low"), entry.get("success_rate_ci_high")
    return f"[{low:.2f}, {high:.2f}]" if low is not None and high is not None else "n/a"


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def report_markdown(metrics: dict, settings: Settings, model_dir: str, *, video_prefix: str = "") -> str:
    sim = metrics.get("simulator", {})
    t = metrics.get("timing", {})
    sim_name = sim.get("package", "?") + (f" {sim['version']}" if sim.get("version") else "")
    lines = ["# Closed-loop LIBERO evaluation", ""]
    if metrics.get("expectation"):
        lines += [f"**What to expect.** {metrics['expectation']}", ""]
    lines += [
        f"Model `{model_dir}`; simulator {sim_name}; trials per task: {settings.trials_per_task}, "
        f"replanning every {settings.replan_steps} steps, {settings.num_wait_steps} wait steps, "
        f"environment seed {settings.seed}, images resized to {settings.resize_size}, step limit "
        + (f"{settings.max_steps} (eval.max_steps)" if settings.max_steps else "openpi's per suite")
        + f". {t.get('num_envs', '?')} environment processes.",
    ]
    if metrics.get("prompt"):
        lines.append(f"Prompt: {metrics['prompt']['describe']}.")
    if metrics.get("guidance"):
        lines.append(f"Guidance: {metrics['guidance']['describe']}.")
    lines += ["", f"Success rate {_num(metrics['success_rate'], '.3f')} "
              f"(95% Wilson {_fmt_ci(metrics)}) over {metrics['episodes']} "
              f"episodes, every one run to its end; {metrics.get('retried', 0)} of them ended in an "
              f"error first and were run again on a fresh worker (episodes.jsonl: `retried_errors`).", ""]
    lines += ["| suite | success rate | 95% CI | successes / trials | mean steps | episodes run again after an error |",
              "|---|---|---|---|---|---|"]
    for name, s in metrics["suites"].items():
        lines.append(f"| {name} | {s['success_rate']:.3f} | {_fmt_ci(s)} | "
                     f"{s['successes']} / {s['trials']} | {_num(s['episode_steps']['mean'], '.1f')} | "
                     f"{s.get('retried', 0)} |")
    lines += ["", "| suite | task | success rate | 95% CI | successes / trials | mean steps | video |",
              "|---|---|---|---|---|---|---|"]
    for name, s in metrics["suites"].items():
        for e in s["per_task"].values():
            video = f"[{Path(e['video']).name}]({video_prefix}{e['video']})" if e.get("video") else "—"
            lines.append(f"| {name} | {e['task_id']}: {e['task']} | {e['success_rate']:.3f} | "
                         f"{_fmt_ci(e)} | {e['successes']} / {e['trials']} | "
                         f"{_num(e['episode_steps']['mean'], '.1f')} | {video} |")
    if t:
        lines += ["", f"Throughput: {_num(t.get('simulator_steps_per_s'), '.2f')} simulator steps/s per "
                  f"environment (physics and both 256×256 renders), "
                  f"{_num(t.get('simulator_steps_per_s_all_envs'), '.2f')} steps/s over all environments; "
                  f"policy {_num(t.get('policy_ms_per_chunk'), '.1f')} ms per chunk "
                  f"({t.get('policy_calls')} chunks"
                  + (f", {_num(t.get('mean_policy_batch'), '.1f')} per forward on average over "
                     f"{t.get('policy_replicas')} replica(s): {', '.join(t.get('policy_devices') or [])}"
                     if t.get("policy_forwards") else "")
                  + f"); rollouts took {_num(t.get('wall_time_s'), '.1f')} s."]
    videos = [(name, e) for name, s in metrics["suites"].items() for e in s["per_task"].values()
              if e.get("video")]
    if videos:
        lines += ["", "## Videos", "",
                  "First episode of each task: agent view (left) and wrist camera (right), rotated as "
                  "the policy sees them, 10 frames per second.", ""]
        for name, e in videos:
            src = f"{video_prefix}{e['video']}"
            lines += [f"{name} task {e['task_id']}: {e['task']}", "",
                      f'<video src="{src}" controls width="512"></video>', ""]
    return "\n".join(lines) + "\n"


OFF_NOTE = ("eval.closed_loop is false: closed-loop evaluation was not run (no simulator was "
            "started). Set eval.closed_loop: true to run it.")


def write_not_run(cfg: config_mod.PisftConfig) -> dict:
    """The stage with eval.closed_loop off (a DVC pipeline keeps the stage whatever the config
    says): an explicit "not run" output, never numbers; `evaluate` ignores it while the key is
    off and refuses it when the key is on (`offline.closed_loop_results`)."""
    metrics = {"closed_loop": False, "note": OFF_NOTE}
    with atomic_dir(cfg.results(OUTPUT_DIR)) as out:
        (out / VIDEO_DIR).mkdir()
        write_json_atomic(out / "metrics.json", metrics)
        write_text_atomic(out / "report.md", f"# Closed-loop LIBERO evaluation\n\nNot run: {OFF_NOTE}\n")
        config_mod.write_resolved(cfg, out / "pisft_config.json")
    print(f"closed_loop: not run ({OFF_NOTE})", flush=True)
    return metrics


def run(cfg: config_mod.PisftConfig, *, simulator: Callable[[], libero_sim.Simulator] | None = None,
        policy: ChunkPolicy | None = None, inline: bool = False) -> dict:
    """The closed_loop stage: the fine-tuned model (`results/train/model`) in LIBERO.

    `simulator` is a picklable factory (default `libero_sim.LiberoSimulator`): called here to
    plan the episodes (and to fail at once, with the install instructions, when LIBERO is
    missing) and in every worker. `inline` runs the environments in this process (tests).
    """
    if not cfg.eval.closed_loop:
        return write_not_run(cfg)
    settings = Settings.from_config(cfg, stage="closed_loop")
    model_dir = cfg.results("train", "model")
    factory = simulator if simulator is not None else libero_sim.LiberoSimulator
    sim = factory()  # SimulatorUnavailable with the install line when LIBERO is not installed
    sim_info = simulator_info(sim)
    with open_policy_pool(cfg, policy, model_dir=model_dir, trained_on=cfg.results("dataset"), seed=settings.seed,
                          settings=settings, stage="closed_loop") as pool:
        return _evaluate(cfg, settings, pool, factory=factory, sim=sim, sim_info=sim_info, inline=inline,
                         model_dir=model_dir)


def _evaluate(cfg: config_mod.PisftConfig, settings: Settings, pool: PolicyPool, *,
              factory: Callable[[], libero_sim.Simulator], sim: libero_sim.Simulator, sim_info: dict,
              inline: bool, model_dir: Path) -> dict:
    with atomic_dir(cfg.results(OUTPUT_DIR)) as out:
        specs, languages = plan_episodes(sim, settings, out)
        num_envs = env_count(settings, specs, stage="closed_loop")
        print(f"closed_loop: {len(specs)} episodes in {sim_info.get('package')} "
              f"{sim_info.get('version') or ''}, {num_envs} environment "
              f"{'(inline)' if inline else 'processes'}", flush=True)
        record = progress("closed_loop", len(specs), lambda r: f"{r.suite} task {r.task_id} trial {r.trial}")

        mujoco_logs = logs_mod.mujoco_log_dir("closed_loop", cfg.results("logs"))
        results, wall = roll_out(specs, pool, settings, factory=factory, simulator=sim, num_envs=num_envs,
                                 inline=inline, languages=languages, on_episode=record, name="closed_loop",
                                 log_dir=mujoco_logs)
        mujoco_note(mujoco_logs, "closed_loop")
        for r in results:
            if r.video:  # a page per video for `snakemake --report`, which plays no bare MP4
                write_text_atomic(out / Path(r.video).with_suffix(".html"), video_mod.html_page(
                    out / r.video, f"{r.suite} task {r.task_id}: {r.task}",
                    f"Trial {r.trial}: {'success' if r.success else 'failure'} after {r.steps} steps"
                    f". Agent view (left) and wrist "
                    f"camera (right), as the policy sees them; {video_mod.FPS} frames per second; "
                    f"simulator {sim_info.get('package')} {sim_info.get('version') or ''}."))
        (out / VIDEO_DIR).mkdir(exist_ok=True)  # a declared output, also when videos are off
        with open(out / "episodes.jsonl", "w") as fh:
            for r in results:
                fh.write(json.dumps(asdict(r)) + "\n")
        metrics = {"closed_loop": True, **summarize(results)}
        metrics["simulator"] = sim_info
        metrics["timing"] = timing(results, wall, num_envs, pool)
        metrics["settings"] = asdict(settings)
        metrics["model_dir"] = str(model_dir)
        metrics["expectation"] = expectation(cfg, settings)
        metrics.update(policy_record(pool))
        metrics["wall_time_s"] = wall
        write_json_atomic(out / "metrics.json", metrics)
        write_text_atomic(out / "report.md", report_markdown(metrics, settings, str(model_dir)))
        config_mod.write_resolved(cfg, out / "pisft_config.json")
    t = metrics["timing"]
    print(f"closed_loop: success rate {metrics['success_rate']:.3f} over {metrics['episodes']} "
          f"episodes in {wall:.1f} s ({_num(t['simulator_steps_per_s'], '.2f')} simulator steps/s per "
          f"environment, policy {_num(t['policy_ms_per_chunk'], '.1f')} ms per chunk) -> "
          f"{cfg.results(OUTPUT_DIR)}/metrics.json", flush=True)
    return metrics
