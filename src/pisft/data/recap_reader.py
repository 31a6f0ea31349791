"""Read a RECAP-format LIBERO dataset in any LeRobot layout users bring (v2.0, v2.1, v3.0).

`RecapSource.open(root)` reads and checks the metadata; `read_lowdim(ep)` returns an episode's
non-image columns under canonical names (`state`, `actions`, ...), checked against
`meta/info.json`; `read_png_bytes(ep, camera)` / `read_video_frames(ep, camera)` return its
camera frames. Every problem is a `DataError` naming the file, the episode and the column.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pisft.config import COLUMN_KEYS
from pisft.data import images as imgs
from pisft.data.libero import (
    ACTION_DIM,
    CAMERAS,
    INDEX_COLUMNS,
    NAMINGS,
    ROLLOUT_COLUMNS,
    STATE_DIM,
    SUCCESS_COLUMNS,
)
from pisft.errors import DataError

SUPPORTED = ("v2.0", "v2.1", "v3.0")
# canonical name -> (allowed info.json dtypes, shape)
LOWDIM_SPEC = {
    "state": (("float32", "float64"), (STATE_DIM,)),
    "actions": (("float32", "float64"), (ACTION_DIM,)),
    "timestamp": (("float32", "float64"), (1,)),
    "frame_index": (("int64", "int32"), (1,)),
    "episode_index": (("int64", "int32"), (1,)),
    "index": (("int64", "int32"), (1,)),
    "task_index": (("int64", "int32"), (1,)),
    "is_success": (("bool",), (1,)),
    "done": (("bool",), (1,)),
    "intervene_flag": (("bool",), (1,)),
}
_ARROW_FOR = {"float32": pa.float32(), "float64": pa.float64(), "int64": pa.int64(), "int32": pa.int32(),
              "bool": pa.bool_()}


@dataclass
class EpisodeRef:
    episode_index: int
    length: int | None  # as declared in the episodes metadata
    data_file: Path
    videos: dict[str, tuple[Path, float]] = field(default_factory=dict)  # camera -> (file, from_timestamp)


def _rel(root: Path, path: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


class RecapSource:
    """A RECAP input dataset: metadata checked, data read lazily per episode."""

    def __init__(self, root: Path):
        self.root = root
        self._file_cache: tuple[Path, pa.Table] | None = None
        self.side_features: dict[str, Path] = {}

    # ------------------------------------------------------------------ metadata
    @classmethod
    def open(cls, root: str | Path, columns: dict[str, str] | None = None) -> RecapSource:
        """`columns`: `data.columns` (canonical key -> the dataset's column), overriding detection."""
        root = Path(root)
        src = cls(root)
        if not root.is_dir():
            raise DataError(f"{root}: the RECAP dataset directory does not exist; set data.recap_dir to a "
                            "LeRobot dataset root (with meta/info.json and data/)")
        src._load_info()
        src._detect_naming(dict(columns or {}))
        src._find_side_features()
        if src.version == "v3.0":
            src._load_v3_meta()
        else:
            src._load_v2_meta()
        return src

    def where(self, path: Path) -> str:
        return f"{self.root}/{_rel(self.root, path)}"

    def _load_info(self) -> None:
        path = self.root / "meta" / "info.json"
        if not path.is_file():
            raise DataError(f"{self.where(path)}: missing; a LeRobot dataset root needs meta/info.json "
                            "(is data.recap_dir the dataset root, the folder holding meta/ and data/?)")
        try:
            info = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DataError(f"{self.where(path)}: not valid JSON ({exc}); restore the file") from None
        for key in ("codebase_version", "fps", "features"):
            if key not in info:
                raise DataError(f"{self.where(path)}: key '{key}' is missing")
        self.version = str(info["codebase_version"])
        if self.version not in SUPPORTED:
            raise DataError(f"{self.where(path)}: codebase_version '{self.version}' is not supported; "
                            f"convert_recap reads {', '.join(SUPPORTED)}")
        self.info = info
        self.info_path = path
        self.fps = int(info["fps"])
        self.features: dict = info["features"]
        self.chunks_size = int(info.get("chunks_size", 1000))

    def _detect_naming(self, columns: dict[str, str]) -> None:
        where = self.where(self.info_path)
        if columns:
            self.names = self._names_from_columns(columns)
            self.naming = "data.columns"
        else:
            matches: list[tuple[str, dict[str, str]]] = []
            for naming, spec in NAMINGS.items():
                found: dict[str, str] = {}
                for canon, accepted in spec.items():
                    present = [c for c in accepted if c in self.features]
                    if len(present) != 1:
                        break
                    found[canon] = present[0]
                else:
                    if all(found != m for _, m in matches):
                        matches.append((naming, found))
            if not matches:
                wanted = "; ".join(f"{name}: {', '.join(' or '.join(c) for c in spec.values())}"
                                   for name, spec in NAMINGS.items())
                raise DataError(f"{where}: features {sorted(self.features)} lack the LIBERO columns; known "
                                f"namings: {wanted}. Name your columns with data.columns (image, wrist_image, "
                                "state, actions -> the dataset's features)")
            if len(matches) > 1:
                listed = "; ".join(f"{n}: {m}" for n, m in matches)
                raise DataError(f"{where}: the features fit more than one LIBERO naming ({listed}); choose the "
                                "columns with data.columns (image, wrist_image, state, actions)")
            self.naming, found = matches[0]
            self.names = dict(found)  # canonical -> source column
        for key in (*INDEX_COLUMNS, *(c for c in ROLLOUT_COLUMNS if c != "is_success")):
            if key in self.features:
                self.names[key] = key
        for col in SUCCESS_COLUMNS:  # is_success (RECAP, RLinf) before LeRobot's next.success
            if col in self.features:
                self.names["is_success"] = col
                break
        for key in INDEX_COLUMNS:
            if key not in self.features:
                raise DataError(f"{self.where(self.info_path)}: feature '{key}' is missing from 'features'")
        self.video = {}
        for cam in CAMERAS:
            ft = self.features[self.names[cam]]
            if ft.get("dtype") not in ("image", "video"):
                raise DataError(f"{self.where(self.info_path)}: feature '{self.names[cam]}' has dtype "
                                f"'{ft.get('dtype')}', expected 'image' or 'video'")
            shape = tuple(ft.get("shape", ()))
            if len(shape) != 3 or 3 not in (shape[0], shape[2]):
                raise DataError(f"{self.where(self.info_path)}: feature '{self.names[cam]}' has shape "
                                f"{list(shape)}, expected [height, width, 3]")
            self.video[cam] = ft["dtype"] == "video"
        for canon, (dtypes, shape) in LOWDIM_SPEC.items():
            if canon not in self.names:
                continue
            ft = self.features[self.names[canon]]
            if ft.get("dtype") not in dtypes or tuple(ft.get("shape", ())) != shape:
                raise DataError(
                    f"{self.where(self.info_path)}: feature '{self.names[canon]}' is {ft.get('dtype')}"
                    f"{list(ft.get('shape', []))}, expected {' or '.join(dtypes)}{list(shape)}")

    def _names_from_columns(self, columns: dict[str, str]) -> dict[str, str]:
        """data.columns, and for the keys it leaves out the one known name the dataset has."""
        where = self.where(self.info_path)
        names: dict[str, str] = {}
        for canon in COLUMN_KEYS:
            if canon in columns:
                col = columns[canon]
                if col not in self.features:
                    raise DataError(f"{where}: data.columns.{canon} is '{col}', which is not a feature of the "
                                    f"dataset; features: {sorted(self.features)}")
                names[canon] = col
                continue
            known = sorted({c for spec in NAMINGS.values() for c in spec[canon]
                            if c in self.features and c not in columns.values()})
            if len(known) != 1:
                found = f"found {known}" if known else "none of the known names is a feature"
                raise DataError(f"{where}: data.columns does not name the '{canon}' column and it cannot be "
                                f"detected ({found}); add data.columns.{canon}")
            names[canon] = known[0]
        return names

    def _find_side_features(self) -> None:
        """Features that RLinf's `compute_returns` declares in info.json (`return`, `reward`,
        `prompt`) while their values live in `meta/returns_<tag>.parquet` (or the untagged
        `meta/returns.parquet`), not in the data files: feature -> the side file holding it."""
        meta = self.root / "meta"
        for path in sorted(meta.glob("returns*.parquet")):
            if path.name != "returns.parquet" and not path.name.startswith("returns_"):
                continue
            try:
                cols = pq.read_schema(path).names
            except (pa.ArrowInvalid, OSError) as exc:
                raise DataError(f"{self.where(path)}: not a readable parquet file ({exc}); RLinf's "
                                "compute_returns writes it: rerun it or remove the file") from None
            used = set(self.names.values())  # what we read must be in the data files
            for col in cols:
                if col in self.features and col not in used:
                    self.side_features.setdefault(col, path)

    @property
    def has_video(self) -> bool:
        return any(self.video.values())

    def image_shape(self, cam: str) -> tuple[int, int, int]:
        shape = tuple(self.features[self.names[cam]]["shape"])
        return shape if shape[2] == 3 else (shape[1], shape[2], shape[0])  # type: ignore[return-value]

    @property
    def parquet_columns(self) -> list[str]:
        """Columns every data file must have: the non-video features of info.json."""
        return [k for k, ft in self.features.items() if ft.get("dtype") != "video"]

    def _read_jsonl(self, path: Path) -> list[dict]:
        if not path.is_file():
            raise DataError(f"{self.where(path)}: missing; a LeRobot {self.version} dataset needs it")
        rows = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{self.where(path)}: line {lineno} is not valid JSON ({exc})") from None
        return rows

    def _set_tasks(self, pairs: list[tuple[int, str]], path: Path) -> None:
        self.tasks: dict[int, str] = {}
        for idx, task in pairs:
            if idx in self.tasks:
                raise DataError(f"{self.where(path)}: task_index {idx} appears twice")
            self.tasks[int(idx)] = str(task)
        self.tasks_path = path

    def _check_unique(self, indices: list[int], path: Path) -> None:
        seen: set[int] = set()
        for idx in indices:
            if idx in seen:
                raise DataError(f"{self.where(path)}: duplicated episode_index {idx} (column 'episode_index'); "
                                "each episode must be listed once; remove or renumber the duplicate")
            seen.add(idx)

    def inside(self, rel: str, what: str, where: Path | None = None) -> Path:
        """`root/rel` when `rel` stays inside the dataset folder; a DataError naming the offending
        path when it is absolute or climbs out with '..' (the drivers track this folder: a file
        read from elsewhere would change the result without either noticing). Checked on the
        text, so a symbolic link inside the folder (a DVC checkout) is followed as usual."""
        norm = os.path.normpath(rel)
        if os.path.isabs(rel) or norm == os.pardir or norm.startswith(os.pardir + os.sep):
            raise DataError(f"{self.where(where or self.info_path)}: {what} '{rel}' leaves the dataset folder "
                            f"{self.root} ({'an absolute path' if os.path.isabs(rel) else 'through ..'}); every "
                            "file of a dataset is read from inside its folder, which the pipeline tracks: make "
                            "the path relative to the dataset root, inside it")
        return self.root / norm

    def _format(self, template: str, key: str, where: Path | None = None, **values) -> Path:
        try:
            rel = template.format(**values)
        except (KeyError, ValueError, IndexError, AttributeError, TypeError) as exc:
            raise DataError(f"{self.where(where or self.info_path)}: '{key}' template {template!r} cannot be "
                            f"filled with {values} ({type(exc).__name__}: {exc})") from None
        return self.inside(rel, f"{key} (meta/info.json's template, filled)", self.info_path)

    def _load_v2_meta(self) -> None:
        meta = self.root / "meta"
        task_rows = self._read_jsonl(meta / "tasks.jsonl")
        try:
            self._set_tasks([(int(r["task_index"]), r["task"]) for r in task_rows], meta / "tasks.jsonl")
        except KeyError as exc:
            raise DataError(f"{self.where(meta / 'tasks.jsonl')}: a line lacks key {exc}") from None
        ep_path = meta / "episodes.jsonl"
        ep_rows = self._read_jsonl(ep_path)
        try:
            indices = [int(r["episode_index"]) for r in ep_rows]
        except KeyError:
            raise DataError(f"{self.where(ep_path)}: a line lacks 'episode_index'") from None
        self._check_unique(indices, ep_path)
        self.episodes_path = ep_path
        data_path = self.info.get("data_path")
        if not data_path:
            raise DataError(f"{self.where(self.info_path)}: key 'data_path' is missing")
        video_path = self.info.get("video_path")
        if self.has_video and not video_path:
            raise DataError(f"{self.where(self.info_path)}: cameras are stored as video but 'video_path' is null")
        self.episodes: list[EpisodeRef] = []
        for row in sorted(ep_rows, key=lambda r: int(r["episode_index"])):
            idx = int(row["episode_index"])
            chunk = idx // self.chunks_size
            ref = EpisodeRef(idx, int(row["length"]) if "length" in row else None,
                             self._format(data_path, "data_path", episode_chunk=chunk, episode_index=idx))
            for cam in CAMERAS:
                if self.video[cam]:
                    ref.videos[cam] = (self._format(video_path, "video_path", episode_chunk=chunk, episode_index=idx,
                                                    video_key=self.names[cam]), 0.0)
            self.episodes.append(ref)

    def _load_v3_meta(self) -> None:
        meta = self.root / "meta"
        tasks_path = meta / "tasks.parquet"
        if not tasks_path.is_file():
            raise DataError(f"{self.where(tasks_path)}: missing; a LeRobot v3.0 dataset needs it")
        tasks = pq.read_table(tasks_path).to_pandas()
        if "task" not in tasks.columns:
            tasks = tasks.reset_index()
        if not {"task", "task_index"} <= set(tasks.columns):
            raise DataError(f"{self.where(tasks_path)}: expected columns 'task' and 'task_index', "
                            f"found {list(tasks.columns)}")
        self._set_tasks([(int(i), t) for i, t in zip(tasks["task_index"], tasks["task"], strict=True)], tasks_path)
        ep_files = sorted((meta / "episodes").glob("*/*.parquet"))
        if not ep_files:
            raise DataError(f"{self.where(meta / 'episodes')}: no episode metadata files "
                            "(meta/episodes/chunk-XXX/file-XXX.parquet)")
        self.episodes_path = meta / "episodes"
        table = pa.concat_tables([pq.read_table(p, columns=[c for c in pq.read_schema(p).names
                                                            if not c.startswith("stats/")]) for p in ep_files],
                                 promote_options="permissive")
        rows = table.to_pylist()
        for col in ("episode_index", "data/chunk_index", "data/file_index"):
            if col not in table.column_names:
                raise DataError(f"{self.where(ep_files[0])}: column '{col}' is missing")
        self._check_unique([int(r["episode_index"]) for r in rows], ep_files[0])
        data_path = self.info.get("data_path", "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet")
        video_path = self.info.get("video_path")
        self.episodes = []
        for row in sorted(rows, key=lambda r: int(r["episode_index"])):
            ref = EpisodeRef(int(row["episode_index"]), int(row["length"]) if row.get("length") is not None else None,
                             self._format(data_path, "data_path", ep_files[0], chunk_index=row["data/chunk_index"],
                                          file_index=row["data/file_index"]))
            for cam in CAMERAS:
                if self.video[cam]:
                    key = self.names[cam]
                    try:
                        vfile = self._format(video_path, "video_path", ep_files[0], video_key=key,
                                             chunk_index=row[f"videos/{key}/chunk_index"],
                                             file_index=row[f"videos/{key}/file_index"])
                        ref.videos[cam] = (vfile, float(row[f"videos/{key}/from_timestamp"]))
                    except (KeyError, AttributeError):
                        raise DataError(f"{self.where(ep_files[0])}: episode {ref.episode_index} lacks the "
                                        f"'videos/{key}/...' columns of its video") from None
            self.episodes.append(ref)

    # ------------------------------------------------------------------ data
    def _episode_table(self, ep: EpisodeRef, columns: list[str]) -> pa.Table:
        path = ep.data_file
        where = self.where(path)
        if not path.is_file():
            raise DataError(f"{where}: missing data file of episode {ep.episode_index} (listed in "
                            f"{_rel(self.root, self.episodes_path)}); restore it or remove the episode")
        if path.stat().st_size == 0:
            raise DataError(f"{where}: empty data file of episode {ep.episode_index}; restore it or remove "
                            "the episode from the metadata")
        try:
            schema = pq.read_schema(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{where}: not a readable parquet file (episode {ep.episode_index}): {exc}") from None
        declared = set(self.parquet_columns)
        present = set(schema.names)
        missing = sorted(declared - present - set(self.side_features))
        extra = sorted(present - declared)
        if missing or extra:
            parts = []
            if missing:
                side = sorted(p.name for p in (self.root / "meta").glob("returns*.parquet"))
                parts.append(f"declared in meta/info.json but not in the file: {missing} (nor in a "
                             f"meta/returns_<tag>.parquet side file, where RLinf's compute_returns keeps "
                             f"the features it declares; found {side or 'none'})")
            if extra:
                parts.append(f"in the file but not declared in meta/info.json: {extra}")
            raise DataError(f"{where}: columns disagree with meta/info.json features (episode {ep.episode_index}): "
                            + "; ".join(parts) + ". Fix info.json 'features' or the data file")
        if self.version == "v3.0":
            cached = self._file_cache
            if cached is None or cached[0] != path:
                cached = (path, pq.read_table(path, columns=[c for c in schema.names
                                                             if self.features[c].get("dtype") != "image"]))
                self._file_cache = cached
            full = cached[1]
            mask = pc.equal(full.column("episode_index"), pa.scalar(ep.episode_index, full.schema.field(
                "episode_index").type))
            table = full.filter(mask).select(columns)
        else:
            table = pq.read_table(path, columns=columns)
        if table.num_rows == 0:
            raise DataError(f"{where}: episode {ep.episode_index} has no frames; restore its data or remove it "
                            "from the episode metadata")
        return table

    def read_lowdim(self, ep: EpisodeRef) -> dict[str, np.ndarray]:
        """The episode's non-image columns as numpy arrays, keyed by canonical name."""
        src_cols = {canon: col for canon, col in self.names.items() if canon not in CAMERAS}
        table = self._episode_table(ep, list(src_cols.values()))
        out: dict[str, np.ndarray] = {}
        for canon, col in src_cols.items():
            out[canon] = self._column_array(table.column(col), ep, col, canon)
        return out

    def _column_array(self, column: pa.ChunkedArray, ep: EpisodeRef, col: str, canon: str) -> np.ndarray:
        dtypes, shape = LOWDIM_SPEC[canon]
        declared = self.features[col]["dtype"]
        want = _ARROW_FOR[declared]
        where = f"{self.where(ep.data_file)}: episode {ep.episode_index}, column '{col}'"
        arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        typ = arr.type
        if shape == (1,):
            if pa.types.is_list(typ) or pa.types.is_fixed_size_list(typ) or pa.types.is_large_list(typ):
                lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
                if (lengths != 1).any():
                    raise DataError(f"{where}: expected one value per frame, found lists of length "
                                    f"{sorted(set(lengths.tolist()))}")
                arr = pc.list_flatten(arr)
                typ = arr.type
            if typ != want:
                raise DataError(f"{where}: dtype {typ}, but meta/info.json declares {declared}; "
                                "rewrite the column with the declared dtype")
            if arr.null_count:
                raise DataError(f"{where}: {arr.null_count} missing (null) value(s)")
            return arr.to_numpy(zero_copy_only=False)
        if not (pa.types.is_list(typ) or pa.types.is_fixed_size_list(typ) or pa.types.is_large_list(typ)):
            raise DataError(f"{where}: dtype {typ}, expected a list of {shape[0]} {declared} per frame")
        if typ.value_type != want:
            raise DataError(f"{where}: values are {typ.value_type}, but meta/info.json declares {declared}; "
                            "rewrite the column with the declared dtype")
        if arr.null_count:
            raise DataError(f"{where}: {arr.null_count} missing (null) row(s)")
        lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
        if (lengths != shape[0]).any():
            bad = int(np.flatnonzero(lengths != shape[0])[0])
            raise DataError(f"{where}: frame {bad} has {lengths[bad]} values, expected shape [{shape[0]}] "
                            f"(as meta/info.json declares)")
        flat = pc.list_flatten(arr)
        if flat.null_count:
            raise DataError(f"{where}: contains null values")
        return flat.to_numpy(zero_copy_only=False).reshape(-1, shape[0])

    def read_png_bytes(self, ep: EpisodeRef, cam: str) -> list[bytes | None]:
        """The encoded frames of one camera stored in the parquet file (None where missing)."""
        col = self.names[cam]
        path = ep.data_file
        if self.version == "v3.0":
            # row-group statistics let pyarrow skip the other episodes' row groups
            table = pq.read_table(path, columns=[col], filters=[("episode_index", "=", ep.episode_index)])
        else:
            table = pq.read_table(path, columns=[col])
        arr = table.column(col)
        typ = arr.type
        where = f"{self.where(path)}: episode {ep.episode_index}, column '{col}'"
        if pa.types.is_struct(typ) and typ.get_field_index("bytes") >= 0:
            values = pc.struct_field(arr, "bytes").to_pylist()
        elif pa.types.is_binary(typ) or pa.types.is_large_binary(typ):
            values = arr.to_pylist()
        else:
            raise DataError(f"{where}: dtype {typ}, expected an image (struct of bytes and path, as LeRobot "
                            "stores images)")
        return values

    def read_video_frames(self, ep: EpisodeRef, cam: str, count: int) -> list[np.ndarray]:
        path, start = ep.videos[cam]
        where = f"{self.where(path)}: episode {ep.episode_index}, camera '{self.names[cam]}'"
        if not path.is_file():
            raise DataError(f"{where}: video file missing; restore it")
        try:
            frames = imgs.decode_mp4_range(path, start, count, self.fps)
        except Exception as exc:  # noqa: BLE001 - PyAV raises many types for broken files
            raise DataError(f"{where}: the video does not decode ({exc}); re-encode or restore it") from None
        if len(frames) < count:
            raise DataError(f"{where}: the video has {len(frames)} frame(s) from t={start:.3f}s, the episode "
                            f"has {count}")
        return frames
