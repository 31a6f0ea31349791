"""Simulator side of closed-loop LIBERO: one environment per worker process, driven by messages.

A worker owns a simulator (built in the worker by a picklable factory, e.g. the class
`libero_sim.LiberoSimulator`) and at most one environment, the one of the task it ran last; it
is created again only when the worker moves to another task (creating a LIBERO environment takes
seconds). The parent sends three kinds of message:

  ("start", EpisodeSpec)     seed the environment, reset it, set the task's initial state number
                             `init_state` (default: `trial`; under the spec's perturbation, as
                             `pisft.rollout.perturb` changes it), run the wait steps; reply ("obs", request)
  ("act", actions)           execute the actions (a chunk's first `replan_steps`) until the task
                             is done or the step limit is reached; reply ("obs", request) when
                             more actions are needed, else ("done", EpisodeOutcome)
  ("act", (actions, then))   with an inference delay (`pisft.rollout.chunking`): execute
                             `actions`, take the request's observation, execute `then` (the
                             steps the robot keeps moving while the next chunk is computed), reply
  ("close", None)            close the environment and exit

An exception inside an episode is replied as ("error", EpisodeOutcome with `error`), the
environment is closed (its state is unknown) and the worker waits for the next episode.

Requests are built in the worker (`libero_sim.policy_request`: 180° rotation, resize with
padding, 8-dim state), so only 224×224 images cross the pipe, and the video of an episode
(`EpisodeSpec.video`) is encoded in the worker, frame by frame, in parallel with the others.
Likewise `EpisodeSpec.record` has the worker record every executed step (both cameras, the
state, the action; `pisft.rollout.recording`) for the rollout collection of the RECAP loop.

`InlineWorker` runs the same `EpisodeRunner` in the calling process (tests that inspect the
stand-in environment, debugging); `ProcessWorker` in a spawned process (spawn, not fork: the
parent holds PyTorch's thread pools and the simulator needs its own GL context).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pisft import logs
from pisft.errors import PisftError
from pisft.rollout import libero_sim
from pisft.rollout import perturb
from pisft.rollout.recording import EpisodeRecorder
from pisft.rollout.video import SideBySideWriter


@dataclass(frozen=True)
class EpisodeSpec:
    index: int  # position in the run's episode order (suite, task, trial)
    suite: str
    task_id: int
    trial: int
    max_steps: int
    num_wait_steps: int
    env_seed: int
    resize_size: int
    video: str | None = None  # write this episode's rollout video here
    init_state: int | None = None  # the task's initial state number; None: `trial`
    record: str | None = None  # record the executed steps into this folder (pisft.rollout.recording)
    # this episode under a perturbation (pisft.rollout.perturb; eval.perturbations), None: as openpi's
    perturbation: perturb.Perturbation | None = None

    @property
    def initial_state(self) -> int:
        return self.trial if self.init_state is None else self.init_state


@dataclass
class EpisodeOutcome:
    success: bool
    steps: int  # policy steps executed (wait steps not counted)
    sim_steps: int  # every env.step, wait steps included
    step_time_s: float  # time inside env.step (physics and both camera renders)
    env_create_s: float  # 0 when the worker's environment was reused
    reset_s: float  # env.seed + reset + set_init_state
    video_frames: int = 0
    error: str | None = None
    recorded_steps: int = 0
    perturbation: dict | None = None  # what the episode's perturbation applied (pisft.rollout.perturb)


@dataclass
class _Episode:
    spec: EpisodeSpec
    env: Any
    prompt: str
    obs: dict
    outcome: EpisodeOutcome
    writer: SideBySideWriter | None = None
    recorder: EpisodeRecorder | None = None
    done: bool = False
    perturbed: perturb.EpisodePerturbation | None = None


def _frame(obs: dict) -> tuple[np.ndarray, np.ndarray]:
    """The two camera images as the policy sees them (rotated 180°), at render resolution."""
    agent = libero_sim.to_uint8(np.ascontiguousarray(obs["agentview_image"][::-1, ::-1]))
    wrist = libero_sim.to_uint8(np.ascontiguousarray(obs["robot0_eye_in_hand_image"][::-1, ::-1]))
    return agent, wrist


@dataclass
class EpisodeRunner:
    """Runs episodes in one simulator; keeps the environment of the last task."""

    simulator: Any
    _key: tuple[str, int] | None = None
    _env: Any = None
    _suites: dict = field(default_factory=dict)
    _episode: _Episode | None = None

    def _suite(self, name: str):
        if name not in self._suites:
            self._suites[name] = self.simulator.suite(name)
        return self._suites[name]

    def _close_env(self) -> None:
        env, self._env, self._key = self._env, None, None
        close = getattr(env, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - a broken environment is replaced either way
                pass

    def start(self, spec: EpisodeSpec) -> dict:
        suite = self._suite(spec.suite)
        task = suite.get_task(spec.task_id)
        created = 0.0
        if self._key != (spec.suite, spec.task_id):
            self._close_env()
            t0 = time.monotonic()
            self._env = self.simulator.make_env(task, resolution=libero_sim.RENDER_RESOLUTION,
                                                seed=spec.env_seed)
            created = time.monotonic() - t0
            self._key = (spec.suite, spec.task_id)
        env = self._env
        t0 = time.monotonic()
        # Seeded before every episode (openpi seeds once per task): LIBERO's reset draws object
        # placements from numpy's global generator, so this makes an episode independent of
        # the episodes this worker ran before, i.e. of eval.num_envs.
        seed = getattr(env, "seed", None)
        if callable(seed):
            seed(spec.env_seed)
        env.reset()
        init_state = suite.get_task_init_states(spec.task_id)[spec.initial_state]
        perturbed = perturb.for_episode(spec.perturbation, seed=spec.env_seed, suite=spec.suite,
                                        task_id=spec.task_id, init_state=spec.initial_state)
        if perturbed is not None:  # the scene and the initial state, before LIBERO sets it
            init_state = perturbed.initial_state(env, init_state)
        obs = env.set_init_state(init_state)
        prompt = task.language
        if perturbed is not None:  # the prompt and the first observation
            obs, prompt = perturbed.begin(obs, task)
        reset_s = time.monotonic() - t0
        outcome = EpisodeOutcome(success=False, steps=0, sim_steps=0, step_time_s=0.0,
                                 env_create_s=created, reset_s=reset_s,
                                 perturbation=None if perturbed is None else perturbed.record)
        ep = _Episode(spec=spec, env=env, prompt=prompt, obs=obs, outcome=outcome, perturbed=perturbed)
        self._episode = ep
        for _ in range(spec.num_wait_steps):
            self._step(ep, list(libero_sim.DUMMY_ACTION))
        if spec.video:
            ep.writer = SideBySideWriter(spec.video)
            ep.writer.add(*_frame(ep.obs))
        if spec.record:
            ep.recorder = EpisodeRecorder(spec.record)
        return libero_sim.policy_request(ep.obs, ep.prompt, resize=spec.resize_size)

    def _step(self, ep: _Episode, action: list[float]) -> bool:
        t0 = time.monotonic()
        ep.obs, _, done, _ = ep.env.step(action)
        ep.outcome.step_time_s += time.monotonic() - t0
        ep.outcome.sim_steps += 1
        if ep.perturbed is not None:  # what the policy and the video see (obs_noise)
            ep.obs = ep.perturbed.observe(ep.obs, ep.outcome.sim_steps)
        return bool(done)

    def act(self, actions: np.ndarray, then: np.ndarray | None = None) -> tuple[str, Any]:
        """Execute `actions`; the next request is of the observation after them, taken before
        `then` is executed (`pisft.rollout.chunking`: the steps during the next inference)."""
        ep = self._episode
        assert ep is not None, "act before start"
        reply = self._execute(ep, actions)
        if reply is not None or then is None or not len(then):
            return reply or ("obs", libero_sim.policy_request(ep.obs, ep.prompt, resize=ep.spec.resize_size))
        request = libero_sim.policy_request(ep.obs, ep.prompt, resize=ep.spec.resize_size)
        return self._execute(ep, then) or ("obs", request)

    def _execute(self, ep: _Episode, actions: np.ndarray) -> tuple[str, Any] | None:
        """Execute `actions` until the task is done or the step limit; ("done", ...) then, else None."""
        for action in np.asarray(actions, dtype=np.float64):
            if ep.outcome.steps >= ep.spec.max_steps:
                break
            if ep.recorder is not None:  # the observation this step is taken from, and its action
                ep.recorder.add(*_frame(ep.obs), libero_sim.libero_state(ep.obs), action)
            done = self._step(ep, action.tolist())
            ep.outcome.steps += 1
            if ep.writer is not None:
                ep.writer.add(*_frame(ep.obs))
            if done:
                ep.outcome.success = True
                break
        if ep.outcome.success or ep.outcome.steps >= ep.spec.max_steps:
            return "done", self.finish()
        return None

    def finish(self, error: str | None = None, *, keep_env: bool = False) -> EpisodeOutcome:
        """End the current episode (normally or after an error); close its video. After an
        error in the simulator the environment is closed (its state is unknown); `keep_env`
        when the episode was stopped for a reason outside it (the policy failed)."""
        ep, self._episode = self._episode, None
        if ep is None:
            return EpisodeOutcome(False, 0, 0, 0.0, 0.0, 0.0, error=error)
        if ep.writer is not None:
            try:
                ep.outcome.video_frames = ep.writer.close()
            except Exception as exc:  # noqa: BLE001 - the episode's result stands without its video
                error = error or f"video: {type(exc).__name__}: {exc}"
        if ep.recorder is not None:
            if error is None:
                try:
                    ep.outcome.recorded_steps = ep.recorder.close(ep.outcome.success)
                except Exception as exc:  # noqa: BLE001 - a recording that cannot be written is this episode's error
                    error = f"recording: {type(exc).__name__}: {exc}"
            if error is not None:
                ep.recorder.discard()
        if error is not None:
            ep.outcome.error = error
            if not keep_env:
                self._close_env()
        return ep.outcome

    def handle(self, kind: str, payload: Any) -> tuple[str, Any]:
        """One message; exceptions become ("error", outcome)."""
        try:
            if kind == "start":
                return "obs", self.start(payload)
            if kind == "act":
                return self.act(*payload) if isinstance(payload, tuple) else self.act(payload)
            if kind == "abort":
                return "done", self.finish(error=str(payload), keep_env=True)
            raise ValueError(f"unknown message {kind!r}")
        except Exception as exc:  # noqa: BLE001 - an episode that crashed is a failure, recorded
            return "error", self.finish(error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        if self._episode is not None:
            self.finish(error="closed")
        self._close_env()


def _worker_main(conn, simulator_factory: Callable[[], Any], workdir: str | None = None) -> None:
    # What the simulator libraries print (robosuite's and LIBERO's import lines, MuJoCo's
    # warnings, a native crash) goes to the stage's log, not the console: what the stage has
    # to say of an episode comes through the pipe.
    logs.output_to_stage_log()
    # The simulator is single-threaded per environment; one thread per library keeps N workers
    # from oversubscribing the cores the parent's policy also needs.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = "1"
    try:
        runner = EpisodeRunner(simulator_factory())
        if workdir is not None:
            # MuJoCo writes its log (MUJOCO_LOG.TXT) into the working folder on every simulator
            # warning: the stage's log folder, not the project root. Paths in the messages are
            # absolute (pisft.rollout.plan.plan_episodes).
            os.makedirs(workdir, exist_ok=True)
            os.chdir(workdir)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the stage
        conn.send(("fatal", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        conn.close()
        return
    conn.send(("ready", os.getpid()))
    parent = os.getppid()
    try:
        while True:
            try:
                kind, payload = conn.recv()
            except EOFError:  # the parent is gone
                break
            # "close", or the stage is gone (a kill -9: what it sent before is unwanted; a start
            # would make its episode's folder again in the temporary output its rerun removed)
            if kind == "close" or os.getppid() != parent:
                break
            conn.send(runner.handle(kind, payload))
    finally:
        runner.close()
        conn.close()


class WorkerDied(PisftError):
    """A worker process exited (a crash in native simulator code) or could not start."""


class ProcessWorker:
    """An `EpisodeRunner` in its own (spawned) process."""

    def __init__(self, simulator_factory: Callable[[], Any], name: str, workdir: str | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, simulator_factory, workdir), name=name,
                                   daemon=True)
        self.process.start()
        child.close()
        self._ready = False

    def wait_ready(self) -> None:
        kind, payload = self.recv()
        if kind == "fatal":
            self.process.join(timeout=10)
            raise WorkerDied(payload)
        self._ready = True

    def send(self, kind: str, payload: Any = None) -> None:
        try:
            self.conn.send((kind, payload))
        except (BrokenPipeError, EOFError, OSError):
            pass  # the worker is gone: its pipe is readable at EOF, and recv() says so

    def recv(self) -> tuple[str, Any]:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.process.join(timeout=5)
            log = os.environ.get(logs.STAGE_LOG_ENV)
            where = f"; what it printed is in {log}" if log else ""
            raise WorkerDied(f"worker {self.process.name} died (exit code {self.process.exitcode}){where}") from None

    def has_reply(self) -> bool:
        return False  # use multiprocessing.connection.wait on self.conn

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


class InlineWorker:
    """The same runner in this process: replies are computed when a message is sent."""

    def __init__(self, simulator: Any, name: str = "inline") -> None:
        self.runner = EpisodeRunner(simulator)
        self.name = name
        self._reply: tuple[str, Any] | None = None

    def wait_ready(self) -> None:
        pass

    def send(self, kind: str, payload: Any = None) -> None:
        self._reply = self.runner.handle(kind, payload)

    def recv(self) -> tuple[str, Any]:
        reply, self._reply = self._reply, None
        assert reply is not None
        return reply

    def has_reply(self) -> bool:
        return self._reply is not None

    def close(self) -> None:
        self.runner.close()
