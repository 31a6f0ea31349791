"""The LIBERO simulator as the closed-loop evaluation sees it, with openpi's LIBERO settings.

Everything the rollout loop needs from LIBERO goes through `Simulator` (a suite's tasks, their
fixed initial states, an environment per task); `LiberoSimulator` is the real one (the `libero`
package, imported only when used), and tests use a stand-in with the same interface.

Settings follow openpi's `examples/libero/main.py`: 256×256 renders, images rotated 180° and
resized with padding to 224 before they are sent, the state is end-effector position (3) +
axis-angle orientation (3) + gripper joint positions (2), 10 wait steps with a dummy action
while objects settle, a fixed environment seed (7), and per-suite step limits.

`make setup` installs the simulator, its scene assets, the OpenGL libraries and LIBERO's config
file (docs/libero.md, "The LIBERO simulator"); `LiberoSimulator` checks each of these before the slow
import and names what is missing and the command that provides it.

What LIBERO and robosuite print as they load (robosuite's "No private macro file found!" when
set-up has not written `robosuite/macros_private.py`, LIBERO's "[info] using task orders" per
suite) goes to the stage's log only (`pisft.logs.only_in_stage_log`), as does everything a
simulator worker process prints (`pisft.rollout.workers`); what matters of it reaches the console as a
pisft line (MuJoCo's warnings: `pisft.rollout.scheduler.mujoco_note`; a worker's crash: `WorkerDied`).
"""

from __future__ import annotations

import ctypes.util
import hashlib
import importlib.metadata
import importlib.util
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import yaml
from PIL import Image

from pisft import logs
from pisft.errors import PisftError
from pisft.io import sha256_file

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
# `make setup` keeps a copy of the asset checksum manifest beside the assets under this name
# (scripts/libero_sim_setup.py writes it, `assets_problem` reads it).
INSTALLED_MANIFEST = ".pisft-manifest.sha256"
# `assets_problem` compares every listed asset's sha256 (about 400 MB read) and then records in
# this environment variable what it checked (the assets folder, the manifest, each file's size
# and modification time), so the environment workers it spawns, which inherit it, skip the
# reading unless a file has changed since.
ASSETS_VERIFIED_ENV = "PISFT_LIBERO_ASSETS_VERIFIED"

# Debian packages LIBERO's cameras need (MuJoCo's EGL or OSMesa back end); `make setup` installs
# them when it runs as root (scripts/libero_sim_setup.py, docs/libero.md "The LIBERO simulator").
GL_PACKAGES = ("libosmesa6", "libegl1", "libegl-mesa0", "libgl1")
APT_LINE = "apt-get install -y " + " ".join(GL_PACKAGES)
INSTALL_HELP = f"""\
The LIBERO simulator is not installed in this environment. `make setup` installs it into .venv
(docs/libero.md, "The LIBERO simulator"): hf-libero 0.1.4, robosuite 1.4.0 and bddl 1.0.1 from
workflow/envs/libero-sim.nodeps.txt (--no-deps), MuJoCo and the rest from the lock, LIBERO's
scene assets checked against workflow/envs/libero-assets.sha256, LIBERO's config file, and, as
root, the OpenGL libraries ({APT_LINE}).
Rendering: MUJOCO_GL=egl (pisft's default; GPU driver or Mesa) or MUJOCO_GL=osmesa (CPU)."""


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


def libero_config_file(environ: dict | None = None) -> Path:
    """Where LIBERO reads its paths: $LIBERO_CONFIG_PATH/config.yaml, default ~/.libero/config.yaml."""
    env = os.environ if environ is None else environ
    return Path(env.get("LIBERO_CONFIG_PATH", Path.home() / ".libero")) / "config.yaml"


def _libero_bench_root() -> Path | None:
    """<site-packages>/libero/libero of the installed `libero`, found without importing it."""
    try:
        spec = importlib.util.find_spec("libero")  # imports only the (empty) top-level package
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    bench_root = Path(next(iter(spec.submodule_search_locations))) / "libero"
    return bench_root if bench_root.is_dir() else None


def ensure_libero_config(environ: dict | None = None) -> Path | None:
    """Write LIBERO's `config.yaml` (its paths) if missing; return its path when written.

    On first import LIBERO asks on stdin where to keep its files, which fails (EOFError) in a
    Snakemake/DVC job. Writing the default answer first (the package's own bddl_files,
    init_files and assets folders) makes the import non-interactive. An existing file is kept
    (`LiberoSimulator` checks that its paths exist). `make setup` calls this too.
    """
    config_file = libero_config_file(environ)
    if config_file.is_file():
        return None
    bench_root = _libero_bench_root()
    if bench_root is None:
        return None
    paths = {
        "benchmark_root": bench_root,
        "bddl_files": bench_root / "bddl_files",
        "init_states": bench_root / "init_files",
        "datasets": bench_root.parent / "datasets",
        "assets": bench_root / "assets",
    }
    config_file.parent.mkdir(parents=True, exist_ok=True)
    # atomic: environment worker processes may start together and LIBERO reads it at import
    tmp = config_file.with_name(f".{config_file.name}.{os.getpid()}.tmp")
    tmp.write_text(yaml.safe_dump({k: str(v) for k, v in paths.items()}))
    os.replace(tmp, config_file)
    return config_file


# Shared libraries each MuJoCo back end loads (through PyOpenGL), as (alternatives, Debian package).
_GL_NEEDS = {
    "egl": ((("EGL",), "libegl1"), (("EGL_mesa", "EGL_nvidia"), "libegl-mesa0"), (("GL", "OpenGL"), "libgl1")),
    "osmesa": ((("OSMesa",), "libosmesa6"),),
}


def rendering_problem(backend: str) -> str | None:
    """Why MuJoCo's `backend` (MUJOCO_GL) cannot render here, naming the install line; else None.

    Checked before LIBERO is imported: without these libraries the import fails deep inside
    PyOpenGL, or the first render does, long after the policy was loaded.
    """
    needs = _GL_NEEDS.get(backend)
    if needs is None:
        return None  # glfw and others: a display is the user's business
    missing = sorted({pkg for libs, pkg in needs if not any(ctypes.util.find_library(lib) for lib in libs)})
    if not missing:
        return None
    return (f"LIBERO's cameras cannot render with MUJOCO_GL={backend}: the OpenGL libraries of "
            f"{', '.join(missing)} are not installed. Install them (as root): {APT_LINE}  "
            f"(`make setup` does this when it runs as root)")


def import_failure_hint(backend: str) -> str:
    """What to check when an installed LIBERO fails to import: the rendering back end chosen."""
    if backend == "egl":
        return (f"The rendering back end MUJOCO_GL=egl needs EGL (a GPU driver, or Mesa's libegl1 and "
                f"libegl-mesa0); MUJOCO_GL=osmesa renders on the CPU instead (libosmesa6): {APT_LINE}.")
    if backend == "osmesa":
        return (f"The rendering back end MUJOCO_GL=osmesa needs OSMesa (libosmesa6); MUJOCO_GL=egl "
                f"renders with a GPU driver or Mesa's EGL instead: {APT_LINE}.")
    return (f"The rendering back end MUJOCO_GL={backend} is not one pisft checks; MUJOCO_GL=egl (pisft's "
            f"default) and MUJOCO_GL=osmesa (CPU) render without a display: {APT_LINE}.")


def _is_hf_libero(bench_root: Path) -> bool:
    try:
        dist = importlib.metadata.distribution("hf-libero")
    except importlib.metadata.PackageNotFoundError:
        return False
    return Path(dist.locate_file("libero/libero")).resolve() == bench_root.resolve()


def _assets_signature(assets: Path, manifest: Path, listed: list[str]) -> str:
    h = hashlib.sha256(manifest.read_bytes())
    for rel in listed:
        st = (assets / rel).stat()
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"{assets.resolve()}:{h.hexdigest()}"


def assets_problem(bench_root: Path) -> str | None:
    """Why hf-libero's scene assets cannot be used, naming what is missing or damaged; else None.

    hf-libero downloads the assets from the Hugging Face hub when `libero/libero/assets` is
    absent (a hang or a crash offline); `make setup` installs them there and keeps a copy of the
    checksum manifest beside them, against which each listed file is checked here: present, and
    its content (sha256) the manifest's. A damaged scene file otherwise fails every episode of
    its tasks inside MuJoCo's parser. The content check runs once per process tree
    (`ASSETS_VERIFIED_ENV`).
    """
    if not _is_hf_libero(bench_root):
        return None  # a LIBERO checkout carries its assets in the repository
    assets = bench_root / "assets"
    if not assets.is_dir():
        return (f"LIBERO's scene assets are not installed ({assets} is missing; hf-libero would try "
                "to download them from the Hugging Face hub). Run `make setup`, or "
                "`.venv/bin/python scripts/libero_sim_setup.py assets`")
    manifest = assets / INSTALLED_MANIFEST
    if not manifest.is_file():
        return None  # installed some other way: taken as it is
    entries = [line.split("  ", 1) for line in manifest.read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    listed = [rel for _, rel in entries]
    missing = [rel for rel in listed if not (assets / rel).is_file()]
    repair = "Repair: `.venv/bin/python scripts/libero_sim_setup.py assets`"
    if missing:
        return (f"{len(missing)} of LIBERO's {len(listed)} scene asset files are missing from {assets}, "
                f"e.g. {missing[0]}. {repair}")
    signature = _assets_signature(assets, manifest, listed)
    if os.environ.get(ASSETS_VERIFIED_ENV) == signature:
        return None
    damaged = [rel for digest, rel in entries if sha256_file(assets / rel) != digest.strip().lower()]
    if damaged:
        return (f"{len(damaged)} of LIBERO's {len(listed)} scene asset files in {assets} are damaged (their "
                f"sha256 differs from {manifest}), e.g. {damaged[0]}; every episode of a task that loads "
                f"one would fail. {repair}")
    os.environ[ASSETS_VERIFIED_ENV] = signature
    return None


def config_problem(config_file: Path) -> str | None:
    """Why LIBERO's config file would break the import or the environments; else None."""
    try:
        paths = yaml.safe_load(config_file.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        return f"LIBERO's config file {config_file} cannot be read ({exc}); delete it (pisft rewrites it)"
    if not isinstance(paths, dict):
        return f"LIBERO's config file {config_file} is not a mapping; delete it (pisft rewrites it)"
    for key in ("bddl_files", "init_states"):
        if key not in paths or not Path(str(paths[key])).is_dir():
            return (f"LIBERO's config file {config_file} gives {key}: {paths.get(key)!r}, which is not a "
                    f"folder; fix the path or delete the file (pisft rewrites it for the installed LIBERO)")
    return None


class LiberoSimulator:
    """The real LIBERO (`libero.libero`), imported on construction.

    Sets `MUJOCO_GL=egl` unless the environment chooses another back end (headless rendering on
    a GPU driver or Mesa; `osmesa` renders on the CPU), answers LIBERO's first-run question, and
    checks, before the (slow) import, what `make setup` provides: the package, the OpenGL
    libraries of the back end, the scene assets, a usable config file.
    """

    def __init__(self) -> None:
        os.environ.setdefault("MUJOCO_GL", "egl")
        bench_root = _libero_bench_root()
        if bench_root is None:
            raise SimulatorUnavailable(f"{INSTALL_HELP}\n(no 'libero' package to import)")
        for problem in (rendering_problem(os.environ["MUJOCO_GL"]), assets_problem(bench_root)):
            if problem:
                raise SimulatorUnavailable(problem)
        try:
            written = ensure_libero_config()
        except OSError as exc:
            raise SimulatorUnavailable(
                f"cannot write LIBERO's config file {libero_config_file()} ({exc}); set LIBERO_CONFIG_PATH "
                "to a writable folder (LIBERO asks on stdin for its paths without this file)") from None
        if written is not None:
            print(f"closed_loop: wrote LIBERO's paths to {written}", flush=True)
        elif problem := config_problem(libero_config_file()):  # a file from elsewhere, e.g. an old install
            raise SimulatorUnavailable(problem)
        try:
            with logs.only_in_stage_log():  # robosuite's and LIBERO's import lines (module docstring)
                from libero.libero import benchmark, get_libero_path
                from libero.libero.envs import OffScreenRenderEnv
        except ModuleNotFoundError as exc:
            raise SimulatorUnavailable(f"{INSTALL_HELP}\n(import failed: {exc})") from None
        except Exception as exc:  # noqa: BLE001 - a rendering back end or LIBERO's set-up failing at import
            raise SimulatorUnavailable(
                f"LIBERO is installed ({bench_root.parent}) but failed to import ({type(exc).__name__}: "
                f"{exc}). {import_failure_hint(os.environ['MUJOCO_GL'])} Check also LIBERO's paths file "
                f"({libero_config_file()}); `make setup` reinstalls the simulator (docs/libero.md, \"The LIBERO "
                f"simulator\")."
            ) from None
        self._benchmark = benchmark
        self._get_libero_path = get_libero_path
        self._env_cls = OffScreenRenderEnv

    def suite(self, name: str) -> Suite:
        suites = self._benchmark.get_benchmark_dict()
        if name not in suites:
            raise PisftError(f"eval.libero_suites: LIBERO has no suite '{name}'; "
                             f"known: {', '.join(sorted(suites))}")
        with logs.only_in_stage_log():  # LIBERO prints "[info] using task orders ..." for each suite
            return suites[name]()

    def make_env(self, task: Any, *, resolution: int, seed: int) -> Env:
        """openpi's `_get_libero_env`: the task's BDDL file, both cameras at `resolution`, seeded."""
        bddl = Path(self._get_libero_path("bddl_files")) / task.problem_folder / task.bddl_file
        env = self._env_cls(bddl_file_name=str(bddl), camera_heights=resolution,
                            camera_widths=resolution)
        env.seed(seed)  # the seed moves objects even with a fixed initial state (openpi)
        return env


def quat_to_axis_angle(quat: Sequence[float]) -> np.ndarray:
    """(x, y, z, w) unit quaternion -> axis-angle vector (axis × angle), as robosuite's
    `transform_utils.quat2axisangle` and openpi's LIBERO client compute it (w clipped to [-1, 1];
    exactly zero rotation -> zeros)."""
    q = np.asarray(quat, dtype=np.float64)
    w = float(np.clip(q[3], -1.0, 1.0))
    den = math.sqrt(1.0 - w * w)
    if math.isclose(den, 0.0):
        return np.zeros(3)
    return (q[:3] * 2.0 * math.acos(w)) / den


def libero_state(obs: dict) -> np.ndarray:
    """The 8-dim state openpi's LIBERO client sends: end-effector position (3), axis-angle of the
    end-effector quaternion (3), the two gripper finger joint positions (2)."""
    return np.concatenate((
        np.asarray(obs["robot0_eef_pos"], dtype=np.float64),
        quat_to_axis_angle(obs["robot0_eef_quat"]),
        np.asarray(obs["robot0_gripper_qpos"], dtype=np.float64),
    ))


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
        "observation/state": libero_state(obs),
        "prompt": str(prompt),
    }
