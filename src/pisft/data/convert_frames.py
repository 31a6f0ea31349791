"""Pass 2 of a conversion: the kept episodes' camera frames decoded, checked (and resized) on a
thread pool, and the episodes written in order with their statistics; the output's features."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import cv2
import numpy as np

from pisft.data import dataset_stats as st
from pisft.data import images as imgs
from pisft.data.convert_options import Options
from pisft.data.convert_select import Kept
from pisft.data.libero import ACTION_DIM, CAMERAS, OUTPUT_NAMES, STATE_DIM
from pisft.data.recap_reader import EpisodeRef, RecapSource
from pisft.data.v30_writer import V30Writer
from pisft.errors import DataError

STATE_NAMES = ["eef_x", "eef_y", "eef_z", "eef_ax", "eef_ay", "eef_az", "gripper_left", "gripper_right"]
ACTION_NAMES = ["dx", "dy", "dz", "dax", "day", "daz", "gripper"]


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


def write_episodes(writer: V30Writer, fps: int, kept: list[Kept], opts: Options,
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


def output_features(shape: tuple[int, int, int]) -> dict:
    img = {"dtype": "image", "shape": list(shape), "names": ["height", "width", "channel"]}
    return {
        OUTPUT_NAMES["image"]: dict(img),
        OUTPUT_NAMES["wrist_image"]: dict(img),
        OUTPUT_NAMES["state"]: {"dtype": "float32", "shape": [STATE_DIM], "names": STATE_NAMES},
        OUTPUT_NAMES["actions"]: {"dtype": "float32", "shape": [ACTION_DIM], "names": ACTION_NAMES},
    }


def check_output_shape(src: RecapSource, opts: Options) -> tuple[int, int, int]:
    shapes = {cam: src.image_shape(cam) for cam in CAMERAS}
    if opts.data.image_size:
        return (opts.data.image_size, opts.data.image_size, 3)
    if shapes["image"] != shapes["wrist_image"]:
        raise DataError(f"{src.where(src.info_path)}: the cameras differ in size ({shapes['image']} vs "
                        f"{shapes['wrist_image']}); set data.image_size to convert both to one size")
    return shapes["image"]
