"""Normalisation statistics in LeRobot's format, computed with LeRobot's own functions.

Per episode: exactly what LeRobot's recorder stores (`compute_episode_stats`): min, max, mean,
std, count and the quantiles q01/q10/q50/q90/q99 of every numeric feature over all frames, and
of every camera per channel over LeRobot's frame sample (`sample_indices`), scaled to [0, 1].

Dataset level (`meta/stats.json`, what pi0.5's quantile normalisation reads): LeRobot's
`aggregate_stats` averages per-episode quantiles, which is not the dataset's quantile when
episodes differ (e.g. one task's state range never overlaps another's, so the averaged q01 sits
far inside the real 1% tail). For numeric features we therefore compute the quantiles over all
frames at once with LeRobot's `get_feature_stats` (its RunningQuantileStats histogram); camera
statistics are aggregated from the per-episode ones as LeRobot does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from lerobot.datasets.compute_stats import (
    DEFAULT_QUANTILES,
    aggregate_stats,
    get_feature_stats,
    sample_indices,
)


QUANTILE_KEYS = [f"q{int(q * 100):02d}" for q in DEFAULT_QUANTILES]


def image_sample_indices(num_frames: int) -> list[int]:
    """The frames LeRobot samples from an episode for camera statistics."""
    return sample_indices(num_frames)


def image_histogram(img: np.ndarray) -> np.ndarray:
    """(channels, 256) pixel-value counts of one HWC uint8 frame, downsampled as LeRobot's
    `auto_downsample_height_width` does (frames of 300 px and more). OpenCV's `calcHist` releases
    the GIL, so worker threads compute these in parallel."""
    import cv2

    h, w = img.shape[:2]
    if max(h, w) >= 300:
        step = int(w / 150) if w > h else int(h / 150)
        img = np.ascontiguousarray(img[::step, ::step])
    return np.stack([cv2.calcHist([img], [c], None, [256], [0, 256])[:, 0] for c in range(img.shape[2])])


def stats_from_histograms(hist: np.ndarray, frames: int) -> dict[str, np.ndarray]:
    """LeRobot-layout camera stats ((C, 1, 1) in [0, 1]; count = frames) from summed histograms."""
    hist = np.asarray(hist, dtype=np.float64)
    values = np.arange(256, dtype=np.float64)
    out: dict[str, list] = {k: [] for k in ("min", "max", "mean", "std", *QUANTILE_KEYS)}
    for h in hist:
        n = h.sum()
        nz = np.flatnonzero(h)
        mean = float((h * values).sum() / n)
        out["min"].append(float(nz[0]))
        out["max"].append(float(nz[-1]))
        out["mean"].append(mean)
        out["std"].append(float(np.sqrt(max(0.0, (h * (values - mean) ** 2).sum() / n))))
        cum = np.cumsum(h)
        for key, q in zip(QUANTILE_KEYS, DEFAULT_QUANTILES, strict=True):
            out[key].append(float(np.searchsorted(cum, q * n, side="left")))
    stats = {k: (np.asarray(v, dtype=np.float64) / 255.0).reshape(len(hist), 1, 1) for k, v in out.items()}
    stats["count"] = np.array([frames])
    return stats


def image_stats(frames: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """Per-channel stats of already-sampled HWC uint8 frames, LeRobot layout (3, 1, 1) in [0, 1].

    Same frames (LeRobot's sample, downsampled as LeRobot does above 300 px) and same keys as
    LeRobot's `compute_episode_stats`, but computed from an exact 256-bin histogram per channel
    instead of LeRobot's 5000-bin `np.histogram`, which costs ~1 s per camera per 100-frame
    256 px episode and dominated the conversion (`make bench` times it). Quantiles are the exact
    lower quantiles of the pixel values (LeRobot interpolates within its bins).
    """
    return stats_from_histograms(sum(image_histogram(f) for f in frames), len(frames))


def numeric_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """Stats of a (frames,) or (frames, dim) array, LeRobot layout ((1,) or (dim,))."""
    values = np.asarray(values)
    if values.dtype == np.bool_:
        values = values.astype(np.float32)
    return get_feature_stats(values, axis=0, keepdims=values.ndim == 1)


def episode_stats(numeric: dict[str, np.ndarray], sampled_images: dict[str, Sequence[np.ndarray]]) -> dict:
    """All features of one episode."""
    out = {key: numeric_stats(v) for key, v in numeric.items()}
    out.update({key: image_stats(frames) for key, frames in sampled_images.items()})
    return out


def dataset_stats(all_numeric: dict[str, np.ndarray], per_episode: list[dict]) -> dict:
    """Dataset stats: exact-over-all-frames for numeric features, aggregated for cameras."""
    image_keys = sorted({k for ep in per_episode for k in ep if k not in all_numeric})
    out: dict = {}
    if image_keys:
        # LeRobot's aggregate_stats gathers the keys in a set: its order changes with the string hash
        # seed of each process, and stats.json (a DVC-hashed output) would change with it
        merged = aggregate_stats([{k: ep[k] for k in image_keys if k in ep} for ep in per_episode])
        out.update({k: merged[k] for k in image_keys})
    for key, values in all_numeric.items():
        out[key] = numeric_stats(values)
    return out


def to_jsonable(stats: dict) -> dict:
    """np arrays -> nested lists (the layout of LeRobot's stats.json / episodes_stats.jsonl)."""
    return {k: to_jsonable(v) if isinstance(v, dict) else np.asarray(v).tolist() for k, v in stats.items()}
