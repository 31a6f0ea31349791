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
    raw["data"].update(demo_episodes_per_task=400, demo_episode_length=200)  # minutes of work
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def tmp_folders(results: Path) -> list[Path]:
    return sorted(results.glob(".*.tmp-*")) if results.is_dir() else []


@pytest.mark.integration  # a real stage process started and signalled: ~10-20 s on 2 cores
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_stage_removes_its_temporary_output(tmp_path, sig):
    cfg = big_demo_config(tmp_path)
    results = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "pisft", "demo_recap", "--config", str(cfg), "--log",
                             str(results / "logs/demo_recap.log")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240  # a bound on waiting, not a verdict on speed
        while not any(any(d.iterdir()) for d in tmp_folders(results)):  # the stage is writing its output
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the stage never started writing"
            time.sleep(0.2)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "pisft.workflow.drivers", "dvc", "demo_recap", "--",
                             sys.executable, "-m", "pisft", "demo_recap", "--config", str(cfg)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not any(any(d.iterdir()) for d in tmp_folders(results)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the stage never started writing"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # to the wrapper alone, as a job runner stops it
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM; its temporary output was removed" in err
    assert tmp_folders(results) == []
