"""Set-up finds Python 3.12 by itself, or says in one line what to install."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/find-python312.sh"


def find(env_extra: dict) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", **env_extra}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)


def test_finds_a_working_python312_under_pyenv():
    out = find({})
    assert out.returncode == 0, out.stderr
    version = subprocess.run([out.stdout.strip(), "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True).stdout
    assert version.strip() == "(3, 12)"


def test_missing_python312_is_one_clear_line(tmp_path):
    shim = tmp_path / "python3.12"  # like pyenv's shim when 3.12 is not selected: present but failing
    shim.write_text("#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    out = find({"PATH": f"{tmp_path}:/usr/bin:/bin", "PISFT_PY312_ROOTS": "", "PISFT_PY312_PATHS": ""})
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Python 3.12" in lines[0] and "install" in lines[0]


def test_make_setup_twice_does_no_work():
    # `make test` ran setup already; if the lock changed since, this first call catches up.
    first = subprocess.run(["make", "-s", "setup"], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ})
    assert first.returncode == 0, first.stderr
    out = subprocess.run(["make", "-s", "setup"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ})
    assert out.returncode == 0
    assert out.stdout.strip() == "setup: .venv is up to date"
