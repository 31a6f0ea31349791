"""A fast stand-in for the LIBERO simulator, for measuring the policy side of closed_loop.

It has LIBERO's interface as `closed_loop` uses it (`suite`, `get_task`, `get_task_init_states`,
`make_env`, and environments with `seed`, `reset`, `set_init_state`, `step`, `close`) and its
observations (both cameras at 256×256, the end effector's pose, the gripper), but no physics and
no rendering: a step moves a point and returns images computed once. The worker still builds
each request as with LIBERO (rotation, resize with padding to 224, the 8-dim state), so what a
benchmark measures is the policy, the requests' trip through the pipes and the dispatch, not the
simulator. No episode succeeds: every one runs to its step limit, so the number of requests is
fixed by the settings. Never used by a stage: `pisft.bench.closed_loop_bench` only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pisft.rollout import libero_sim


@dataclass(frozen=True)
class Task:
    task_id: int
    language: str


class Env:
    def __init__(self, task_id: int, seed: int, step_s: float = 0.0) -> None:
        self.step_s = step_s
        res = libero_sim.RENDER_RESOLUTION
        rng = np.random.default_rng([task_id, seed])
        self.agent = rng.integers(0, 256, (res, res, 3), dtype=np.uint8)
        self.wrist = rng.integers(0, 256, (res, res, 3), dtype=np.uint8)
        self.pos = np.zeros(3)

    def _obs(self) -> dict:
        return {"agentview_image": self.agent, "robot0_eye_in_hand_image": self.wrist,
                "robot0_eef_pos": self.pos.copy(), "robot0_eef_quat": np.array([0.0, 0.0, 0.0, 1.0]),
                "robot0_gripper_qpos": np.array([0.04, -0.04])}

    def seed(self, seed: int) -> None:
        pass

    def reset(self) -> dict:
        self.pos = np.zeros(3)
        return self._obs()

    def set_init_state(self, state) -> dict:
        self.pos = np.asarray(state, dtype=float)[:3].copy()
        return self._obs()

    def step(self, action):
        if self.step_s:  # a simulator's time per step (sleeping: no core taken from the policy)
            time.sleep(self.step_s)
        self.pos = self.pos + 0.01 * np.clip(np.asarray(action[:3], dtype=float), -1, 1)
        return self._obs(), 0.0, False, {}

    def close(self) -> None:
        pass


class Suite:
    def __init__(self, n_tasks: int) -> None:
        self.n_tasks = n_tasks

    def get_task(self, i: int) -> Task:
        return Task(i, f"stand-in task {i}: put the object number {i} in the basket")

    def get_task_init_states(self, i: int) -> list[np.ndarray]:
        return [np.array([0.01 * k, 0.01 * i, 0.0]) for k in range(50)]


class StandInSimulator:
    """A picklable factory: `StandInSimulator(n_tasks)` in every worker process."""

    def __init__(self, n_tasks: int = 10, step_s: float = 0.0) -> None:
        self.n_tasks = n_tasks
        self.step_s = step_s  # seconds a step takes (0: at once); where the simulation dominates

    def describe(self) -> dict:
        return {"package": "stand-in (pisft.bench.stand_in_simulator: no physics, no rendering)", "version": None}

    def suite(self, name: str) -> Suite:  # noqa: ARG002 - every suite has the same stand-in tasks
        return Suite(self.n_tasks)

    def make_env(self, task: Task, *, resolution: int, seed: int) -> Env:
        if resolution != libero_sim.RENDER_RESOLUTION:
            raise ValueError(f"the stand-in renders at {libero_sim.RENDER_RESOLUTION}, not {resolution}")
        return Env(task.task_id, seed, self.step_s)
