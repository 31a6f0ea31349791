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

import importlib.util
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import yaml
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
  1. a Linux host with an EGL-capable GPU driver for headless rendering (or OSMesa to render
     on the CPU, slowly):  apt-get install -y libegl1 libgl1 libosmesa6
  2. in the pisft virtual environment:  .venv/bin/pip install "hf-libero==0.1.4"
     (LIBERO as LeRobot packages it, with MuJoCo and robosuite 1.4; the same package as
     `pip install "lerobot[libero]==0.6.1"`)
  3. export MUJOCO_GL=egl  (the default pisft sets; MUJOCO_GL=osmesa for CPU rendering)
  4. LIBERO's scene assets: hf-libero fetches them from the Hugging Face hub on first use; on
     an offline host copy them into <site-packages>/libero/libero/assets beforehand
  5. python -m pisft closed_loop --config FILE --set eval.closed_loop=true
pisft writes LIBERO's path file (~/.libero/config.yaml, or $LIBERO_CONFIG_PATH) when missing,
so LIBERO's first-run question on stdin does not stop a non-interactive run."""


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


def ensure_libero_config(environ: dict | None = None) -> Path | None:
    """Write LIBERO's `config.yaml` (its paths) if missing; return its path when written.

    On first import LIBERO asks on stdin where to keep its files, which fails (EOFError) in a
    Snakemake/DVC job. Writing the default answer first (the package's own bddl_files,
    init_files and assets folders) makes the import non-interactive. An existing file is kept.
    """
    env = os.environ if environ is None else environ
    root = Path(env.get("LIBERO_CONFIG_PATH", Path.home() / ".libero"))
    config_file = root / "config.yaml"
    if config_file.is_file():
        return None
    try:
        spec = importlib.util.find_spec("libero")  # imports only the (empty) top-level package
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    bench_root = Path(next(iter(spec.submodule_search_locations))) / "libero"
    if not bench_root.is_dir():
        return None
    paths = {
        "benchmark_root": bench_root,
        "bddl_files": bench_root / "bddl_files",
        "init_states": bench_root / "init_files",
        "datasets": bench_root.parent / "datasets",
        "assets": bench_root / "assets",
    }
    root.mkdir(parents=True, exist_ok=True)
    config_file.write_text(yaml.safe_dump({k: str(v) for k, v in paths.items()}))
    return config_file


class LiberoSimulator:
    """The real LIBERO (`libero.libero`), imported on construction.

    Sets `MUJOCO_GL=egl` unless the environment chooses another back end (headless GPU
    rendering; `osmesa` renders on the CPU), and answers LIBERO's first-run question.
    """

    def __init__(self) -> None:
        os.environ.setdefault("MUJOCO_GL", "egl")
        written = ensure_libero_config()
        if written is not None:
            print(f"closed_loop: wrote LIBERO's paths to {written}", flush=True)
        try:
            from libero.libero import benchmark, get_libero_path
            from libero.libero.envs import OffScreenRenderEnv
        except ModuleNotFoundError as exc:
            raise SimulatorUnavailable(f"{INSTALL_HELP}\n(import failed: {exc})") from None
        except Exception as exc:  # a rendering back end or LIBERO's set-up failing at import
            raise SimulatorUnavailable(
                f"LIBERO is installed but failed to import ({type(exc).__name__}: {exc}). Check the "
                f"rendering back end: MUJOCO_GL={os.environ.get('MUJOCO_GL')} needs EGL (a GPU driver) "
                f"or use MUJOCO_GL=osmesa with libosmesa6; and LIBERO's paths file "
                f"($LIBERO_CONFIG_PATH/config.yaml, default ~/.libero/config.yaml).\n\n{INSTALL_HELP}"
            ) from None
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
