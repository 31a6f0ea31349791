"""The optimizer-step loop: the data, the steps, the learning-rate schedule, metrics, checkpoints.

It knows nothing about pi0.5: a `Task` supplies the loss of a micro-batch and the preparation
of a collated batch, so the same loop is unit-tested with a small module. Each optimizer step is
`pisft.train.step.train_step` (accumulation, clipping, the step skipped on the device when the
gradient is not finite, EMA), the step every benchmark measures too.

No device->host synchronisation inside an optimizer step (an accelerator runs ahead of the host;
a sync per step idles it). Per-step values (loss sum, gradient norm, finiteness) stay on the
device and are fetched in one transfer every `log_every` steps, at every checkpoint, at the end,
and after the run's first step (its time, which holds a compiled run's compilation, is then its
own); metrics.jsonl still gets one line per optimizer step.

Collectives use only dtypes that HCCL accepts for the operation on Ascend 910B (float32 sums,
int64 gathers; never float64): torch_npu v2.11.0-26.1.0,
torch_npu/csrc/distributed/ProcessGroupHCCL.cpp, `checkSupportedDataType` (reductions accept
int8/16/32/64, fp16, fp32, bf16 only). The test stand-in `torch_npu` enforces that table.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pisft import device as devices
from pisft.train.batches import split_rand
from pisft.train.metrics import mfu as compute_mfu
from pisft.train.step import StepSettings, train_step


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
    log_every: int = 1  # fetch per-step values from the device every this many steps


def _comm_device(device: torch.device) -> torch.device:
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return torch.device("cpu") if backend == "gloo" else device


@dataclass
class _Pending:
    """Steps run since the last fetch: device tensors and host-side figures."""

    steps: list[int] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    grad_norms: list[torch.Tensor] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    data_waits: list[float] = field(default_factory=list)
    since: float = 0.0


def _fetch(p: _Pending, s: LoopSettings, flops_per_sample: float | None) -> list[dict[str, Any]]:
    """One all-reduce (losses, float32) and one all-gather (per-rank stats, int64) for the
    pending steps, then one transfer of each to the host."""
    comm = _comm_device(s.device)
    n = len(p.steps)
    values = torch.cat([torch.stack(p.losses), torch.stack(p.grad_norms).float()]).to(comm)
    dist.all_reduce(values[:n], op=dist.ReduceOp.SUM)
    stats = torch.tensor([*(round(w * 1e6) for w in p.data_waits),  # microseconds
                          devices.peak_memory_bytes(s.kind), devices.peak_reserved_bytes(s.kind)],
                         dtype=torch.int64, device=comm)
    gathered = [torch.zeros_like(stats) for _ in range(s.world_size)]
    dist.all_gather(gathered, stats)
    host = values.cpu().double()
    losses = (host[:n] / (s.accum * s.world_size)).tolist()
    norms = host[n:].tolist()
    per_rank = torch.stack(gathered).cpu()
    wait_max = (per_rank[:, :n].max(dim=0).values.double() / 1e6).tolist()
    per_rank = per_rank[:, n:].tolist()
    devices.synchronize(s.kind)
    step_time = (time.perf_counter() - p.since) / len(p.steps)  # interval mean (device-bound)
    sps = s.global_batch / step_time if step_time > 0 else 0.0
    return [{
        "step": step + 1,
        "loss": losses[i],
        "grad_norm": float(norms[i]),
        "lr": p.lrs[i],
        "step_time_s": step_time,
        "samples_per_s": sps,
        "data_wait_s": float(wait_max[i]),
        "peak_memory_bytes": max(r[0] for r in per_rank),
        "peak_memory_bytes_per_rank": [r[0] for r in per_rank],
        "peak_reserved_bytes": max(r[1] for r in per_rank),
        "peak_reserved_bytes_per_rank": [r[1] for r in per_rank],
        "mfu": compute_mfu(flops_per_sample, sps, s.peak_flops, s.world_size),
        "flops_per_sample": flops_per_sample,
    } for i, step in enumerate(p.steps)]


def run(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, task: Task,
        batches: Iterator[dict[str, Any]], s: LoopSettings, *, start_step: int,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        save: Callable[[int], None] | None = None, ema: Any = None) -> list[dict[str, Any]]:
    """Run optimizer steps start_step..s.steps-1; returns one record per step. `ema`
    (pisft.train.ema.WeightsEMA) is updated after every applied optimizer step."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    records: list[dict[str, Any]] = []
    flops: list[float | None] = []
    waits = [0.0]
    step_settings = StepSettings(accum=s.accum, grad_clip=s.grad_clip, kind=s.kind, device=s.device)

    def next_micro_batch() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        tw = time.perf_counter()
        batch = next(batches)
        waits[0] += time.perf_counter() - tw
        batch, rand = split_rand(batch)
        batch = task.prepare(batch)
        rand = {k: v.to(s.device, non_blocking=True) for k, v in rand.items()}
        if not flops:
            flops.append(task.flops_per_sample(batch))
        return batch, rand

    devices.synchronize(s.kind)
    pending = _Pending(since=time.perf_counter())
    for step in range(start_step, s.steps):
        waits[0] = 0.0
        pending.lrs.append(float(scheduler.get_last_lr()[0]))
        outcome = train_step(model, optimizer, task, next_micro_batch, step_settings, params=params, ema=ema)
        loss_sum, grad_norm, data_wait = outcome.loss_sum, outcome.grad_norm, waits[0]
        flops_per_sample = flops[0] if flops else None
        with warnings.catch_warnings():  # a skipped (non-finite) step still advances the schedule
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()
        pending.steps.append(step)
        pending.losses.append(loss_sum)
        pending.grad_norms.append(grad_norm)
        pending.data_waits.append(data_wait)
        saving = save is not None and ((s.save_every and (step + 1) % s.save_every == 0)
                                       or step + 1 == s.steps)
        first = step == start_step  # fetched alone: its time is the run's first step (compilation)
        if not (first or saving or (step + 1) % s.log_every == 0 or step + 1 == s.steps):
            continue
        fetched = _fetch(pending, s, flops_per_sample)
        pending = _Pending(since=time.perf_counter())
        for record in fetched:
            records.append(record)
            if on_step is not None:
                on_step(record)
            if s.stop_on_nonfinite and not (math.isfinite(record["grad_norm"])
                                            and math.isfinite(record["loss"])):
                raise NonFiniteError(f"step {record['step']}: loss {record['loss']} / gradient "
                                     f"norm {record['grad_norm']} is not finite")
        if saving:
            save(step + 1)
    return records
