"""Plots for the evaluation report (matplotlib, Agg backend: no display needed).

Every function writes one PNG and returns its path, or returns None when there is nothing to
plot (e.g. a training log without memory figures): the report then says so instead.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from pisft.evaluate import train_log

COLORS = {"base": "#8c8c8c", "finetuned": "#1f77b4"}
LABELS = {"base": "base", "finetuned": "fine-tuned"}


def save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def note_figure(title: str, note: str, path: Path) -> Path:
    """A figure that only says why there is nothing to plot (an output the workflow declares)."""
    fig, ax = plt.subplots(figsize=(7, 2.5))
    ax.axis("off")
    ax.set_title(title)
    ax.text(0.5, 0.5, "\n".join(textwrap.wrap(note, 80)), ha="center", va="center", transform=ax.transAxes,
            fontsize=9)
    return save_figure(fig, path)


def loss_and_lr(records: list[dict], path: Path) -> Path | None:
    """Training loss (log scale when it spans a decade) and learning rate per optimizer step."""
    steps, loss = train_log.series(records, "loss")
    if not steps:
        return None
    lr_steps, lr = train_log.series(records, "lr")
    fig, axes = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True,
                             gridspec_kw={"height_ratios": [2, 1]})
    ax = axes[0]
    ax.plot(steps, loss, lw=1.0, color="#1f77b4", alpha=0.5, label="loss")
    if len(loss) >= 10:
        window = max(2, len(loss) // 20)
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1:], smooth, lw=2.0, color="#1f77b4", label=f"mean of {window} steps")
    if min(loss) > 0 and max(loss) / min(loss) > 10:
        ax.set_yscale("log")
    ax.set_ylabel("training loss")
    ax.set_title("Training loss (flow-matching MSE) per optimizer step")
    ax.grid(alpha=0.3)
    ax.legend()
    ax = axes[1]
    if lr_steps:
        ax.plot(lr_steps, lr, color="#d62728")
    else:
        ax.text(0.5, 0.5, "no 'lr' in the training log", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_ylabel("learning rate")
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


# Memory keys of a training log: `peak_memory_*` (allocated), `peak_reserved_*` (held by the
# allocator's cache) with a unit token (`_bytes`, `_gib`, `_gb`, `_mib`, `_mb`); a number, a list
# with one value per rank, or a mapping device -> value (pisft.train.loop logs the per-rank lists
# and their maximum). Everything is drawn in GiB.
GIB_PER_UNIT = {"bytes": 1 / 2**30, "gib": 1.0, "gb": 1e9 / 2**30, "mib": 1 / 2**10, "mb": 1e6 / 2**30}


def _memory_kind(key: str) -> tuple[str, float] | None:
    """('allocated' | 'reserved', GiB per unit) of a memory key; None when it is no memory key."""
    if key.startswith("peak_mem"):
        what = "allocated"
    elif key.startswith("peak_reserved"):
        what = "reserved"
    else:
        return None
    units = [GIB_PER_UNIT[part] for part in key.split("_") if part in GIB_PER_UNIT]
    return (what, units[0]) if len(units) == 1 else None


def memory_curves(records: list[dict]) -> tuple[list[tuple[str, list[int], list[float]]], list[str]]:
    """Peak memory per device in GiB: ([(label in words, steps, GiB)], keys left out).

    A scalar key is left out when the log also has per-device values of the same kind (it is
    their maximum); keys without a known unit are left out and named.
    """
    keys: list[str] = []
    for r in records:
        keys += [k for k in r if k not in keys and (k.startswith("peak_mem") or k.startswith("peak_reserved"))]
    kinds = {k: _memory_kind(k) for k in keys}
    per_device = {kind[0] for k, kind in kinds.items()
                  if kind and any(isinstance(r.get(k), (list, dict)) for r in records)}
    curves: dict[str, tuple[list[int], list[float]]] = {}
    skipped: list[str] = []
    for key, kind in kinds.items():
        if kind is None:
            skipped.append(key)
            continue
        what, scale = kind
        for r in records:
            value, step = r.get(key), int(r["step"])
            if isinstance(value, list):
                items = [(f"{what}, rank {i}", x) for i, x in enumerate(value)]
            elif isinstance(value, dict):
                items = [(f"{what}, {name}", x) for name, x in value.items()]
            elif what in per_device:
                continue
            else:
                items = [(what, value)]
            for label, x in items:
                if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
                    steps, values = curves.setdefault(label, ([], []))
                    steps.append(step)
                    values.append(float(x) * scale)
    return [(label, s, v) for label, (s, v) in curves.items()], skipped


def throughput_and_memory_figure(records: list[dict]):
    """The figure of `throughput_and_memory` (a matplotlib Figure), or None with nothing to draw."""
    panels = []
    if train_log.series(records, "samples_per_s")[0]:
        panels.append("throughput")
    if train_log.series(records, "step_time_s")[0]:
        panels.append("time")
    mem_curves, mem_skipped = memory_curves(records)
    if mem_curves:
        panels.append("memory")
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), sharex=True,
                             squeeze=False)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        if panel == "throughput":
            ax.plot(*train_log.series(records, "samples_per_s"), color="#2ca02c", label="samples per second")
            ax.set_ylabel("samples / s")
        elif panel == "time":
            ax.plot(*train_log.series(records, "step_time_s"), label="optimizer step time", color="#ff7f0e")
            wait_steps, wait = train_log.series(records, "data_wait_s")
            if wait_steps:
                ax.plot(wait_steps, wait, label="waiting for data", color="#9467bd")
            ax.set_ylabel("seconds")
            ax.legend()
        else:
            for label, steps, gib in mem_curves:
                ax.plot(steps, gib, label=label, ls="--" if label.startswith("reserved") else "-")
            ax.set_ylabel("peak memory per device (GiB)")
            ax.legend(fontsize=7, ncols=2 if len(mem_curves) > 4 else 1)
            if mem_skipped:
                ax.text(0.01, 0.02, f"not drawn (unit unknown): {', '.join(mem_skipped)}",
                        transform=ax.transAxes, fontsize=7)
        ax.grid(alpha=0.3)
    axes[0, 0].set_title("Throughput, step time and peak memory per optimizer step")
    axes[-1, 0].set_xlabel("optimizer step")
    return fig


def throughput_and_memory(records: list[dict], path: Path) -> Path | None:
    """Samples/s, step time and data wait per step; peak memory per device (GiB) per step."""
    fig = throughput_and_memory_figure(records)
    return None if fig is None else save_figure(fig, path)


def per_task_error(metrics: dict, path: Path, metric: str = "action_mse") -> Path | None:
    """Horizontal bars: per-task error of the base and the fine-tuned model."""
    tasks = list(metrics["base"]["per_task"])
    if not tasks:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(tasks) + 1.5))
    y = np.arange(len(tasks))
    height = 0.38
    for offset, name in ((-height / 2, "base"), (height / 2, "finetuned")):
        vals = [metrics[name]["per_task"][t][metric] or 0.0 for t in tasks]
        ax.barh(y + offset, vals, height, label=LABELS[name], color=COLORS[name])
    ax.set_yticks(y, ["\n".join(textwrap.wrap(t, 45)) for t in tasks], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(metric)
    ax.set_title(f"Held-out {metric} per task: base vs fine-tuned")
    ax.grid(axis="x", alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def per_step_error(curves: dict[str, np.ndarray], path: Path, metric: str) -> Path | None:
    """Error at each step of the action chunk (how error grows with the prediction horizon)."""
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, values in curves.items():
        ax.plot(np.arange(len(values)), values, marker=".", label=LABELS.get(name, name),
                color=COLORS.get(name))
    ax.set_xlabel("step within the predicted action chunk")
    ax.set_ylabel(metric)
    ax.set_title(f"Held-out {metric} per chunk step")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)
