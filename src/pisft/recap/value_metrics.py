"""The value model on held-out frames: predictions, Spearman rho, bin accuracy, calibration plot.

`predict` runs the model over a set of frames without gradients, in batches; with several
processes (an FSDP2-sharded model, whose every forward is a collective) each process takes
every world_size-th frame, all run the same number of batches (the last ones padded with
repeats), and every process gets all predictions back in frame order.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from pisft.recap.value_data import ROW_KEY
from pisft.recap.value_model import expected_value, nearest_bin


@torch.no_grad()
def predict(model: torch.nn.Module, frames: Any, task: Any, *, batch_size: int, rank: int = 0,
            world_size: int = 1, num_workers: int = 0) -> dict[str, np.ndarray]:
    """V (float64) and the most likely bin (int64) of every frame of `frames`, in its order."""
    n = len(frames)
    mine = list(range(rank, n, world_size))
    per_rank = math.ceil(n / world_size) if n else 0
    padded = mine + mine[:1] * (per_rank - len(mine)) if mine else [0] * per_rank
    loader = DataLoader(Subset(frames, padded), batch_size=batch_size, shuffle=False,
                        collate_fn=task.collate, num_workers=num_workers)
    was_training = model.training
    model.eval()
    rows, values, best = [], [], []
    try:
        for batch in loader:
            logits = task.logits(model, task.prepare(batch))
            rows.append(batch[ROW_KEY].cpu())
            values.append(expected_value(logits).double().cpu())
            best.append(logits.argmax(dim=-1).cpu())
    finally:
        model.train(was_training)
    k = len(mine)
    local = {"row": torch.cat(rows)[:k].numpy() if rows else np.zeros(0, np.int64),
             "value": torch.cat(values)[:k].numpy() if values else np.zeros(0),
             "bin": torch.cat(best)[:k].numpy() if best else np.zeros(0, np.int64)}
    parts = [local]
    if world_size > 1 and dist.is_initialized():
        parts = [None] * world_size
        dist.all_gather_object(parts, local)
    row = np.concatenate([p["row"] for p in parts])
    order = np.argsort(row, kind="stable")
    if not np.array_equal(row[order], np.arange(n)):
        raise RuntimeError(f"predictions for {len(row)} rows, expected each of {n} once")
    return {key: np.concatenate([p[key] for p in parts])[order] for key in ("value", "bin")}


def spearman(x: np.ndarray, y: np.ndarray) -> float | None:
    """Spearman's rank correlation (ties get their average rank); None when it is undefined
    (fewer than 2 frames, or either side constant)."""
    from scipy.stats import spearmanr

    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(spearmanr(x, y).statistic)


def bin_accuracy(pred_bin: np.ndarray, target: np.ndarray, bins: int) -> float | None:
    """The fraction of frames whose most likely bin is the bin nearest their target."""
    if len(target) == 0:
        return None
    nearest = nearest_bin(torch.as_tensor(np.asarray(target, np.float32)), bins).numpy()
    return float(np.mean(np.asarray(pred_bin) == nearest))


def heldout_metrics(values: np.ndarray, pred_bin: np.ndarray, target: np.ndarray, bins: int) -> dict:
    return {
        "spearman_heldout": spearman(values, target),
        "bin_accuracy_heldout": bin_accuracy(pred_bin, target, bins),
        "mae_heldout": float(np.mean(np.abs(values - target))) if len(target) else None,
        "frames_heldout": int(len(target)),
    }


def calibration_plot(target: np.ndarray, values: np.ndarray, path: Path, *, title: str = "") -> Path:
    """V against the normalised return of the held-out frames: every frame, the mean V in 20
    equal bins of the return, and the diagonal V = return."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.plot([-1, 0], [-1, 0], color="#8c8c8c", linestyle="--", linewidth=1, label="V = return")
    ax.scatter(target, values, s=6, alpha=0.35, color="#1f77b4", label="held-out frames")
    edges = np.linspace(-1, 0, 21)
    which = np.clip(np.digitize(target, edges) - 1, 0, 19)
    centers, means = [], []
    for b in range(20):
        sel = which == b
        if sel.any():
            centers.append(float(np.mean(target[sel])))
            means.append(float(np.mean(values[sel])))
    if centers:
        ax.plot(centers, means, marker="o", color="#d62728", linewidth=1.5, label="mean V per return bin")
    ax.set_xlim(-1.02, 0.02)
    ax.set_ylim(-1.02, 0.02)
    ax.set_xlabel("normalised return (return / |min return|)")
    ax.set_ylabel("V (expected value over the bins)")
    ax.set_title(title or "value model calibration (held-out frames)", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
