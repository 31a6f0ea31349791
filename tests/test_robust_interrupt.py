"""Issue 22, item 8: an interrupted stage leaves no temporary output; the next run clears stale ones."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pisft import io as io_mod

ROOT = Path(__file__).resolve().parents[1]


def big_demo_config(tmp_path: Path) -> Path:
    raw = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    raw["results_dir"] = str(tmp_path / "results")
    # the demo under results_dir, as config.yaml's: dvc.yaml's shape (its DVC wrapper checks it)
    raw["data"].update(recap_dir=str(tmp_path / "results" / "demo_recap"),
                       demo_episodes_per_task=400, demo_episode_length=200)  # minutes of work
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def tmp_folders(results: Path) -> list[Path]:
    return sorted(results.glob(".*.tmp-*")) if results.is_dir() else []


def stage_env() -> dict:
    """The stage runs this checkout's code; PYTHONFAULTHANDLER makes a SIGABRT print every
    thread's stack (`ended_after_signal`)."""
    return {**os.environ, "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def sigint_at_its_default() -> None:
    """In the stage's process before it starts: SIGINT at its default, as a terminal's Ctrl-C
    finds a command. A shell's background job (`make test &`, `nohup ... &`) starts with SIGINT
    ignored, a child inherits that, and Python then installs no KeyboardInterrupt handler: the
    stage ran on after SIGINT (its stacks, sent SIGABRT, showed it still writing episodes)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ended_after_signal(proc: subprocess.Popen, sig: int, log: Path | None = None) -> str:
    """The stage's stderr once it has ended after `sig` (it takes about a second). A stage still
    running 120 s later is a hang: it is sent SIGABRT, and the failure shows its threads' stacks."""
    try:
        return proc.communicate(timeout=120)[1]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            err = proc.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            err = "(no stacks: the stage did not end on SIGABRT either)"
        tail = log.read_text()[-3000:] if log is not None and log.is_file() else ""
        raise AssertionError(f"the stage still ran 120 s after {signal.Signals(sig).name}; its stacks "
                             f"(SIGABRT; with a --log they are at the log's end):\n{err[-12000:]}\n"
                             f"--- its log's end\n{tail}") from None


@pytest.mark.integration  # a real stage process started and signalled: ~10-20 s on 2 cores
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_stage_removes_its_temporary_output(tmp_path, sig):
    cfg = big_demo_config(tmp_path)
    results = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "pisft", "demo_recap", "--config", str(cfg), "--log",
                             str(results / "logs/demo_recap.log")], cwd=ROOT, env=stage_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_at_its_default)
    try:
        deadline = time.monotonic() + 240  # a bound on waiting, not a verdict on speed
        while not any(any(d.iterdir()) for d in tmp_folders(results)):  # the stage is writing its output
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the stage never started writing"
            time.sleep(0.2)
        proc.send_signal(sig)
        err = ended_after_signal(proc, sig, results / "logs/demo_recap.log")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, err
    assert f"stopped by {signal.Signals(sig).name}; its temporary output was removed" in err
    assert tmp_folders(results) == []  # gone: no .demo_recap.tmp-* folder left
    assert not (results / "demo_recap").exists()


def test_the_next_run_clears_stale_temporary_folders_of_dead_processes_only(tmp_path):
    final = tmp_path / "closed_loop"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is a process that no longer runs
    host = socket.gethostname()
    stale = tmp_path / f".closed_loop.tmp-{dead.pid}@{host}-abcd1234"
    live = tmp_path / f".closed_loop.tmp-{os.getppid()}@{host}-efgh5678"  # a running process's
    remote = tmp_path / f".closed_loop.tmp-{dead.pid}@another-host.example-ijkl9012"  # another host's
    other = tmp_path / f".train.tmp-{dead.pid}@{host}-mnop3456"  # another output's
    for folder in (stale, live, remote, other):
        (folder / "big.bin").parent.mkdir(parents=True)
        (folder / "big.bin").write_bytes(b"x" * 1024)
    with io_mod.atomic_dir(final) as out:
        assert out.name.startswith(f".closed_loop.tmp-{os.getpid()}@{host}-")
        (out / "metrics.json").write_text("{}")
    assert not stale.exists()
    assert live.exists() and remote.exists() and other.exists()
    assert (final / "metrics.json").is_file()
    assert sorted(p.name for p in tmp_path.glob(".closed_loop.tmp-*")) == sorted([live.name, remote.name])


@pytest.mark.integration  # the DVC wrapper and its stage, both real processes: ~10-20 s on 2 cores
def test_sigterm_to_dvcs_stage_wrapper_reaches_the_stage_which_cleans_up(tmp_path):
    cfg = big_demo_config(tmp_path)
    results = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "pisft.workflow.drivers", "dvc", "demo_recap", "--",
                             sys.executable, "-m", "pisft", "demo_recap", "--config", str(cfg)], cwd=ROOT,
                            env=stage_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not any(any(d.iterdir()) for d in tmp_folders(results)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the stage never started writing"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # to the wrapper alone, as a job runner stops it
        err = ended_after_signal(proc, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM; its temporary output was removed" in err
    assert tmp_folders(results) == []
