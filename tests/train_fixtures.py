"""Shared helpers for the training tests (tests/test_train_*.py)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config" / "config.yaml"
# Small demo data: 10 tasks x 2 episodes x 24 frames.
DATA_OVERRIDES = ["data.demo_episodes_per_task=2", "data.demo_episode_length=24"]


def inputs_dir(tmp_path_factory) -> Path:
    """results/{base_model,dataset} for the tiny model and small demo data, built once per session."""
    root = tmp_path_factory.getbasetemp() / "train_inputs"
    root.mkdir(exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "dataset" / "split.json").is_file():
            from pisft import config as config_mod
            from pisft.data import convert, demo
            from pisft.model import fetch

            cfg = config_mod.load(CONFIG, [f"results_dir={root}", f"data.recap_dir={root}/demo_recap",
                                           *DATA_OVERRIDES])
            fetch.run(cfg)
            demo.run(cfg)
            convert.run(cfg)
    return root


def results_dir(tmp_path_factory, name: str) -> Path:
    """A fresh results dir that links the shared inputs."""
    src = inputs_dir(tmp_path_factory)
    out = tmp_path_factory.mktemp(name)
    for sub in ("base_model", "dataset", "demo_recap"):
        os.symlink(src / sub, out / sub)
    return out


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


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
