"""The LIBERO simulator as the closed-loop evaluation sees it, with openpi's LIBERO settings.

Everything the rollout loop needs from LIBERO goes through `Simulator` (a suite's tasks, their
fixed initial states, an environment per task); `LiberoSimulator` is the real one (the `libero`
package, imported only when used), and tests use a stand-in with the same interface.

Settings follow openpi's `examples/libero/main.py`: 256×256 renders, images rotated 180° and
resized with padding to 224 before they are sent, the state is end-effector position (3) +
axis-angle orientation (3) + gripper joint positions (2), 10 wait steps with a dummy action
while objects settle, a fixed environment seed (7), and per-suite step limits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from PIL import Image

from pisft.errors import PisftError

# Step limits per suite (openpi: longest training demonstration plus a margin).
SUITE_MAX_STEPS = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
DUMMY_ACTION = [0.0] * 6 + [-1.0]  # no motion, gripper open
RENDER_RESOLUTION = 256  # resolution LIBERO's training data was rendered at

INSTALL_HELP = """\
The LIBERO simulator is not installed in this environment. To run closed-loop evaluation:
  1. a Linux host with an EGL-capable GPU driver (headless rendering), or OSMesa for CPU rendering:
       apt-get install -y libegl1 libgl1 libosmesa6     # then MUJOCO_GL=egl (GPU) or osmesa (CPU)
  2. in the pisft virtual environment:
       .venv/bin/pip install "hf-libero==0.1.4"          # LIBERO as packaged for LeRobot (MuJoCo, robosuite)
     (or `pip install "lerobot[libero]==0.6.1"`, which pulls the same package)
  3. export MUJOCO_GL=egl   (set before anything imports mujoco)
  4. python -m pisft closed_loop --config FILE --set eval.closed_loop=true
On first use LIBERO asks where to keep its assets and writes ~/.libero/config.yaml."""


class SimulatorUnavailable(PisftError):
    """The LIBERO simulator (or its rendering back end) cannot be used here."""


class Task(Protocol):
    language: str


class Suite(Protocol):
    n_tasks: int

    def get_task(self, i: int) -> Task: ...

    def get_task_init_states(self, i: int) -> Sequence[Any]: ...


class Env(Protocol):
    def reset(self) -> Any: ...

    def set_init_state(self, state: Any) -> dict: ...

    def step(self, action: list[float]) -> tuple[dict, float, bool, dict]: ...

    def close(self) -> None: ...


class Simulator(Protocol):
    def suite(self, name: str) -> Suite: ...

    def make_env(self, task: Task, *, resolution: int, seed: int) -> Env: ...


class LiberoSimulator:
    """The real LIBERO (`libero.libero`), imported on construction."""

    def __init__(self) -> None:
        try:
            from libero.libero import benchmark, get_libero_path
            from libero.libero.envs import OffScreenRenderEnv
        except Exception as exc:  # ImportError, or a rendering back end failing at import
            raise SimulatorUnavailable(f"{INSTALL_HELP}\n(import failed: {type(exc).__name__}: {exc})") from None
        self._benchmark = benchmark
        self._get_libero_path = get_libero_path
        self._env_cls = OffScreenRenderEnv

    def suite(self, name: str) -> Suite:
        suites = self._benchmark.get_benchmark_dict()
        if name not in suites:
            raise PisftError(f"eval.libero_suites: LIBERO has no suite '{name}'; "
                             f"known: {', '.join(sorted(suites))}")
        return suites[name]()

    def make_env(self, task: Any, *, resolution: int, seed: int) -> Env:
        from pathlib import Path

        bddl = Path(self._get_libero_path("bddl_files")) / task.problem_folder / task.bddl_file
        env = self._env_cls(bddl_file_name=str(bddl), camera_heights=resolution,
                            camera_widths=resolution)
        env.seed(seed)  # the seed moves objects even with a fixed initial state (openpi)
        return env


def quat_to_axis_angle(quat: Sequence[float]) -> np.ndarray:
    """(x, y, z, w) unit quaternion -> axis-angle vector (axis × angle), as robosuite defines it."""
    q = np.asarray(quat, dtype=np.float64)
    w = float(np.clip(q[3], -1.0, 1.0))
    sin_half = math.sqrt(max(0.0, 1.0 - w * w))
    if math.isclose(sin_half, 0.0, abs_tol=1e-12):
        return np.zeros(3)
    return q[:3] * (2.0 * math.acos(w)) / sin_half


def resize_with_pad(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize an (H, W, 3) uint8 image to fit (height, width) keeping its aspect; pad with black."""
    h, w = image.shape[:2]
    if (h, w) == (height, width):
        return image
    scale = max(w / width, h / height)
    new_w, new_h = int(w / scale), int(h / scale)
    resized = Image.fromarray(image).resize((new_w, new_h), resample=Image.BILINEAR)
    canvas = Image.new(resized.mode, (width, height), 0)
    canvas.paste(resized, ((width - new_w) // 2, (height - new_h) // 2))
    return np.asarray(canvas)


def to_uint8(image: np.ndarray) -> np.ndarray:
    if np.issubdtype(image.dtype, np.floating):
        return (255 * image).astype(np.uint8)
    return image


def policy_request(obs: dict, prompt: str, *, resize: int) -> dict:
    """A LIBERO observation -> the request openpi's LIBERO client sends to a policy server."""
    img = np.ascontiguousarray(obs["agentview_image"][::-1, ::-1])  # rotate 180° like training data
    wrist = np.ascontiguousarray(obs["robot0_eye_in_hand_image"][::-1, ::-1])
    return {
        "observation/image": to_uint8(resize_with_pad(to_uint8(img), resize, resize)),
        "observation/wrist_image": to_uint8(resize_with_pad(to_uint8(wrist), resize, resize)),
        "observation/state": np.concatenate((
            np.asarray(obs["robot0_eef_pos"], dtype=np.float64),
            quat_to_axis_angle(obs["robot0_eef_quat"]),
            np.asarray(obs["robot0_gripper_qpos"], dtype=np.float64),
        )),
        "prompt": str(prompt),
    }
