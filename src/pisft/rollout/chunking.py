"""The closed loop's chunks under an inference delay, with or without real-time chunking, and the
jerk at their boundaries (`eval.rtc`; the scheduler, `pisft.rollout.scheduler`, calls it).

**The delay.** A robot does not stop while its policy computes: it asks for the next chunk while
it still executes the current one and keeps executing that one for the `delay` control steps the
inference takes (`eval.rtc.delay_steps`; the real-time chunking paper's d, Black et al. 2025).
Each chunk then starts `delay` actions in (those steps have passed when it arrives), except an
episode's first, asked for before the robot moves. With `replan_steps` s, chunk k executes its
actions [start, start + s) (start 0 for the first, `delay` after): the first s - delay of them,
then the observation for the next request is taken, then the last `delay` while that request is
computed (`EpisodeRunner.act`'s `then`). With delay 0 this is openpi's synchronous loop: s
actions, ask, wait. The schedule needs delay <= s (validated) and start + s <= the chunk size
(`payload` says so).

**Real-time chunking** (`rtc`, `pisft.policy.rtc`, LeRobot's RTC): a request also carries the
current chunk's actions not yet executed when its observation was taken (from index start + s -
delay on) and the delay, and the next chunk is inpainted to agree with them. Without it ("plain
chunking at the same delay") the next chunk is computed from the observation alone and the robot
jumps to it at the boundary.

**Jerk.** `action_jerk` is the mean |Δ²a| (a_t - 2 a_{t-1} + a_{t-2}, raw action units, over the
7 action dimensions) at chunk boundaries: t the first action executed of a chunk after an
episode's first, among the actions the episode executed; `action_jerk_inside` is the same at
every other step, for scale.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pisft.errors import PisftError
from pisft.policy.rtc import RTC_DELAY_KEY, RTC_PREV_KEY


@dataclass
class _Episode:
    chunk: np.ndarray | None = None  # the last chunk received (raw actions)
    start: int = 0  # where its execution began
    executed: list[np.ndarray] = field(default_factory=list)  # every action sent, in order
    boundaries: list[int] = field(default_factory=list)  # positions in `executed` where a later chunk begins


def jerk_sums(actions: np.ndarray, boundaries: list[int]) -> dict[str, float]:
    """Sums and counts of |Δ²a| (mean over the action dimensions) at the boundaries and elsewhere."""
    actions = np.asarray(actions, dtype=np.float64)
    if len(actions) < 3:
        return {"boundary_sum": 0.0, "boundaries": 0, "inside_sum": 0.0, "inside": 0}
    second = np.abs(actions[2:] - 2 * actions[1:-1] + actions[:-2]).mean(axis=1)  # at t = 2..T-1
    at = np.zeros(len(second), dtype=bool)
    for b in boundaries:
        if 2 <= b < len(actions):
            at[b - 2] = True
    return {"boundary_sum": float(second[at].sum()), "boundaries": int(at.sum()),
            "inside_sum": float(second[~at].sum()), "inside": int((~at).sum())}


def pooled_jerk(sums: list[dict[str, float]]) -> dict[str, float | int | None]:
    """`action_jerk` and `action_jerk_inside` over episodes (pooled: every boundary weighs the same)."""
    b = sum(s["boundaries"] for s in sums)
    n = sum(s["inside"] for s in sums)
    return {"action_jerk": sum(s["boundary_sum"] for s in sums) / b if b else None, "chunk_boundaries": b,
            "action_jerk_inside": sum(s["inside_sum"] for s in sums) / n if n else None}


class ChunkSchedule:
    """The chunks of every episode in flight, keyed by the scheduler's worker index."""

    def __init__(self, replan_steps: int, delay_steps: int = 0, rtc: bool = False) -> None:
        if not 0 <= delay_steps <= replan_steps:
            raise PisftError(f"eval.rtc.delay_steps: {delay_steps} must be in 0..eval.replan_steps ({replan_steps})")
        self.replan, self.delay, self.rtc = replan_steps, delay_steps, rtc
        self._episodes: dict[int, _Episode] = {}

    def describe(self) -> dict[str, Any]:
        return {"delay_steps": self.delay, "replan_steps": self.replan, "rtc": self.rtc}

    def start(self, key: int) -> None:
        self._episodes[key] = _Episode()

    def request(self, key: int, obs: dict) -> dict:
        """The request `obs` as the policy gets it: with the leftover and the delay under RTC."""
        ep = self._episodes[key]
        if not self.rtc or ep.chunk is None:
            return obs
        taken_at = ep.start + self.replan - self.delay  # the observation came after these actions
        if taken_at >= len(ep.chunk):  # the whole chunk executed (no delay, a chunk's worth of steps): plain
            return obs
        return {**obs, RTC_PREV_KEY: ep.chunk[taken_at:], RTC_DELAY_KEY: self.delay}

    def payload(self, key: int, chunk: np.ndarray, check: Callable[[np.ndarray], np.ndarray]) -> Any:
        """What the worker executes of `chunk` (`check`ed: `scheduler.check_chunk`): its
        `replan_steps` actions from where it starts, as `actions` or, with a delay,
        `(before the next observation, after it)`."""
        ep = self._episodes[key]
        start = 0 if ep.chunk is None else self.delay
        chunk = np.asarray(chunk)
        if start and chunk.ndim >= 1 and self.replan <= len(chunk) < start + self.replan:  # the delay does not fit
            raise PisftError(f"the policy's chunk has {len(chunk)} actions; executing eval.replan_steps="
                             f"{self.replan} of them after eval.rtc.delay_steps={self.delay} needs "
                             f"{start + self.replan}: lower one of them")
        actions = check(chunk[start:])
        if ep.chunk is not None:
            ep.boundaries.append(len(ep.executed))
        ep.chunk, ep.start = chunk, start
        ep.executed.extend(actions)
        if self.delay == 0:
            return actions
        cut = self.replan - self.delay
        return actions[:cut], actions[cut:]

    def finish(self, key: int, steps: int) -> dict[str, float]:
        """The episode's jerk sums over the `steps` actions it executed (it may end mid-chunk)."""
        ep = self._episodes.pop(key, None)
        if ep is None or not ep.executed:
            return jerk_sums(np.zeros((0, 7)), [])
        executed = np.asarray(ep.executed[:steps])
        return jerk_sums(executed, [b for b in ep.boundaries if b < len(executed)])
