"""convert_recap: output loads with LeRobot 0.6, keys, stats, split, report, options, inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from data_fixtures import convert, make_recap, read_json

from pisft import config
from pisft.data import convert as convert_mod
from pisft.data.libero import LIBERO_10_TASKS, advantage_prompt

KEYS = ("observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb", "observation.state", "action")


def _lerobot(root: Path, episodes=None):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    return LeRobotDataset(repo_id="pisft/libero_recap", root=root, episodes=episodes, video_backend="pyav")


def test_run_converts_the_demo_and_lerobot_loads_it(tmp_path):
    results = tmp_path / "results"
    cfg = config.from_dict({"results_dir": str(results), "data": {
        "recap_dir": str(results / "demo_recap"), "demo_episodes_per_task": 2, "demo_episode_length": 8,
        "demo_image_size": 32}})
    from pisft.data import demo

    demo.run(cfg)
    out = convert_mod.run(cfg)
    assert out == results / "dataset"
    for name in ("split.json", "conversion_report.json", "pisft_config.json", "meta/info.json",
                 "meta/stats.json", "meta/tasks.parquet"):
        assert (out / name).is_file(), name
    ds = _lerobot(out)
    assert ds.meta.info.codebase_version == "v3.0"
    assert len(ds) == 160 and ds.num_episodes == 20
    for key in KEYS:
        assert key in ds.meta.features
    item = ds[9]
    assert item["observation.images.base_0_rgb"].shape == (3, 32, 32)
    assert item["observation.state"].shape == (8,) and item["action"].shape == (7,)
    assert item["task"] == LIBERO_10_TASKS[0] and int(item["episode_index"]) == 1
    assert sorted(ds.meta.tasks.index) == sorted(LIBERO_10_TASKS)


def test_stats_have_quantiles_and_match_the_data(tmp_path):
    src = make_recap(tmp_path / "in")
    out = tmp_path / "out"
    convert(src, out)
    stats = read_json(out / "meta/stats.json")
    for key in KEYS:
        for q in ("min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99"):
            assert q in stats[key], (key, q)
    ds = _lerobot(out)
    actions = np.stack([np.asarray(x) for x in ds.hf_dataset["action"]])
    q01, q99 = np.asarray(stats["action"]["q01"]), np.asarray(stats["action"]["q99"])
    # exact-over-all-frames quantiles (histogram with 5000 bins: within one bin of numpy's)
    width = (actions.max(0) - actions.min(0)) / 5000 + 1e-6
    assert np.all(np.abs(q01 - np.quantile(actions, 0.01, axis=0)) <= 2 * width + 0.01 * np.ptp(actions, 0))
    assert np.all(np.abs(q99 - np.quantile(actions, 0.99, axis=0)) <= 2 * width + 0.01 * np.ptp(actions, 0))
    assert np.allclose(stats["action"]["mean"], actions.mean(0), atol=1e-5)
    assert stats["action"]["count"] == [len(actions)]
    img = np.asarray(stats["observation.images.base_0_rgb"]["mean"])
    assert img.shape == (3, 1, 1) and np.all((0 <= img) & (img <= 1))
    # per-episode stats are in the episodes metadata, as LeRobot's recorder writes them
    assert "stats/action/q01" in ds.meta.episodes.column_names or (out / "meta/episodes").is_dir()


def test_split_is_stratified_deterministic_and_covers_every_episode(tmp_path):
    src = make_recap(tmp_path / "in", n_tasks=3, per_task=4)
    a = convert(src, tmp_path / "a", eval_fraction=0.25, split_seed=3)
    b = convert(src, tmp_path / "b", eval_fraction=0.25, split_seed=3)
    c = convert(src, tmp_path / "c", eval_fraction=0.25, split_seed=4)
    sa, sb, sc = (read_json(tmp_path / n / "split.json") for n in "abc")
    assert sa == sb and sa != sc
    assert sorted(sa["train"] + sa["eval"]) == list(range(12))
    assert not set(sa["train"]) & set(sa["eval"])
    tasks_of = {e["episode_index"]: e["task"] for e in a["episodes"]}
    for task in LIBERO_10_TASKS[:3]:
        assert sum(tasks_of[i] == task for i in sa["eval"]) == 1
    assert b["episodes"] == a["episodes"] and c["out"] == a["out"]


def test_report_counts_and_drop_reasons(tmp_path):
    src = make_recap(tmp_path / "in", n_tasks=3, per_task=3, failure_fraction=0.34)
    rep = convert(src, tmp_path / "out", success_only=True, tasks=["0", LIBERO_10_TASKS[2].upper()])
    assert rep["in"] == {"episodes": 9, "frames": 108, "tasks": 3}
    assert rep["out"]["episodes"] == 4 and rep["out"]["tasks"] == 2 and rep["out"]["frames"] == 48
    reasons = {d["source_episode_index"]: d["reason"] for d in rep["dropped"]}
    assert [i for i, r in reasons.items() if r == "task_not_selected"] == [3, 4, 5]
    assert sum(r == "not_successful" for r in reasons.values()) == 2
    assert rep["dropped_by_reason"] == {"not_successful": 2, "task_not_selected": 3}
    assert all(e["success"] for e in rep["episodes"])
    on_disk = read_json(tmp_path / "out" / "conversion_report.json")
    assert on_disk["dropped"] == rep["dropped"]
    ds = _lerobot(tmp_path / "out")
    assert ds.num_episodes == 4 and ds.meta.total_episodes == 4


def test_advantage_prompts(tmp_path):
    src = make_recap(tmp_path / "in", n_tasks=2, per_task=3)
    rep = convert(src, tmp_path / "out", advantage_tag="demo")
    ds = _lerobot(tmp_path / "out")
    prompts = set(ds.meta.tasks.index)
    assert prompts <= {advantage_prompt(t, s) for t in LIBERO_10_TASKS[:2] for s in (True, False)}
    assert advantage_prompt(LIBERO_10_TASKS[0], True) in prompts
    assert advantage_prompt(LIBERO_10_TASKS[0], False) in prompts
    assert rep["out"]["prompts"] == len(prompts)
    failed = [e["episode_index"] for e in rep["episodes"] if not e["success"]]
    item = ds[failed[0] * 12]
    assert item["task"].endswith("Advantage: negative")


def test_image_size_option_resizes(tmp_path):
    src = make_recap(tmp_path / "in", n_tasks=1, per_task=2, length=4)
    convert(src, tmp_path / "out", image_size=16)
    info = read_json(tmp_path / "out/meta/info.json")
    assert info["features"]["observation.images.base_0_rgb"]["shape"] == [16, 16, 3]
    assert _lerobot(tmp_path / "out")[0]["observation.images.left_wrist_0_rgb"].shape == (3, 16, 16)


def test_png_bytes_pass_through_unchanged(tmp_path):
    import pyarrow.parquet as pq

    src = make_recap(tmp_path / "in", n_tasks=1, per_task=2, length=4)
    convert(src, tmp_path / "out")
    before = pq.read_table(src / "data/chunk-000/episode_000001.parquet").column("wrist_image").to_pylist()
    after = pq.read_table(tmp_path / "out/data/chunk-000/file-000.parquet").column(
        "observation.images.left_wrist_0_rgb").to_pylist()
    assert [x["bytes"] for x in before] == [x["bytes"] for x in after[4:8]]


@pytest.mark.parametrize("version,naming,video", [
    ("v2.0", "recap", False), ("v2.1", "libero_v2", False), ("v3.0", "recap", False),
    ("v3.0", "libero_v2", False), ("v2.1", "recap", True), ("v3.0", "libero_v2", True),
])
def test_every_input_layout_converts_to_the_same_data(tmp_path, version, naming, video):
    ref_src = make_recap(tmp_path / "ref", n_tasks=2, per_task=2, length=6)
    src = make_recap(tmp_path / "in", version=version, naming=naming, video=video, n_tasks=2, per_task=2, length=6)
    ref = convert(ref_src, tmp_path / "ref_out")
    rep = convert(src, tmp_path / "out")
    assert rep["source"]["codebase_version"] == version and rep["source"]["naming"] == naming
    assert rep["source"]["image_storage"] == ("video" if video else "png_in_parquet")
    assert rep["out"] == ref["out"] and rep["episodes"] == ref["episodes"]
    a, b = _lerobot(tmp_path / "ref_out"), _lerobot(tmp_path / "out")
    for i in (0, 7, 23):
        x, y = a[i], b[i]
        assert x["task"] == y["task"]
        assert np.array_equal(x["action"].numpy(), y["action"].numpy())
        img_x, img_y = x["observation.images.base_0_rgb"], y["observation.images.base_0_rgb"]
        if video:  # lossy codec: close, not equal
            assert float((img_x - img_y).abs().mean()) < 0.03
        else:
            assert np.array_equal(img_x.numpy(), img_y.numpy())


def test_output_is_deterministic(tmp_path):
    import hashlib

    src = make_recap(tmp_path / "in", n_tasks=2, per_task=2, length=5)
    convert(src, tmp_path / "a")
    convert(src, tmp_path / "b")

    def hashes(root):
        return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*")) if p.is_file()}

    ha, hb = hashes(tmp_path / "a"), hashes(tmp_path / "b")
    ha.pop("conversion_report.json"), hb.pop("conversion_report.json")  # holds the source path
    assert ha == hb
    rep = json.loads((tmp_path / "a" / "conversion_report.json").read_text())
    assert "_timing" not in rep
