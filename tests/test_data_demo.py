"""demo_recap: the synthetic RECAP LIBERO-10 dataset (layout, content, determinism), written as
RLinf's writer leaves its collection, unlabelled (issue 20, item 10); and RLinf's finished output
(its returns and advantages steps run on such a dataset, issue 12, item 1)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from data_fixtures import make_recap

from pisft import config
from pisft.data import demo, rlinf_recap
from pisft.data.images import decode_png
from pisft.data.libero import LIBERO_10_TASKS

# RLinf's LeRobotDatasetWriter features for LIBERO rollouts, in its order, then LeRobot's defaults
RLINF_COLUMNS = ["state", "actions", "done", "is_success", "intervene_flag", "segment_id", "image", "wrist_image",
                 "timestamp", "frame_index", "episode_index", "index", "task_index"]
ADVANTAGE_COLUMNS = ["episode_index", "frame_index", "advantage_continuous", "return", "value_current", "value_next",
                     "reward_sum", "reward_sum_raw", "num_valid_rewards", "dataset_name", "advantage"]


def _cfg(tmp_path: Path, **data) -> config.PisftConfig:
    results = tmp_path / "results"
    d = {"recap_dir": str(results / "demo_recap"), "demo_episodes_per_task": 2, "demo_episode_length": 10,
         "demo_image_size": 32, **data}
    return config.from_dict({"results_dir": str(results), "data": d})


def _hashes(root: Path) -> dict[str, str]:
    """Every file's sha256 but the resolved config's (it names the results folder); the manifest
    by its entries less that file's."""
    out = {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
           for p in sorted(root.rglob("*"))
           if p.is_file() and p.name not in ("pisft_config.json", "MANIFEST.json")}
    listed = json.loads((root / "MANIFEST.json").read_text())["files"]
    out["MANIFEST.json"] = json.dumps({k: v for k, v in listed.items() if k != "pisft_config.json"},
                                      sort_keys=True)
    return out


def test_run_writes_rlinfs_unlabelled_collection(tmp_path):
    cfg = _cfg(tmp_path)
    out = demo.run(cfg)
    assert out == tmp_path / "results" / "demo_recap"
    meta = out / "meta"
    # RLinf's collection before any labelling: LeRobot v2.1's metadata, no returns/advantages files
    assert sorted(p.name for p in meta.iterdir()) == ["episodes.jsonl", "episodes_stats.jsonl", "info.json",
                                                      "tasks.jsonl"]
    assert (out / "pisft_config.json").is_file()
    info = json.loads((meta / "info.json").read_text())
    assert info["codebase_version"] == "v2.1"
    assert info["total_episodes"] == 20 and info["total_frames"] == 200 and info["fps"] == 10
    assert info["features"]["image"]["dtype"] == "image"
    assert info["features"]["image"]["shape"] == [32, 32, 3]
    assert info["features"]["state"]["shape"] == [8] and info["features"]["actions"]["shape"] == [7]
    assert list(info["features"]) == RLINF_COLUMNS
    tasks = [json.loads(line)["task"] for line in (meta / "tasks.jsonl").read_text().splitlines()]
    assert tasks == list(LIBERO_10_TASKS)
    files = sorted((out / "data" / "chunk-000").glob("episode_*.parquet"))
    assert [f.name for f in files] == [f"episode_{i:06d}.parquet" for i in range(20)]
    table = pq.read_table(files[3])
    assert table.column_names == RLINF_COLUMNS
    assert table.schema.field("segment_id").type == pa.uint8()
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
        # RLinf's collector writes the episode's outcome on every frame
        assert ep.is_success.all() or not ep.is_success.any()


@pytest.mark.parametrize("version", ["v2.1", "v3.0"])
def test_rlinf_complete_recap_output(tmp_path, version):
    """What RLinf's compute_returns + compute_advantages leave in a dataset, field by field."""
    length = 12
    src = make_recap(tmp_path / "in", version=version, n_tasks=3, per_task=3, length=length, size=16)
    meta = src / "meta"
    info = json.loads((meta / "info.json").read_text())
    # compute_returns declares the three features (and rewrites info.json with indent 2) ...
    assert info["features"]["return"] == {"dtype": "float32", "shape": [1], "names": None}
    assert info["features"]["reward"] == {"dtype": "float32", "shape": [1], "names": None}
    assert info["features"]["prompt"] == {"dtype": "string", "shape": [1], "names": None}
    assert (meta / "info.json").read_text().startswith('{\n  "codebase_version"')
    # ... whose values are not in the data files but in the returns side file
    data_file = sorted((src / "data").rglob("*.parquet"))[0]
    assert not {"return", "reward", "prompt"} & set(pq.read_schema(data_file).names)
    returns = pq.read_table(meta / "returns_demo.parquet")
    assert [(f.name, str(f.type)) for f in returns.schema] == [
        ("episode_index", "int64"), ("frame_index", "int64"), ("return", "float"), ("reward", "float"),
        ("prompt", "string")]
    assert returns.num_rows == 9 * length
    rows = returns.to_pandas()
    ep0 = rows[rows.episode_index == 0]
    # reward -1 per step, 0 at a success's last step, failure_reward at a failure's; undiscounted
    success = {e: bool(pq.read_table(data_file).column("is_success")[0].as_py()) for e in [0]}
    assert success[0] and ep0["reward"].tolist() == [-1.0] * (length - 1) + [0.0]
    assert ep0["return"].tolist() == [float(-(length - 1 - t)) for t in range(length)]
    fail_eps = rows.groupby("episode_index")["reward"].last()
    failed = sorted(fail_eps[fail_eps == demo.FAILURE_REWARD].index)
    assert len(failed) == 3  # one per task
    assert rows[rows.episode_index == failed[0]]["return"].iloc[0] == -(length - 1) + demo.FAILURE_REWARD
    # prompt: tasks.jsonl's text in v2.1; a v3.0 dataset has no tasks.jsonl -> RLinf's fallback
    expected_prompt = LIBERO_10_TASKS[0] if version == "v2.1" else rlinf_recap.FALLBACK_PROMPT
    assert set(ep0["prompt"]) == {expected_prompt}
    stats = json.loads((meta / "stats.json").read_text())
    assert set(stats["return"]) == {"mean", "std", "min", "max"}
    assert stats["return"]["min"] == -(length - 1) + demo.FAILURE_REWARD and stats["return"]["max"] == 0.0
    if version == "v2.1":  # LeRobot v2.1 keeps per-episode stats only: compute_returns creates stats.json
        assert set(stats) == {"return", "reward"}
    # compute_advantages: its columns, the boolean label, the threshold in mixture_config.yaml
    adv = pd.read_parquet(meta / "advantages_demo.parquet")
    assert list(adv.columns) == ADVANTAGE_COLUMNS
    assert adv["advantage"].dtype == bool and adv["advantage_continuous"].dtype == np.float64
    labels = adv.groupby("episode_index")["advantage"].agg(["all", "any"])
    assert all(not labels.loc[e, "any"] for e in failed)
    assert all(labels.loc[e, "all"] for e in labels.index if e not in failed)
    mixture = yaml.safe_load((meta / "mixture_config.yaml").read_text())
    threshold = mixture["tags"]["demo"]["unified_threshold"]
    assert mixture["tags"]["demo"]["positive_quantile"] == 0.3
    assert (adv["advantage"] == (adv["advantage_continuous"] >= threshold)).all()
    assert mixture["global_return_min"] == stats["return"]["min"]


def test_untagged_rlinf_output(tmp_path):
    """RLinf's default tag is null: meta/returns.parquet, meta/advantages.parquet."""
    root = tmp_path / "ds"
    root.mkdir()
    demo.build(root, episodes_per_task=2, length=6, image_size=16, failure_fraction=0.5, seed=0,
               tasks=LIBERO_10_TASKS[:2], workers=1, labelled=True, side_tag=None)
    assert (root / "meta/returns.parquet").is_file() and (root / "meta/advantages.parquet").is_file()
    assert not list((root / "meta").glob("*_demo.parquet"))
    mixture = yaml.safe_load((root / "meta/mixture_config.yaml").read_text())
    assert "unified_threshold" in mixture and "tags" not in mixture


def test_lerobot_eval_style_success_column(tmp_path):
    root = tmp_path / "ds"
    root.mkdir()
    demo.build(root, episodes_per_task=2, length=6, image_size=16, failure_fraction=0.5, seed=0,
               tasks=LIBERO_10_TASKS[:1], workers=1, naming="lerobot", success_column="next.success")
    info = json.loads((root / "meta/info.json").read_text())
    assert {"next.reward", "next.success", "next.done", "observation.images.image",
            "observation.images.image2"} <= set(info["features"])
    assert "is_success" not in info["features"]
    table = pq.read_table(sorted((root / "data").rglob("*.parquet"))[0])
    success = table.column("next.success").to_pylist()
    assert success[:-1] == [False] * 5  # true at the step the environment reports success, if any


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
