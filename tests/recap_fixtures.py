"""Inputs of the RECAP value model and advantage stages, as the lead's pool conversion leaves them:
a converted dataset (demo + convert_recap) whose conversion report gives each episode a
`source_type`, and `dataset/returns.parquet` computed as RLinf's compute_returns does
(`rlinf_recap.episode_returns`; sft episodes count as successes)."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from train_fixtures import CONFIG

from pisft.data.dataset import episode_success
from pisft.data.rlinf_recap import episode_returns

# 10 tasks x 5 episodes x 24 frames; demo_failure_fraction 0.2: one failed episode per task.
DATA_OVERRIDES = ["data.demo_episodes_per_task=5", "data.demo_episode_length=24"]


def add_pool_fields(dataset_dir: Path, *, sft_episodes: frozenset[int] = frozenset(), gamma: float = 1.0,
                    failure_reward: float = -300.0) -> Path:
    """Mark each episode's source_type in conversion_report.json and write returns.parquet."""
    report_path = dataset_dir / "conversion_report.json"
    report = json.loads(report_path.read_text())
    for entry in report["episodes"]:
        entry["source_type"] = "sft" if int(entry["episode_index"]) in sft_episodes else "rollout"
    report_path.write_text(json.dumps(report, indent=2))
    success = episode_success(dataset_dir)
    files = sorted((dataset_dir / "data").rglob("*.parquet"))
    frames = pa.concat_tables([pq.read_table(f, columns=["episode_index", "frame_index"]) for f in files])
    ep = frames.column("episode_index").to_numpy().astype(np.int64)
    fr = frames.column("frame_index").to_numpy().astype(np.int64)
    order = np.lexsort((fr, ep))
    ep, fr = ep[order], fr[order]
    ret = np.empty(len(ep), np.float32)
    rew = np.empty(len(ep), np.float32)
    for e in np.unique(ep):
        sel = np.flatnonzero(ep == e)
        ok = int(e) in sft_episodes or bool(success[int(e)])
        ret[sel], rew[sel] = episode_returns(len(sel), ok, gamma, failure_reward)
    pq.write_table(pa.table({"episode_index": ep, "frame_index": fr, "return": ret, "reward": rew}),
                   dataset_dir / "returns.parquet")
    return dataset_dir


def value_inputs(tmp_path_factory) -> Path:
    """results/{base_model,demo_recap,dataset} (tiny model, demo pool with returns), once per session."""
    root = tmp_path_factory.getbasetemp() / "value_inputs"
    root.mkdir(exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "dataset" / "returns.parquet").is_file():
            from pisft import config as config_mod
            from pisft.data import convert, demo
            from pisft.model import fetch

            cfg = config_mod.load(CONFIG, overrides(root))
            fetch.run(cfg)
            demo.run(cfg)
            convert.run(cfg)
            add_pool_fields(root / "dataset", sft_episodes=frozenset({0, 5}))
    return root


def results_with_inputs(tmp_path_factory, name: str) -> Path:
    """A fresh results dir linking the shared inputs."""
    src = value_inputs(tmp_path_factory)
    out = tmp_path_factory.mktemp(name)
    for sub in ("base_model", "dataset", "demo_recap"):
        os.symlink(src / sub, out / sub)
    return out


def overrides(results: Path, *extra: str) -> list[str]:
    return [f"results_dir={results}", f"data.recap_dir={results}/demo_recap", *DATA_OVERRIDES, *extra]
