"""Set-up finds Python 3.12 by itself, or says in one line what to install; it does no work twice."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/find-python312.sh"
BASH = shutil.which("bash")
REAL_PY312 = Path(os.path.realpath(sys.executable))  # the interpreter behind .venv (3.12)


def find(env_extra: dict) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", **env_extra}
    return subprocess.run([BASH, str(SCRIPT)], env=env, capture_output=True, text=True)


def failing_shim(folder: Path) -> Path:
    """Like pyenv's python3.12 shim when 3.12 is not selected: present but failing."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "python3.12"
    shim.write_text("#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    return shim


def fake_pyenv(root: Path) -> Path:
    """A pyenv root with a broken 3.12.0 (sorted first) and a working 3.12.99; returns the latter."""
    failing_shim(root / "versions/3.12.0/bin")
    good = root / "versions/3.12.99/bin/python3.12"
    good.parent.mkdir(parents=True)
    good.symlink_to(REAL_PY312)
    return good


def test_finds_a_working_python312_on_this_machine():
    out = find({})
    assert out.returncode == 0, out.stderr
    version = subprocess.run([out.stdout.strip(), "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True).stdout
    assert version.strip() == "(3, 12)"


def test_finds_python312_under_pyenv(tmp_path):
    # No python3.12 on PATH but pyenv's failing shim, no system locations: only pyenv's versions.
    shims = tmp_path / "shims"
    failing_shim(shims)
    only_pyenv = {"PATH": str(shims), "PISFT_PY312_PATHS": ""}
    good = fake_pyenv(tmp_path / "pyenv")
    out = find({**only_pyenv, "PYENV_ROOT": str(tmp_path / "pyenv")})
    assert (out.returncode, out.stdout.strip()) == (0, str(good)), out.stderr
    # without PYENV_ROOT: pyenv's default root, ~/.pyenv
    home = tmp_path / "home"
    home_good = fake_pyenv(home / ".pyenv")
    out = find({**only_pyenv, "HOME": str(home)})
    assert (out.returncode, out.stdout.strip()) == (0, str(home_good)), out.stderr


def test_missing_python312_is_one_clear_line(tmp_path):
    failing_shim(tmp_path)
    out = find({"PATH": f"{tmp_path}:/usr/bin:/bin", "PISFT_PY312_ROOTS": "", "PISFT_PY312_PATHS": ""})
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Python 3.12" in lines[0] and "install" in lines[0]


def _setup_tree(tmp_path: Path) -> Path:
    """What `make setup` reads, in a scratch folder, with a .venv whose python records every call
    and does nothing but answer `-c` checks (pip installs and set-up scripts are logged and
    succeed): the tests' own .venv is never touched."""
    work = tmp_path / "proj"
    (work / "workflow").mkdir(parents=True)
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, work / name)
    shutil.copytree(ROOT / "scripts", work / "scripts")
    shutil.copytree(ROOT / "workflow/envs", work / "workflow/envs")
    py = work / ".venv/bin/python"
    py.parent.mkdir(parents=True)
    py.write_text(f'#!/bin/bash\necho "$*" >> "{work}/calls.log"\n'
                  f'[ "$1" = -c ] && exec "{REAL_PY312}" "$@"\nexit 0\n')
    py.chmod(0o755)
    uv = py.with_name("uv")  # logs its call; fails when the test asks (FAKE_UV_FAILS)
    uv.write_text(f'#!/bin/bash\necho "uv $*" >> "{work}/calls.log"\n[ -z "$FAKE_UV_FAILS" ]\n')
    uv.chmod(0o755)
    return work


LOCK_BY_UV = "uv pip install --python .venv/bin/python --quiet -r workflow/envs/cpu-cuda.lock.txt"
LOCK_BY_PIP = "-m pip install --quiet -r workflow/envs/cpu-cuda.lock.txt"


def test_make_setup_twice_does_no_work(tmp_path):
    work = _setup_tree(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "DEVICE",
                                                            "UV_INDEX_URL", "PIP_INDEX_URL")}
    real_stamp = ROOT / ".venv/.pisft-setup"
    before = real_stamp.stat().st_mtime_ns if real_stamp.exists() else None

    def setup() -> subprocess.CompletedProcess:
        out = subprocess.run(["make", "-s", "setup"], cwd=work, capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        return out

    def calls() -> list[str]:
        log = work / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    first = setup()
    assert LOCK_BY_UV in calls() and LOCK_BY_PIP not in calls(), calls()
    assert first.stdout.strip().endswith("setup: done")
    n = len(calls())
    second = setup()
    assert second.stdout.strip() == "setup: .venv is up to date"
    assert len(calls()) == n, "the second `make setup` ran the environment's python"
    # a changed lock is installed again
    with (work / "workflow/envs/cpu-cuda.lock.txt").open("a") as lock:
        lock.write("# changed\n")
    setup()
    assert calls()[n:].count(LOCK_BY_UV) == 1 and LOCK_BY_PIP not in calls()[n:]
    after = real_stamp.stat().st_mtime_ns if real_stamp.exists() else None
    assert after == before, "the project's own .venv was set up again"


def test_make_setup_installs_the_lock_with_pip_when_uv_fails(tmp_path):
    """uv is the fast path, not a new way to fail: when it cannot install the lock (an index it
    cannot reach, a platform it does not know), pip installs it as before, with one line."""
    work = _setup_tree(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "DEVICE",
                                                            "UV_INDEX_URL", "PIP_INDEX_URL")}
    out = subprocess.run(["make", "-s", "setup"], cwd=work, capture_output=True, text=True,
                         env={**env, "FAKE_UV_FAILS": "1", "PIP_INDEX_URL": "https://mirror.invalid/simple"})
    assert out.returncode == 0, out.stdout + out.stderr
    calls = (work / "calls.log").read_text().splitlines()
    uv_call = LOCK_BY_UV.replace("--quiet ", "--quiet --index-url https://mirror.invalid/simple ")
    assert calls.index(uv_call) < calls.index(LOCK_BY_PIP), calls  # pip's index handed to uv, then pip
    assert "uv could not install workflow/envs/cpu-cuda.lock.txt" in out.stdout
