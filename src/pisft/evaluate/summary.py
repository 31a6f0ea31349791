"""Turn per-model error accumulators into the metrics file and the tables behind the plots.

`metrics.json` is flat-ish on purpose, so `dvc metrics diff` compares it between commits:
scalars only (no lists), at most three levels deep (`base.per_task.<task>.action_mse`).
The per-step and per-dimension curves go to CSV files (`per_step.csv`, `per_dim.csv`,
`per_task.csv`) that `dvc plots` and the report read.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping

import numpy as np

from pisft.evaluate import intervals
from pisft.evaluate.action_error import METRICS, ErrorAccumulator

# Primary comparison metric (the contract: `base.action_mse`, `finetuned.action_mse`).
PRIMARY = "action_mse"


def _finite(x: float) -> float | None:
    """JSON has no NaN: an undefined figure is written as null."""
    return float(x) if x is not None and math.isfinite(x) else None


def _model_section(acc: ErrorAccumulator, *, n_bootstrap: int, seed: int, level: float) -> dict:
    section: dict = {}
    for metric in METRICS:
        sums, counts = acc.per_episode(metric)
        section[metric] = _finite(intervals.pooled_mean(sums, counts))
        if n_bootstrap > 0:
            ci = intervals.bootstrap_pooled_mean(sums, counts, n_samples=n_bootstrap, seed=seed, level=level)
            section[f"{metric}_ci_low"] = _finite(ci.low)
            section[f"{metric}_ci_high"] = _finite(ci.high)
    section["per_task"] = {
        task: {
            **{m: _finite(acc.mean(m, ids)) for m in METRICS},
            "episodes": len(ids),
            "frames": acc.frames(ids),
        }
        for task, ids in acc.tasks().items()
    }
    return section


def _check_same_frames(models: Mapping[str, ErrorAccumulator]) -> list[int]:
    accs = list(models.values())
    ids = accs[0].episode_ids()
    for name, acc in models.items():
        if acc.episode_ids() != ids:
            raise ValueError(f"model '{name}' was evaluated on other episodes than the rest")
        for e in ids:
            if not np.array_equal(acc.episodes[e].valid_frames, accs[0].episodes[e].valid_frames):
                raise ValueError(f"model '{name}' was evaluated on other frames of episode {e}")
    return ids


def summarize(base: ErrorAccumulator, finetuned: ErrorAccumulator, *, n_bootstrap: int,
              seed: int, level: float = 0.95) -> dict:
    """The metrics dict: `base`, `finetuned`, `comparison`, `improvement` and the sample sizes."""
    ids = _check_same_frames({"base": base, "finetuned": finetuned})
    out: dict = {
        "base": _model_section(base, n_bootstrap=n_bootstrap, seed=seed, level=level),
        "finetuned": _model_section(finetuned, n_bootstrap=n_bootstrap, seed=seed, level=level),
    }
    comparison: dict = {}
    for metric in METRICS:
        b, f = out["base"][metric], out["finetuned"][metric]
        ratio = f / b if b not in (None, 0.0) and f is not None else None
        entry = {"ratio": _finite(ratio) if ratio is not None else None,
                 "reduction": _finite(1.0 - ratio) if ratio is not None else None}
        if n_bootstrap > 0:
            sums_b, counts = base.per_episode(metric, ids)
            sums_f, _ = finetuned.per_episode(metric, ids)
            ci = intervals.bootstrap_paired_ratio(sums_b, sums_f, counts, n_samples=n_bootstrap,
                                              seed=seed, level=level)
            entry["ratio_ci_low"], entry["ratio_ci_high"] = _finite(ci.low), _finite(ci.high)
        comparison[metric] = entry
    out["comparison"] = comparison
    # Relative reduction of the primary metric: 0.6 means the fine-tuned error is 40% of base.
    out["improvement"] = comparison[PRIMARY]["reduction"]
    out["episodes"] = len(ids)
    out["frames"] = base.frames()
    out["tasks"] = len(base.tasks())
    out["confidence_level"] = level
    out["bootstrap_samples"] = n_bootstrap
    return out


def _csv(header: list[str], rows: list[list]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow(["" if isinstance(v, float) and not math.isfinite(v) else
                         (f"{v:.6g}" if isinstance(v, float) else v) for v in row])
    return buf.getvalue()


def per_step_csv(models: Mapping[str, ErrorAccumulator]) -> str:
    """step, then `<model>_<metric>` for every model and metric (one row per chunk step)."""
    header = ["step"] + [f"{name}_{m}" for name in models for m in METRICS]
    curves = {(name, m): acc.per_step(m) for name, acc in models.items() for m in METRICS}
    chunk = len(next(iter(curves.values())))
    rows = [[k] + [float(curves[(name, m)][k]) for name in models for m in METRICS]
            for k in range(chunk)]
    return _csv(header, rows)


def per_dim_csv(models: Mapping[str, ErrorAccumulator], dim_names: list[str]) -> str:
    header = ["dim"] + [f"{name}_{m}" for name in models for m in METRICS]
    curves = {(name, m): acc.per_dim(m) for name, acc in models.items() for m in METRICS}
    rows = [[dim_names[d]] + [float(curves[(name, m)][d]) for name in models for m in METRICS]
            for d in range(len(dim_names))]
    return _csv(header, rows)


def per_task_csv(metrics: dict) -> str:
    tasks = list(metrics["base"]["per_task"])
    header = ["task", "episodes", "frames"] + [f"{name}_{m}" for name in ("base", "finetuned")
                                               for m in METRICS]
    rows = []
    for task in tasks:
        b = metrics["base"]["per_task"][task]
        row = [task, b["episodes"], b["frames"]]
        for name in ("base", "finetuned"):
            entry = metrics[name]["per_task"][task]
            row += [float("nan") if entry[m] is None else float(entry[m]) for m in METRICS]
        rows.append(row)
    return _csv(header, rows)
