"""Write RECAP-format LIBERO datasets in the LeRobot on-disk layouts users bring.

Used by the `demo_recap` stage (v2.1, PNG images in parquet, RECAP names) and by tests and the
benchmark to produce the other inputs `convert_recap` reads: LeRobot v2.0 / v2.1 / v3.0, every
LIBERO naming of `libero.NAMINGS`, images as PNG-in-parquet or MP4 video.

The features are those RLinf's LeRobot writer declares for its LIBERO rollouts
(`rlinf/data/storage/lerobot/writer.py`, `LeRobotDatasetWriter.create`, fed by
`rlinf/envs/wrappers/collect_episode.py`), in its order: `state`, `actions`, `done`, `is_success`
(the episode's outcome on every frame), `intervene_flag`, `segment_id` (uint8), `image`,
`wrist_image`, then LeRobot's `timestamp`, `frame_index`, `episode_index`, `index`, `task_index`.
With `success_column="next.success"` the rollout columns are those LeRobot's `lerobot-eval`
records instead (`next.reward`, `next.success` true at the step of success, `next.done`).
RLinf's labelling steps that follow (returns and advantages side files) are in `rlinf_recap`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pisft.data import images as imgs
from pisft.data.dataset_stats import aggregate_simple, simple_stats
from pisft.data.libero import ACTION_DIM, CAMERAS, FPS, NAMINGS, STATE_DIM, naming_columns
from pisft.data.v30_writer import CHUNK_SIZE, DATA_FILE_SIZE_IN_MB, DATA_PATH, VIDEO_PATH, V30Writer

VERSIONS = ("v2.0", "v2.1", "v3.0")
V2_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
V2_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"


@dataclass
class RecapEpisode:
    """One episode in memory: arrays over its T frames."""

    episode_index: int
    task_index: int
    state: np.ndarray  # (T, 8) float32
    actions: np.ndarray  # (T, 7) float32
    images: dict[str, np.ndarray]  # camera -> (T, H, W, 3) uint8
    is_success: np.ndarray  # (T,) bool: the episode's outcome, on every frame (as RLinf records it)
    done: np.ndarray  # (T,) bool
    intervene_flag: np.ndarray  # (T,) bool
    segment_id: np.ndarray | None = None  # (T,) uint8; zeros when None

    @property
    def length(self) -> int:
        return int(self.state.shape[0])


SUCCESS_STYLES = ("is_success", "next.success")


def input_features(image_shape: tuple[int, int, int], naming: str, video: bool, fps: int = FPS,
                   success_column: str = "is_success") -> dict:
    """info.json `features` of a RECAP input dataset (RLinf's order, see the module docstring)."""
    names = naming_columns(naming)
    feats: dict = {}
    cams: dict = {}
    for cam in CAMERAS:
        ft = {"dtype": "video" if video else "image", "shape": list(image_shape),
              "names": ["height", "width", "channel"]}
        if video:
            ft["info"] = {"video.fps": fps, "video.height": image_shape[0], "video.width": image_shape[1],
                          "video.channels": 3, "video.codec": "h264", "video.pix_fmt": "yuv420p",
                          "video.is_depth_map": False, "has_audio": False}
        cams[names[cam]] = ft
    state = {"dtype": "float32", "shape": [STATE_DIM], "names": ["state"]}
    actions = {"dtype": "float32", "shape": [ACTION_DIM], "names": ["actions"]}
    if success_column == "is_success":  # RLinf's LeRobotDatasetWriter
        feats[names["state"]] = state
        feats[names["actions"]] = actions
        for key in ("done", "is_success", "intervene_flag"):
            feats[key] = {"dtype": "bool", "shape": [1], "names": [key]}
        feats["segment_id"] = {"dtype": "uint8", "shape": [1], "names": ["segment_id"]}
        feats.update(cams)
    elif success_column == "next.success":  # LeRobot's lerobot-eval recording
        feats.update(cams)
        feats[names["state"]] = {**state, "names": None}
        feats[names["actions"]] = {**actions, "names": None}
        feats["next.reward"] = {"dtype": "float32", "shape": [1], "names": None}
        feats["next.success"] = {"dtype": "bool", "shape": [1], "names": None}
        feats["next.done"] = {"dtype": "bool", "shape": [1], "names": None}
    else:
        raise ValueError(f"success_column must be one of {SUCCESS_STYLES}, got {success_column!r}")
    for key, dtype in (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"),
                       ("index", "int64"), ("task_index", "int64")):
        feats[key] = {"dtype": dtype, "shape": [1], "names": None}
    return feats


_ARROW_TYPES = {"float32": pa.float32(), "float64": pa.float64(), "int64": pa.int64(), "bool": pa.bool_(),
                "uint8": pa.uint8()}


def arrow_schema(features: dict) -> pa.Schema:
    """The parquet schema LeRobot (HF `datasets` 4) writes for these non-video features.

    Built here rather than with `datasets.Features` so that the demo stage does not pay the
    import of LeRobot/torch (the demo must take seconds).
    """
    fields, hf = [], {}
    for key, ft in features.items():
        shape = tuple(ft["shape"])
        if ft["dtype"] == "image":
            fields.append(pa.field(key, pa.struct([("bytes", pa.binary()), ("path", pa.string())])))
            hf[key] = {"_type": "Image"}
        elif shape == (1,):
            fields.append(pa.field(key, _ARROW_TYPES[ft["dtype"]]))
            hf[key] = {"dtype": ft["dtype"], "_type": "Value"}
        else:
            fields.append(pa.field(key, pa.list_(pa.field("element", _ARROW_TYPES[ft["dtype"]]), shape[0])))
            hf[key] = {"feature": {"dtype": ft["dtype"], "_type": "Value"}, "length": shape[0], "_type": "List"}
    meta = {"huggingface": json.dumps({"info": {"features": hf}})}
    return pa.schema(fields, metadata=meta)


def _png_column(frames: np.ndarray, pool: ThreadPoolExecutor | None) -> list[dict]:
    encoded = list(pool.map(imgs.encode_png, frames)) if pool else [imgs.encode_png(f) for f in frames]
    return [{"bytes": b, "path": None} for b in encoded]


def _numeric_columns(ep: RecapEpisode, first_index: int, naming: str, fps: int) -> dict[str, np.ndarray]:
    """Every non-image column of one episode, under its dataset name (both rollout styles)."""
    names = naming_columns(naming)
    t = ep.length
    last = np.zeros(t, dtype=bool)
    last[-1] = True
    reached = ep.is_success.astype(bool) & last  # lerobot-eval: success at the final step
    return {
        names["state"]: ep.state.astype(np.float32), names["actions"]: ep.actions.astype(np.float32),
        "done": ep.done.astype(bool), "is_success": ep.is_success.astype(bool),
        "intervene_flag": ep.intervene_flag.astype(bool),
        "segment_id": (ep.segment_id if ep.segment_id is not None else np.zeros(t)).astype(np.uint8),
        "next.reward": reached.astype(np.float32), "next.success": reached, "next.done": ep.done.astype(bool),
        "timestamp": (np.arange(t, dtype=np.float32) / np.float32(fps)).astype(np.float32),
        "frame_index": np.arange(t, dtype=np.int64), "episode_index": np.full(t, ep.episode_index, dtype=np.int64),
        "index": np.arange(first_index, first_index + t, dtype=np.int64),
        "task_index": np.full(t, ep.task_index, dtype=np.int64),
    }


def episode_table(ep: RecapEpisode, first_index: int, features: dict, naming: str, video: bool,
                  pool: ThreadPoolExecutor | None, fps: int = FPS) -> pa.Table:
    """The parquet rows of one episode, columns in the order of `features`."""
    names = naming_columns(naming)
    cols: dict[str, object] = {k: (list(v) if v.ndim > 1 else v)
                               for k, v in _numeric_columns(ep, first_index, naming, fps).items()}
    if not video:
        for cam in CAMERAS:
            cols[names[cam]] = _png_column(ep.images[cam], pool)
    schema = arrow_schema({k: v for k, v in features.items() if v["dtype"] != "video"})
    arrays = [pa.array(cols[f.name], type=f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def _episode_stats(ep: RecapEpisode, first_index: int, naming: str, fps: int, features: dict) -> dict:
    names = naming_columns(naming)
    numeric = _numeric_columns(ep, first_index, naming, fps)
    out = {names[cam]: simple_stats(ep.images[cam], image=True) for cam in CAMERAS}
    out.update({k: simple_stats(v) for k, v in numeric.items() if k in features})
    return out


def _write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=4) + "\n")


def write_recap_dataset(root: Path, episodes: Iterable[RecapEpisode], tasks: Sequence[str], *,
                        version: str = "v2.1", naming: str = "recap", video: bool = False, fps: int = FPS,
                        workers: int = 0, robot_type: str = "panda",
                        success_column: str = "is_success") -> list[RecapEpisode]:
    """Write `episodes` under `root` (an existing empty directory) in the given layout.

    Episodes are written one at a time and their images released afterwards, so a large
    dataset never sits in memory whole. Returns the (image-less) episodes written.
    """
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {tuple(NAMINGS)}, got {naming!r}")
    if success_column not in SUCCESS_STYLES:
        raise ValueError(f"success_column must be one of {SUCCESS_STYLES}, got {success_column!r}")
    (root / "meta").mkdir(parents=True, exist_ok=True)
    pool = ThreadPoolExecutor(max_workers=workers) if workers > 1 else None
    try:
        writer = (_V3Writer if version == "v3.0" else _V2Writer)(root, tasks, naming, video, fps, pool, version,
                                                                 robot_type, success_column)
        written = []
        for ep in episodes:
            writer.add(ep)
            ep.images = {}
            written.append(ep)
        writer.close()
    finally:
        if pool:
            pool.shutdown()
    return written


class _V2Writer:
    def __init__(self, root, tasks, naming, video, fps, pool, version, robot_type, success_column):
        self.root, self.tasks, self.naming, self.video, self.fps = root, tasks, naming, video, fps
        self.pool, self.version, self.robot_type = pool, version, robot_type
        self.success_column = success_column
        self.first = 0
        self.ep_rows: list[dict] = []
        self.stats_rows: list[dict] = []
        self.all_stats: list[dict] = []
        self.features: dict | None = None
        self.max_episode = 0

    def add(self, ep: RecapEpisode) -> None:
        names = naming_columns(self.naming)
        if self.features is None:
            self.features = input_features(tuple(ep.images[CAMERAS[0]].shape[1:]), self.naming, self.video,
                                           self.fps, self.success_column)
        chunk = ep.episode_index // CHUNK_SIZE
        path = self.root / V2_DATA_PATH.format(episode_chunk=chunk, episode_index=ep.episode_index)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(episode_table(ep, self.first, self.features, self.naming, self.video, self.pool, self.fps),
                       path)
        if self.video:
            for cam in CAMERAS:
                vpath = self.root / V2_VIDEO_PATH.format(episode_chunk=chunk, video_key=names[cam],
                                                         episode_index=ep.episode_index)
                imgs.encode_mp4(ep.images[cam], vpath, self.fps)
        ep_stats = _episode_stats(ep, self.first, self.naming, self.fps, self.features)
        self.all_stats.append(ep_stats)
        self.ep_rows.append({"episode_index": ep.episode_index, "tasks": [self.tasks[ep.task_index]],
                             "length": ep.length})
        self.stats_rows.append({"episode_index": ep.episode_index, "stats": ep_stats})
        self.first += ep.length
        self.max_episode = max(self.max_episode, ep.episode_index)

    def close(self) -> None:
        n = len(self.ep_rows)
        info = {
            "codebase_version": self.version, "robot_type": self.robot_type, "total_episodes": n,
            "total_frames": self.first, "total_tasks": len(self.tasks), "total_videos": n * 2 if self.video else 0,
            "total_chunks": self.max_episode // CHUNK_SIZE + 1, "chunks_size": CHUNK_SIZE, "fps": self.fps,
            "splits": {"train": f"0:{n}"}, "data_path": V2_DATA_PATH,
            "video_path": V2_VIDEO_PATH if self.video else None, "features": self.features,
        }
        meta = self.root / "meta"
        _write_json(meta / "info.json", info)
        _write_jsonl(meta / "tasks.jsonl", [{"task_index": i, "task": t} for i, t in enumerate(self.tasks)])
        _write_jsonl(meta / "episodes.jsonl", self.ep_rows)
        if self.version == "v2.1":
            _write_jsonl(meta / "episodes_stats.jsonl", self.stats_rows)
        else:
            _write_json(meta / "stats.json", aggregate_simple(self.all_stats))


class _V3Writer:
    """The v3.0 layout through `V30Writer`: one data file (and one MP4 per camera) for the whole
    dataset, the episodes' own indices, their rows' `meta/episodes/*` columns first."""

    def __init__(self, root, tasks, naming, video, fps, pool, version,  # noqa: ARG002 - the v2.1 writer's signature
                 robot_type, success_column):
        self.root, self.tasks, self.naming, self.video, self.fps = root, tasks, naming, video, fps
        self.pool, self.robot_type = pool, robot_type
        self.success_column = success_column
        self.all_stats: list[dict] = []
        self.features: dict | None = None
        self.writer: V30Writer | None = None
        self.videos: dict[str, imgs.Mp4Writer] = {}

    def add(self, ep: RecapEpisode) -> None:
        names = naming_columns(self.naming)
        if self.features is None:
            shape = tuple(ep.images[CAMERAS[0]].shape[1:])
            self.features = input_features(shape, self.naming, self.video, self.fps, self.success_column)
            if self.video:
                for cam in CAMERAS:
                    path = self.root / VIDEO_PATH.format(video_key=names[cam], chunk_index=0, file_index=0)
                    self.videos[cam] = imgs.Mp4Writer(path, self.fps, shape[1], shape[0])
        first = self.writer.total_frames if self.writer is not None else 0
        table = episode_table(ep, first, self.features, self.naming, self.video, self.pool, self.fps)
        if self.writer is None:
            self.writer = V30Writer(self.root, table.schema, data_files_size_in_mb=None, meta_columns_first=True)
        for cam, vw in self.videos.items():
            vw.write(ep.images[cam])
        ep_stats = _episode_stats(ep, first, self.naming, self.fps, self.features)
        self.all_stats.append(ep_stats)
        extra = {}
        if self.video:
            for cam in CAMERAS:
                extra[f"videos/{names[cam]}/chunk_index"] = 0
                extra[f"videos/{names[cam]}/file_index"] = 0
                extra[f"videos/{names[cam]}/from_timestamp"] = first / self.fps
                extra[f"videos/{names[cam]}/to_timestamp"] = (first + ep.length) / self.fps
        self.writer.add_table(table, [self.tasks[ep.task_index]], ep_stats, episode_index=ep.episode_index,
                              extra=extra)

    def close(self) -> None:
        assert self.writer is not None and self.features is not None, "no episode to write"
        for vw in self.videos.values():
            vw.close()
        self.writer.finish(self.tasks)
        feats = {k: ({**v, "fps": self.fps} if v["dtype"] != "video" else v) for k, v in self.features.items()}
        n = len(self.writer.episode_rows)
        info = {
            "codebase_version": "v3.0", "robot_type": self.robot_type, "total_episodes": n,
            "total_frames": self.writer.total_frames, "total_tasks": len(self.tasks), "chunks_size": CHUNK_SIZE,
            "data_files_size_in_mb": DATA_FILE_SIZE_IN_MB, "video_files_size_in_mb": 200, "fps": self.fps,
            "splits": {"train": f"0:{n}"}, "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if self.video else None, "features": feats,
        }
        meta = self.root / "meta"
        _write_json(meta / "info.json", info)
        _write_json(meta / "stats.json", aggregate_simple(self.all_stats))
