"""The suite's own caches (tests/conftest.py): one folder per test run, gone when the run ends."""

from __future__ import annotations

import getpass
import os
import subprocess
import sys

from conftest import ROOT


def test_a_test_run_leaves_nothing_in_the_temporary_folder_but_pytests_own(tmp_path):
    """A pytest run of a test that builds a cached RECAP dataset (tests/data_fixtures.py) and converts
    it (pisft.integrity's verdicts), in a temporary folder of its own: afterwards the folder holds
    pytest's basetemp and nothing else. Each run used to leave its caches there for good."""
    env = {k: v for k, v in os.environ.items()  # without this run's folder and the caches in it (conftest)
           if k != "TORCHINDUCTOR_CACHE_DIR" and not k.startswith(("PYTEST_", "PISFT_"))}
    env["TMPDIR"] = str(tmp_path)
    test = "tests/test_data_convert.py::test_report_counts_and_drop_reasons"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", test],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1 passed" in out.stdout
    assert sorted(os.listdir(tmp_path)) == [f"pytest-of-{getpass.getuser()}"]
