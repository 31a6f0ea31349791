"""`train.micro_batch_size: auto` and `train.activation_checkpointing: auto`, decided from measured
peaks on the run's device (the smoke gate, `smoke_1card`).

A candidate micro batch divides a process's share of the global batch (`candidates`), so the
global batch is kept through accumulation. For each, ascending, the gate runs one optimizer step
of its smoke batch at that size on the built model (weights restored after) and reads the
device's peak memory; what the N-process run needs is that peak less the (N-1)/N of the model
state that sharding removes, plus what only the N-process run adds: FSDP's gathered buffers at the
world size beyond the one-process layout's, from the memory estimate (`extra_n`). It fits when
that is at most the device's free memory (read before the model was built) less the margin
(smoke.min_memory_headroom of the capacity, the same as the headroom check's) and HCCL's buffers.
The search stops at the first candidate that does not fit (peaks grow with the micro batch) or runs
out of memory.

- `auto` micro batch: the largest candidate that fits; with checkpointing `auto`, first without
  checkpointing, then the larger candidates with it: checkpointing is off where the memory allows
  it at the chosen micro batch.
- an explicit micro batch with checkpointing `auto`: off if it fits without, else on.
- an explicit micro batch runs as written: the smoke steps measure it and the headroom check
  judges it; when it does not fit, the gate measures the smaller candidates and its failure names
  the largest that fits, and train_8card's launcher refuses to start (the report did not pass).

Without a memory figure (the CPU: no fixed capacity) there is nothing to fit: an explicit setting
runs as written, and `auto` fails the gate with what to set (`device.MEMORY_CAP_ENV` gives the CPU a
budget, as the tests do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pisft.train.decisions import AUTO, decision

GIB = 2**30


def candidates(global_batches: list[int], world_size: int) -> list[int]:
    """Micro batches that split a process's share of each global batch evenly (the policy's, and the
    RECAP value model's, which trains at the chosen micro batch too), ascending."""
    shares = [g // world_size if world_size and g % world_size == 0 else 0 for g in global_batches]
    return [m for m in range(1, min(shares) + 1) if all(share % m == 0 for share in shares)]


def extra_n(estimate: Any, world_size: int) -> int:
    """FSDP's gathered buffers at `world_size` beyond the one-process layout's (the estimate's
    `gathered` bytes at the peak; 0 without an estimate)."""
    try:
        return max(0, int(estimate[str(world_size)]["bytes"]["gathered"]) - int(estimate["1"]["bytes"]["gathered"]))
    except (KeyError, TypeError, ValueError):
        return 0


def need(peak: int, state: int, world_size: int, extra: int) -> int:
    """Per-device bytes of the N-process run from a one-process peak (pisft.gates.smoke.project_memory)."""
    return int(peak - state * (1 - 1 / world_size) + extra)


class Sizing:
    """The search, on a `measure(micro, checkpointing) -> (peak, state) | None` (None: out of memory)."""

    def __init__(self, measure: Callable[[int, bool], tuple[int, int] | None], world_size: int,
                 extra: int, limit: int) -> None:
        self.measure, self.world_size, self.extra, self.limit = measure, world_size, extra, limit
        self.measured: list[dict[str, Any]] = []

    def fits(self, micro: int, checkpointing: bool) -> bool:
        for m in self.measured:
            if m["micro_batch_size"] == micro and m["activation_checkpointing"] == checkpointing:
                return m["fits"]
        got = self.measure(micro, checkpointing)
        entry: dict[str, Any] = {"micro_batch_size": micro, "activation_checkpointing": checkpointing}
        if got is None:
            entry.update(peak_bytes=None, need_bytes=None, fits=False, out_of_memory=True)
        else:
            peak, state = got
            n = need(peak, state, self.world_size, self.extra)
            entry.update(peak_bytes=int(peak), state_bytes=int(state), need_bytes=n, fits=n <= self.limit)
        self.measured.append(entry)
        return entry["fits"]

    def largest(self, sizes: list[int], checkpointing: bool) -> int | None:
        best = None
        for m in sizes:
            if not self.fits(m, checkpointing):
                break
            best = m
        return best


def decide(micro: Any, checkpointing: Any, sizes: list[int], sizing: Sizing) -> dict[str, Any]:
    """The chosen (micro batch, checkpointing), or None for a micro batch that does not fit, with
    the largest that fits (`largest_fitting`, None when none does)."""
    if micro == AUTO:
        if checkpointing == AUTO:
            off = sizing.largest(sizes, False)
            on = sizing.largest([m for m in sizes if off is None or m > off], True)
            chosen = (on, True) if on is not None else ((off, False) if off is not None else None)
        else:
            best = sizing.largest(sizes, bool(checkpointing))
            chosen = (best, bool(checkpointing)) if best is not None else None
        return {"chosen": chosen, "largest_fitting": chosen[0] if chosen else None}
    options = [False, True] if checkpointing == AUTO else [bool(checkpointing)]
    for ckpt in options:
        if sizing.fits(micro, ckpt):
            return {"chosen": (micro, ckpt), "largest_fitting": None}
    smaller = [m for m in sizes if m < micro] or [1]
    return {"chosen": None, "largest_fitting": sizing.largest(smaller, options[-1]),
            "largest_with_checkpointing": options[-1]}


def entries(micro: Any, checkpointing: Any, result: dict[str, Any], sizing: Sizing, *, free: int,
            capacity: int, margin: int, hccl: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The report's two decision entries (micro batch, checkpointing)."""
    figures = {"measured": sizing.measured, "limit_bytes": sizing.limit, "free_bytes": free,
               "capacity_bytes": capacity, "margin_bytes": margin, "hccl_buffer_bytes": hccl,
               "extra_n_bytes": sizing.extra, "world_size": sizing.world_size}
    rule = (f"needs at most {sizing.limit / GIB:.2f} GiB per device on {sizing.world_size} (free "
            f"{free / GIB:.2f} less the margin {margin / GIB:.2f} and HCCL's {hccl / GIB:.2f})")
    chosen = result["chosen"]
    if chosen is None:
        fit = result["largest_fitting"]
        what = (f"micro batch {micro}" if micro != AUTO else "no micro batch")
        tail = (f"; the largest that fits is {fit}" + (" with train.activation_checkpointing: true"
                                                         if result.get("largest_with_checkpointing") else "")
                if fit is not None else "; none fits, not even 1")
        line = f"{what} fits: {rule}{tail}" if micro == AUTO else f"{what} does not fit: {rule}{tail}"
        return (decision(micro, None, line, fits=False, largest_fitting=fit, **figures),
                decision(checkpointing, None, line))
    m, ckpt = chosen
    tried = sorted({x["micro_batch_size"] for x in sizing.measured})
    how = "as written" if micro != AUTO else f"the largest that fits of {tried} measured"
    micro_line = f"micro batch {m} ({how}): {rule}"
    ckpt_line = (f"checkpointing {'on' if ckpt else 'off'}"
                 + (f" ({'the memory does not allow it off' if ckpt else 'off fits'} at micro batch {m})"
                    if checkpointing == AUTO else " as written"))
    return (decision(micro, m, micro_line, fits=True, **figures), decision(checkpointing, ckpt, ckpt_line))


NO_FIGURE = ("train.micro_batch_size / train.activation_checkpointing: auto fits the device's memory, and this "
             "device reports none (the CPU has no fixed capacity): set a number and true/false, or give the CPU "
             "a budget in bytes with PISFT_DEVICE_MEMORY_BYTES")
