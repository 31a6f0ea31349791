"""`convert_recap`: RECAP-format LIBERO (LeRobot v2.0/v2.1/v3.0) -> pi0.5-ready LeRobot v3.0.

The input is a pool of typed sources (`data.recap_dir`; at RECAP iteration k also the rollouts
of iterations 1..k): `sft` demonstrations and `rollout` collections train together, with one
episode split (stratified by task) and one set of statistics over the pool; the report counts
episodes, frames and successes per source. Every episode's Monte-Carlo return is written beside
the dataset (`returns.parquet`, RLinf's `compute_returns`: -1 per step, the last step 0 for a
success or `recap.failure_reward` for a failure; an `sft` episode counts as a success), in this
stage's own output: the inputs are never changed.

Two passes over each source:

1. metadata and every episode's non-image columns (cheap, column projection): the layout and
   naming are detected, every episode is checked (`validate.check_episode`), the filters
   (`data.success_only`, `data.tasks`) decide what is kept and why the rest is dropped, the
   advantages side file is matched to the frames, and the train/eval split is drawn;
2. the kept episodes' camera frames, on all cores (a thread pool; OpenCV and PyAV release the
   GIL): every frame is decoded (a frame that does not decode, or has the wrong size, is an
   error), resized when `data.image_size` asks for it, and the PNG bytes are passed through
   untouched otherwise; the main thread writes episodes in order and computes statistics.

The output is written into a temporary sibling directory and renamed at the end, so a failure
leaves no output behind.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pisft import layout
from pisft import device
from pisft.config import (CONVERSION, INPUT, DataConfig, DataSource, PisftConfig, data_sources, keys_marked,
                          roles_of)
from pisft.data import images as imgs
from pisft.data import dataset_stats as st
from pisft.data.libero import ACTION_DIM, CAMERAS, OUTPUT_NAMES, STATE_DIM, SUCCESS_COLUMNS
from pisft.data.prompts import CONDITIONING_FILE, PromptConditioning
from pisft.data.recap_reader import EpisodeRef, RecapSource
from pisft.data.source_weights import SourceSampling
from pisft.data.split import stratified_split
from pisft.data.v30_writer import V30Writer, recorder_layout, write_recorder_meta
from pisft.data.validate import check_episode
from pisft.errors import DataError
from pisft.integrity import stage_output
from pisft.io import write_json_atomic
from pisft.layout import RETURNS_FILE, SPLIT_FILE
from pisft.stages import CONVERT_RECAP

STATE_NAMES = ["eef_x", "eef_y", "eef_z", "eef_ax", "eef_ay", "eef_az", "gripper_left", "gripper_right"]
ACTION_NAMES = ["dx", "dy", "dz", "dax", "day", "daz", "gripper"]


# The data.* keys a conversion reads (`Options.data`); its report's "options" records them. Read off
# the keys' marks (pisft.config): the data keys a change of which reruns the conversion, less the
# input it converts (`data.recap_dir`).
CONVERSION_KEYS = tuple(key.removeprefix("data.") for key in keys_marked(CONVERSION)
                        if key.startswith("data.") and INPUT not in roles_of(key))


class Options:
    """How one conversion runs: the data.* settings it reads (`data`, a `DataConfig`, where those
    keys and their defaults are written, once) and its worker threads (`workers`; 0: every core
    this process may use). Keywords set data keys: `Options(image_size=16)` converts as
    `data.image_size: 16` does."""

    def __init__(self, data: DataConfig | None = None, *, workers: int = 0, **keys: Any) -> None:
        unknown = sorted(set(keys) - set(CONVERSION_KEYS))
        if unknown:
            raise TypeError(f"Options: {unknown} not among the data keys a conversion reads: "
                            f"{', '.join(CONVERSION_KEYS)}")
        self.data = dataclasses.replace(data or DataConfig(), **keys)
        self.workers = workers

    @classmethod
    def from_config(cls, cfg: PisftConfig) -> Options:
        d = cfg.data
        return cls(d, tasks=[str(t) for t in d.tasks], columns=dict(d.columns),
                   # at a RECAP iteration the pool's held-out episodes are the value model's only
                   # (recap.holdout_fraction): the policy trains on every episode of the pool
                   eval_fraction=cfg.recap.holdout_fraction if cfg.iteration else d.eval_fraction)

    def recorded(self) -> dict[str, Any]:
        """The settings the conversion ran with, as its report records them."""
        return {key: getattr(self.data, key) for key in CONVERSION_KEYS}

    @property
    def conditioning(self) -> PromptConditioning:
        return PromptConditioning(advantage_tag=self.data.advantage_tag,
                                  positive_only_conditional=self.data.positive_only_conditional,
                                  unconditional_prob=self.data.unconditional_prob)

    def n_workers(self) -> int:
        if self.workers > 0:
            return self.workers
        return device.usable_cores()


@dataclass
class _Kept:
    ref: EpisodeRef
    cols: dict[str, np.ndarray]
    task_index: int
    prompts: list[str]
    src: RecapSource | None = None  # the source it comes from (set by convert_recap)
    source: int = 0  # its position in the pool
    labels: np.ndarray | None = None  # the advantage label per frame (data.advantage_tag), else None


@dataclass(frozen=True)
class Returns:
    """RLinf's return settings (`recap_compute_returns.yaml`: gamma 1, failure reward -300)."""

    gamma: float = 1.0
    failure_reward: float = -300.0


# ------------------------------------------------------------------------- pass 1

def _resolve_tasks(src: RecapSource, wanted: list[str]) -> tuple[set[int] | None, list[str]]:
    """data.tasks entries (task index or instruction text) -> this source's task indices, and
    the entries it does not hold. The filter is the pool's: an entry need only name a task of
    one source (a RECAP iteration's rollouts hold recap.task_ids alone), see `_refuse_unknown_tasks`."""
    if not wanted:
        return None, []
    by_text = {t.strip().lower(): i for i, t in src.tasks.items()}
    chosen: set[int] = set()
    unknown: list[str] = []
    for entry in wanted:
        text = str(entry).strip()
        if text.lstrip("-").isdigit() and int(text) in src.tasks:
            chosen.add(int(text))
        elif text.lower() in by_text:
            chosen.add(by_text[text.lower()])
        else:
            unknown.append(entry)
    return chosen, unknown


def _refuse_unknown_tasks(srcs: list[RecapSource], unknown: list[list[str]], wanted: list[str]) -> None:
    """A data.tasks entry that names a task of no source of the pool is a typo, not a filter."""
    nowhere = [e for e in wanted if all(e in u for u in unknown)]
    if not nowhere:
        return
    def known(src: RecapSource) -> str:
        return "; ".join(f"{i}: {t}" for i, t in sorted(src.tasks.items()))
    if len(srcs) == 1:
        raise DataError(f"data.tasks: '{nowhere[0]}' is neither a task_index nor an instruction in "
                        f"{srcs[0].where(srcs[0].tasks_path)}; known tasks: {known(srcs[0])}")
    per_source = " | ".join(f"{src.where(src.tasks_path)}: {known(src)}" for src in srcs)
    raise DataError(f"data.tasks: '{nowhere[0]}' is neither a task_index nor an instruction in any of the "
                    f"{len(srcs)} sources of the pool; known tasks per source: {per_source}")


def _episode_task(cols: dict[str, np.ndarray]) -> int:
    return int(cols["task_index"][0])


def advantages_path(src: RecapSource, tag: str) -> Path:
    """meta/advantages_<tag>.parquet; `advantages.parquet` names RLinf's untagged file."""
    name = tag if tag.endswith(".parquet") else f"advantages_{tag}.parquet"
    return src.inside(f"meta/{name}", "data.advantage_tag's side file", src.info_path)


def _match_frames(where: str, ep: np.ndarray, fr: np.ndarray, lowdim: dict[int, dict[str, np.ndarray]]
                  ) -> tuple[np.ndarray, dict[int, tuple[int, int]]]:
    """Check that a side file has exactly one row per frame of the dataset; returns the sort
    order of its rows and episode -> (start, end) in that order."""
    order = np.lexsort((fr, ep))
    ep, fr = ep[order], fr[order]
    dup = (np.diff(ep) == 0) & (np.diff(fr) == 0)
    if dup.any():
        i = int(np.flatnonzero(dup)[0])
        raise DataError(f"{where}: episode {ep[i]}, frame_index {fr[i]} appears more than once "
                        "(columns 'episode_index', 'frame_index')")
    unknown = sorted(set(np.unique(ep).tolist()) - set(lowdim))
    if unknown:
        raise DataError(f"{where}: column 'episode_index' has rows for episode(s) {unknown[:10]} that the "
                        "dataset does not have; the side file belongs to another dataset?")
    spans: dict[int, tuple[int, int]] = {}
    starts = np.searchsorted(ep, list(lowdim), side="left")
    ends = np.searchsorted(ep, list(lowdim), side="right")
    for (idx, cols), a, b in zip(lowdim.items(), starts, ends, strict=True):
        n = len(cols["frame_index"])
        frames = fr[a:b]
        if len(frames) != n or not np.array_equal(frames, np.arange(n)):
            missing = sorted(set(range(n)) - set(frames.tolist()))
            extra = sorted(set(frames.tolist()) - set(range(n)))
            raise DataError(f"{where}: episode {idx}, column 'frame_index': {len(frames)} row(s) for {n} frames"
                            + (f"; missing frame_index {missing[:10]}" if missing else "")
                            + (f"; frame_index {extra[:10]} beyond the episode" if extra else "")
                            + "; the side file must have one row per frame")
        spans[idx] = (int(a), int(b))
    return order, spans


def _index_columns(src: RecapSource, path: Path, extra: tuple[str, ...]) -> pa.Table:
    where = src.where(path)
    try:
        names = pq.read_schema(path).names
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{where}: not a readable parquet file ({exc})") from None
    for col in ("episode_index", "frame_index", *extra):
        if col not in names:
            raise DataError(f"{where}: column '{col}' is missing (found {names})")
    table = pq.read_table(path, columns=["episode_index", "frame_index", *extra])
    for col in ("episode_index", "frame_index"):
        if table.column(col).null_count:
            raise DataError(f"{where}: column '{col}' has {table.column(col).null_count} null value(s)")
        _require_integers(where, col, table.column(col))
    return table


def _require_integers(where: str, col: str, column: pa.ChunkedArray) -> None:
    """An index column holds integers: an integer type, or floats that are all whole numbers
    (a cast would silently move a frame 1.5 to frame 1)."""
    typ = column.type
    if pa.types.is_integer(typ):
        return
    if not pa.types.is_floating(typ):
        raise DataError(f"{where}: column '{col}' is {typ}, not integers; episode and frame indices are "
                        "integers (RLinf writes int64)")
    values = column.to_numpy(zero_copy_only=False).astype(np.float64)
    bad = ~np.isfinite(values) | (values != np.round(values))
    if bad.any():
        raise DataError(f"{where}: column '{col}' has {int(bad.sum())} non-integer value(s) of {len(values)} "
                        f"(e.g. {values[bad][0]!r}); episode and frame indices are integers (RLinf writes "
                        "int64): fix the file that wrote it")


def _require_finite(where: str, table: pa.Table, columns: tuple[str, ...]) -> None:
    """Returns and advantages are finite numbers: NaN or inf would label or weight frames at random."""
    for col in columns:
        if col not in table.column_names:
            continue
        column = table.column(col)
        if not (pa.types.is_floating(column.type) or pa.types.is_integer(column.type)):
            continue
        values = column.to_numpy(zero_copy_only=False).astype(np.float64)
        bad = ~np.isfinite(values)
        if bad.any():
            raise DataError(f"{where}: column '{col}' has {int(bad.sum())} non-finite value(s) (NaN or inf) of "
                            f"{len(values)}; the returns/advantages that wrote it diverged: recompute them")


def _check_returns_files(src: RecapSource, lowdim: dict[int, dict[str, np.ndarray]]) -> None:
    """The `meta/returns_<tag>.parquet` files that hold features info.json declares (RLinf's
    compute_returns output) must hold one row per frame of this dataset."""
    for path in sorted(set(src.side_features.values())):
        table = _index_columns(src, path, ())
        numeric = tuple(c for c in ("return", "reward") if c in pq.read_schema(path).names)
        _require_finite(src.where(path), pq.read_table(path, columns=list(numeric)), numeric)
        _match_frames(src.where(path), table.column("episode_index").to_numpy(zero_copy_only=False).astype(np.int64),
                      table.column("frame_index").to_numpy(zero_copy_only=False).astype(np.int64), lowdim)


def _load_advantages(src: RecapSource, tag: str, lowdim: dict[int, dict[str, np.ndarray]]) -> dict[int, np.ndarray]:
    """meta/advantages_<tag>.parquet -> episode -> bool per frame; rows must match the frames."""
    path = advantages_path(src, tag)
    if not path.is_file():
        meta = src.root / "meta"
        found = sorted(p.name[len("advantages_"):-len(".parquet")] for p in meta.glob("advantages_*.parquet"))
        untagged = " and the untagged advantages.parquet (data.advantage_tag: advantages.parquet)" \
            if (meta / "advantages.parquet").is_file() else ""
        raise DataError(f"{src.where(path)}: missing (data.advantage_tag is '{tag}'); tags present: "
                        f"{found or 'none'}{untagged}")
    where = src.where(path)
    table = _index_columns(src, path, ("advantage",))
    ep = table.column("episode_index").to_numpy(zero_copy_only=False).astype(np.int64)
    fr = table.column("frame_index").to_numpy(zero_copy_only=False).astype(np.int64)
    adv_col = table.column("advantage")
    if adv_col.null_count:
        raise DataError(f"{where}: column 'advantage' has {adv_col.null_count} null value(s)")
    if not pa.types.is_boolean(adv_col.type):
        raise DataError(f"{where}: column 'advantage' is {adv_col.type}, expected bool (RLinf's "
                        "compute_advantages writes the label as bool next to 'advantage_continuous')")
    numeric = tuple(c for c in ("advantage_continuous", "return") if c in pq.read_schema(path).names)
    _require_finite(where, pq.read_table(path, columns=list(numeric)), numeric)
    adv = adv_col.to_numpy(zero_copy_only=False).astype(bool)
    order, spans = _match_frames(where, ep, fr, lowdim)
    adv = adv[order]
    return {idx: adv[a:b] for idx, (a, b) in spans.items()}


def _select(src: RecapSource, lowdim: dict[int, dict[str, np.ndarray]], opts: Options
            ) -> tuple[list[_Kept], list[dict]]:
    wanted_tasks, unknown = _resolve_tasks(src, opts.data.tasks)
    if opts.data.success_only and "is_success" not in src.names:
        names = " nor ".join(f"'{c}'" for c in SUCCESS_COLUMNS)
        raise DataError(f"{src.where(src.info_path)}: data.success_only is set but the dataset records no "
                        f"per-frame success: neither {names} is among its features "
                        f"(RECAP/RLinf write 'is_success', LeRobot's lerobot-eval 'next.success'). Unset "
                        "data.success_only to keep every episode, or add a success column to the dataset")
    advantages = _load_advantages(src, opts.data.advantage_tag, lowdim) if opts.data.advantage_tag else None
    kept: list[_Kept] = []
    dropped: list[dict] = []
    for ref in src.episodes:
        cols = lowdim[ref.episode_index]
        task = _episode_task(cols)
        reason = None
        if wanted_tasks is not None and task not in wanted_tasks:
            reason = "task_not_selected"
        elif opts.data.success_only and not bool(cols["is_success"].any()):
            reason = "not_successful"
        if reason:
            dropped.append({"source_episode_index": ref.episode_index, "task_index": task,
                            "task": src.tasks[task], "frames": len(cols["frame_index"]), "reason": reason,
                            "detail": _reason_text(src, reason)})
            continue
        frame_tasks = [src.tasks[int(t)] for t in cols["task_index"]]
        if advantages is not None:
            cond = opts.conditioning
            prompts = [cond.frame_prompt(t, a) for t, a in zip(frame_tasks, advantages[ref.episode_index],
                                                                  strict=True)]
        else:
            prompts = frame_tasks
        kept.append(_Kept(ref, cols, task, prompts,
                          labels=None if advantages is None else advantages[ref.episode_index]))
    return kept, dropped, unknown


_REASONS = {
    "task_not_selected": "the task (column 'task_index') is not in data.tasks",
    "not_successful": "data.success_only is set and column '{success}' is never true",
}


def _reason_text(src: RecapSource, reason: str) -> str:
    return _REASONS[reason].format(success=src.names.get("is_success", "is_success"))


def _short(items: list[int], limit: int = 12) -> str:
    if len(items) <= limit:
        return str(items)
    return str(items[:limit])[:-1] + f", ...] ({len(items)} episodes)"


# ------------------------------------------------------------------------- pass 2

@dataclass
class _Frames:
    png: dict[str, list[bytes]]
    image_stats: dict[str, dict]  # output camera key -> LeRobot per-episode stats
    shape: tuple[int, int, int]


def _episode_frames(src: RecapSource, ref: EpisodeRef, n: int, image_size: int) -> _Frames:
    """Decode, check (and resize) every camera frame of one episode; runs in a worker thread."""
    sample = set(st.image_sample_indices(n))
    png: dict[str, list[bytes]] = {}
    cam_stats: dict[str, dict] = {}
    out_shape = None
    for cam in CAMERAS:
        col = src.names[cam]
        declared = src.image_shape(cam)
        where = f"{src.where(ref.data_file)}: episode {ref.episode_index}, column '{col}'"
        frames_png: list[bytes] = []
        hist = None
        if src.video[cam]:
            decoded = src.read_video_frames(ref, cam, n)
            where = f"{src.where(ref.videos[cam][0])}: episode {ref.episode_index}, column '{col}'"
            raw = None
        else:
            raw = src.read_png_bytes(ref, cam)
            if len(raw) != n:  # pragma: no cover - same file as the low-dim columns
                raise DataError(f"{where}: {len(raw)} images for {n} frames")
            decoded = None
        for i in range(n):
            if raw is not None:
                data = raw[i]
                if not data:
                    raise DataError(f"{where}, frame {i}: no image bytes; restore the frame")
                try:
                    img = imgs.decode_png(data)
                except imgs.ImageDecodeError as exc:
                    raise DataError(f"{where}, frame {i}: image does not decode ({exc}); restore the frame "
                                    "or remove the episode") from None
            else:
                img = decoded[i]  # type: ignore[index]
            if img.shape != declared:
                raise DataError(f"{where}, frame {i}: image is {'x'.join(map(str, img.shape))}, but "
                                f"meta/info.json declares {'x'.join(map(str, declared))}; re-export the frame at the "
                                "declared size or fix the feature shape in meta/info.json")
            if image_size and (img.shape[0] != image_size or img.shape[1] != image_size):
                img = imgs.resize(img, image_size)
                frames_png.append(imgs.encode_png(img))
            elif raw is not None:
                frames_png.append(raw[i])  # type: ignore[arg-type]
            else:
                frames_png.append(imgs.encode_png(img))
            if i in sample:
                h = st.image_histogram(img)
                hist = h if hist is None else hist + h
            out_shape = img.shape
        png[OUTPUT_NAMES[cam]] = frames_png
        cam_stats[OUTPUT_NAMES[cam]] = st.stats_from_histograms(hist, len(sample))
    return _Frames(png, cam_stats, out_shape)  # type: ignore[arg-type]


def _ordered_results(pool: ThreadPoolExecutor, jobs: list[Callable[[], _Frames]], window: int) -> Iterator[_Frames]:
    """Run jobs on the pool with at most `window` in flight; yield results in submission order."""
    pending: list[Future] = []
    it = iter(jobs)
    for job in it:
        pending.append(pool.submit(job))
        if len(pending) >= window:
            break
    while pending:
        fut = pending.pop(0)
        try:
            result = fut.result()
        except BaseException:
            for other in pending:
                other.cancel()
            raise
        nxt = next(it, None)
        if nxt is not None:
            pending.append(pool.submit(nxt))
        yield result


def _write_episodes(writer: V30Writer, fps: int, kept: list[_Kept], opts: Options,
                    prompt_index: dict[str, int], workers: int, train: set[int]
                    ) -> tuple[list[dict], dict[str, list[np.ndarray]]]:
    """Pass 2: frames decoded/checked on the pool, episodes written in order by this thread.
    Returns the per-episode stats and numeric columns of the `train` episodes (output indices),
    from which the dataset statistics are computed."""
    per_episode_stats: list[dict] = []
    numeric_all: dict[str, list[np.ndarray]] = {}
    jobs = [lambda k=k: _episode_frames(k.src, k.ref, len(k.cols["frame_index"]), opts.data.image_size) for k in kept]
    cv_threads = cv2.getNumThreads()
    # our pool is the parallelism: OpenCV's own per-call thread pool on top of it only
    # oversubscribes the cores (2 workers ran slower than 1 without this)
    cv2.setNumThreads(1 if workers > 1 else cv_threads)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="convert") as pool:
            for out_idx, (k, frames) in enumerate(zip(kept, _ordered_results(pool, jobs, 2 * workers), strict=True)):
                n = len(k.cols["frame_index"])
                start = writer.total_frames
                numeric = {
                    OUTPUT_NAMES["state"]: k.cols["state"].astype(np.float32),
                    OUTPUT_NAMES["actions"]: k.cols["actions"].astype(np.float32),
                    "timestamp": (np.arange(n) / fps).astype(np.float32),
                    "frame_index": np.arange(n, dtype=np.int64),
                    "episode_index": np.full(n, out_idx, dtype=np.int64),
                    "index": np.arange(start, start + n, dtype=np.int64),
                    "task_index": np.array([prompt_index[p] for p in k.prompts], dtype=np.int64),
                }
                ep_stats = {**st.episode_stats(numeric, {}), **frames.image_stats}
                writer.add_episode({**numeric, **frames.png}, sorted(set(k.prompts), key=prompt_index.get), ep_stats)
                if out_idx in train:  # normalisation statistics: training episodes only
                    per_episode_stats.append(ep_stats)
                    for key, v in numeric.items():
                        numeric_all.setdefault(key, []).append(v)
    finally:
        cv2.setNumThreads(cv_threads)
    return per_episode_stats, numeric_all


def _output_features(shape: tuple[int, int, int]) -> dict:
    img = {"dtype": "image", "shape": list(shape), "names": ["height", "width", "channel"]}
    return {
        OUTPUT_NAMES["image"]: dict(img),
        OUTPUT_NAMES["wrist_image"]: dict(img),
        OUTPUT_NAMES["state"]: {"dtype": "float32", "shape": [STATE_DIM], "names": STATE_NAMES},
        OUTPUT_NAMES["actions"]: {"dtype": "float32", "shape": [ACTION_DIM], "names": ACTION_NAMES},
    }


def _check_output_shape(src: RecapSource, opts: Options) -> tuple[int, int, int]:
    shapes = {cam: src.image_shape(cam) for cam in CAMERAS}
    if opts.data.image_size:
        return (opts.data.image_size, opts.data.image_size, 3)
    if shapes["image"] != shapes["wrist_image"]:
        raise DataError(f"{src.where(src.info_path)}: the cameras differ in size ({shapes['image']} vs "
                        f"{shapes['wrist_image']}); set data.image_size to convert both to one size")
    return shapes["image"]


# ------------------------------------------------------------------------- entry points

def _open_source(source: DataSource, opts: Options
                 ) -> tuple[RecapSource, dict[int, dict[str, np.ndarray]], list[_Kept], list[dict]]:
    """Pass 1 over one source: layout, every episode checked, the filters applied."""
    from pisft.integrity import verify_read

    # A source pisft wrote (demo_recap, collect_rollouts) is checked against its MANIFEST.json;
    # the user's own data (no pisft_config.json) as it is.
    verify_read(source.path, what=f"{CONVERT_RECAP.name}'s source {source.path}")
    src = RecapSource.open(source.path, opts.data.columns)
    lowdim: dict[int, dict[str, np.ndarray]] = {}
    for ref in src.episodes:
        cols = src.read_lowdim(ref)
        check_episode(src, ref, cols)
        lowdim[ref.episode_index] = cols
    if not src.episodes:
        raise DataError(f"{src.where(src.episodes_path)}: lists no episodes; nothing to convert")
    if source.type == "rollout" and "is_success" not in src.names:
        names = " nor ".join(f"'{c}'" for c in SUCCESS_COLUMNS)
        raise DataError(f"{src.where(src.info_path)}: a source of type rollout needs each episode's outcome, but "
                        f"neither {names} is among its features; give it type sft if it holds demonstrations")
    _check_returns_files(src, lowdim)
    kept, dropped, unknown = _select(src, lowdim, opts)
    for k in kept:
        k.src = src
    failed = [k.ref.episode_index for k in kept if "is_success" in src.names and not k.cols["is_success"].any()]
    if source.type == "sft" and failed:
        print(f"convert_recap: note: {src.root} is a source of type sft (demonstrations): its {len(failed)} "
              f"episode(s) whose '{src.names['is_success']}' is never true ({_short(failed)})\n"
              "convert_recap: note: they count as successes for their returns and are positive frames, as "
              "RLinf's type sft; give the source type rollout to use their outcome", flush=True)
    return src, lowdim, kept, dropped, unknown


def label_counts(kept: list[_Kept]) -> dict:
    """Positive and negative frames of the converted episodes, overall and per task."""
    per_task: dict[str, dict[str, int]] = {}
    for k in kept:
        if k.labels is None:
            continue
        entry = per_task.setdefault(k.src.tasks[k.task_index], {"positive": 0, "negative": 0})  # type: ignore[union-attr]
        p = int(np.sum(k.labels))
        entry["positive"] += p
        entry["negative"] += len(k.labels) - p
    return {"positive": sum(e["positive"] for e in per_task.values()),
            "negative": sum(e["negative"] for e in per_task.values()),
            "per_task": dict(sorted(per_task.items()))}


def _refuse_untrainable_labels(opened, kept: list[_Kept], opts: Options) -> None:
    """An advantage-conditioned policy learns from positive frames (and, when every frame
    carries its label, `data.positive_only_conditional: false`, from negative ones too)."""
    counts = label_counts(kept)
    files = ", ".join(str(advantages_path(src, opts.data.advantage_tag)) for _, src, *_ in opened)
    frames = counts["positive"] + counts["negative"]
    need_negative = not opts.data.positive_only_conditional
    if counts["positive"] == 0 or (need_negative and counts["negative"] == 0):
        missing = "positive" if counts["positive"] == 0 else "negative"
        raise DataError(
            f"{files}: the {frames} converted frames have {counts['positive']} positive and {counts['negative']} "
            f"negative advantage labels: no {missing} frame, so the advantage-conditioned prompt "
            + ("(positive_only_conditional: false labels every frame) " if need_negative else "")
            + "cannot be learned. Relabel (recap.positive_quantile, the advantages stage), check "
              "data.advantage_tag and the data.tasks / data.success_only filters, or unset data.advantage_tag")


def _as_sources(sources: str | Path | DataSource | list) -> list[DataSource]:
    items = sources if isinstance(sources, list | tuple) else [sources]
    return [s if isinstance(s, DataSource) else DataSource(str(s)) for s in items]


def convert_recap(sources: str | Path | DataSource | list, out_dir: Path, opts: Options,
                  cfg: PisftConfig | None = None, returns: Returns | None = None) -> dict:
    """Convert the pool `sources` (a directory, or typed sources) into `out_dir` (written
    atomically). Returns the conversion report."""
    t0 = time.perf_counter()
    pool = _as_sources(sources)
    opened = []
    unknown: list[list[str]] = []  # per source: the data.tasks entries it does not hold
    kept: list[_Kept] = []
    for i, source in enumerate(pool):
        src, lowdim, kept_i, dropped_i, unknown_i = _open_source(source, opts)
        for k in kept_i:
            k.source = i
        for d in dropped_i:
            d["source"] = i
        opened.append((source, src, lowdim, kept_i, dropped_i))
        unknown.append(unknown_i)
        kept += kept_i
    _refuse_unknown_tasks([src for _, src, *_ in opened], unknown, opts.data.tasks)
    dropped = [d for *_, ds in opened for d in ds]
    frames_in = sum(len(c["frame_index"]) for _, _, lowdim, _, _ in opened for c in lowdim.values())
    if not kept:
        by_reason: dict[str, list[int]] = {}
        for d in dropped:
            by_reason.setdefault(d["reason"], []).append(d["source_episode_index"])
        first = opened[0][1]
        parts = [f"episode(s) {_short(eps)}: {_reason_text(first, r)}" for r, eps in sorted(by_reason.items())]
        where = first.root if len(opened) == 1 else f"the {len(opened)} sources of data.recap_dir"
        raise DataError(f"{where}: nothing left to convert after filtering; all {len(dropped)} episodes "
                        f"were dropped: {'; '.join(parts)}. Relax data.success_only / data.tasks")
    if opts.data.advantage_tag:
        _refuse_untrainable_labels(opened, kept, opts)
    out_shape, fps = _pool_shape_and_fps(opened, opts)
    split = stratified_split({i: k.src.tasks[k.task_index] for i, k in enumerate(kept)},  # type: ignore[union-attr]
                             opts.data.eval_fraction, opts.data.split_seed)
    t_meta = time.perf_counter()

    prompt_index: dict[str, int] = {}
    for k in kept:
        for p in k.prompts:
            prompt_index.setdefault(p, len(prompt_index))
    out = Path(out_dir)
    first_src = opened[0][1]
    with stage_output(out, cfg) as tmp:  # every reader checks the dataset against its manifest
        features, info, schema = recorder_layout(_output_features(out_shape), fps,
                                                 robot_type=first_src.info.get("robot_type"))
        writer = V30Writer(tmp, schema, features)
        workers = opts.n_workers()
        per_episode_stats, numeric_all = _write_episodes(writer, fps, kept, opts, prompt_index, workers,
                                                         set(split["train"]))
        tasks_out = sorted(prompt_index, key=prompt_index.get)
        stats = st.dataset_stats({k: np.concatenate(v) for k, v in numeric_all.items()}, per_episode_stats)
        write_recorder_meta(writer, info, tasks_out, stats)
        t_write = time.perf_counter()
        sampling = SourceSampling(opts.data.balance_source_weights, tuple(s.weight for s in pool),
                                  tuple(k.source for k in kept))
        sampling.write(tmp)  # each episode's source and each source's weight: the training stages' draw
        report = _report(opened, opts, kept, dropped, split, frames_in, tasks_out, out_shape, sampling)
        write_json_atomic(tmp / SPLIT_FILE, split)
        write_json_atomic(tmp / "conversion_report.json", report)
        _write_returns(tmp / RETURNS_FILE, kept, [s.type for s in pool], returns or Returns())
        # how the prompts were conditioned; the export copies it next to the trained model
        (opts.conditioning if opts.data.advantage_tag else PromptConditioning()).write(tmp / "meta" / CONDITIONING_FILE)
    frames_out = report["out"]["frames"]
    total = time.perf_counter() - t0
    report["_timing"] = {"total_s": total, "metadata_s": t_meta - t0, "frames_s": t_write - t_meta,
                         "frames_per_s": frames_out / total if total > 0 else 0.0, "workers": workers}
    return report


def _pool_shape_and_fps(opened: list, opts: Options) -> tuple[tuple[int, int, int], int]:
    """One image shape and one frame rate for the whole pool, or a DataError naming the sources."""
    shapes = [(src, _check_output_shape(src, opts)) for _, src, _, kept, _ in opened if kept]
    if len({shape for _, shape in shapes}) > 1:
        listed = "; ".join(f"{src.root}: {'x'.join(map(str, shape))}" for src, shape in shapes)
        raise DataError(f"data.recap_dir: the sources' images differ in size ({listed}); set data.image_size "
                        "to convert all of them to one size")
    rates = {src.root: src.fps for _, src, _, kept, _ in opened if kept}
    if len(set(rates.values())) > 1:
        listed = "; ".join(f"{root}: {fps} fps" for root, fps in rates.items())
        raise DataError(f"data.recap_dir: the sources were recorded at different frame rates ({listed}); "
                        "one dataset needs one fps: resample the odd one out or leave it out")
    return shapes[0][1], next(iter(rates.values()))


def episode_outcome(k: _Kept, source_type: str) -> bool:
    """An episode's success for its return: an sft episode always; a rollout by the success
    column of its last frame (RLinf's compute_returns)."""
    if source_type == "sft":
        return True
    return bool(k.cols["is_success"][-1])


def _write_returns(path: Path, kept: list[_Kept], types: list[str], settings: Returns) -> None:
    """Every frame's Monte-Carlo return and reward, by output episode and frame index."""
    from pisft.data.rlinf_recap import episode_returns

    eps, frs, rets, rews = [], [], [], []
    for i, k in enumerate(kept):
        n = len(k.cols["frame_index"])
        ret, rew = episode_returns(n, episode_outcome(k, types[k.source]), settings.gamma, settings.failure_reward)
        eps.append(np.full(n, i, dtype=np.int64))
        frs.append(np.arange(n, dtype=np.int64))
        rets.append(ret)
        rews.append(rew)
    table = pa.table({"episode_index": np.concatenate(eps), "frame_index": np.concatenate(frs),
                      "return": np.concatenate(rets).astype(np.float32),
                      "reward": np.concatenate(rews).astype(np.float32)})
    meta = {b"pisft": json.dumps({"gamma": settings.gamma, "failure_reward": settings.failure_reward,
                                  "source": "RLinf compute_returns: -1 per step; last step 0 (success) "
                                            "or failure_reward; G_t = r_t + gamma G_{t+1}"}, sort_keys=True).encode()}
    pq.write_table(table.replace_schema_metadata(meta), path)


def _source_info(src: RecapSource) -> dict:
    return {"path": str(src.root), "codebase_version": src.version, "naming": src.naming,
            "columns": {k: src.names[k] for k in ("image", "wrist_image", "state", "actions")},
            "success_column": src.names.get("is_success"),
            "side_features": {k: p.name for k, p in sorted(src.side_features.items())},
            "image_storage": "video" if src.has_video else "png_in_parquet", "fps": src.fps,
            "image_shape": list(src.image_shape("image"))}


def _sampling_report(opened, kept: list[_Kept], split: dict, sampling: SourceSampling) -> dict:
    """Each source's frames and expected share of the samples, in the train split (the SFT run,
    the value model) and in every episode (the policy at a RECAP iteration)."""
    from pisft.data import source_weights

    n = len(opened)
    frames = {name: [0] * n for name in ("train", "all")}
    train = set(split["train"])
    for i, k in enumerate(kept):
        frames["all"][k.source] += len(k.cols["frame_index"])
        if i in train:
            frames["train"][k.source] += len(k.cols["frame_index"])
    return source_weights.report(sampling, frames)


def _report(opened, opts, kept, dropped, split, frames_in, tasks_out, out_shape, sampling) -> dict:
    in_split = {i: name for name, ids in split.items() for i in ids}
    types = [source.type for source, *_ in opened]
    episodes = []
    for i, k in enumerate(kept):
        src = k.src
        success = "is_success" in src.names
        episodes.append({
            "episode_index": i, "source_episode_index": k.ref.episode_index, "task_index": k.task_index,
            "task": src.tasks[k.task_index], "frames": len(k.cols["frame_index"]),
            "success": bool(k.cols["is_success"].any()) if success else None, "split": in_split[i],
            "source": k.source, "source_type": types[k.source],
        })
    source_tasks = sorted({(n, _episode_task(c)) for n, (_, _, lowdim, _, _) in enumerate(opened)
                           for c in lowdim.values()})

    def outcomes(eps: list[dict]) -> dict:
        return {"episodes": len(eps), "successes": sum(e["success"] is True for e in eps),
                "failures": sum(e["success"] is False for e in eps),
                "unknown": sum(e["success"] is None for e in eps)}

    sampled = _sampling_report(opened, kept, split, sampling)
    sources = []
    for n, (source, src, lowdim, _, _) in enumerate(opened):
        mine = [e for e in episodes if e["source"] == n]
        sources.append({**_source_info(src), "type": source.type, "episodes_in": len(lowdim),
                        "frames_in": int(sum(len(c["frame_index"]) for c in lowdim.values())),
                        "frames": int(sum(e["frames"] for e in mine)), **outcomes(mine),
                        "dropped": sum(d["source"] == n for d in dropped),
                        # its weight, training frames and expected share of the samples (`sampling`)
                        "weight": source.weight, "frames_train": sampled["frames"]["train"][n],
                        "share_train": _share(sampled, "train", n), "share_all": _share(sampled, "all", n)})
    cond = opts.conditioning if opts.data.advantage_tag else PromptConditioning()
    return {
        "source": _source_info(opened[0][1]),  # the first source (the only one unless a pool)
        "sources": sources,
        "sampling": sampled,
        "options": opts.recorded(),
        "prompts": cond.to_dict(),
        "stats_from": "train",
        # held-out successes and failures: with data.success_only false, failed rollouts are held
        # out too and evaluated like demonstrations
        "outcomes": {name: outcomes([e for e in episodes if e["split"] == name]) for name in ("train", "eval")},
        "in": {"episodes": sum(len(lowdim) for _, _, lowdim, _, _ in opened), "frames": int(frames_in),
               "tasks": len(source_tasks)},
        "out": {"episodes": len(kept), "frames": int(sum(e["frames"] for e in episodes)),
                "tasks": len({e["task"] for e in episodes}), "prompts": len(tasks_out),
                "image_shape": list(out_shape), "train_episodes": len(split["train"]),
                "eval_episodes": len(split["eval"])},
        "dropped": dropped,
        "dropped_by_reason": dict(sorted(Counter(d["reason"] for d in dropped).items())),
        # positive and negative frames, overall and per task (data.advantage_tag; None without labels)
        "advantage_labels": label_counts(kept) if opts.data.advantage_tag else None,
        "episodes": episodes,
    }


def _share(sampled: dict, split: str, n: int) -> float | None:
    share = sampled["share"][split]
    return None if share is None else share[n]


def output_dir(cfg: PisftConfig) -> Path:
    return layout.iteration(cfg).dataset


def pool(cfg: PisftConfig) -> list[DataSource]:
    """The sources converted at cfg's iteration: `data.recap_dir`, then the rollouts of
    iterations 1..k (RECAP's pool grows by one collection per iteration)."""
    rollouts = [DataSource(str(layout.iteration(cfg, j).rollouts), "rollout")
                for j in range(1, cfg.iteration + 1)]
    return data_sources(cfg) + rollouts


def _require_rollouts(cfg: PisftConfig) -> None:
    """The rollouts of iterations 1..k are all there (one deleted between iterations: named)."""
    for j in range(1, cfg.iteration + 1):
        path = layout.iteration(cfg, j).rollouts
        if not path.is_dir():
            raise DataError(f"convert_recap --iteration {cfg.iteration}: {path} (iteration {j}'s collected rollouts, "
                            f"part of the pool) is missing; collect them again: snakemake --cores all "
                            f"collect_rollouts_{j} (or python -m pisft collect_rollouts --iteration {j} "
                            "--config FILE), then rerun")


def run(cfg: PisftConfig) -> Path:
    out = output_dir(cfg)
    _require_rollouts(cfg)
    report = convert_recap(pool(cfg), out, Options.from_config(cfg), cfg,
                           Returns(cfg.recap.gamma, cfg.recap.failure_reward))
    t = report["_timing"]
    held = report["outcomes"]["eval"]
    print(f"convert_recap: {report['out']['episodes']}/{report['in']['episodes']} episodes, "
          f"{report['out']['frames']} frames, {report['out']['tasks']} tasks "
          f"({len(report['dropped'])} dropped; held out {held['episodes']}: {held['successes']} successes, "
          f"{held['failures']} failures) from {len(report['sources'])} source(s) in {t['total_s']:.1f} s "
          f"({t['frames_per_s']:.0f} frames/s, {t['workers']} workers) -> {out}")
    if len(report["sources"]) > 1:  # the policy trains on every episode at a RECAP iteration
        split = "all" if cfg.iteration else "train"
        for n, s in enumerate(report["sources"]):
            share = s[f"share_{split}"]
            print(f"convert_recap: source {n} ({Path(s['path']).name}, {s['type']}, weight {s['weight']:g}): "
                  f"{report['sampling']['frames'][split][n]} frames, "
                  f"{'-' if share is None else f'{100 * share:.1f}%'} of the policy's samples "
                  f"(data.balance_source_weights {str(report['sampling']['balance_source_weights']).lower()})")
    return out
