"""Write a LeRobot v3.0 dataset root, episode by episode, with LeRobot's own metadata helpers.

The files are exactly those LeRobot 0.6's recorder (`LeRobotDataset.create` / `add_frame` /
`save_episode` / `finalize`) produces for image (not video) features: `meta/info.json`,
`meta/tasks.parquet`, `meta/stats.json`, `meta/episodes/chunk-000/file-000.parquet` (one row per
episode with its location and per-episode stats) and `data/chunk-XXX/file-XXX.parquet` (one row
group per episode, images as PNG bytes in `{bytes, path}` structs). What we skip is the
recorder's per-frame round trip through PNG files on disk (decode, PNG re-encode at zlib
level 6, re-read), which is what makes it slow (see `pisft.bench.convert_bench`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from lerobot.datasets.dataset_metadata import CODEBASE_VERSION
from lerobot.datasets.feature_utils import create_empty_dataset_info, get_hf_features_from_features
from lerobot.datasets.io_utils import write_info, write_stats, write_tasks
from lerobot.datasets.utils import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_DATA_FILE_SIZE_IN_MB,
    DEFAULT_DATA_PATH,
    DEFAULT_EPISODES_PATH,
    update_chunk_file_indices,
)
from lerobot.utils.constants import DEFAULT_FEATURES

_IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


class V30Writer:
    def __init__(self, root: Path, features: dict, fps: int, robot_type: str | None = None,
                 data_files_size_in_mb: int = DEFAULT_DATA_FILE_SIZE_IN_MB):
        self.root = Path(root)
        feats = {**features, **{k: dict(v) for k, v in DEFAULT_FEATURES.items()}}
        for ft in feats.values():
            ft["shape"] = tuple(ft["shape"])
            if ft["dtype"] not in ("image", "video"):
                ft["fps"] = fps
        self.features = feats
        self.info = create_empty_dataset_info(CODEBASE_VERSION, fps, feats, use_videos=False,
                                              robot_type=robot_type, data_files_size_in_mb=data_files_size_in_mb)
        self.schema = get_hf_features_from_features(feats).arrow_schema
        self.limit_bytes = data_files_size_in_mb * 1024 * 1024
        self.chunk, self.file = 0, 0
        self._writer: pq.ParquetWriter | None = None
        self._file_bytes = 0
        self.total_frames = 0
        self.episode_rows: list[dict] = []

    def _open(self) -> None:
        path = self.root / DEFAULT_DATA_PATH.format(chunk_index=self.chunk, file_index=self.file)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(path, schema=self.schema, compression="snappy", use_dictionary=True)
        self._file_bytes = 0

    def add_episode(self, columns: dict, tasks: list[str], stats: dict) -> None:
        """Append one episode. `columns` maps every non-default feature to its per-frame values:
        images as lists of PNG bytes, vectors as (T, dim) arrays; the default features
        (timestamp, frame_index, episode_index, index, task_index) are given too."""
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
        table = pa.Table.from_arrays(arrays, schema=self.schema)
        if self._writer is not None and self._file_bytes + payload >= self.limit_bytes:
            self._writer.close()
            self._writer = None
            self.chunk, self.file = update_chunk_file_indices(self.chunk, self.file, DEFAULT_CHUNK_SIZE)
        if self._writer is None:
            self._open()
        self._writer.write_table(table)
        self._file_bytes += payload
        ep_index = len(self.episode_rows)
        row = {
            "episode_index": ep_index,
            "tasks": list(tasks),
            "length": length,
            "data/chunk_index": self.chunk,
            "data/file_index": self.file,
            "dataset_from_index": self.total_frames,
            "dataset_to_index": self.total_frames + length,
        }
        for key, ft_stats in stats.items():
            for name, value in ft_stats.items():
                row[f"stats/{key}/{name}"] = np.asarray(value).tolist()
        row["meta/episodes/chunk_index"] = 0
        row["meta/episodes/file_index"] = 0
        self.episode_rows.append(row)
        self.total_frames += length

    def finish(self, tasks: list[str], stats: dict) -> None:
        """Close the data files; write episodes, tasks, stats and info (tasks in task_index order)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        path = self.root / DEFAULT_EPISODES_PATH.format(chunk_index=0, file_index=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(self.episode_rows), path, compression="snappy")
        write_tasks(pd.DataFrame({"task_index": np.arange(len(tasks), dtype=np.int64)},
                                 index=pd.Index(tasks, name="task")), self.root)
        write_stats(stats, self.root)
        self.info.total_episodes = len(self.episode_rows)
        self.info.total_frames = self.total_frames
        self.info.total_tasks = len(tasks)
        self.info.splits = {"train": f"0:{len(self.episode_rows)}"}
        write_info(self.info, self.root)
