"""convert_recap refuses broken input: one test per case of issue 3, item 3, and the damage to
RLinf's finished RECAP output that must still be refused (issue 12).

Each error is a DataError naming the file, the episode and the column, and leaves no output
directory (nor a temporary sibling) behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_fixtures import convert_fails as _fails
from data_fixtures import make_recap

from pisft.data.images import encode_png

EP = "data/chunk-000/episode_000002.parquet"  # episode 2 of the v2.1 fixture


@pytest.fixture
def src(tmp_path) -> Path:
    return make_recap(tmp_path / "in", n_tasks=2, per_task=2, length=8, size=16)




def _edit(path: Path, fn) -> None:
    table = pq.read_table(path)
    new = fn(table)
    pq.write_table(new, path)


def _set_column(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, pa.field(name, array.type), array)


def _vectors(table: pa.Table, name: str) -> np.ndarray:
    return np.array(table.column(name).to_pylist(), dtype=np.float32)


def test_missing_info_json(src, tmp_path):
    (src / "meta/info.json").unlink()
    _fails(src, tmp_path, "meta/info.json", "missing")


def test_info_features_disagree_with_parquet_columns(src, tmp_path):
    info = json.loads((src / "meta/info.json").read_text())
    info["features"]["gripper_force"] = {"dtype": "float32", "shape": [1], "names": None}
    (src / "meta/info.json").write_text(json.dumps(info))
    _fails(src, tmp_path, "episode_000000.parquet", "episode 0", "gripper_force", "info.json", "returns_demo.parquet")


def test_column_in_the_file_but_not_declared(src, tmp_path):
    info = json.loads((src / "meta/info.json").read_text())
    del info["features"]["segment_id"]
    (src / "meta/info.json").write_text(json.dumps(info))
    _fails(src, tmp_path, "episode_000000.parquet", "episode 0", "segment_id", "not declared")


def test_declared_returns_features_without_their_side_file(src, tmp_path):
    # RLinf's compute_returns declared return/reward/prompt; the side file holding them is gone
    (src / "meta/returns_demo.parquet").unlink()
    msg = _fails(src, tmp_path, "episode_000000.parquet", "episode 0", "'prompt'", "'return'", "'reward'",
                 "meta/returns_<tag>.parquet")
    assert "found none" in msg


def test_returns_side_file_that_lacks_a_declared_feature(src, tmp_path):
    _edit(src / "meta/returns_demo.parquet", lambda t: t.drop_columns(["prompt"]))
    _fails(src, tmp_path, "episode_000000.parquet", "episode 0", "['prompt']", "info.json")


def test_returns_side_file_that_does_not_match_the_frames(src, tmp_path):
    path = src / "meta/returns_demo.parquet"
    _edit(path, lambda t: t.filter(pa.compute.invert(pa.compute.and_(
        pa.compute.equal(t.column("episode_index"), 1), pa.compute.equal(t.column("frame_index"), 7)))))
    _fails(src, tmp_path, "meta/returns_demo.parquet", "episode 1", "'frame_index'", "missing frame_index [7]")


def test_unreadable_returns_side_file(src, tmp_path):
    (src / "meta/returns_demo.parquet").write_bytes(b"PAR1 but not really")
    _fails(src, tmp_path, "meta/returns_demo.parquet", "not a readable parquet file")


def test_advantage_label_that_is_not_boolean(src, tmp_path):
    path = src / "meta/advantages_demo.parquet"
    _edit(path, lambda t: _set_column(t, "advantage", pa.array(np.ones(t.num_rows), type=pa.float64())))
    _fails(src, tmp_path, "meta/advantages_demo.parquet", "'advantage'", "double", "bool", advantage_tag="demo")


def test_advantage_rows_of_another_dataset(src, tmp_path):
    path = src / "meta/advantages_demo.parquet"
    _edit(path, lambda t: _set_column(t, "episode_index", pa.compute.add(t.column("episode_index"), 10)))
    _fails(src, tmp_path, "meta/advantages_demo.parquet", "'episode_index'", "episode(s) [10", "another dataset",
           advantage_tag="demo")


def test_missing_episode_file(src, tmp_path):
    (src / EP).unlink()
    _fails(src, tmp_path, EP, "episode 2", "missing")


def test_empty_episode_file(src, tmp_path):
    _edit(src / EP, lambda t: t.slice(0, 0))
    _fails(src, tmp_path, EP, "episode 2", "no frames")


def test_zero_byte_episode_file(src, tmp_path):
    (src / EP).write_bytes(b"")
    _fails(src, tmp_path, EP, "episode 2", "empty")


def test_column_of_wrong_dtype(src, tmp_path):
    def to_int(t):
        ints = pa.array((_vectors(t, "state") * 100).astype(np.int64).tolist(), type=pa.list_(pa.int64(), 8))
        return _set_column(t, "state", ints)

    _edit(src / EP, to_int)
    _fails(src, tmp_path, EP, "episode 2", "'state'", "int64", "float32")


def test_column_of_wrong_shape(src, tmp_path):
    def shorter(t):
        return _set_column(t, "actions", pa.array(_vectors(t, "actions")[:, :6].tolist(), type=pa.list_(pa.float32())))

    _edit(src / EP, shorter)
    _fails(src, tmp_path, EP, "episode 2", "'actions'", "shape [7]")


@pytest.mark.parametrize("column,value,word", [("state", np.nan, "NaN"), ("actions", np.inf, "inf")])
def test_nan_or_inf_in_state_or_actions(src, tmp_path, column, value, word):
    def poison(t):
        v = _vectors(t, column)
        v[5, 3] = value
        return _set_column(t, column, pa.array(v.tolist(), type=t.schema.field(column).type))

    _edit(src / EP, poison)
    _fails(src, tmp_path, EP, "episode 2", f"'{column}'", word, "frame 5")


def test_timestamps_that_do_not_increase(src, tmp_path):
    def stall(t):
        ts = t.column("timestamp").to_numpy().copy()
        ts[4] = ts[3]
        return _set_column(t, "timestamp", pa.array(ts, type=pa.float32()))

    _edit(src / EP, stall)
    _fails(src, tmp_path, EP, "episode 2", "'timestamp'", "does not increase", "frame 4")


def test_gap_in_frame_index(src, tmp_path):
    def gap(t):
        fi = t.column("frame_index").to_numpy().copy()
        fi[6:] += 1
        return _set_column(t, "frame_index", pa.array(fi, type=pa.int64()))

    _edit(src / EP, gap)
    _fails(src, tmp_path, EP, "episode 2", "'frame_index'", "row 6")


def test_task_index_missing_from_tasks_file(src, tmp_path):
    _edit(src / EP, lambda t: _set_column(t, "task_index", pa.array(np.full(t.num_rows, 7), type=pa.int64())))
    _fails(src, tmp_path, EP, "episode 2", "'task_index'", "[7]", "tasks.jsonl")


def test_duplicated_episode_index(src, tmp_path):
    lines = (src / "meta/episodes.jsonl").read_text().splitlines()
    (src / "meta/episodes.jsonl").write_text("\n".join(lines + [lines[1]]) + "\n")
    _fails(src, tmp_path, "meta/episodes.jsonl", "duplicated episode_index 1", "'episode_index'")


def test_episode_index_column_that_duplicates_another_episode(src, tmp_path):
    _edit(src / EP, lambda t: _set_column(t, "episode_index", pa.array(np.full(t.num_rows, 1), type=pa.int64())))
    _fails(src, tmp_path, EP, "episode 2", "'episode_index'", "holds episode_index 1")


def _set_image(t: pa.Table, column: str, frame: int, data: bytes) -> pa.Table:
    rows = t.column(column).to_pylist()
    rows[frame] = {"bytes": data, "path": None}
    return _set_column(t, column, pa.array(rows, type=t.schema.field(column).type))


def test_image_that_does_not_decode(src, tmp_path):
    def corrupt(t):
        good = t.column("wrist_image").to_pylist()[3]["bytes"]
        return _set_image(t, "wrist_image", 3, good[: len(good) // 2])

    _edit(src / EP, corrupt)
    _fails(src, tmp_path, EP, "episode 2", "'wrist_image'", "frame 3", "does not decode")


def test_image_of_wrong_size(src, tmp_path):
    _edit(src / EP, lambda t: _set_image(t, "image", 2, encode_png(np.zeros((24, 16, 3), np.uint8))))
    _fails(src, tmp_path, EP, "episode 2", "'image'", "frame 2", "24x16x3", "16x16x3")


def test_side_file_rows_that_do_not_match_the_frames(src, tmp_path):
    path = src / "meta/advantages_demo.parquet"
    _edit(path, lambda t: t.filter(pa.compute.invert(pa.compute.and_(
        pa.compute.equal(t.column("episode_index"), 3), pa.compute.equal(t.column("frame_index"), 5)))))
    _fails(src, tmp_path, "meta/advantages_demo.parquet", "episode 3", "'frame_index'", "missing frame_index [5]",
           advantage_tag="demo")


def test_nothing_left_after_filtering(src, tmp_path):
    # task 1 holds episodes 2 and 3; make both failures, then keep only task 1's successes
    for ep in (2, 3):
        _edit(src / f"data/chunk-000/episode_{ep:06d}.parquet",
              lambda t: _set_column(t, "is_success", pa.array(np.zeros(t.num_rows, bool))))
    _fails(src, tmp_path, "nothing left", "episode(s) [0, 1]", "episode(s) [2, 3]", "'is_success'",
           "'task_index'", success_only=True, tasks=["1"])


# ---------------------------------------------------------------- the same checks on the other layouts

def test_v30_duplicated_episode_index_in_episode_metadata(tmp_path):
    src = make_recap(tmp_path / "in", version="v3.0", n_tasks=2, per_task=2, length=8, size=16)
    path = src / "meta/episodes/chunk-000/file-000.parquet"
    _edit(path, lambda t: _set_column(t, "episode_index", pa.array([0, 1, 1, 3], type=t.schema.field(
        "episode_index").type)))
    _fails(src, tmp_path, "meta/episodes/chunk-000/file-000.parquet", "duplicated episode_index 1",
           "'episode_index'")


def test_v30_image_that_does_not_decode_in_a_shared_data_file(tmp_path):
    src = make_recap(tmp_path / "in", version="v3.0", n_tasks=2, per_task=2, length=8, size=16)
    path = src / "data/chunk-000/file-000.parquet"
    _edit(path, lambda t: _set_image(t, "image", 8 * 2 + 5, b"not a png"))
    _fails(src, tmp_path, "data/chunk-000/file-000.parquet", "episode 2", "'image'", "frame 5", "does not decode")


def test_v21_video_file_missing(tmp_path):
    src = make_recap(tmp_path / "in", video=True, n_tasks=2, per_task=2, length=8, size=16)
    video = src / "videos/chunk-000/wrist_image/episode_000001.mp4"
    video.unlink()
    _fails(src, tmp_path, "videos/chunk-000/wrist_image/episode_000001.mp4", "episode 1", "wrist_image", "missing")


def test_v30_video_shorter_than_the_episodes(tmp_path):
    from pisft.data.images import encode_mp4

    src = make_recap(tmp_path / "in", version="v3.0", naming="libero_v2", video=True, n_tasks=2, per_task=2,
                     length=8, size=16)
    video = src / "videos/observation.images.image/chunk-000/file-000.mp4"
    encode_mp4(np.zeros((20, 16, 16, 3), np.uint8), video, 10)  # 20 frames for 32
    _fails(src, tmp_path, "file-000.mp4", "episode 2", "observation.images.image", "4 frame(s)")


def test_unsupported_codebase_version(src, tmp_path):
    info = json.loads((src / "meta/info.json").read_text())
    info["codebase_version"] = "v1.6"
    (src / "meta/info.json").write_text(json.dumps(info))
    _fails(src, tmp_path, "meta/info.json", "v1.6", "v2.0, v2.1, v3.0")


def test_missing_tasks_file(src, tmp_path):
    (src / "meta/tasks.jsonl").unlink()
    _fails(src, tmp_path, "meta/tasks.jsonl", "missing")


def test_unknown_task_in_options(src, tmp_path):
    _fails(src, tmp_path, "data.tasks", "'open the fridge'", "known tasks", tasks=["open the fridge"])


def test_missing_advantages_side_file(src, tmp_path):
    _fails(src, tmp_path, "advantages_rl2.parquet", "missing", "demo", advantage_tag="rl2")


def test_success_only_without_any_success_column(src, tmp_path):
    info = json.loads((src / "meta/info.json").read_text())
    del info["features"]["is_success"]
    (src / "meta/info.json").write_text(json.dumps(info))
    for p in sorted((src / "data").glob("*/*.parquet")):
        _edit(p, lambda t: t.drop_columns(["is_success"]))
    msg = _fails(src, tmp_path, "meta/info.json", "'is_success'", "'next.success'", "data.success_only",
                 "Unset data.success_only", success_only=True)
    assert "rollout data" not in msg


# ---------------------------------------------------------------- namings and data.columns

def test_features_of_no_known_naming_ask_for_data_columns(src, tmp_path):
    info = json.loads((src / "meta/info.json").read_text())
    info["features"]["front"] = info["features"].pop("image")
    (src / "meta/info.json").write_text(json.dumps(info))
    _fails(src, tmp_path, "meta/info.json", "lack the LIBERO columns", "data.columns", "observation.images.image2")


def test_features_that_fit_two_namings_ask_for_data_columns(tmp_path):
    src = make_recap(tmp_path / "in", naming="lerobot", n_tasks=1, per_task=2, length=4, size=16)
    info = json.loads((src / "meta/info.json").read_text())
    # an extra camera with RLinf's libero_v2 wrist name: both namings fit
    info["features"]["observation.images.wrist_image"] = dict(info["features"]["observation.images.image2"])
    (src / "meta/info.json").write_text(json.dumps(info))
    _fails(src, tmp_path, "meta/info.json", "more than one LIBERO naming", "libero_v2", "lerobot", "data.columns")


def test_data_columns_naming_a_missing_feature(src, tmp_path):
    _fails(src, tmp_path, "meta/info.json", "data.columns.wrist_image", "'cam_wrist'", "not a feature",
           columns={"wrist_image": "cam_wrist"})


def test_data_columns_pointing_at_a_column_of_the_wrong_kind(src, tmp_path):
    _fails(src, tmp_path, "meta/info.json", "feature 'state'", "dtype 'float32'", "expected 'image' or 'video'",
           columns={"image": "state", "state": "image"})
