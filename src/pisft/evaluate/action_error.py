"""Open-loop action error, accumulated per episode, per step of the chunk and per action dim.

For every evaluated frame the model predicts an action chunk (chunk_size, action_dim); it is
compared with the ground-truth chunk of the dataset. Steps past the end of the episode are
padding (`action_is_pad`) and are left out. Errors are kept in two units:

- `raw`: the dataset's own action units (after the postprocessor's unnormalisation);
- `norm`: the model's normalised space (quantile normalisation to [-1, 1] with q01/q99), where
  every action dimension has a comparable range, so no single joint dominates the average.

Metric names: `action_mse`, `action_l1` (raw units) and `action_mse_norm`, `action_l1_norm`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pisft.evaluate import intervals

# metric name -> (unit, kind)
METRICS = {
    "action_mse": ("raw", "mse"),
    "action_l1": ("raw", "l1"),
    "action_mse_norm": ("norm", "mse"),
    "action_l1_norm": ("norm", "l1"),
}


def _as_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


@dataclass
class EpisodeErrors:
    """Error sums of one model on one episode: (chunk_size, action_dim) per metric."""

    task: str
    sums: dict[str, np.ndarray]
    valid_frames: np.ndarray  # (chunk_size,) number of frames whose step k is not padding
    frames: int = 0


@dataclass
class ErrorAccumulator:
    """Collects the errors of one model, frame by frame, grouped by episode."""

    chunk_size: int
    action_dim: int
    episodes: dict[int, EpisodeErrors] = field(default_factory=dict)

    def _episode(self, episode: int, task: str) -> EpisodeErrors:
        ep = self.episodes.get(episode)
        if ep is None:
            shape = (self.chunk_size, self.action_dim)
            ep = EpisodeErrors(task=task, sums={m: np.zeros(shape) for m in METRICS},
                               valid_frames=np.zeros(self.chunk_size))
            self.episodes[episode] = ep
        elif ep.task != task:
            raise ValueError(f"episode {episode} has frames of two tasks: {ep.task!r} and {task!r}")
        return ep

    def add(self, *, episodes: Sequence[int], tasks: Sequence[str], pred_norm, target_norm,
            pred_raw, target_raw, is_pad) -> None:
        """Add a batch: arrays (B, chunk, dim); `is_pad` (B, chunk) true for padded steps."""
        pred = {"norm": _as_numpy(pred_norm), "raw": _as_numpy(pred_raw)}
        target = {"norm": _as_numpy(target_norm), "raw": _as_numpy(target_raw)}
        valid = ~np.asarray(_as_numpy(is_pad), dtype=bool)
        expected = (len(episodes), self.chunk_size, self.action_dim)
        for unit in ("norm", "raw"):
            for name, arr in (("prediction", pred[unit]), ("target", target[unit])):
                if arr.shape != expected:
                    raise ValueError(f"{name} ({unit}) has shape {arr.shape}, expected {expected}")
        if valid.shape != expected[:2]:
            raise ValueError(f"action_is_pad has shape {valid.shape}, expected {expected[:2]}")
        diff = {unit: pred[unit] - target[unit] for unit in ("norm", "raw")}
        err = {
            "mse": {u: d**2 for u, d in diff.items()},
            "l1": {u: np.abs(d) for u, d in diff.items()},
        }
        mask = valid[:, :, None].astype(np.float64)
        for i, (episode, task) in enumerate(zip(episodes, tasks, strict=True)):
            ep = self._episode(int(episode), str(task))
            for metric, (unit, kind) in METRICS.items():
                ep.sums[metric] += err[kind][unit][i] * mask[i]
            ep.valid_frames += valid[i]
            ep.frames += 1

    # ---- summaries ----
    def episode_ids(self) -> list[int]:
        return sorted(self.episodes)

    def per_episode(self, metric: str, episode_ids: Sequence[int] | None = None):
        """(sums, element counts) per episode, in the order of `episode_ids`."""
        ids = self.episode_ids() if episode_ids is None else list(episode_ids)
        sums = np.array([self.episodes[e].sums[metric].sum() for e in ids])
        counts = np.array([self.episodes[e].valid_frames.sum() * self.action_dim for e in ids])
        return sums, counts

    def mean(self, metric: str, episode_ids: Sequence[int] | None = None) -> float:
        return intervals.pooled_mean(*self.per_episode(metric, episode_ids))

    def per_step(self, metric: str) -> np.ndarray:
        """(chunk_size,) mean error at each step of the chunk, over all dims and frames."""
        sums = sum(ep.sums[metric].sum(axis=1) for ep in self.episodes.values())
        counts = sum(ep.valid_frames for ep in self.episodes.values()) * self.action_dim
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)

    def per_dim(self, metric: str) -> np.ndarray:
        """(action_dim,) mean error of each action dimension over all valid steps and frames."""
        sums = sum(ep.sums[metric].sum(axis=0) for ep in self.episodes.values())
        counts = sum(ep.valid_frames.sum() for ep in self.episodes.values())
        return sums / counts if counts > 0 else np.full(self.action_dim, np.nan)

    def tasks(self) -> dict[str, list[int]]:
        """task -> its episode ids (sorted), tasks in sorted order."""
        out: dict[str, list[int]] = {}
        for e in self.episode_ids():
            out.setdefault(self.episodes[e].task, []).append(e)
        return dict(sorted(out.items()))

    def frames(self, episode_ids: Sequence[int] | None = None) -> int:
        ids = self.episode_ids() if episode_ids is None else episode_ids
        return int(sum(self.episodes[e].frames for e in ids))
