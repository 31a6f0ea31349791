"""`make setup`'s LIBERO part (scripts/libero_sim_setup.py) and the simulator's pre-import checks.

The asset checks run on small trees in tmp_path with a manifest in the shipped format, and once on
the installed tree against the shipped manifest. Nothing here installs anything or touches .venv.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pisft.rollout import libero_sim

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/libero_sim_setup.py"
MANIFEST = ROOT / "workflow/envs/libero-assets.sha256"
NODEPS = ROOT / "workflow/envs/libero-sim.nodeps.txt"
LOCKS = [ROOT / "workflow/envs/cpu-cuda.lock.txt", ROOT / "workflow/envs/ascend-aarch64.lock.txt"]
INSTALLED = importlib.util.find_spec("libero") is not None


def _load_script():
    spec = importlib.util.spec_from_file_location("libero_sim_setup", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    assets = tmp_path / "assets"
    files = {"scenes/floor.xml": b"<mujoco/>", "textures/wood.png": b"\x89PNG...", "wall.xml": b"<wall/>"}
    lines = ["# comment lines are allowed"]
    for rel, data in files.items():
        (assets / rel).parent.mkdir(parents=True, exist_ok=True)
        (assets / rel).write_bytes(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {rel}")
    manifest = tmp_path / "manifest.sha256"
    manifest.write_text("\n".join(lines) + "\n")
    return assets, manifest


def _verify(assets: Path, manifest: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "verify", str(assets), str(manifest)],
                          capture_output=True, text=True, timeout=120)


def test_verify_names_each_missing_or_damaged_asset(tmp_path):
    assets, manifest = _tree(tmp_path)
    out = _verify(assets, manifest)
    assert out.returncode == 0 and "all 3 files match" in out.stdout, out.stderr
    (assets / "wall.xml").unlink()
    with open(assets / "textures/wood.png", "r+b") as f:  # one flipped byte, same size
        f.write(b"\x88")
    out = _verify(assets, manifest)
    assert out.returncode == 1
    assert f"missing: {assets / 'wall.xml'}" in out.stderr
    assert f"damaged (sha256 differs from the manifest): {assets / 'textures/wood.png'}" in out.stderr
    assert "scenes/floor.xml" not in out.stderr
    assert "2 of 3 LIBERO asset files are missing or damaged" in out.stderr and "assets" in out.stderr


def test_a_malformed_manifest_line_is_named(tmp_path):
    mod = _load_script()
    bad = tmp_path / "m.sha256"
    bad.write_text(f"{'0' * 64}  ../escape.xml\n")
    with pytest.raises(mod.SetupError, match=r"m.sha256:1: not a '<sha256>  <relative path>' line"):
        mod.read_manifest(bad)


def _manifest_lines() -> dict[str, str]:
    """The shipped manifest's entries read without the parser under test: sha256sum's format."""
    found = [re.fullmatch(r"([0-9a-f]{64})  (\S.*)", line) for line in MANIFEST.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert all(found), "a line of libero-assets.sha256 is not sha256sum's '<hex>  <path>'"
    return {m.group(2): m.group(1) for m in found}


def test_shipped_manifest_lists_libero_upstream_assets():
    mod = _load_script()
    entries = mod.read_manifest(MANIFEST)
    assert entries == _manifest_lines()
    assert len(entries) == 585  # LIBERO's assets/ tree, without LIBERO-PRO's additions (docs/libero.md)
    assert any(e.startswith("stable_hope_objects/alphabet_soup/") for e in entries)  # LIBERO-10 task 0


@pytest.mark.skipif(not INSTALLED, reason="the LIBERO simulator is not installed (`make setup` installs it)")
def test_installed_assets_match_the_shipped_manifest(tmp_path):
    """The count is the installed tree's, walked here: the manifest lists exactly its files, and
    verify checks each of them (a damaged last entry, in a copy of the tree, is found)."""
    assets = libero_sim._libero_bench_root() / "assets"
    installed = sorted(p.relative_to(assets).as_posix() for p in assets.rglob("*")
                       if p.is_file() and p.name != libero_sim.INSTALLED_MANIFEST)
    assert sorted(_manifest_lines()) == installed
    out = subprocess.run([sys.executable, str(SCRIPT), "verify"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"all {len(installed)} files match libero-assets.sha256" in out.stdout
    # the same tree (links to the installed files), the manifest's last file with one byte flipped
    copy = tmp_path / "assets"
    for rel in installed:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).symlink_to(assets / rel)
    last = list(_manifest_lines())[-1]
    data = bytearray((assets / last).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / last).unlink()
    (copy / last).write_bytes(bytes(data))
    out = subprocess.run([sys.executable, str(SCRIPT), "verify", str(copy), str(MANIFEST)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert f"damaged (sha256 differs from the manifest): {copy / last}" in out.stderr
    assert f"1 of {len(installed)} LIBERO asset files are missing or damaged" in out.stderr


def test_simulator_pins_are_in_every_lock_and_not_installed_with_their_deps():
    nodeps = {line.split("==")[0] for line in NODEPS.read_text().splitlines() if line and not line.startswith("#")}
    assert nodeps == {"hf-libero", "robosuite", "bddl"}
    assert all("--hash=sha256:" in line for line in NODEPS.read_text().splitlines() if line and line[0] != "#")
    for lock in LOCKS:
        pins = {line.split("==")[0].lower() for line in lock.read_text().splitlines() if "==" in line}
        assert {"mujoco", "numba", "llvmlite", "easydict", "future", "pyopengl", "glfw"} <= pins, lock
        assert not pins & nodeps, f"{lock} would install {pins & nodeps} with their dependencies"
        assert "opencv-python" not in pins and "opencv-python-headless" in pins
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install --quiet --no-deps --require-hashes -r $(SIM_NODEPS)" in makefile


def test_gl_packages_missing_without_root_print_the_one_apt_line(monkeypatch, capsys):
    mod = _load_script()
    monkeypatch.setattr(mod, "missing_gl_packages", lambda: ["libosmesa6", "libgl1"])
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert mod.ensure_gl() is False
    out = capsys.readouterr().out
    assert "sudo apt-get install -y libosmesa6 libegl1 libegl-mesa0 libgl1" in out
    assert "closed-loop stage fails" in out


def test_gl_packages_missing_as_root_are_installed_with_apt_get(tmp_path, monkeypatch, capsys):
    """As root: apt-get install, then (after a failure) apt-get update and install again."""
    mod = _load_script()
    log = tmp_path / "apt.log"
    apt = tmp_path / "bin/apt-get"
    apt.parent.mkdir()
    apt.write_text(f'#!/bin/sh\necho "$*" >> {log}\n[ "$1" = update ] && touch {tmp_path}/updated\n'
                   f'[ -e {tmp_path}/updated ]\n')  # install fails until the lists are updated
    apt.chmod(0o755)
    monkeypatch.setenv("PATH", f"{apt.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(mod, "missing_gl_packages", lambda: [] if (tmp_path / "updated").exists() else ["libosmesa6"])
    assert mod.ensure_gl() is True
    calls = log.read_text().splitlines()
    assert calls == ["install -y --no-install-recommends libosmesa6 libegl1 libegl-mesa0 libgl1", "update",
                     "install -y --no-install-recommends libosmesa6 libegl1 libegl-mesa0 libgl1"]


def test_missing_gl_libraries_stop_the_simulator_with_the_apt_line(monkeypatch):
    import ctypes.util

    real = ctypes.util.find_library
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None if name == "OSMesa" else real(name))
    monkeypatch.setenv("MUJOCO_GL", "osmesa")
    if not INSTALLED:
        pytest.skip("LiberoSimulator checks rendering only once the libero package is there")
    with pytest.raises(libero_sim.SimulatorUnavailable) as exc:
        libero_sim.LiberoSimulator()
    assert "MUJOCO_GL=osmesa" in str(exc.value) and "libosmesa6" in str(exc.value)
    assert libero_sim.APT_LINE in str(exc.value)


def test_missing_assets_stop_the_simulator_before_a_hub_download(tmp_path, monkeypatch):
    bench = tmp_path / "libero"
    monkeypatch.setattr(libero_sim, "_is_hf_libero", lambda root: True)
    problem = libero_sim.assets_problem(bench)
    assert "scene assets are not installed" in problem and "make setup" in problem
    assets, manifest = _tree(tmp_path)
    bench = tmp_path  # assets/ under it
    (assets / ".pisft-manifest.sha256").write_bytes(manifest.read_bytes())
    assert libero_sim.assets_problem(bench) is None
    (assets / "scenes/floor.xml").unlink()
    problem = libero_sim.assets_problem(bench)
    assert "1 of LIBERO's 3 scene asset files are missing" in problem and "scenes/floor.xml" in problem


def test_a_stale_libero_config_is_named(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"bddl_files: {tmp_path / 'gone'}\ninit_states: {tmp_path}\n")
    problem = libero_sim.config_problem(cfg)
    assert str(cfg) in problem and "bddl_files" in problem and "delete the file" in problem
    cfg.write_text(f"bddl_files: {tmp_path}\ninit_states: {tmp_path}\n")
    assert libero_sim.config_problem(cfg) is None


@pytest.mark.skipif(not INSTALLED, reason="the LIBERO simulator is not installed (`make setup` installs it)")
def test_the_installed_libero_is_hf_libero_with_assets_and_config():
    root = libero_sim._libero_bench_root()
    assert libero_sim._is_hf_libero(root)
    assert libero_sim.assets_problem(root) is None
    assert (root / "assets" / ".pisft-manifest.sha256").read_bytes() == MANIFEST.read_bytes()


def test_make_setup_installs_the_simulator_and_reruns_when_its_pins_change(tmp_path):
    """The Makefile in a scratch copy with a stand-in Python (tests/test_ascend_install.py's): the
    recipe installs the no-deps file with hashes, then runs the set-up script; changing the asset
    manifest makes the next `make setup` do the work again."""
    import shutil

    from test_ascend_install import STUB_PYTHON, make

    work = tmp_path / "proj"
    for rel in ("Makefile", "pyproject.toml", "workflow/envs/cpu-cuda.lock.txt",
                "workflow/envs/ascend-aarch64.lock.txt", "workflow/envs/libero-sim.nodeps.txt",
                "workflow/envs/libero-assets.txt", "workflow/envs/libero-assets.sha256",
                "scripts/libero_sim_setup.py"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, work / rel)
    stub = tmp_path / "python3.12"
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    (work / "scripts/find-python312.sh").write_text(f"#!/bin/bash\necho {stub}\n")
    (work / "scripts/find-python312.sh").chmod(0o755)
    log = tmp_path / "calls.log"
    env = {"PISFT_TEST_LOG": str(log)}
    out = make("-s", "setup", cwd=work, env=env)
    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    lock = calls.index("python -m pip install --quiet -r workflow/envs/cpu-cuda.lock.txt")
    sim = calls.index("python -m pip install --quiet --no-deps --require-hashes -r workflow/envs/libero-sim.nodeps.txt")
    assert lock < sim < calls.index("python scripts/libero_sim_setup.py all")
    assert make("-s", "setup", cwd=work, env=env).stdout.strip() == "setup: .venv is up to date"
    with open(work / "workflow/envs/libero-assets.sha256", "a") as f:
        f.write(f"{'0' * 64}  scenes/new.xml\n")
    log.unlink()
    out = make("-s", "setup", cwd=work, env=env)
    assert out.returncode == 0 and "up to date" not in out.stdout
    assert "python scripts/libero_sim_setup.py all" in log.read_text()


@pytest.mark.skipif(not INSTALLED, reason="the LIBERO simulator is not installed (`make setup` installs it)")
def test_an_unwritable_config_folder_is_named_with_the_variable_to_set(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("LIBERO_CONFIG_PATH", str(blocker / "libero"))
    with pytest.raises(libero_sim.SimulatorUnavailable, match="set LIBERO_CONFIG_PATH to a writable folder"):
        libero_sim.LiberoSimulator()


def test_the_config_file_is_written_whole_and_then_kept(tmp_path):
    if not INSTALLED:
        pytest.skip("the LIBERO simulator is not installed (`make setup` installs it)")
    env = {"LIBERO_CONFIG_PATH": str(tmp_path / "cfg")}
    written = libero_sim.ensure_libero_config(env)
    assert written == tmp_path / "cfg" / "config.yaml"
    assert [p.name for p in (tmp_path / "cfg").iterdir()] == ["config.yaml"]  # no temporary left
    assert libero_sim.config_problem(written) is None
    assert libero_sim.ensure_libero_config(env) is None


def test_robosuites_private_macro_file_is_a_copy_of_its_macros_and_kept_once_there(tmp_path, capsys):
    """What robosuite's scripts/setup_macros.py does (robosuite 1.4.0): macros_private.py, a copy
    of macros.py; a file the user already has is left as it is."""
    setup = _load_script()
    package = tmp_path / "robosuite"
    package.mkdir()
    (package / "macros.py").write_text("SIMULATION_TIMESTEP = 0.002\nCONSOLE_LOGGING_LEVEL = 'WARN'\n")
    private = setup.ensure_robosuite_macros(package)
    assert private == package / "macros_private.py"
    text = private.read_text()
    assert text.startswith("# Written by pisft") and text.endswith((package / "macros.py").read_text())
    ns: dict = {}
    exec(compile(text, str(private), "exec"), ns)  # the module robosuite imports
    assert ns["SIMULATION_TIMESTEP"] == 0.002 and ns["CONSOLE_LOGGING_LEVEL"] == "WARN"
    private.write_text("ENABLE_NUMBA = False\n")
    setup.ensure_robosuite_macros(package)
    assert private.read_text() == "ENABLE_NUMBA = False\n"
    assert "exists; kept" in capsys.readouterr().out
    (package / "macros.py").unlink()
    private.unlink()
    with pytest.raises(setup.SetupError, match="macros.py not found"):
        setup.ensure_robosuite_macros(package)


@pytest.mark.skipif(importlib.util.find_spec("robosuite") is None, reason="the simulator is not installed")
def test_the_installed_robosuite_is_where_the_macro_file_goes():
    setup = _load_script()
    assert (setup.robosuite_dir() / "macros.py").is_file()
