"""Shared fixtures: copies of the project in which real Snakemake / DVC runs happen."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning, in this process and every process a test starts
# (set before torch loads libgomp, which reads it once). The suite runs more workers (the Makefile's
# TEST_WORKERS) than CI has cores, and their stages and trainers each use threads on CI's two cores:
# an oversubscribed thread that spins until a descheduled peer reaches the barrier burns the cores
# the other processes wait for. Measured: two small SFT DAGs through Snakemake at once, 136 -> 110
# CPU s each (210 -> 163 s wall); `evaluate` beside other work, 46 -> 15 CPU s. Thread counts, and
# so every result's bytes, are unchanged. An OMP_WAIT_POLICY set by hand wins (docs/development.md,
# "Tests").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch.distributed as dist
import yaml

from pisft.workflow import scratch

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# This test run's caches, in one folder that the run removes when it ends (`pytest_sessionfinish`):
# the process that runs pytest makes it, and its xdist workers, the stages the tests start and their
# subprocesses inherit it. Each run used to leave its caches in the temporary folder for good
# (an inductor cache of about 27 MB among them).
_OWN_RUN_DIR = "PISFT_TESTS_RUN_DIR" not in os.environ
if _OWN_RUN_DIR:
    os.environ["PISFT_TESTS_RUN_DIR"] = tempfile.mkdtemp(prefix="pisft-tests-")
RUN_DIR = Path(os.environ["PISFT_TESTS_RUN_DIR"])
# The verdicts of pisft.integrity go to a folder of this run, not the user's cache.
os.environ.setdefault("PISFT_VERIFY_CACHE", str(RUN_DIR / "verify"))
# One inductor cache for the whole run, both xdist workers and every stage a test starts (the
# launcher leaves a set TORCHINDUCTOR_CACHE_DIR alone): a block or chunk one test compiled is loaded,
# not compiled again, by the next that compiles the same code (inductor keys its entries on the graph,
# torch's version and its config). Without it each test's results folder held a cache of its own.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(RUN_DIR / "inductor"))
# One estimate cache for the whole run too (pisft.introspect.estimate_cache): a smoke stage of the same step
# and code reads what an earlier test's smoke stage estimated; never the user's cache.
os.environ.setdefault("PISFT_ESTIMATE_CACHE", str(RUN_DIR / "estimates"))
# And one kept import graph (pisft.code_graph.stored_graph): every Snakemake parse and dvc.yaml
# rendering of the run reads the stage code dependencies parsed once; never the user's cache.
os.environ.setdefault("PISFT_CODE_GRAPH_CACHE", str(RUN_DIR / "code-graph"))


def pytest_sessionfinish(session):
    """The run's caches go with the process that made them (an xdist worker's run ends before it)."""
    if _OWN_RUN_DIR:
        import shutil

        shutil.rmtree(RUN_DIR, ignore_errors=True)


TERMINAL = ".snakemake/pisft-terminal.txt"  # the default pipeline's stdout, then its stderr
def tool_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    for who in ("AUTHOR", "COMMITTER"):  # dvc exp and git commits in scratch repos
        env.setdefault(f"GIT_{who}_NAME", "pisft-tests")
        env.setdefault(f"GIT_{who}_EMAIL", "tests@pisft.invalid")
    return env


def copy_project(dest: Path, *, git: bool = False) -> Path:
    """A working copy of the workflow files (the library comes from the installed package)."""
    return scratch.copy_project(ROOT, dest, git=git)


@contextmanager
def reverted(path: Path):
    """The file at `path` as it was (bytes, access and modification times) after the block: one
    copy of a finished run serves several planning cases, each edit put back before the next
    (an edit left behind shows as extra jobs in the next case's plan)."""
    saved, times = path.read_bytes(), path.stat()
    try:
        yield path
    finally:
        path.write_bytes(saved)
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))


@contextmanager
def appended_comment(path: Path):
    """`path` with a comment line appended (an edit that changes no behaviour) for the block, then
    as it was (`reverted`)."""
    with reverted(path):
        with path.open("a") as fh:
            fh.write("\n# edited\n")
        yield path


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    """`predicate()`'s first truthy value; a bound on waiting (an AssertionError naming `what`),
    never a verdict on speed."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def run(cmd: list[str], cwd: Path, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
    exe = cmd[0]
    if (BIN / exe).exists():
        cmd = [str(BIN / exe), *cmd[1:]]
    proc = subprocess.run(cmd, cwd=cwd, env=tool_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode})\n--- stdout\n{proc.stdout[-6000:]}\n"
            f"--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def planned(work: Path, *targets: str) -> set[str]:
    """The rules `snakemake -n` would run in `work` (besides `all`)."""
    import re

    out = run(["snakemake", "-n", "--cores", "2", *targets], work).stdout
    return set(re.findall(r"^rule (\w+):", out, re.M)) - {"all"}


# The default pipeline's fixture runs the embedded default's DAG (every stage, the real simulator,
# one RECAP iteration) with fewer optimizer and simulator steps: the tests read the numbers from its
# config/config.yaml, and what the steps show (losses fall, the model learns, the loop runs) holds at
# these counts. The embedded default's own counts are `make run`'s.
LIGHTER_DEFAULT = {
    # 150 in the embedded default; the offline MSE, fine-tuned over base, must fall under 0.5
    # (test_integration_pipeline): 0.54 after 50 steps, 0.31 after 100 (measured)
    "train": {"steps": 100},
    # the simulator's episodes are the DAG's costliest part (creation, a reset that rebuilds the
    # model, a quarter second a step): 30 steps after the 10 waiting ones, one collected episode a task
    "eval": {"max_steps": 30},  # 60
    "recap": {"max_steps": 30, "episodes_per_task": 1, "value_steps": 20, "policy_steps": 20},  # 60, 2, 50, 60
}


@pytest.fixture(scope="session")
def default_pipeline(tmp_path_factory) -> Path:
    """The whole pipeline on the embedded default's DAG with LIGHTER_DEFAULT's counts, run once
    through Snakemake."""
    work = copy_project(tmp_path_factory.mktemp("default_pipeline") / "w", git=True)  # a DVC project too
    lighter = work.parent / "lighter.yaml"
    lighter.write_text(yaml.safe_dump(LIGHTER_DEFAULT))
    run([str(BIN / "python"), "-m", "pisft", "profile", str(lighter)], work)  # the documented switch
    run(["git", "commit", "-qam", "fewer steps"], work)
    out = run(["snakemake", "--cores", "2"], work)
    (work / TERMINAL).write_text(out.stdout + out.stderr)  # what a terminal showed (tests/test_terminal.py)
    return work


@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory):
    """A gloo process group of world size 1 for the tests of one module (FSDP2 needs one)."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# `make test` runs the suite on pytest-xdist workers, grouped by tests/worker_groups.py.
from worker_groups import (  # noqa: E402, F401
    pytest_collection_modifyitems, pytest_configure, pytest_runtest_setup)


# Session fixtures shared by several modules (imported last: they import this module's helpers).
from dvc_fixtures import dvc_run  # noqa: E402, F401
from slurm_fixtures import slurm_two_nodes  # noqa: E402, F401
