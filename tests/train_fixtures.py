"""Shared helpers for the training tests (tests/test_train_*.py)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config" / "config.yaml"
# Small demo data: 10 tasks x 2 episodes x 24 frames.
DATA_OVERRIDES = ["data.demo_episodes_per_task=2", "data.demo_episode_length=24"]


def shared_inputs(tmp_path_factory, name: str, data_overrides: list[str], ready: str,
                  then=None) -> Path:
    """results/{base_model,demo_recap,dataset} (fetch_base, demo_recap, convert_recap on the tiny
    model) in the session's `name` folder, built once per pytest process: each xdist worker has a
    base temporary folder of its own (`popen-gwN`), so each builds its copy (4.7 CPU s for
    train_inputs), and only its own tests, one at a time, write through their links (the lock
    holds off a second pytest run given the same `--basetemp`). `then(root)` finishes it; `ready`
    (relative) exists when it is complete."""
    root = tmp_path_factory.getbasetemp() / name
    root.mkdir(exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ready).is_file():
            from pisft import config as config_mod
            from pisft.data import convert, demo
            from pisft.model import fetch

            cfg = config_mod.load(CONFIG, [f"results_dir={root}", f"data.recap_dir={root}/demo_recap",
                                           *data_overrides])
            fetch.run(cfg)
            demo.run(cfg)
            convert.run(cfg)
            if then is not None:
                then(root)
    return root


def linked_results(src: Path, tmp_path_factory, name: str) -> Path:
    """A fresh results dir that links the shared inputs of `src`."""
    out = tmp_path_factory.mktemp(name)
    for sub in ("base_model", "dataset", "demo_recap"):
        os.symlink(src / sub, out / sub)
    return out


def inputs_dir(tmp_path_factory) -> Path:
    """results/{base_model,dataset} for the tiny model and small demo data, built once per session."""
    return shared_inputs(tmp_path_factory, "train_inputs", DATA_OVERRIDES, "dataset/split.json")


def results_dir(tmp_path_factory, name: str) -> Path:
    """A fresh results dir that links the shared inputs."""
    return linked_results(inputs_dir(tmp_path_factory), tmp_path_factory, name)


def overrides(results: Path, *extra: str) -> list[str]:
    return [f"results_dir={results}", f"data.recap_dir={results}/demo_recap", *DATA_OVERRIDES, *extra]


def launch_cmd(stage: str, results: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "pisft", "launch", stage, "--config", str(CONFIG)]
    for item in overrides(results, *extra):
        cmd += ["--set", item]
    return cmd


def launch_env() -> dict[str, str]:
    """One thread per process in every run, so runs of different topologies compute alike."""
    return {**os.environ, "PISFT_NUM_THREADS": "1"}  # the launcher's one knob (device.THREADS_ENV)


def launch(stage: str, results: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(launch_cmd(stage, results, *extra), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=launch_env())


def left_by_a_killed_run(finished: Path, results: Path, step: int, kind: str = "train") -> Path:
    """What a run killed after its checkpoint of `step` leaves its rerun, taken from `finished`, a
    finished run of the same settings: the run folder (same fingerprint, same name) with that
    checkpoint and the metrics log, whose lines after `step` the resume drops. Returns the copied
    checkpoint's folder. For a resume tested at the trainer: the real SIGKILL and the launcher's
    report of it are kill_worker_after_checkpoint's tests'."""
    (src,) = (finished / "checkpoints" / kind).glob("run-*")
    dst = results / "checkpoints" / kind / src.name
    dst.mkdir(parents=True)
    name = f"step_{step:06d}"
    shutil.copytree(src / name, dst / name)
    shutil.copy(src / "metrics.jsonl", dst / "metrics.jsonl")
    return dst / name


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def training_worker(pid: int, local_rank: int) -> int:
    """The torchrun worker of `local_rank` among the descendants of the launcher `pid`."""
    for child in descendants(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pisft.train" in cmd and b"torch.distributed.run" not in cmd \
                and f"LOCAL_RANK={local_rank}".encode() in env:
            return child
    raise AssertionError("worker process not found")


def kill_rank1_after_checkpoint(cmd: list[str], checkpoints: Path, step: int, timeout: float) -> str:
    """kill_worker_after_checkpoint of local rank 1 (a run of 2 or more processes)."""
    return kill_worker_after_checkpoint(cmd, checkpoints, step, timeout, local_rank=1)


def kill_worker_after_checkpoint(cmd: list[str], checkpoints: Path, step: int, timeout: float,
                                 local_rank: int) -> str:
    """Start the launcher `cmd`, wait for the complete checkpoint of `step` under `checkpoints`
    (run-*/step_<step>), SIGKILL the worker of `local_rank` and wait for the launcher to fail.
    Returns its stderr (the launcher's failure report)."""
    import signal
    import time

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=launch_env())
    deadline = time.time() + timeout
    while not list(checkpoints.glob(f"run-*/step_{step:06d}/COMPLETE.json")):
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(training_worker(proc.pid, local_rank=local_rank), signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert f"rank {local_rank} (local rank {local_rank}) killed by SIGKILL" in err
    assert f"step_{step:06d} (step {step}); a rerun resumes from it" in err
    return err
