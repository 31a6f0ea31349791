"""demo_recap: the synthetic RECAP LIBERO-10 dataset (layout, content, determinism)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pisft import config
from pisft.data import demo
from pisft.data.images import decode_png
from pisft.data.libero import LIBERO_10_TASKS


def _cfg(tmp_path: Path, **data) -> config.PisftConfig:
    results = tmp_path / "results"
    d = {"recap_dir": str(results / "demo_recap"), "demo_episodes_per_task": 2, "demo_episode_length": 10,
         "demo_image_size": 32, **data}
    return config.from_dict({"results_dir": str(results), "data": d})


def _hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "pisft_config.json"}


def test_run_writes_v21_layout(tmp_path):
    cfg = _cfg(tmp_path)
    out = demo.run(cfg)
    assert out == tmp_path / "results" / "demo_recap"
    meta = out / "meta"
    for name in ("info.json", "tasks.jsonl", "episodes.jsonl", "episodes_stats.jsonl",
                 "returns_demo.parquet", "advantages_demo.parquet"):
        assert (meta / name).is_file(), name
    assert (out / "pisft_config.json").is_file()
    info = json.loads((meta / "info.json").read_text())
    assert info["codebase_version"] == "v2.1"
    assert info["total_episodes"] == 20 and info["total_frames"] == 200 and info["fps"] == 10
    assert info["features"]["image"]["dtype"] == "image"
    assert info["features"]["image"]["shape"] == [32, 32, 3]
    assert info["features"]["state"]["shape"] == [8] and info["features"]["actions"]["shape"] == [7]
    tasks = [json.loads(line)["task"] for line in (meta / "tasks.jsonl").read_text().splitlines()]
    assert tasks == list(LIBERO_10_TASKS)
    files = sorted((out / "data" / "chunk-000").glob("episode_*.parquet"))
    assert [f.name for f in files] == [f"episode_{i:06d}.parquet" for i in range(20)]
    table = pq.read_table(files[3])
    assert table.column_names == ["image", "wrist_image", "state", "actions", "timestamp", "frame_index",
                                  "episode_index", "index", "task_index", "is_success", "done",
                                  "intervene_flag"]
    row = table.slice(0, 1).to_pylist()[0]
    assert decode_png(row["image"]["bytes"]).shape == (32, 32, 3)
    assert row["episode_index"] == 3 and row["index"] == 30 and row["task_index"] == 1
    assert len(row["state"]) == 8 and len(row["actions"]) == 7
    assert str(table.schema.field("state").type.value_type) == "float"
    assert b"huggingface" in table.schema.metadata


def test_run_is_byte_identical_for_a_seed_and_differs_across_seeds(tmp_path):
    a = _hashes(demo.run(_cfg(tmp_path / "a")))
    b = _hashes(demo.run(_cfg(tmp_path / "b")))
    c = _hashes(demo.run(_cfg(tmp_path / "c", demo_seed=1)))
    assert a == b
    assert a["data/chunk-000/episode_000000.parquet"] != c["data/chunk-000/episode_000000.parquet"]


def test_failure_fraction_and_rollout_columns():
    eps = demo.generate_all(episodes_per_task=5, length=20, image_size=16, failure_fraction=0.2, seed=0)
    assert len(eps) == 50
    failed = [ep for ep in eps if not ep.is_success.any()]
    assert len(failed) == 10  # one per task
    for ep in eps:
        assert ep.done[-1] and not ep.done[:-1].any()
        assert ep.state.dtype == np.float32 and ep.actions.dtype == np.float32
    # advantages: successes positive at the start, failures negative
    ok = [ep for ep in eps if ep.is_success.any()]
    assert all(ep.side["advantage_continuous"][0] > 0 for ep in ok)
    assert all(ep.side["advantage_continuous"][0] < 0 for ep in failed)


def test_actions_are_smooth_and_determined_by_state_and_task():
    eps = demo.generate_all(episodes_per_task=4, length=40, image_size=16, failure_fraction=0.0, seed=0)
    for ep in eps:
        jumps = np.abs(np.diff(ep.actions, axis=0)).max()
        assert jumps < 0.35  # smooth: no step larger than a fraction of the action range
    # a per-task linear model of (state, phase features) explains the actions almost fully
    for task in range(10):
        group = [ep for ep in eps if ep.task_index == task]
        x = np.concatenate([np.c_[ep.state, np.sin(2 * np.pi * np.arange(40) / 39),
                                  np.sin(4 * np.pi * np.arange(40) / 39), np.ones(40)] for ep in group])
        y = np.concatenate([ep.actions[:, :6] for ep in group])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        resid = y - x @ coef
        assert resid.var() < 0.01 * y.var()
    # the images depend on the state and on the task
    a, b = eps[0], eps[4]
    assert not np.array_equal(a.images["image"][0], a.images["image"][-1])
    assert not np.array_equal(a.images["image"][0], b.images["image"][0])


@pytest.mark.parametrize("size", [64, 256])
def test_image_sizes(size):
    eps = demo.generate_all(episodes_per_task=1, length=3, image_size=size, failure_fraction=0.0, seed=0)
    assert eps[0].images["image"].shape == (3, size, size, 3)
    assert eps[0].images["wrist_image"].dtype == np.uint8


def test_failed_run_leaves_no_output(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(demo, "write_recap_dataset", boom)
    with pytest.raises(RuntimeError):
        demo.run(cfg)
    assert not (tmp_path / "results" / "demo_recap").exists()
    assert list((tmp_path / "results").iterdir()) == []
