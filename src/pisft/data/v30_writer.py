"""Write the files of a LeRobot v3.0 dataset root, episode by episode: pisft's one v3.0 writer.

Both v3.0 datasets pisft writes go through `V30Writer`: the conversion's output (`convert_recap`,
pi0.5-ready, image features) and the RECAP inputs of `recap_layout` (the demo generator and the
rollout collection in the v3.0 layout, images or MP4 video).

The writer holds what the v3.0 layout fixes: the data files `data/chunk-XXX/file-XXX.parquet`
(one row group per episode, a new file once `data_files_size_in_mb` of payload is reached, or
one file for everything), the episode index `meta/episodes/chunk-000/file-000.parquet` (one row
per episode: its tasks, length and location, its per-episode stats flattened to
`stats/<feature>/<stat>`, and the caller's extra columns such as its videos' location) and
`meta/tasks.parquet` (a pandas frame indexed by the task string, as LeRobot writes it). The
arrow schema, `meta/info.json` and `meta/stats.json` are the caller's: the conversion has
LeRobot's own helpers make them, as LeRobot 0.6's recorder (`LeRobotDataset.create` /
`add_frame` / `save_episode` / `finalize`) does for image features; `recap_layout` builds them
without LeRobot, so the demo stage does not pay the import of LeRobot/torch.

What the conversion skips against LeRobot's recorder is its per-frame round trip through PNG
files on disk (decode, PNG re-encode at zlib level 6, re-read), which is what makes it slow
(see `pisft.bench.convert_bench`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

# LeRobot v3.0's layout (lerobot.datasets.utils: DEFAULT_DATA_PATH, DEFAULT_EPISODES_PATH,
# DEFAULT_CHUNK_SIZE, DEFAULT_DATA_FILE_SIZE_IN_MB; tests/test_data_convert.py compares them)
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
TASKS_PATH = "meta/tasks.parquet"
CHUNK_SIZE = 1000
DATA_FILE_SIZE_IN_MB = 100

_IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def next_chunk_file(chunk: int, file: int, chunk_size: int = CHUNK_SIZE) -> tuple[int, int]:
    """The (chunk, file) index after this one: `chunk_size` files a chunk (LeRobot's
    `update_chunk_file_indices`)."""
    return (chunk + 1, 0) if file + 1 == chunk_size else (chunk, file + 1)


def write_tasks(root: Path, tasks: Sequence[str]) -> None:
    """`meta/tasks.parquet`: task_index by task string, in task_index order."""
    path = Path(root) / TASKS_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"task_index": np.arange(len(tasks), dtype=np.int64)},
                 index=pd.Index(list(tasks), name="task")).to_parquet(path)


class V30Writer:
    """The data files, episode index and tasks of a v3.0 root at `root`.

    `schema`: the data files' arrow schema (every non-video feature, in order); `features`: the
    info.json features, which give `add_episode` each column's dtype; `data_files_size_in_mb`:
    payload after which a new data file starts (None: one data file); `meta_columns_first`: the
    episode rows' `meta/episodes/*` columns right after the location, before the extra and stats
    columns (the RECAP inputs' rows), instead of last (LeRobot's recorder).
    """

    def __init__(self, root: Path, schema: pa.Schema, features: dict | None = None, *,
                 data_files_size_in_mb: int | None = DATA_FILE_SIZE_IN_MB, meta_columns_first: bool = False):
        self.root = Path(root)
        self.schema = schema
        self.features = features
        self.limit_bytes = None if data_files_size_in_mb is None else data_files_size_in_mb * 1024 * 1024
        self.meta_columns_first = meta_columns_first
        self.chunk, self.file = 0, 0
        self._writer: pq.ParquetWriter | None = None
        self._file_bytes = 0
        self.total_frames = 0
        self.episode_rows: list[dict] = []

    def _open(self) -> None:
        path = self.root / DATA_PATH.format(chunk_index=self.chunk, file_index=self.file)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(path, schema=self.schema, compression="snappy", use_dictionary=True)
        self._file_bytes = 0

    def table(self, columns: dict) -> tuple[pa.Table, int]:
        """One episode's rows from `columns` (every schema field's per-frame values: images as
        lists of PNG bytes, vectors as (T, dim) arrays, scalars as (T,)), with its payload bytes."""
        assert self.features is not None, "V30Writer.table needs the features"
        length = len(columns["frame_index"])
        arrays = []
        payload = 0
        for field in self.schema:
            ft = self.features[field.name]
            values = columns[field.name]
            if ft["dtype"] == "image":
                payload += sum(len(b) for b in values)
                arrays.append(pa.StructArray.from_arrays(
                    [pa.array(values, type=pa.binary()), pa.nulls(length, type=pa.string())],
                    fields=list(_IMAGE_STRUCT)))
            elif pa.types.is_fixed_size_list(field.type):
                flat = np.ascontiguousarray(values, dtype=ft["dtype"]).reshape(-1)
                arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(flat), field.type.list_size))
                payload += flat.nbytes
            else:
                arr = np.asarray(values, dtype=ft["dtype"]).reshape(length)
                arrays.append(pa.array(arr, type=field.type))
                payload += arr.nbytes
        return pa.Table.from_arrays(arrays, schema=self.schema), payload

    def add_episode(self, columns: dict, tasks: Sequence[str], stats: dict) -> None:
        """Append one episode given as columns (see `table`), numbered in the order added."""
        table, payload = self.table(columns)
        self.add_table(table, tasks, stats, payload=payload)

    def add_table(self, table: pa.Table, tasks: Sequence[str], stats: dict, *, payload: int = 0,
                  episode_index: int | None = None, extra: dict | None = None) -> None:
        """Append one episode's rows (`table`, of `schema`). `episode_index` None: the number of
        episodes added before it; `extra`: further columns of its episode row (its videos)."""
        length = table.num_rows
        if (self.limit_bytes is not None and self._writer is not None
                and self._file_bytes + payload >= self.limit_bytes):
            self._writer.close()
            self._writer = None
            self.chunk, self.file = next_chunk_file(self.chunk, self.file)
        if self._writer is None:
            self._open()
        assert self._writer is not None
        self._writer.write_table(table)
        self._file_bytes += payload
        row = {
            "episode_index": len(self.episode_rows) if episode_index is None else episode_index,
            "tasks": list(tasks),
            "length": length,
            "data/chunk_index": self.chunk,
            "data/file_index": self.file,
            "dataset_from_index": self.total_frames,
            "dataset_to_index": self.total_frames + length,
        }
        meta = {"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0}
        if self.meta_columns_first:
            row.update(meta)
        row.update(extra or {})
        for key, ft_stats in stats.items():
            for name, value in ft_stats.items():
                row[f"stats/{key}/{name}"] = np.asarray(value).tolist()
        if not self.meta_columns_first:
            row.update(meta)
        self.episode_rows.append(row)
        self.total_frames += length

    def finish(self, tasks: Sequence[str]) -> None:
        """Close the data files; write the episode index and the tasks (in task_index order).
        The caller writes `meta/info.json` and `meta/stats.json`."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        path = self.root / EPISODES_PATH.format(chunk_index=0, file_index=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(self.episode_rows), path, compression="snappy")
        write_tasks(self.root, tasks)


def recorder_layout(features: dict, fps: int, robot_type: str | None = None,
                    data_files_size_in_mb: int = DATA_FILE_SIZE_IN_MB) -> tuple[dict, object, pa.Schema]:
    """What LeRobot's recorder (`LeRobotDataset.create`) makes of image `features`: every feature
    with its defaults (timestamp, frame_index, episode_index, index, task_index) and `fps` on the
    non-image ones, its `DatasetInfo` and its arrow schema (HF `datasets`). Imports LeRobot."""
    from lerobot.datasets.dataset_metadata import CODEBASE_VERSION
    from lerobot.datasets.feature_utils import create_empty_dataset_info, get_hf_features_from_features
    from lerobot.utils.constants import DEFAULT_FEATURES

    feats = {**features, **{k: dict(v) for k, v in DEFAULT_FEATURES.items()}}
    for ft in feats.values():
        ft["shape"] = tuple(ft["shape"])
        if ft["dtype"] not in ("image", "video"):
            ft["fps"] = fps
    info = create_empty_dataset_info(CODEBASE_VERSION, fps, feats, use_videos=False, robot_type=robot_type,
                                     data_files_size_in_mb=data_files_size_in_mb)
    return feats, info, get_hf_features_from_features(feats).arrow_schema


def write_recorder_meta(writer: V30Writer, info, tasks: Sequence[str], stats: dict) -> None:
    """Finish `writer` and write `meta/stats.json` and `meta/info.json` (`info` from
    `recorder_layout`, its totals set here) with LeRobot's own writers."""
    from lerobot.datasets.io_utils import write_info, write_stats

    writer.finish(tasks)
    write_stats(stats, writer.root)
    info.total_episodes = len(writer.episode_rows)
    info.total_frames = writer.total_frames
    info.total_tasks = len(tasks)
    info.splits = {"train": f"0:{len(writer.episode_rows)}"}
    write_info(info, writer.root)
