"""Inputs of the RECAP value model and advantage stages, as the lead's pool conversion leaves them:
a converted dataset (demo + convert_recap) whose conversion report gives each episode a
`source_type`, and `dataset/returns.parquet` computed as RLinf's compute_returns does
(`rlinf_recap.episode_returns`; sft episodes count as successes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from train_fixtures import linked_results, shared_inputs

from pisft.data.dataset import episode_success
from pisft.data.rlinf_recap import episode_returns
from pisft.io import write_manifest

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
    write_manifest(dataset_dir)  # the pool's conversion writes its manifest last
    return dataset_dir


def value_inputs(tmp_path_factory) -> Path:
    """results/{base_model,demo_recap,dataset} (tiny model, demo pool with returns), once per session."""
    return shared_inputs(tmp_path_factory, "value_inputs", DATA_OVERRIDES, ".pool_marked", then=_mark_pool)


def _mark_pool(root: Path) -> None:
    add_pool_fields(root / "dataset", sft_episodes=frozenset({0, 5}))
    (root / ".pool_marked").write_text("episodes 0 and 5 typed sft\n")


def results_with_inputs(tmp_path_factory, name: str) -> Path:
    """A fresh results dir linking the shared inputs."""
    return linked_results(value_inputs(tmp_path_factory), tmp_path_factory, name)


def overrides(results: Path, *extra: str) -> list[str]:
    return [f"results_dir={results}", f"data.recap_dir={results}/demo_recap", *DATA_OVERRIDES, *extra]
