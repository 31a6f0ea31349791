"""The rollout scheduler: episodes through environment workers, their requests through the
policy's batching rule, an episode that errs run again on a fresh worker.

`Scheduler` drives `workers` (`pisft.rollout.workers`) through the planned episodes
(`pisft.rollout.plan`): a free worker takes the next pending episode of the task whose
environment it holds, else the first pending episode of a task no other worker holds, else the
first pending episode (building an environment costs seconds; which worker runs an episode
changes no result). The requests of every worker waiting for the policy go to an idle replica of
the pool (`pisft.policy.replicas`) as the pool's rule says (`pisft.policy.batching`: who joins,
how long a batch that could still grow is held, from the simulation and forward times it
measures here), each with its chunk's noise seed.

An episode that ends in an error (the simulator raised, its worker process died, the policy
failed or answered with non-finite actions) runs again from its start on a fresh worker, up to
`EPISODE_ATTEMPTS` in all; one that errs on every attempt stops the run: no new episode is
started, those in flight end, and `EpisodeErrors` names the episodes and their errors.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait as wait_for_replies
from pathlib import Path
from typing import Any

import numpy as np

from pisft import device as device_mod
from pisft.errors import PisftError
from pisft.policy.fixed_shape import FixedShape
from pisft.policy.interface import Policy
from pisft.policy.replicas import Answer as PolicyAnswer
from pisft.policy.replicas import PolicyPool, inference_timing
from pisft.policy.replicas import Request as PolicyRequest
from pisft.rollout import libero_sim
from pisft.rollout.chunking import ChunkSchedule
from pisft.rollout.plan import chunk_seed, episode_seed, video_name
from pisft.rollout.settings import Settings
from pisft.rollout.workers import EpisodeOutcome, EpisodeSpec, InlineWorker, ProcessWorker, WorkerDied
from pisft.stages import CLOSED_LOOP

log = logging.getLogger("pisft.closed_loop")


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
    perturbation: dict | None = None  # the episode's perturbation as applied (pisft.rollout.perturb); None: none

    # errors of earlier attempts of this episode (each ended in an error and was run again on a
    # fresh worker); this result is of the attempt that ran to its end
    retried_errors: list[str] = field(default_factory=list)
    # |Δ²a| sums at chunk boundaries and elsewhere (pisft.rollout.chunking.jerk_sums)
    chunking: dict | None = None

    # How the run went, not what the episode gave: the times, and the attempts before this one.
    RUN_ONLY = ("wall_time_s", "sim_step_time_s", "env_create_s", "reset_s", "policy_ms", "retried_errors")

    def outcome(self) -> dict:
        """What the episode gave (`episodes.jsonl`): fixed by the config, the model and the thread
        count, whatever the timing, the environment processes or a crash on the way. An episode without a
        perturbation has no `perturbation` key (the lines are as before eval.perturbations)."""
        return {k: v for k, v in asdict(self).items()
                if k not in self.RUN_ONLY and not (k == "perturbation" and v is None)}

    def run_record(self) -> dict:
        """How this run of the episode went (the timing record): its times and retried errors."""
        return {"suite": self.suite, "task_id": self.task_id, "trial": self.trial,
                **{k: getattr(self, k) for k in self.RUN_ONLY}}


#####
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




class Scheduler:
    """One run of `specs` on `workers` (module docstring); `run()` returns the results in the
    order of `specs`. `respawn(i)` replaces worker i after an error (without it, the same worker,
    whose environment was closed, runs the episode again)."""

    def __init__(self, specs: list[EpisodeSpec], pool: PolicyPool, settings: Settings, *, workers: list,
                 respawn: Callable[[int], Any] | None, languages: dict[tuple[str, int], str],
                 on_episode: Callable[[EpisodeResult], None] | None = None,
                 attempts: int = EPISODE_ATTEMPTS, stage: str = CLOSED_LOOP.name) -> None:
        self.specs, self.pool, self.settings = specs, pool, settings
        self.workers, self.respawn, self.languages = workers, respawn, languages
        self.on_episode, self.attempts, self.stage = on_episode, attempts, stage
        self.pending = list(specs)
        self.results: dict[int, EpisodeResult] = {}
        self.busy: dict[int, _InFlight] = {}  # worker index -> its episode
        self.last_task: dict[int, tuple[str, int]] = {}
        self.crashed: list[CrashedEpisode] = []
        self.waiting: dict[int, tuple[dict, float]] = {}  # worker index -> (its request, when it came), oldest first
        self.asked: set[int] = set()  # workers whose request is in a forward
        # worker index -> (what it was sent, "chunk" or "start", and when): simulating since then
        self.sent: dict[int, tuple[str, float]] = {}
        # the chunks of each episode under eval.rtc's delay, with or without RTC
        self.chunking = ChunkSchedule(settings.replan_steps, settings.delay_steps, settings.rtc is not None)

    def start(self, i: int, spec: EpisodeSpec, attempt: int = 1, earlier: tuple[str, ...] = ()) -> None:
        self.busy[i] = _InFlight(spec=spec, seed=episode_seed(spec.env_seed, spec.suite, spec.task_id,
                                                              spec.initial_state), start=time.monotonic(),
                                 attempt=attempt, earlier_errors=earlier)
        self.last_task[i] = (spec.suite, spec.task_id)
        self.chunking.start(i)
        self.workers[i].send("start", spec)
        self.sent[i] = ("start", time.monotonic())

    def replace(self, i: int) -> None:
        if self.respawn is None:
            return
        try:
            self.workers[i].close()
        except Exception:  # noqa: BLE001 - a broken worker is replaced either way
            pass
        self.workers[i] = self.respawn(i)
        self.last_task.pop(i, None)

    def finish(self, i: int, outcome: EpisodeOutcome, *, died: bool = False) -> None:
        ep = self.busy.pop(i)
        self.sent.pop(i, None)
        jerk = self.chunking.finish(i, outcome.steps)
        s = ep.spec
        error = ep.error or outcome.error
        task = self.languages[(s.suite, s.task_id)]
        if error:
            if s.video:  # the video of an attempt that erred is not the episode's
                Path(s.video).unlink(missing_ok=True)
            errors = (*ep.earlier_errors, error)
            if not died:
                self.replace(i)
            if ep.attempt < self.attempts:
                log.warning("%s: %s task %d trial %d: attempt %d of %d ended in an error (%s); running it "
                            "again on a fresh worker", self.stage, s.suite, s.task_id, s.trial, ep.attempt,
                            self.attempts, error)
                self.start(i, s, ep.attempt + 1, errors)
            else:
                log.error("%s: %s task %d trial %d ended in an error on all %d attempts: %s", self.stage,
                          s.suite, s.task_id, s.trial, self.attempts, error)
                self.crashed.append(CrashedEpisode(spec=s, task=task, steps=outcome.steps, errors=errors))
            return
        r = EpisodeResult(
            suite=s.suite, task_id=s.task_id, task=task, trial=s.trial,
            success=bool(outcome.success), steps=outcome.steps,
            policy_calls=ep.calls, wall_time_s=time.monotonic() - ep.start, error=None,
            sim_steps=outcome.sim_steps, sim_step_time_s=outcome.step_time_s,
            env_create_s=outcome.env_create_s, reset_s=outcome.reset_s, perturbation=outcome.perturbation,
            policy_ms=1000.0 * ep.policy_s,
            video=(video_name(s.suite, s.task_id) if s.video and outcome.video_frames else None),
            video_frames=outcome.video_frames, retried_errors=list(ep.earlier_errors), chunking=jerk)
        self.results[s.index] = r
        if self.on_episode is not None:
            self.on_episode(r)

    def assign(self, i: int) -> None:
        key = self.last_task.get(i)
        pick = next((k for k, s in enumerate(self.pending) if (s.suite, s.task_id) == key), None)
        if pick is None:  # a task no other worker holds: each task's environment built once, not per worker
            held = {t for j, t in self.last_task.items() if j != i}
            pick = next((k for k, s in enumerate(self.pending) if (s.suite, s.task_id) not in held), 0)
        self.start(i, self.pending.pop(pick))

    def handle(self, i: int) -> None:
        """Worker i replied: its episode ended, or it waits for actions."""
        try:
            kind, payload = self.workers[i].recv()
        except WorkerDied as exc:
            if self.respawn is None:
                raise
            self.workers[i] = self.respawn(i)
            self.last_task.pop(i, None)
            self.finish(i, EpisodeOutcome(False, 0, 0, 0.0, 0.0, 0.0, error=str(exc)), died=True)
            return
        if kind in ("done", "error"):
            self.finish(i, payload)
        else:
            now = time.monotonic()
            sent = self.sent.pop(i, None)
            if sent is not None:  # the simulation of one chunk or episode start (the rule's forecast)
                self.pool.rule.simulated(now - sent[1], sent[0])
            self.waiting[i] = (payload, now)

    def dispatch(self) -> float | None:
        """The waiting requests, oldest first, to the idle replicas, as the pool's rule says;
        returns the seconds a batch that could still grow is held (None: nothing held back)."""
        rule = self.pool.rule
        while self.waiting and self.pool.has_idle_replica():
            now = time.monotonic()
            simulating = [i for i in self.busy if i not in self.waiting and i not in self.asked]
            hold = rule.hold_s(now=now, oldest=next(iter(self.waiting.values()))[1], waiting=len(self.waiting),
                               could_join=len(self.waiting) + len(simulating),
                               expected=[rule.expected(self.sent[i][1], self.sent[i][0])
                                         for i in simulating if i in self.sent])
            if hold is not None:
                return hold
            batch = []
            for i in list(self.waiting)[: rule.limit(len(self.waiting))]:
                ep = self.busy[i]
                batch.append(PolicyRequest(key=i, obs=self.chunking.request(i, self.waiting.pop(i)[0]),
                                           seed=chunk_seed(ep.seed, ep.calls)))
                ep.calls += 1
                self.asked.add(i)
            self.pool.submit(batch)
        return None

    def answered(self, a: PolicyAnswer) -> None:
        i = a.key
        self.asked.discard(i)
        ep = self.busy[i]
        ep.policy_s += a.policy_s
        error = a.error
        if error is None:
            try:
                self.workers[i].send("act", self.chunking.payload(i, a.actions,
                                                                  lambda c: check_chunk(c, self.settings)))
                self.sent[i] = ("chunk", time.monotonic())
                return
            except PisftError as exc:
                error = f"{type(exc).__name__}: {exc}"
        ep.error = error  # the policy failing is this episode's error
        self.workers[i].send("abort", ep.error)

    def run(self) -> list[EpisodeResult]:
        workers = self.workers
        while (self.pending and not self.crashed) or self.busy:
            for i in range(len(workers)):
                if i not in self.busy and self.pending and not self.crashed:
                    self.assign(i)
            hold = self.dispatch()
            simulating = [i for i in self.busy if i not in self.waiting and i not in self.asked]
            inline = [i for i in simulating if workers[i].has_reply()]
            if inline:
                for i in inline:
                    self.handle(i)
                continue
            objs: dict[Any, int | None] = {workers[i].conn: i for i in simulating if hasattr(workers[i], "conn")}
            if self.pool.in_flight:
                objs[self.pool.notify] = None
            if not objs:
                raise RuntimeError(f"{self.stage}: nothing to wait for with {len(self.busy)} episodes in flight "
                                   "(a bug)")
            ready = wait_for_replies(list(objs), timeout=hold)
            for i in sorted(objs[c] for c in ready if objs[c] is not None):
                self.handle(i)
            if self.pool.notify in ready:
                for a in self.pool.collect():
                    self.answered(a)
        if self.crashed:
            raise EpisodeErrors(sorted(self.crashed, key=lambda c: c.spec.index), len(self.pending), self.stage,
                                self.attempts)
        return [self.results[s.index] for s in self.specs]


def run_episodes(specs: list[EpisodeSpec], policy: Any, settings: Settings, *,
                 workers: list, respawn: Callable[[int], Any] | None = None,
                 languages: dict[tuple[str, int], str],
                 on_episode: Callable[[EpisodeResult], None] | None = None,
                 attempts: int = EPISODE_ATTEMPTS, stage: str = CLOSED_LOOP.name) -> list[EpisodeResult]:
    """`Scheduler(...).run()`; `policy`: a `PolicyPool`, or one policy, then pooled here with
    `settings.forward_rows` and `settings.policy_batch_wait_ms` (a model's forwards then have that
    many rows, `FixedShape`; a pool made here is closed here; a given pool, by its owner). Every
    result returned ran to its end (`error` is None); `retried_errors` keeps what failed on the way."""
    ours = not isinstance(policy, PolicyPool)
    if ours:
        rows = settings.forward_rows(len(specs))
        model = FixedShape(policy, rows, name=stage) if isinstance(policy, Policy) else policy
        made = PolicyPool([model], max_batch=rows, wait_ms=settings.policy_batch_wait_ms)
    else:
        made = contextlib.nullcontext(policy)
    with made as pool:
        return Scheduler(specs, pool, settings, workers=workers, respawn=respawn, languages=languages,
                         on_episode=on_episode, attempts=attempts, stage=stage).run()


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


def roll_out(specs: list[EpisodeSpec], policy: Any, settings: Settings, *,
             factory: Callable[[], libero_sim.Simulator], simulator: libero_sim.Simulator, num_envs: int,
             inline: bool, languages: dict[tuple[str, int], str],
             on_episode: Callable[[EpisodeResult], None] | None = None,
             name: str = CLOSED_LOOP.name, log_dir: Path | None = None) -> tuple[list[EpisodeResult], float]:
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

#####
def stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "min": None, "max": None}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "median": float(np.median(a)), "min": float(a.min()),
            "max": float(a.max())}


def timing(results: list[EpisodeResult], wall_time_s: float, num_envs: int, pool: PolicyPool | None = None,
           settings: Settings | None = None) -> dict:
    """How the run went (the timing record; these vary run to run, results do not): throughput of
    the simulator and the policy, the environment processes, the policy's batches, the episodes
    run again after an error, each episode's times (`EpisodeResult.run_record`) and the settings
    that change only the speed (`Settings.RUN_ONLY`)."""
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
        "env_create_s": stats([r.env_create_s for r in results if r.env_create_s > 0]),
        "reset_s": stats([r.reset_s for r in results if r.sim_steps]),
        "retried": sum(bool(r.retried_errors) for r in results),
        "episodes": [r.run_record() for r in results],
    }
    if settings is not None:
        out["settings"] = {k: getattr(settings, k) for k in settings.RUN_ONLY}
    if pool is not None:  # the forwards of every attempt, also of episodes run again
        out["policy_devices"] = list(pool.devices)
        out["policy_replicas"] = len(pool.replicas)
        out["policy_batch_limit"] = pool.max_batch
        out.update(pool.stats.to_dict())
        out["inference"] = inference_timing(pool)
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
