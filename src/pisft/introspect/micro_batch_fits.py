"""The largest micro batch per trainable mode, with activation checkpointing on and off, whose
estimate fits a 910B and an 80 GB GPU (`largest_micro_batches`, `format_fits`; printed by `pisft
estimate` for pi0.5): a few simulated steps (pisft.introspect.simulated_step) bracket each, in two
worker processes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pisft.config import PisftConfig
from pisft.introspect.simulated_step import GIB, ema_enabled, simulate_step, with_mode
from pisft.model import policy as policy_mod

MIB = 1 << 20
# Nominal device memory: Ascend 910B (64 GB HBM; npu-smi reports 65536 MB) and an 80 GB GPU
# (A100/H100 80GB). The smoke gate's headroom (smoke.min_memory_headroom) and, on the NPU, HCCL's
# buffers are taken off before a micro batch counts as fitting (as `one_card_gate` does).
FIT_DEVICES = {"910B 64GB": ("npu", 65536 * MIB), "GPU 80GB": ("cuda", 81920 * MIB)}
FIT_PRESET = "pi05"
MAX_FIT_MICRO_BATCH = 1024  # no search above this (reported as ">= 1024")


def _fit_total(raw: str, preset: str, mode: str, checkpointing: bool, micro_batch: int, world: int) -> int:
    """The estimated per-device total of `preset` in `mode` (a worker of `largest_micro_batches`)."""
    from pisft import config as config_mod
    from pisft.train import trainable

    cfg = config_mod.from_dict(json.loads(raw))
    cfg.train.trainable = mode
    t = cfg.train
    make = with_mode(lambda: policy_mod.build_policy(preset, seed=0, device="meta", dtype="float32"),
                     mode, trainable.spec_for(cfg), t.precision, seed=t.seed)
    sim = simulate_step(make, world_size=world, micro_batch=micro_batch, precision=t.precision,
                        checkpointing=checkpointing, ema=ema_enabled(cfg))
    return int(sim["bytes"]["total"])


def config_mod_dict(cfg: PisftConfig) -> dict[str, Any]:
    from pisft import config as config_mod

    return config_mod.to_dict(cfg)


def _limit(kind: str, capacity: int, headroom: float) -> int:
    from pisft.device import hccl_buffer_bytes

    return int(capacity * (1 - headroom)) - hccl_buffer_bytes(kind, env={})


def _search(total_at: Callable[[int], int], known: dict[int, int], limit: int, tries: int = 4) -> tuple[int, bool]:
    """(largest micro batch whose total is <= limit, whether a neighbour above it was seen over the limit).

    The total is affine in the micro batch within one peak phase and convex over all of them (a
    maximum of affine terms): extrapolating the last two points overshoots, interpolating
    between a fitting and a failing point undershoots, so a few simulated steps bracket it."""
    for _ in range(tries):
        fit = [b for b, v in known.items() if v <= limit]
        over = [b for b, v in known.items() if v > limit]
        lo = max(fit, default=0)
        hi = min((b for b in over if b > lo), default=None)
        if lo == 0 or (hi is not None and hi == lo + 1) or lo >= MAX_FIT_MICRO_BATCH:
            break
        if hi is None:
            a, b = sorted(known)[-2:]
            slope = max((known[b] - known[a]) / (b - a), 1.0)
            guess = lo + int((limit - known[lo]) // slope)
            guess = max(guess, lo + 1)
        else:
            slope = (known[hi] - known[lo]) / (hi - lo)
            guess = lo + int((limit - known[lo]) // slope)
            guess = min(max(guess, lo + 1), hi - 1)
        guess = min(guess, MAX_FIT_MICRO_BATCH)
        if guess in known:
            break
        known[guess] = total_at(guess)
    fit = [b for b, v in known.items() if v <= limit]
    lo = max(fit, default=0)
    exact = lo == 0 or (lo + 1) in known or lo >= MAX_FIT_MICRO_BATCH
    return lo, exact


def largest_micro_batches(cfg: PisftConfig, *, world_size: int | None = None,
                          modes: tuple[str, ...] | None = None, preset: str = FIT_PRESET,
                          devices: dict[str, tuple[str, int]] | None = None) -> dict[str, Any]:
    """For `preset` (pi0.5) at `world_size` (default: the configured one): per mode and
    checkpointing on/off, the largest micro batch whose estimated per-device peak fits each of
    `devices` (`FIT_DEVICES`: name -> (kind, bytes)) less the smoke gate's headroom. Two worker
    processes simulate the steps."""
    import concurrent.futures
    import multiprocessing

    from pisft.train.trainable import MODES

    world = world_size or cfg.world_size
    raw = json.dumps(config_mod_dict(cfg), sort_keys=True)
    headroom = cfg.smoke.min_memory_headroom
    devices = devices or FIT_DEVICES
    out: dict[str, Any] = {"preset": preset, "world_size": world, "precision": cfg.train.precision,
                           "headroom": headroom, "ema": ema_enabled(cfg),
                           "devices": {n: c for n, (_, c) in devices.items()},
                           "device_kinds": {n: k for n, (k, _) in devices.items()}, "modes": {}}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=ctx) as pool:
        def totals(jobs):
            futures = {key: pool.submit(_fit_total, raw, preset, key[0], key[1], key[2], world) for key in jobs}
            return {key: f.result() for key, f in futures.items()}

        cases = [(m, ck) for m in (modes or MODES) for ck in (True, False)]
        known = {case: {} for case in cases}
        for (m, ck, b), v in totals([(m, ck, b) for m, ck in cases for b in (1, 8)]).items():
            known[(m, ck)][b] = v
        for case in cases:
            row = {}
            for name, (kind, capacity) in devices.items():
                limit = _limit(kind, capacity, headroom)
                best, exact = _search(lambda b, c=case: totals([(c[0], c[1], b)])[(c[0], c[1], b)],
                                      known[case], limit)
                row[name] = {"micro_batch": best, "exact": exact, "limit_bytes": limit,
                             "total_gib_at_1": round(known[case][1] / GIB, 2),
                             "total_gib_at_best": round(known[case][best] / GIB, 2) if best else None}
            out["modes"].setdefault(case[0], {})["checkpointing" if case[1] else "no_checkpointing"] = row
    return out


def format_fits(fits: dict[str, Any]) -> str:
    from pisft import device as devices

    names = list(fits["devices"])
    buffers = any(devices.row(k).collective_buffer_bytes for k in fits["device_kinds"].values())
    lines = [f"largest micro batch per device, {fits['preset']} at world size {fits['world_size']} "
             f"({fits['precision']}; fits = estimate <= capacity less {fits['headroom']:.0%} headroom"
             f"{' and HCCL buffers on the NPU' if buffers else ''}"
             f"{'; EMA counted' if fits['ema'] else ''}):",
             f"  {'train.trainable':<16}{'checkpointing':<15}" + "".join(f"{n:>14}" for n in names)]
    for mode, rows in fits["modes"].items():
        for key, label in (("checkpointing", "on"), ("no_checkpointing", "off")):
            cells = []
            for n in names:
                cell = rows[key][n]
                b = cell["micro_batch"]
                text = "none" if b == 0 else (f">={b}" if b >= MAX_FIT_MICRO_BATCH else str(b))
                cells.append(f"{text + ('' if cell['exact'] else '?'):>14}")
            lines.append(f"  {mode:<16}{label:<15}" + "".join(cells))
    lines.append("  (?: the search stopped before bracketing it; none: micro batch 1 does not fit)")
    return "\n".join(lines)
