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

The RECAP inputs pisft writes (`recap_layout`: the demo generator, the rollout collection) carry
the statistics of a LeRobot v2.1 `episodes_stats.jsonl` instead, `simple_stats` per episode (min,
max, mean, std, count; cameras over every frame) and `aggregate_simple` for a dataset's
`stats.json`: the numbers those layouts have always held, computed with numpy only. LeRobot is
imported by the functions that use it, not by this module, so the demo stage does not pay the
import of LeRobot/torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def quantiles() -> dict[str, float]:
    """LeRobot's quantiles by their stats key (q01, q10, q50, q90, q99)."""
    from lerobot.datasets.compute_stats import DEFAULT_QUANTILES

    return {f"q{int(q * 100):02d}": q for q in DEFAULT_QUANTILES}


def image_sample_indices(num_frames: int) -> list[int]:
    """The frames LeRobot samples from an episode for camera statistics."""
    from lerobot.datasets.compute_stats import sample_indices

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
    qs = quantiles()
    out: dict[str, list] = {k: [] for k in ("min", "max", "mean", "std", *qs)}
    for h in hist:
        n = h.sum()
        nz = np.flatnonzero(h)
        mean = float((h * values).sum() / n)
        out["min"].append(float(nz[0]))
        out["max"].append(float(nz[-1]))
        out["mean"].append(mean)
        out["std"].append(float(np.sqrt(max(0.0, (h * (values - mean) ** 2).sum() / n))))
        cum = np.cumsum(h)
        for key, q in qs.items():
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
    from lerobot.datasets.compute_stats import get_feature_stats

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
    from lerobot.datasets.compute_stats import aggregate_stats

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


def simple_stats(values: np.ndarray, image: bool = False) -> dict[str, list]:
    """min/max/mean/std/count as in a LeRobot v2.1 `episodes_stats.jsonl` (images: per channel,
    (3, 1, 1), scaled to [0, 1])."""
    if image:  # (T, H, W, 3) uint8 -> channel rows, reduced along contiguous memory
        ch = np.ascontiguousarray(np.asarray(values).reshape(-1, 3).T)
        x = ch.astype(np.float32)
        mean = x.mean(1, dtype=np.float64)
        std = np.sqrt(((x - mean[:, None].astype(np.float32)) ** 2).mean(1, dtype=np.float64))
        out = {"min": ch.min(1) / 255.0, "max": ch.max(1) / 255.0, "mean": mean / 255.0, "std": std / 255.0}
        out = {k: np.asarray(x, dtype=np.float64).reshape(3, 1, 1).tolist() for k, x in out.items()}
    else:
        v = np.asarray(values, dtype=np.float64)
        if v.ndim == 1:
            v = v[:, None]
        out = {"min": v.min(0).tolist(), "max": v.max(0).tolist(), "mean": v.mean(0).tolist(),
               "std": v.std(0).tolist()}
    out["count"] = [int(np.asarray(values).shape[0])]
    return out


def aggregate_simple(per_episode: list[dict]) -> dict:
    """Dataset stats (v2.0 `stats.json`) from per-episode simple stats."""
    out = {}
    for key in per_episode[0]:
        counts = np.array([ep[key]["count"][0] for ep in per_episode], dtype=np.float64)
        means = np.array([ep[key]["mean"] for ep in per_episode])
        stds = np.array([ep[key]["std"] for ep in per_episode])
        w = counts.reshape((-1,) + (1,) * (means.ndim - 1))
        mean = (means * w).sum(0) / counts.sum()
        var = ((stds**2 + (means - mean) ** 2) * w).sum(0) / counts.sum()
        out[key] = {"min": np.min([ep[key]["min"] for ep in per_episode], 0).tolist(),
                    "max": np.max([ep[key]["max"] for ep in per_episode], 0).tolist(),
                    "mean": mean.tolist(), "std": np.sqrt(var).tolist(), "count": [int(counts.sum())]}
    return out
