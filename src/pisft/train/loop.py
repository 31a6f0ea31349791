"""The optimizer-step loop: gradient accumulation, clipping, metrics, checkpoints.

It knows nothing about pi0.5: a `Task` supplies the loss of a micro-batch and the preparation
of a collated batch, so the same loop is unit-tested with a small module.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pisft import device as devices
from pisft.train.data import split_rand
from pisft.train.metrics import mfu as compute_mfu


class Task(Protocol):
    """What the loop needs from a model + data pairing."""

    def draw(self, rng: np.random.Generator) -> dict[str, np.ndarray]: ...
    def prepare(self, batch: dict[str, Any]) -> dict[str, Any]: ...
    def loss(self, model: nn.Module, batch: dict[str, Any],
             rand: dict[str, torch.Tensor]) -> torch.Tensor: ...
    def flops_per_sample(self, batch: dict[str, Any]) -> float | None: ...


class NonFiniteError(RuntimeError):
    pass


@dataclass
class LoopSettings:
    steps: int  # the last optimizer step of the run (exclusive end)
    accum: int
    global_batch: int
    grad_clip: float
    kind: str  # npu | cuda | cpu
    device: torch.device
    world_size: int
    rank: int
    peak_flops: float | None = None
    save_every: int = 0  # 0: never
    stop_on_nonfinite: bool = True


def _comm_device(device: torch.device) -> torch.device:
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return torch.device("cpu") if backend == "gloo" else device


def _as_float(t: torch.Tensor) -> float:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return float(t.detach().float().cpu())


def run(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, task: Task,
        batches: Iterator[dict[str, Any]], s: LoopSettings, *, start_step: int,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        save: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Run optimizer steps start_step..s.steps-1; returns one record per step."""
    model.train()
    comm = _comm_device(s.device)
    params = [p for p in model.parameters() if p.requires_grad]
    records: list[dict[str, Any]] = []
    flops_per_sample: float | None = None
    for step in range(start_step, s.steps):
        devices.synchronize(s.kind)
        t0 = time.perf_counter()
        data_wait = 0.0
        loss_sum = torch.zeros((), dtype=torch.float64, device=s.device)
        lr = float(scheduler.get_last_lr()[0])
        for _ in range(s.accum):
            tw = time.perf_counter()
            batch = next(batches)
            data_wait += time.perf_counter() - tw
            batch, rand = split_rand(batch)
            batch = task.prepare(batch)
            rand = {k: v.to(s.device, non_blocking=True) for k, v in rand.items()}
            if flops_per_sample is None:
                flops_per_sample = task.flops_per_sample(batch)
            loss = task.loss(model, batch, rand)
            (loss / s.accum).backward()
            loss_sum += loss.detach().to(torch.float64)
        grad_norm_t = torch.nn.utils.clip_grad_norm_(params, s.grad_clip, error_if_nonfinite=False)
        grad_norm = _as_float(grad_norm_t)
        finite = math.isfinite(grad_norm)
        if finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # a skipped (non-finite) step still advances the schedule
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()

        loss_total = loss_sum.to(comm)
        dist.all_reduce(loss_total, op=dist.ReduceOp.SUM)
        loss_mean = float(loss_total) / (s.accum * s.world_size)
        stats = torch.tensor([data_wait, float(devices.peak_memory_bytes(s.kind))],
                             dtype=torch.float64, device=comm)
        per_rank = [torch.zeros_like(stats) for _ in range(s.world_size)]
        dist.all_gather(per_rank, stats)
        stats = torch.stack(per_rank).max(dim=0).values
        devices.synchronize(s.kind)
        step_time = time.perf_counter() - t0
        sps = s.global_batch / step_time if step_time > 0 else 0.0
        record = {
            "step": step + 1,
            "loss": loss_mean,
            "grad_norm": grad_norm,
            "lr": lr,
            "step_time_s": step_time,
            "samples_per_s": sps,
            "data_wait_s": float(stats[0]),
            "peak_memory_bytes": int(stats[1]),
            "peak_memory_bytes_per_rank": [int(r[1]) for r in per_rank],
            "mfu": compute_mfu(flops_per_sample, sps, s.peak_flops, s.world_size),
            "flops_per_sample": flops_per_sample,
        }
        records.append(record)
        if on_step is not None:
            on_step(record)
        if not (finite and math.isfinite(loss_mean)) and s.stop_on_nonfinite:
            raise NonFiniteError(
                f"step {step + 1}: loss {loss_mean} / gradient norm {grad_norm} is not finite"
            )
        if save is not None and ((s.save_every and (step + 1) % s.save_every == 0)
                                 or step + 1 == s.steps):
            save(step + 1)
    return records
