"""convert_recap: output loads with LeRobot 0.6, keys, stats, split, report, options, inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from data_fixtures import convert, make_recap, read_json

from pisft import config
from pisft.data import convert as convert_mod
from pisft.data import prompts
from pisft.data.convert import Options, convert_recap
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
    # statistics from the training episodes only (issue 12, item 5)
    train = set(read_json(out / "split.json")["train"])
    episode = np.asarray([int(e) for e in ds.hf_dataset["episode_index"]])
    all_actions = np.stack([np.asarray(x) for x in ds.hf_dataset["action"]])
    in_train = np.isin(episode, sorted(train))
    assert 0 < in_train.sum() < len(ds)
    actions = all_actions[in_train]
    from pisft.data.dataset_stats import numeric_stats

    expected, everything = numeric_stats(actions), numeric_stats(all_actions)
    for q in ("q01", "q99", "mean", "std", "min", "max"):
        assert np.allclose(stats["action"][q], expected[q], atol=1e-6), q
    assert not np.allclose(stats["action"]["q01"], everything["q01"])
    q01, q99 = np.asarray(stats["action"]["q01"]), np.asarray(stats["action"]["q99"])
    # the 1% / 99% tails of the training frames (LeRobot's histogram quantiles)
    assert np.all(actions.min(0) - 1e-6 <= q01) and np.all(q01 <= np.quantile(actions, 0.05, axis=0))
    assert np.all(np.quantile(actions, 0.95, axis=0) <= q99) and np.all(q99 <= actions.max(0) + 1e-6)
    assert np.allclose(stats["action"]["mean"], actions.mean(0), atol=1e-5)
    assert stats["action"]["count"] == [len(actions)]
    assert stats["observation.state"]["count"] == [len(actions)]
    img = np.asarray(stats["observation.images.base_0_rgb"]["mean"])
    assert img.shape == (3, 1, 1) and np.all((img >= 0) & (img <= 1))
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


def test_advantage_prompts_as_rlinf_trains_them(tmp_path):
    """RLinf's recipe (positive_only_conditional: true): positive frames carry the label,
    negative frames the plain task; the recipe is recorded for training and export."""
    src = make_recap(tmp_path / "in", n_tasks=2, per_task=3)
    rep = convert(src, tmp_path / "out", advantage_tag="demo")
    ds = _lerobot(tmp_path / "out")
    stored = set(ds.meta.tasks.index)
    assert stored == {advantage_prompt(t, True) for t in LIBERO_10_TASKS[:2]} | set(LIBERO_10_TASKS[:2])
    assert rep["out"]["prompts"] == len(stored) == 4
    failed = [e["episode_index"] for e in rep["episodes"] if not e["success"]]
    ok = [e["episode_index"] for e in rep["episodes"] if e["success"]]
    assert ds[failed[0] * 12]["task"] in LIBERO_10_TASKS
    assert ds[ok[0] * 12]["task"].endswith("\nAdvantage: positive")
    cond = prompts.for_dataset(tmp_path / "out")
    assert cond == prompts.PromptConditioning("demo", True, 0.1)
    assert rep["prompts"]["eval_prompt"] == "positive"
    assert read_json(tmp_path / "out/meta/prompt_conditioning.json")["unconditional_prob"] == 0.1


def test_advantage_prompts_on_every_frame(tmp_path):
    """positive_only_conditional: false labels every frame (pisft's former behaviour with
    unconditional_prob 0)."""
    src = make_recap(tmp_path / "in", n_tasks=2, per_task=3)
    rep = convert(src, tmp_path / "out", advantage_tag="demo", positive_only_conditional=False,
                  unconditional_prob=0.0)
    ds = _lerobot(tmp_path / "out")
    assert set(ds.meta.tasks.index) == {advantage_prompt(t, s) for t in LIBERO_10_TASKS[:2] for s in (True, False)}
    failed = [e["episode_index"] for e in rep["episodes"] if not e["success"]]
    assert ds[failed[0] * 12]["task"].endswith("Advantage: negative")
    assert prompts.training_prompt_fn(tmp_path / "out") is None  # nothing is dropped


def test_plain_conversion_records_plain_prompts(tmp_path):
    src = make_recap(tmp_path / "in", n_tasks=1, per_task=2, length=4)
    rep = convert(src, tmp_path / "out")
    assert not prompts.for_dataset(tmp_path / "out").conditioned
    assert rep["prompts"]["eval_prompt"] == "task"


@pytest.mark.parametrize("version", ["v2.1", "v3.0"])
@pytest.mark.parametrize("tag", ["", "demo"])
def test_rlinf_complete_recap_output_converts(tmp_path, version, tag):
    """RLinf's writer + compute_returns + compute_advantages, with and without data.advantage_tag."""
    src = make_recap(tmp_path / "in", version=version, n_tasks=2, per_task=3, length=8)
    info = read_json(src / "meta/info.json")
    assert {"return", "reward", "prompt"} <= set(info["features"])
    rep = convert(src, tmp_path / "out", advantage_tag=tag)
    assert rep["source"]["side_features"] == {"prompt": "returns_demo.parquet", "return": "returns_demo.parquet",
                                              "reward": "returns_demo.parquet"}
    assert rep["out"]["episodes"] == 6 and rep["out"]["frames"] == 48
    ds = _lerobot(tmp_path / "out")
    assert len(ds) == 48
    assert "return" not in ds.meta.features and "prompt" not in ds.meta.features
    assert rep["out"]["prompts"] == (4 if tag else 2)


def test_rlinf_untagged_output_converts(tmp_path):
    from pisft.data import demo

    src = tmp_path / "in"
    src.mkdir()
    demo.build(src, episodes_per_task=2, length=6, image_size=16, failure_fraction=0.5, seed=0,
               tasks=LIBERO_10_TASKS[:2], workers=1, labelled=True, side_tag=None)
    rep = convert(src, tmp_path / "out", advantage_tag="advantages.parquet")
    assert set(rep["source"]["side_features"].values()) == {"returns.parquet"}
    assert rep["out"]["prompts"] == 4


def test_report_counts_successes_and_failures_per_split(tmp_path):
    src = make_recap(tmp_path / "in", n_tasks=3, per_task=3, failure_fraction=0.34)
    rep = convert(src, tmp_path / "out", eval_fraction=0.34)
    by_split = {}
    for e in rep["episodes"]:
        by_split.setdefault(e["split"], []).append(e["success"])
    for name in ("train", "eval"):
        o = rep["outcomes"][name]
        assert o["episodes"] == len(by_split[name])
        assert o["successes"] == sum(by_split[name]) and o["failures"] == len(by_split[name]) - sum(by_split[name])
        assert o["unknown"] == 0
    assert rep["outcomes"]["train"]["failures"] + rep["outcomes"]["eval"]["failures"] == 3
    from pisft.data import dataset

    assert dataset.outcome_counts(tmp_path / "out", read_json(tmp_path / "out/split.json")["eval"]) == \
        rep["outcomes"]["eval"]


def test_success_only_reads_lerobot_next_success(tmp_path):
    """A LIBERO rollout recorded by LeRobot's lerobot-eval: next.success marks the success step."""
    from pisft.data import demo

    src = tmp_path / "in"
    src.mkdir()
    demo.build(src, episodes_per_task=3, length=6, image_size=16, failure_fraction=0.34, seed=0,
               tasks=LIBERO_10_TASKS[:2], workers=1, naming="lerobot", success_column="next.success")
    rep = convert(src, tmp_path / "out", success_only=True)
    assert rep["source"]["naming"] == "lerobot" and rep["source"]["success_column"] == "next.success"
    assert rep["out"]["episodes"] == 4 and rep["dropped_by_reason"] == {"not_successful": 2}
    assert "'next.success'" in rep["dropped"][0]["detail"]
    assert all(e["success"] for e in rep["episodes"])


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
    ("v3.0", "lerobot", False), ("v2.1", "observation_flat", False), ("v3.0", "lerobot", True),
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


def test_data_columns_maps_any_naming(tmp_path):
    """data.columns: a dataset whose columns no tool's LIBERO naming uses."""
    ref_src = make_recap(tmp_path / "ref", n_tasks=2, per_task=2, length=6)
    src = make_recap(tmp_path / "in", n_tasks=2, per_task=2, length=6)
    renames = {"image": "cam_front", "wrist_image": "cam_hand", "state": "proprio", "actions": "act"}
    info = read_json(src / "meta/info.json")
    info["features"] = {renames.get(k, k): v for k, v in info["features"].items()}
    (src / "meta/info.json").write_text(json.dumps(info))
    import pyarrow.parquet as pq

    for path in sorted((src / "data").rglob("*.parquet")):
        table = pq.read_table(path)
        pq.write_table(table.rename_columns([renames.get(c, c) for c in table.column_names]), path)
    ref = convert(ref_src, tmp_path / "ref_out")
    # wrist_image left out: it is not a known name here and detection says so ...
    from pisft.errors import DataError

    with pytest.raises(DataError, match="data.columns.wrist_image"):
        convert(src, tmp_path / "bad", columns={"image": "cam_front", "state": "proprio", "actions": "act"})
    rep = convert(src, tmp_path / "out", columns=renames)
    assert rep["source"]["naming"] == "data.columns" and rep["source"]["columns"] == renames
    assert rep["episodes"] == ref["episodes"]
    a, b = _lerobot(tmp_path / "ref_out"), _lerobot(tmp_path / "out")
    for i in (0, 11, 23):
        assert np.array_equal(a[i]["action"].numpy(), b[i]["action"].numpy())
        assert np.array_equal(a[i]["observation.images.left_wrist_0_rgb"].numpy(),
                              b[i]["observation.images.left_wrist_0_rgb"].numpy())


def test_data_columns_fills_in_the_keys_it_leaves_out(tmp_path):
    src = make_recap(tmp_path / "in", naming="lerobot", n_tasks=1, per_task=2, length=4)
    rep = convert(src, tmp_path / "out", columns={"wrist_image": "observation.images.image2"})
    assert rep["source"]["columns"] == {"image": "observation.images.image",
                                        "wrist_image": "observation.images.image2",
                                        "state": "observation.state", "actions": "action"}


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


def test_the_v30_writers_layout_is_lerobots():
    """pisft's v3.0 writer spells LeRobot's layout without importing LeRobot (the demo does not
    pay for it): the same paths, chunk size, data file size and next (chunk, file) index."""
    from lerobot.datasets import utils as lr

    from pisft.data import v30_writer as v3

    assert v3.DATA_PATH == lr.DEFAULT_DATA_PATH
    assert v3.VIDEO_PATH == lr.DEFAULT_VIDEO_PATH
    assert v3.EPISODES_PATH == lr.DEFAULT_EPISODES_PATH
    assert v3.TASKS_PATH == lr.DEFAULT_TASKS_PATH
    assert v3.CHUNK_SIZE == lr.DEFAULT_CHUNK_SIZE
    assert v3.DATA_FILE_SIZE_IN_MB == lr.DEFAULT_DATA_FILE_SIZE_IN_MB
    for chunk, file in ((0, 0), (0, 998), (0, 999), (3, 999), (2, 5)):
        assert v3.next_chunk_file(chunk, file) == lr.update_chunk_file_indices(chunk, file, lr.DEFAULT_CHUNK_SIZE)


def test_the_v30_writer_starts_a_new_data_file_past_its_size(tmp_path):
    """A data file takes episodes until their payload reaches `data_files_size_in_mb`; the next
    episode opens the next file, and each episode row names its file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pisft.data.v30_writer import V30Writer

    features = {"x": {"dtype": "float32", "shape": [1]}, "frame_index": {"dtype": "int64", "shape": [1]}}
    schema = pa.schema([("x", pa.float32()), ("frame_index", pa.int64())])
    writer = V30Writer(tmp_path, schema, features, data_files_size_in_mb=1)
    n = 100_000  # 1.2 MB of payload an episode (4 + 8 bytes a frame)
    for _ in range(3):
        writer.add_episode({"x": np.zeros(n), "frame_index": np.arange(n)}, ["task"], {})
    writer.finish(["task"])
    files = [(r["data/chunk_index"], r["data/file_index"]) for r in writer.episode_rows]
    assert files == [(0, 0), (0, 1), (0, 2)]
    assert [r["dataset_from_index"] for r in writer.episode_rows] == [0, n, 2 * n]
    for chunk, file in files:
        assert pq.read_metadata(tmp_path / f"data/chunk-{chunk:03d}/file-{file:03d}.parquet").num_rows == n
    one = V30Writer(tmp_path / "one", schema, features, data_files_size_in_mb=None)
    for _ in range(3):
        one.add_episode({"x": np.zeros(n), "frame_index": np.arange(n)}, ["task"], {})
    one.finish(["task"])
    assert {(r["data/chunk_index"], r["data/file_index"]) for r in one.episode_rows} == {(0, 0)}


def test_decoded_episodes_in_memory_are_bounded_by_the_window():
    """The conversion's memory does not follow the number of episodes: at most `window` decoded
    episodes exist at once (submitted and not yet consumed), whatever the dataset's size."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from pisft.data.convert_frames import _ordered_results

    lock = threading.Lock()
    alive = {"now": 0, "max": 0}

    def job(i):
        with lock:
            alive["now"] += 1
            alive["max"] = max(alive["max"], alive["now"])
        return i

    window = 3
    got = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for result in _ordered_results(pool, [lambda i=i: job(i) for i in range(40)], window):
            got.append(result)
            with lock:
                alive["now"] -= 1  # the writer has consumed (and dropped) this episode's frames
    assert got == list(range(40))  # in submission order
    assert 1 <= alive["max"] <= window  # never more decoded episodes than the window


def test_a_pool_of_typed_sources_trains_together_with_returns_per_type(tmp_path):
    """Demonstrations (sft) and rollouts convert into one dataset: one split and one set of
    statistics over the pool, counts per source, and RLinf's returns beside it (the inputs are
    not touched); an sft episode's return is a success's whatever its success column says."""
    import numpy as np
    import pyarrow.parquet as pq

    from pisft.config import DataSource
    from pisft.data.convert import Returns
    from pisft.data.rlinf_recap import episode_returns
    from pisft.layout import RETURNS_FILE

    demos = make_recap(tmp_path / "demos", n_tasks=2, per_task=2, length=8, failure_fraction=0.0)
    rollouts = make_recap(tmp_path / "rollouts", n_tasks=2, per_task=3, length=10, failure_fraction=0.34, seed=3)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    rep = convert_recap([DataSource(str(demos), "sft"), DataSource(str(rollouts), "rollout")], tmp_path / "out",
                        Options(), returns=Returns(gamma=1.0, failure_reward=-50.0))
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")
                  if p.is_file() and "out" not in p.relative_to(tmp_path).parts) == before
    assert [s["type"] for s in rep["sources"]] == ["sft", "rollout"]
    assert [(s["episodes"], s["frames"]) for s in rep["sources"]] == [(4, 32), (6, 60)]
    assert rep["sources"][1]["failures"] == sum(e["success"] is False for e in rep["episodes"]) > 0
    assert rep["out"]["episodes"] == 10 and rep["out"]["frames"] == 92
    split = read_json(tmp_path / "out" / "split.json")
    assert sorted(split["train"] + split["eval"]) == list(range(10))
    returns = pq.read_table(tmp_path / "out" / RETURNS_FILE).to_pandas()
    assert len(returns) == 92
    for e in rep["episodes"]:
        rows = returns[returns.episode_index == e["episode_index"]].sort_values("frame_index")
        success = e["source_type"] == "sft" or e["success"]
        expected, _ = episode_returns(e["frames"], bool(success), 1.0, -50.0)
        np.testing.assert_array_equal(rows["return"].to_numpy(), expected)
    # by hand: a failed rollout of 10 frames: -1 x 9 steps, then -50 -> G_0 = -59
    failed = next(e for e in rep["episodes"] if e["success"] is False)
    first = returns[(returns.episode_index == failed["episode_index"]) & (returns.frame_index == 0)]
    assert first["return"].item() == -59.0


def test_a_pool_refuses_sources_that_cannot_share_one_dataset(tmp_path):
    from pisft.config import DataSource
    from pisft.errors import DataError

    a = make_recap(tmp_path / "a", n_tasks=1, per_task=2, length=6, size=32)
    b = make_recap(tmp_path / "b", n_tasks=1, per_task=2, length=6, size=16)
    with pytest.raises(DataError, match="differ in size.*data.image_size"):
        convert_recap([DataSource(str(a)), DataSource(str(b), "rollout")], tmp_path / "out", Options())
    assert not (tmp_path / "out").exists()
    convert_recap([DataSource(str(a)), DataSource(str(b), "rollout")], tmp_path / "out", Options(image_size=16))


def test_data_tasks_filter_the_pool_not_each_source(tmp_path):
    """At a RECAP iteration the rollouts hold recap.task_ids alone: data.tasks [0, 1] keeps both
    tasks of the demonstrations and the one task of the rollouts; an entry no source holds is refused."""
    from pisft.config import DataSource
    from pisft.errors import DataError

    demos = make_recap(tmp_path / "demos", n_tasks=2, per_task=2, length=6, failure_fraction=0.0)
    rollouts = make_recap(tmp_path / "rollouts", n_tasks=1, per_task=2, length=6, seed=3)
    pool = [DataSource(str(demos), "sft"), DataSource(str(rollouts), "rollout")]
    rep = convert_recap(pool, tmp_path / "out", Options(tasks=["0", "1"]))
    assert [(s["episodes"], s["frames"]) for s in rep["sources"]] == [(4, 24), (2, 12)]
    assert rep["dropped"] == []
    with pytest.raises(DataError, match=r"'7' is neither .* any of the 2 sources.*demos.*rollouts"):
        convert_recap(pool, tmp_path / "out7", Options(tasks=["0", "7"]))
    assert not (tmp_path / "out7").exists()


STATS_ORDER = """
import json, sys
import numpy as np
from pisft.data import dataset_stats as st
rng = np.random.default_rng(0)
cams = ["observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb", "observation.images.right_wrist_0_rgb"]
eps = [st.episode_stats({}, {c: [rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)] for c in cams}) for _ in range(2)]
numeric = {"observation.state": rng.normal(size=(4, 8)), "action": rng.normal(size=(4, 7))}
sys.stdout.write(json.dumps(st.to_jsonable(st.dataset_stats(numeric, eps))))
"""


@pytest.mark.integration
def test_dataset_stats_bytes_do_not_depend_on_the_processes_hash_seed():
    """meta/stats.json is a DVC-hashed output: two conversions of the same data (any two processes,
    each with its own string hash seed) write the same bytes. Under hash seeds 0 and 2 LeRobot's
    aggregate_stats orders these cameras differently, neither in sorted order."""
    import os
    import subprocess
    import sys

    outs = [subprocess.run([sys.executable, "-c", STATS_ORDER], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (0, 2)]
    assert len(set(outs)) == 1, [list(json.loads(o))[:3] for o in outs]
    assert list(json.loads(outs[0]))[:3] == sorted(list(json.loads(outs[0]))[:3])


@pytest.mark.parametrize(("balance", "by_hand"), [
    (True, (32 / 62, 30 / 62)),  # weight x frames: 1 x 32 : 0.5 x 60
    (False, (2 / 3, 1 / 3)),  # the weights alone: 1 : 0.5
])
def test_source_weights_set_each_sources_share_of_the_samples(tmp_path, balance, by_hand):
    """Issue 32, item 6: the report shows each source's weight, frames and expected share (RLinf's
    rule, by hand), the dataset records them, and the training stages' sampler draws by them."""
    from pisft.config import DataSource
    from pisft.data.dataset import load_split
    from pisft.data.source_weights import SourceSampling
    from pisft.train.job import source_mixture

    demos = make_recap(tmp_path / "demos", n_tasks=2, per_task=2, length=8, failure_fraction=0.0)  # 4 x 8 frames
    rollouts = make_recap(tmp_path / "rollouts", n_tasks=2, per_task=3, length=10, failure_fraction=0.34, seed=3)
    pool = [DataSource(str(demos), "sft"), DataSource(str(rollouts), "rollout", 0.5)]
    out = tmp_path / "out"
    rep = convert_recap(pool, out, Options(eval_fraction=0.0, balance_source_weights=balance))
    assert [(s["weight"], s["frames_train"]) for s in rep["sources"]] == [(1.0, 32), (0.5, 60)]
    assert [s["share_train"] for s in rep["sources"]] == pytest.approx(by_hand, rel=1e-12)
    assert [s["share_all"] for s in rep["sources"]] == pytest.approx(by_hand, rel=1e-12)
    assert rep["sampling"]["balance_source_weights"] is balance and "RLinf" in rep["sampling"]["rule"]
    assert rep["sampling"]["draw"]["train"] == "weighted by source"
    recorded = SourceSampling.read(out)
    assert recorded == SourceSampling(balance, (1.0, 0.5), tuple(e["source"] for e in rep["episodes"]))
    train_set = load_split(out, "train", chunk_size=1)
    mixture = source_mixture(out, train_set)
    assert mixture is not None and mixture.probs.tolist() == pytest.approx(by_hand, rel=1e-12)
    source_of = {e["episode_index"]: e["source"] for e in rep["episodes"]}
    for n, rows in enumerate(mixture.groups):  # every row of a group is a frame of that source
        assert len(rows) == (32, 60)[n]
        assert {source_of[int(train_set.episode_index[r])] for r in rows} == {n}


def test_one_source_and_the_default_pool_keep_every_frame_equally_likely(tmp_path):
    """A single source (whatever its weight) and a pool of equal weights balanced by frames
    record a permutation draw: the sampler is today's, bit for bit; the held-out episodes
    are not in the train split's frames."""
    from pisft.config import DataSource
    from pisft.data.dataset import load_split
    from pisft.train.job import source_mixture

    demos = make_recap(tmp_path / "demos", n_tasks=2, per_task=3, length=8, failure_fraction=0.0)
    rollouts = make_recap(tmp_path / "rollouts", n_tasks=2, per_task=3, length=10, failure_fraction=0.34, seed=3)
    one = convert_recap([DataSource(str(demos), "sft", 4.0)], tmp_path / "one", Options())
    assert one["sampling"]["draw"] == {"train": "permutation (every frame equally likely)",
                                       "all": "permutation (every frame equally likely)"}
    assert one["sources"][0]["share_train"] == 1.0
    assert source_mixture(tmp_path / "one", load_split(tmp_path / "one", "train", chunk_size=1)) is None
    both = convert_recap([DataSource(str(demos)), DataSource(str(rollouts), "rollout")], tmp_path / "both",
                         Options(eval_fraction=0.34))
    train = set(read_json(tmp_path / "both" / "split.json")["train"])
    by_source = [sum(e["frames"] for e in both["episodes"] if e["source"] == n and e["episode_index"] in train)
                 for n in (0, 1)]
    assert [s["frames_train"] for s in both["sources"]] == by_source and sum(by_source) < 108
    assert both["sampling"]["frames"]["all"] == [48, 60]
    assert [s["share_train"] for s in both["sources"]] == pytest.approx([n / sum(by_source) for n in by_source])
    assert source_mixture(tmp_path / "both", load_split(tmp_path / "both", "train", chunk_size=1)) is None
