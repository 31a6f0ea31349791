"""Read the training stage's per-step metrics (`results/train/metrics.jsonl`).

One JSON object per optimizer step: step, loss, grad_norm, lr, step_time_s, samples_per_s,
data_wait_s, peak memory (a number, a list per device, or a mapping device -> number), mfu...
A run that resumed from a checkpoint may log a step twice; the later record wins.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pisft.errors import DataError


def read_metrics(path: str | Path) -> list[dict]:
    """Records sorted by step (one per step). A missing file gives an empty list."""
    path = Path(path)
    if not path.is_file():
        return []
    by_step: dict[int, dict] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path}:{lineno}: not a JSON object ({exc.msg}); the training log is damaged — "
                f"rerun the train stage or delete that line"
            ) from None
        if not isinstance(record, dict) or "step" not in record:
            raise DataError(f"{path}:{lineno}: each line must be a JSON object with a 'step' key")
        by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a numeric key, skipping records without it or with a non-number."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        steps.append(int(r["step"]))
        values.append(float(v))
    return steps, values


def memory_keys(records: list[dict]) -> list[str]:
    """Keys that hold peak memory figures (e.g. `peak_memory_gb`, `peak_memory_mb`)."""
    keys: list[str] = []
    for r in records:
        for k in r:
            if k.startswith("peak_mem") and k not in keys:
                keys.append(k)
    return keys


def memory_series(records: list[dict], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """Per-device curves of one memory key: label -> (steps, values); `*_bytes` keys in GiB.

    A plain number is one curve labelled by the key; a list gives `key[i]` per device; a
    mapping gives `key[name]`.
    """
    curves: dict[str, tuple[list[int], list[float]]] = {}

    scale = 1.0 / 2**30 if key.endswith("_bytes") else 1.0  # bytes are shown in GiB

    def put(label: str, step: int, value) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            s, v = curves.setdefault(label, ([], []))
            s.append(step)
            v.append(float(value) * scale)

    for r in records:
        value = r.get(key)
        step = int(r["step"])
        if isinstance(value, list):
            for i, x in enumerate(value):
                put(f"{key}[{i}]", step, x)
        elif isinstance(value, dict):
            for name, x in value.items():
                put(f"{key}[{name}]", step, x)
        else:
            put(key, step, value)
    return curves


def summary(records: list[dict]) -> dict:
    """A few headline figures of the training run (for the report)."""
    if not records:
        return {}
    out: dict = {"steps": len(records), "last_step": int(records[-1]["step"])}
    _, losses = series(records, "loss")
    if losses:
        out["first_loss"], out["last_loss"] = losses[0], losses[-1]
        tail = losses[-max(1, len(losses) // 10):]
        out["final_loss_mean_last_10pct"] = sum(tail) / len(tail)
    for key in ("step_time_s", "samples_per_s", "data_wait_s", "mfu"):
        _, vals = series(records, key)
        if vals:
            # Skip the first step (compilation, warm-up) when there is more than one.
            vals = vals[1:] if len(vals) > 1 else vals
            out[f"mean_{key}"] = sum(vals) / len(vals)
    for key in memory_keys(records):
        peaks = [max(v) for _, v in memory_series(records, key).values() if v]
        if peaks:
            out[f"max_{key.removesuffix('_bytes') + '_gib' if key.endswith('_bytes') else key}"] = max(peaks)
    return out
