"""One optimizer step of training, the same everywhere: the micro-steps of the accumulation
(forward, backward), gradient clipping, the optimizer step skipped on the device when the
gradient is not finite, and the EMA of the weights.

The training loop (`pisft.train.loop.run`: the policy, the RECAP value model, the smoke gate) and
every benchmark that reports pisft's speed (`pisft.bench.gpu_step`, `pisft.bench.real_size`,
`pisft.bench.train_bench`, `pisft.bench.host_overhead`, `pisft.introspect.measure`) call
`train_step`, so a figure of pisft's speed is a figure of pisft's training. What a benchmark
records (phase times with device synchronisations, memory, dispatched operations) it records
through a `StepProbe`; the training's probe records nothing and synchronises nothing.

No device->host synchronisation inside a step: the loss sum, the gradient norm and whether it
is finite stay on the device (`StepOutcome`), fetched by the loop every `train.log_every` steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pisft.tensors import local_shard

# Device kinds whose fused AdamW kernel honours `found_inf` (torch's CPU and CUDA kernels).
# torch_npu's `_fused_adamw_` (Ascend/op-plugin, op_plugin/ops/opapi/FusedAdamWKernelNpuOpApi.cpp)
# takes `found_inf` in its signature but never reads it: on an NPU the step would be applied.
FOUND_INF_HONOURED = ("cpu", "cuda")
PHASES = ("data", "forward", "backward", "clip", "optimizer")


class StepProbe:
    """What a step reports besides its result; this one reports nothing (the training's).

    `phase(name)` wraps each phase of the step (`PHASES`), `micro_step(i)` each micro-step."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:  # noqa: ARG002 - the probe interface
        yield

    @contextlib.contextmanager
    def micro_step(self, index: int) -> Iterator[None]:  # noqa: ARG002
        yield


NO_PROBE = StepProbe()


class PhaseTimes(StepProbe):
    """Seconds per phase of the steps it probes (summed over micro-steps), the device synchronised
    around each phase so a phase's time is its own (benchmarks; the syncs cost the overlap)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        from pisft import device as devices

        devices.synchronize(self.kind)
        start = time.perf_counter()
        yield
        devices.synchronize(self.kind)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def reset(self) -> None:
        self.seconds = {}


@dataclass(frozen=True)
class StepSettings:
    accum: int  # micro-steps per optimizer step
    grad_clip: float
    kind: str  # npu | cuda | cpu
    device: torch.device


@dataclass
class StepOutcome:
    """One step's result, on the device."""

    loss_sum: torch.Tensor  # float32: the sum of the micro-steps' losses
    grad_norm: torch.Tensor  # the total gradient norm before clipping
    finite: torch.Tensor  # bool: the step was applied


def _on_device(t: torch.Tensor) -> torch.Tensor:
    """The value of a (replicated) DTensor as a plain tensor, without leaving the device."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _zero_nonfinite_grads(params: list[torch.Tensor], finite: torch.Tensor) -> None:
    """Every gradient becomes 0 when `finite` is False, on the device (NaN * 0 would stay NaN)."""
    bad = ~finite
    for p in params:
        if p.grad is not None:
            local_shard(p.grad).masked_fill_(bad, 0.0)


def skip_if_nonfinite_step(optimizer: torch.optim.Optimizer, finite: torch.Tensor, kind: str,
                           params: list[torch.Tensor]) -> None:
    """optimizer.step(), not applied as computed when `finite` (a device bool tensor) is False.

    Fused AdamW on CPU/CUDA skips the step on the device (parameters, moments and step count
    untouched: torch.optim.adam `_fused_adam`, the path torch.amp.GradScaler uses). On an NPU
    the gradients are zeroed on the device instead: parameters and moments stay finite, and the
    step coasts on the momentum; a run with stop_on_nonfinite stops at the next fetch, before any
    checkpoint, so no saved state contains that step. A non-fused optimizer asks the host (one
    sync per optimizer step).
    """
    if not optimizer.defaults.get("fused"):
        if bool(finite):
            optimizer.step()
        return
    if kind not in FOUND_INF_HONOURED:
        _zero_nonfinite_grads(params, finite)
        optimizer.step()
        return
    optimizer.found_inf = (~finite).to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def micro_step(model: nn.Module, task: Any, batch: dict[str, Any], rand: dict[str, torch.Tensor],
               accum: int, probe: StepProbe = NO_PROBE) -> torch.Tensor:
    """Forward and backward of one micro-batch (its gradient scaled by 1/accum, accumulated);
    returns its loss, detached, float32, on the device."""
    with probe.phase("forward"):
        loss = task.loss(model, batch, rand)
    with probe.phase("backward"):
        (loss / accum).backward()
    return loss.detach().float()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, task: Any,
               next_micro_batch: Callable[[], tuple[dict[str, Any], dict[str, torch.Tensor]]],
               s: StepSettings, *, params: list[torch.Tensor] | None = None, ema: Any = None,
               probe: StepProbe = NO_PROBE) -> StepOutcome:
    """One optimizer step: `s.accum` micro-steps on `next_micro_batch()`'s (batch, rand) (prepared
    on the device: `Task.prepare`), the gradient clipped to `s.grad_clip`, the optimizer step
    (skipped on the device when the norm is not finite), `ema` (pisft.train.ema.WeightsEMA)
    updated with what was applied, the gradients freed. `params`: the trained parameters
    (default: those of `model` requiring a gradient)."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    loss_sum = torch.zeros((), dtype=torch.float32, device=s.device)
    for i in range(s.accum):
        with probe.micro_step(i):
            with probe.phase("data"):
                batch, rand = next_micro_batch()
            loss_sum += micro_step(model, task, batch, rand, s.accum, probe)
    with probe.phase("clip"):
        grad_norm = _on_device(torch.nn.utils.clip_grad_norm_(params, s.grad_clip, error_if_nonfinite=False))
        finite = torch.isfinite(grad_norm)
    with probe.phase("optimizer"):
        skip_if_nonfinite_step(optimizer, finite, s.kind, params)
        if ema is not None:
            ema.update(finite)
        optimizer.zero_grad(set_to_none=True)
    return StepOutcome(loss_sum, grad_norm.detach(), finite)


def repeat(batch: dict[str, Any], rand: dict[str, torch.Tensor]) -> Callable[[], tuple[dict, dict]]:
    """A `next_micro_batch` that hands out the same prepared micro-batch every time (benchmarks)."""
    return lambda: (batch, rand)
