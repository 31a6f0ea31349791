"""Per-step metrics: JSON lines, MFU against a table of device peaks, progress with ETA.

MFU (model FLOPs utilisation) = analytic training FLOPs per sample × samples/s
                                 / (peak FLOP/s of one device × number of devices).
The peaks are dense bf16/fp16 matrix figures per device (no sparsity), in each device kind's row
(`pisft.device`, `DeviceRow.peak_flops`). The Ascend figures are the commonly cited vendor numbers
per SKU and vary with clocks and firmware: set `train.peak_flops` to your vendor's figure to
override the table. CPU has no entry (MFU null).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from pisft import device as devices

# Every row's (pattern on the device name, peak dense bf16 FLOP/s, label), for the docs and the
# benches; `peak_flops_for` reads the device kind's own row, first match wins.
PEAK_FLOPS_TABLE: list[tuple[str, float, str]] = [
    entry for device_row in devices.ROWS.values() for entry in device_row.peak_flops]


def peak_flops_for(device_name: str, kind: str, override: float = 0.0) -> tuple[float | None, str]:
    """Peak FLOP/s of one device and where the figure came from."""
    if override > 0:
        return float(override), "train.peak_flops"
    table = devices.row(kind).peak_flops
    if not table:
        return None, f"{kind}: no peak figure (MFU not reported)"
    for pattern, flops, label in table:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return flops, f"table: {label}"
    return None, f"'{device_name}' not in the peak table; set train.peak_flops for MFU"


def mfu(flops_per_sample: float | None, samples_per_s: float, peak: float | None,
        n_devices: int) -> float | None:
    if not flops_per_sample or not peak or samples_per_s <= 0:
        return None
    return flops_per_sample * samples_per_s / (peak * n_devices)


class MetricsLog:
    """Append-only JSON lines, one object per optimizer step; truncatable on resume."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def reset(self, keep_upto_step: int) -> None:
        """Keep the lines of steps <= keep_upto_step (those a resumed run does not redo).

        What is kept has unique, increasing steps 1..keep_upto_step at most: lines past the
        checkpoint (the steps the resumed run redoes) go, a line cut by a crash and everything
        after it go, and should the file ever hold a step twice, the later line wins.
        """
        by_step: dict[int, str] = {}
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                if not line.strip():
                    continue
                try:
                    step = json.loads(line).get("step")
                except (json.JSONDecodeError, AttributeError):
                    break  # a line cut by a crash: drop it and everything after
                if isinstance(step, int) and 0 < step <= keep_upto_step:
                    by_step[step] = line
        self.path.parent.mkdir(parents=True, exist_ok=True)
        from pisft.io import write_text_atomic

        write_text_atomic(self.path, "".join(by_step[k] + "\n" for k in sorted(by_step)))

    def append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
            fh.flush()

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


class Progress:
    """Rank-0 progress: a line every `every` optimizer steps (the trainers pass `train.log_every`,
    the steps whose values the loop fetches together) and at the last one, with step/total,
    loss, gradient norm, learning rate, samples/s, MFU where known and an ETA; without `every`
    a line every ~5% of the run and at its first step. On a terminal, a tqdm bar instead."""

    def __init__(self, total: int, start: int, enabled: bool, stream: TextIO | None = None,
                 desc: str = "train", every: int | None = None) -> None:
        self.total = total
        self.done = start
        self.start = start
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.desc = desc
        self.t0 = time.perf_counter()
        self.every = max(1, every) if every else max(1, total // 20)
        self.first_line = not every
        self._bar = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc=desc, file=self.stream,
                             dynamic_ncols=True)

    def eta_s(self) -> float:
        steps = self.done - self.start
        if steps <= 0:
            return math.inf
        per = (time.perf_counter() - self.t0) / steps
        return per * (self.total - self.done)

    def update(self, record: dict[str, Any]) -> None:
        self.done = record["step"]
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
            return
        if (self.done % self.every == 0 or self.done == self.total
                or (self.first_line and self.done == self.start + 1)):
            pct = 100.0 * self.done / self.total
            mfu_txt = f" mfu {record['mfu']:.1%}" if record.get("mfu") is not None else ""
            print(f"[{self.desc}] step {self.done}/{self.total} ({pct:.0f}%) "
                  f"loss {record['loss']:.4f} grad_norm {record['grad_norm']:.3f} "
                  f"lr {record['lr']:.2e} {record['samples_per_s']:.1f} samples/s{mfu_txt} "
                  f"ETA {_fmt_duration(self.eta_s())}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class TensorBoardSink:
    """Optional TensorBoard scalars (train.tensorboard); needs the `tensorboard` package."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            from pisft.errors import PisftError

            raise PisftError(
                "train.tensorboard is true but the `tensorboard` package is not installed; "
                "install it into the venv (pip install tensorboard) or set train.tensorboard: false"
            ) from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and value is not None:
                self.writer.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
