"""`demo_recap`: a synthetic RECAP-format LIBERO-10 dataset, so the pipeline runs anywhere.

Written as RLinf's LIBERO collection leaves a dataset before any labelling: the LeRobot v2.1
layout and features of RLinf's LeRobot writer (`recap_layout`, the writer `collect_rollouts`
uses for real rollouts too), with no returns or advantages side files: the pipeline computes
its labels itself. `label` runs RLinf's `compute_returns` and `compute_advantages` on such a
dataset (see `rlinf_recap`) where RLinf's finished output is wanted (tests, the conversion
benchmark): `meta/returns_<tag>.parquet`, `meta/advantages_<tag>.parquet`,
`meta/mixture_config.yaml`, `return`/`reward` in `meta/stats.json` and the `return`, `reward`,
`prompt` features declared in `meta/info.json` (whose values live in the returns side file).
The data is made to be learnable:

- each of the ten LIBERO-10 tasks has its own goal pose, gain, phase wave and gripper timing;
- the action is a task-specific linear function of the state plus a smooth phase term
  (`a = k_task * (goal_task - s) + amp_task * sin(2 pi f_task phase)`, gripper a smooth tanh
  step at a task-specific phase), and the state integrates the action;
- the base camera shows a task-coloured textured table, the end effector as a disc whose
  position/size/colour follow the state, and a progress bar for the phase; the wrist camera
  shows a state-dependent gradient and the gripper opening, so image + state + task determine
  the action;
- a `demo_failure_fraction` of each task's episodes fail: they drift away from the goal and
  never close the gripper (`is_success` false on every frame, as RLinf's collector records the
  outcome), some successful ones carry a short `intervene_flag` window;
- `label`: returns with RLinf's recipe (reward -1 per step, 0 at a success's last step, -300 at
  a failure's); advantages with a critic that knows each task's mean return at each frame but
  not the episode's outcome, looking ahead over the whole episode (RLinf's N-step advantage with
  N the episode length: the Monte-Carlo advantage), labelled positive for the top 30% (RLinf's
  `positive_quantile`): successes positive, failures negative.

Deterministic for `data.demo_seed`: the same config gives byte-identical files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pisft import layout
from pisft.config import PisftConfig
from pisft.data.libero import ACTION_DIM, FPS, LIBERO_10_TASKS, STATE_DIM
from pisft.data import rlinf_recap
from pisft.data.recap_layout import RecapEpisode, write_recap_dataset
from pisft.integrity import stage_output
from pisft.io import write_manifest

SIDE_TAG = "demo"
FAILURE_REWARD = -300.0  # RLinf's recap_compute_returns.yaml
# One distinct RGB base colour per task (the table the base camera looks at).
_PALETTE = np.array([
    [200, 80, 70], [70, 160, 90], [80, 100, 200], [210, 180, 60], [150, 80, 180],
    [60, 170, 170], [220, 130, 60], [120, 120, 120], [170, 60, 110], [90, 140, 40],
], dtype=np.float32)


class TaskDynamics:
    """The hidden controller of one task (fixed by the seed and the task index)."""

    def __init__(self, task_index: int, seed: int, image_size: int):
        rng = np.random.default_rng([seed, 1000 + task_index])
        self.goal = rng.uniform(-0.6, 0.6, 6)
        self.gain = rng.uniform(0.08, 0.15)
        self.amp = rng.uniform(0.01, 0.03, 6) * rng.choice([-1.0, 1.0], 6)
        self.freq = float(rng.choice([1.0, 2.0]))
        self.grip_phase = rng.uniform(0.35, 0.65)
        self.texture = self._texture(rng, task_index, image_size)
        self.color = _PALETTE[task_index % len(_PALETTE)]

    @staticmethod
    def _texture(rng: np.random.Generator, task_index: int, size: int) -> np.ndarray:
        yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
        base = _PALETTE[task_index % len(_PALETTE)]
        stripes = 18.0 * np.sin(2 * np.pi * (3 + task_index % 4) * (xx + 0.5 * yy))
        noise = rng.normal(0.0, 4.0, (size, size, 1))  # luminance grain: PNG sizes like LIBERO's
        return (base[None, None, :] * 0.8 + stripes[..., None] + noise).astype(np.float32)


def simulate(dyn: TaskDynamics, length: int, rng: np.random.Generator, failed: bool
             ) -> tuple[np.ndarray, np.ndarray]:
    """Roll out the task controller: (states (T, 8), actions (T, 7)), float32."""
    s = np.zeros(STATE_DIM)
    s[:6] = rng.normal(0.0, 0.15, 6)
    s[6], s[7] = 0.04, -0.04
    drift = rng.normal(0.0, 1.0, 6)
    drift *= 0.03 / np.linalg.norm(drift)
    states = np.empty((length, STATE_DIM), dtype=np.float32)
    actions = np.empty((length, ACTION_DIM), dtype=np.float32)
    for k in range(length):
        phase = k / max(length - 1, 1)
        a = np.empty(ACTION_DIM)
        a[:6] = dyn.gain * (dyn.goal - s[:6]) + dyn.amp * np.sin(2 * np.pi * dyn.freq * phase)
        g = np.tanh(8.0 * (phase - dyn.grip_phase))
        if failed:  # drifts off (smoothly) after 40% of the episode and never grasps
            a[:6] += drift * (1.0 / (1.0 + np.exp(-20.0 * (phase - 0.4))))
            g = -np.abs(g)
        a[6] = g
        states[k] = s
        actions[k] = a
        s = s.copy()
        s[:6] += a[:6]
        s[6] = 0.02 * (1.0 - g)
        s[7] = -s[6]
    return states, actions


def render(dyn: TaskDynamics, states: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Base and wrist camera frames (T, size, size, 3) uint8 for a state trajectory."""
    t = states.shape[0]
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    base = np.empty((t, size, size, 3), dtype=np.uint8)
    wrist = np.empty((t, size, size, 3), dtype=np.uint8)
    bar_h = max(2, size // 16)
    for k, s in enumerate(states):
        phase = k / max(t - 1, 1)
        opening = float(np.clip(s[6] / 0.04, 0.0, 1.0))
        # base camera: textured table, end-effector disc, goal marker, progress bar
        img = dyn.texture.copy()
        cx, cy = (0.5 + 0.35 * np.tanh(s[0])) * size, (0.5 + 0.35 * np.tanh(s[1])) * size
        radius = size * (0.08 + 0.04 * np.tanh(s[2]))
        disc = (xx - cx) ** 2 + (yy - cy) ** 2 <= radius**2
        img[disc] = np.array([230.0, 60.0, 40.0]) * opening + np.array([40.0, 80.0, 230.0]) * (1 - opening)
        gx, gy = (0.5 + 0.35 * np.tanh(dyn.goal[0])) * size, (0.5 + 0.35 * np.tanh(dyn.goal[1])) * size
        marker = (np.abs(xx - gx) <= size * 0.03) & (np.abs(yy - gy) <= size * 0.03)
        img[marker] = 255.0
        img[size - bar_h:, : int(round(phase * size))] = 250.0
        base[k] = np.clip(img, 0, 255).astype(np.uint8)
        # wrist camera: orientation-dependent gradient tinted by the task, gripper jaws
        w = (dyn.color[None, None, :] * 0.5
             + 60.0 * np.tanh(s[3:6])[None, None, :]
             + 50.0 * (yy[..., None] / size - 0.5))
        gap = size * (0.05 + 0.3 * opening)
        jaw_w = size * 0.08
        left = (xx >= size / 2 - gap - jaw_w) & (xx < size / 2 - gap)
        right = (xx > size / 2 + gap) & (xx <= size / 2 + gap + jaw_w)
        w[(left | right) & (yy > size * 0.55)] = 20.0
        wrist[k] = np.clip(w + 64.0, 0, 255).astype(np.uint8)
    return base, wrist


def _failed_episodes(rng: np.random.Generator, per_task: int, fraction: float) -> set[int]:
    n_fail = int(round(fraction * per_task))
    n_fail = min(n_fail, per_task - 1) if per_task > 1 else n_fail
    return set(rng.choice(per_task, size=n_fail, replace=False).tolist()) if n_fail else set()


def generate(episodes_per_task: int, length: int, image_size: int, failure_fraction: float, seed: int,
             tasks: tuple[str, ...] = LIBERO_10_TASKS) -> Iterator[RecapEpisode]:
    """The demo episodes, task-major (episode_index = task * episodes_per_task + i), one at a
    time (side-file values are filled by `side_info` once all exist)."""
    index = 0
    for task_index in range(len(tasks)):
        dyn = TaskDynamics(task_index, seed, image_size)
        rng = np.random.default_rng([seed, task_index])
        failed = _failed_episodes(rng, episodes_per_task, failure_fraction)
        for i in range(episodes_per_task):
            ep_rng = np.random.default_rng([seed, task_index, i])
            is_failed = i in failed
            states, actions = simulate(dyn, length, ep_rng, is_failed)
            base, wrist = render(dyn, states, image_size)
            success = np.full(length, not is_failed, dtype=bool)  # the outcome on every frame (RLinf)
            done = np.zeros(length, dtype=bool)
            done[-1] = True
            intervene = np.zeros(length, dtype=bool)
            if not is_failed and length >= 10 and ep_rng.random() < 0.3:
                start = int(ep_rng.integers(1, length - 5))
                intervene[start:start + 5] = True
            yield RecapEpisode(
                episode_index=index, task_index=task_index, state=states, actions=actions,
                images={"image": base, "wrist_image": wrist}, is_success=success, done=done,
                intervene_flag=intervene,
            )
            index += 1


def generate_all(*args, **kwargs) -> list[RecapEpisode]:
    """`generate` collected."""
    return list(generate(*args, **kwargs))


def label(out_dir: Path, tag: str | None = SIDE_TAG, *, length: int, dataset_name: str | None = None) -> None:
    """RLinf's returns and advantages steps on the written dataset (see `rlinf_recap`). A folder
    `run` wrote keeps a manifest that lists the side files too (its readers check it)."""
    rlinf_recap.compute_returns(out_dir, tag, failure_reward=FAILURE_REWARD)
    rlinf_recap.compute_advantages(out_dir, tag, lookahead=length, dataset_name=dataset_name, decimals=9)
    if (Path(out_dir) / "MANIFEST.json").is_file():
        write_manifest(out_dir)


def build(out_dir: Path, *, episodes_per_task: int, length: int, image_size: int, failure_fraction: float,
          seed: int, version: str = "v2.1", naming: str = "recap", video: bool = False,
          workers: int | None = None, tasks: tuple[str, ...] = LIBERO_10_TASKS,
          side_tag: str | None = SIDE_TAG, labelled: bool = False, success_column: str = "is_success",
          dataset_name: str | None = None) -> None:
    """Generate and write a demo dataset into `out_dir` (an existing empty directory): RLinf's
    raw collection output. `labelled`: then run RLinf's returns/advantages steps with tag
    `side_tag` (None: untagged files), as RLinf's finished output;
    `success_column`: `is_success` (RLinf's writer) or `next.success` (LeRobot's lerobot-eval;
    RLinf's returns step needs `is_success`, so such a dataset is left unlabelled)."""
    episodes = generate(episodes_per_task, length, image_size, failure_fraction, seed, tasks)
    write_recap_dataset(out_dir, episodes, tasks, version=version, naming=naming, video=video, fps=FPS,
                        workers=workers if workers is not None else (os.cpu_count() or 1),
                        success_column=success_column)
    if labelled and success_column == "is_success":
        label(out_dir, side_tag, length=length, dataset_name=dataset_name or out_dir.name)


def output_dir(cfg: PisftConfig) -> Path:
    """results/demo_recap (`data.recap_dir` names it, alone or among its sources, when the demo
    is used: `layout.uses_demo_data`)."""
    return layout.demo_data(cfg)


def run(cfg: PisftConfig) -> Path:
    d = cfg.data
    out = output_dir(cfg)
    with stage_output(out, cfg) as tmp:  # convert_recap checks the demo data against its manifest
        build(tmp, episodes_per_task=d.demo_episodes_per_task, length=d.demo_episode_length,
              image_size=d.demo_image_size, failure_fraction=d.demo_failure_fraction, seed=d.demo_seed)
    n = d.demo_episodes_per_task * len(LIBERO_10_TASKS)
    print(f"demo_recap: {n} episodes x {d.demo_episode_length} frames "
          f"({d.demo_image_size}px, 2 cameras), unlabelled as RLinf's collection -> {out}")
    return out
