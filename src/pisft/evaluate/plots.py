"""Plots for the evaluation report (matplotlib, Agg backend: no display needed).

Every function writes one PNG and returns its path, or returns None when there is nothing to
plot (e.g. a training log without memory figures): the report then says so instead.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pisft.evaluate import train_log  # noqa: E402

COLORS = {"base": "#8c8c8c", "finetuned": "#1f77b4"}
LABELS = {"base": "base", "finetuned": "fine-tuned"}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    return _save(fig, path)


def throughput_and_memory(records: list[dict], path: Path) -> Path | None:
    """Samples/s, step time and data wait per step; peak memory per device per step."""
    panels = []
    if train_log.series(records, "samples_per_s")[0]:
        panels.append("throughput")
    if train_log.series(records, "step_time_s")[0]:
        panels.append("time")
    mem_keys = train_log.memory_keys(records)
    if mem_keys:
        panels.append("memory")
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), sharex=True,
                             squeeze=False)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        if panel == "throughput":
            ax.plot(*train_log.series(records, "samples_per_s"), color="#2ca02c")
            ax.set_ylabel("samples / s")
            ax.set_title("Throughput, step time and memory per optimizer step")
        elif panel == "time":
            ax.plot(*train_log.series(records, "step_time_s"), label="step time", color="#ff7f0e")
            wait_steps, wait = train_log.series(records, "data_wait_s")
            if wait_steps:
                ax.plot(wait_steps, wait, label="data wait", color="#9467bd")
            ax.set_ylabel("seconds")
            ax.legend()
        else:
            for key in mem_keys:
                for label, (s, v) in train_log.memory_series(records, key).items():
                    ax.plot(s, v, label=label)
            ax.set_ylabel("peak memory (GiB)" if all(k.endswith("_bytes") for k in mem_keys)
                          else "peak memory")
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step")
    return _save(fig, path)


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
    return _save(fig, path)


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
    return _save(fig, path)
