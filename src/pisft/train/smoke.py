"""The `smoke_1card` stage: a few optimizer steps on one process, then a go/no-go report.

Each smoke step is one micro-batch at the real micro batch size, precision and activation
checkpointing of the training run, on the same fixed micro-batch (the first one of the run,
with its fixed flow-matching draws) at the peak learning rate: a model that can learn must
lower that loss within a few steps.

Checks (all must pass): loss finite, gradients finite, loss falling (last < first), memory
headroom. The run that the smoke stage gates is the N-process train_8card run, where the
parameters, gradients and optimizer state are sharded N ways; the report gives the measured
1-process peak and the projected per-device peak on N devices (measured peak minus the
(N-1)/N of the model state that sharding removes), and the headroom check applies to the latter.
CPU has no fixed capacity: the headroom check is skipped there, with a note.

`results/smoke/report.json` is written even when a check fails (a copy also goes to
`results/logs/smoke_1card/report.json`, which survives a workflow's cleanup of failed outputs);
the process then exits with status 3 and an actionable message.
"""

from __future__ import annotations

import itertools
import math
import statistics
import sys
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pisft import config as config_mod
from pisft import device as devices
from pisft.io import atomic_dir, write_json_atomic
from pisft.train import loop
from pisft.train.batches import StepDataset
from pisft.train.stage import Context, build, env_summary, make_sampler, peak_flops

SMOKE_FAILED_EXIT = 3


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters + gradients (same size) + optimizer state held by this process."""
    total = 0
    for p in model.parameters():
        total += _local_bytes(p) * (2 if p.requires_grad else 1)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += _local_bytes(value)
    return total


def _estimate(cfg: Any) -> Any:
    """pisft.model.estimate's analytic per-device memory for 1 and for N devices (informative)."""
    try:
        from pisft.model.estimate import estimate_memory
    except ImportError:
        return None
    out: dict[str, Any] = {}
    for n in sorted({1, cfg.world_size}):
        try:
            est = estimate_memory(cfg, world_size=n)
            out[str(n)] = {"total_bytes": est["total_bytes"], "bytes": est["bytes"],
                           "state_bytes": est["state_bytes"]}
        except Exception as exc:  # an estimate is informative only
            out[str(n)] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


class SignDescent(torch.optim.Optimizer):
    """AdamW's first step without AdamW's state: p <- p * (1 - lr * wd) - lr * sign(grad).

    (Adam's bias-corrected first update is grad / |grad| = sign(grad).) Used by the smoke run
    when the AdamW state of the whole model would not fit one device: the N-device run shards
    that state N ways, and the report adds it analytically (8 bytes per trained parameter / N).
    """

    def __init__(self, params, lr: float, weight_decay: float) -> None:
        super().__init__([p for p in params if p.requires_grad], {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - the Optimizer interface
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(p.grad), alpha=-group["lr"])


def _adamw_fits_one_device(cfg: Any, estimate: Any, capacity: int | None) -> tuple[bool, str]:
    if capacity is None or not isinstance(estimate, dict) or "total_bytes" not in estimate.get("1", {}):
        return True, "adamw"
    need = estimate["1"]["total_bytes"]
    if need <= capacity * (1 - cfg.smoke.min_memory_headroom):
        return True, "adamw"
    return False, (f"sign descent (AdamW's first step without its state): the whole model with AdamW "
                   f"state would need about {need / 2**30:.1f} GiB on one device of {capacity / 2**30:.1f} "
                   "GiB; the state is added to the N-device projection analytically")


def _advice(cfg: Any) -> str:
    t = cfg.train
    tips = []
    if t.micro_batch_size > 1:
        tips.append(f"lower train.micro_batch_size (now {t.micro_batch_size}; the global batch "
                    "stays the same through more accumulation steps)")
    if t.precision != "bf16":
        tips.append("set train.precision: bf16")
    if not t.activation_checkpointing:
        tips.append("set train.activation_checkpointing: true")
    tips.append(f"use more devices (train.nproc_per_node / train.nnodes, now {cfg.world_size}): "
                "parameters, gradients and optimizer state are sharded across them")
    return "; or ".join(tips)


def run_smoke(ctx: Context) -> int:
    cfg = ctx.cfg
    t = cfg.train
    kind = ctx.info.kind
    n_target = cfg.world_size
    checks: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "stage": "smoke_1card",
        "device": {"kind": kind, "name": ctx.info.name, "backend": ctx.info.backend},
        "micro_batch_size": t.micro_batch_size,
        "precision": t.precision,
        "activation_checkpointing": t.activation_checkpointing,
        "smoke_steps": cfg.smoke.steps,
        "target_world_size": n_target,
        "environment": env_summary(),
        "estimate": _estimate(cfg),
    }
    records: list[dict[str, Any]] = []
    failure: str | None = None
    built = None
    try:
        built = build(ctx)
        fits, report["optimizer"] = _adamw_fits_one_device(
            cfg, report["estimate"], devices.capacity_bytes(kind, ctx.info.device))
        if not fits:
            built.optimizer = SignDescent(built.policy.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        sampler = make_sampler(cfg, built.train_set, 1)
        first = sampler.micro_batch(0, 0, 0)  # the first micro-batch of the real run
        ds = StepDataset(built.train_set, t.seed, built.task.draw, built.prompt)
        from torch.utils.data import default_collate

        fixed = default_collate([ds[ref] for ref in first])
        batches = (dict(fixed) for _ in itertools.count())
        scheduler = torch.optim.lr_scheduler.LambdaLR(built.optimizer, lambda _: 1.0)
        peak, peak_source = peak_flops(ctx)
        report["peak_flops_source"] = peak_source
        devices.reset_peak_memory(kind)
        settings = loop.LoopSettings(
            steps=cfg.smoke.steps, accum=1, global_batch=t.micro_batch_size, grad_clip=t.grad_clip,
            kind=kind, device=ctx.info.device, world_size=1, rank=0, peak_flops=peak,
            stop_on_nonfinite=False, log_every=t.log_every)

        def on_step(record: dict) -> None:
            ctx.log(f"smoke step {record['step']}/{cfg.smoke.steps}: loss {record['loss']:.5f} "
                    f"grad_norm {record['grad_norm']:.4f} {record['step_time_s']:.3f} s")

        records = loop.run(built.policy, built.optimizer, scheduler, built.task, batches,
                           settings, start_step=0, on_step=on_step)
    except Exception as exc:
        if not _is_oom(exc):
            raise
        failure = (f"out of device memory at micro batch {t.micro_batch_size} on one device "
                   f"({type(exc).__name__}). To fit: {_advice(cfg)}.")

    losses = [r["loss"] for r in records]
    grad_norms = [r["grad_norm"] for r in records]
    report["losses"] = losses
    report["grad_norms"] = grad_norms
    report["first_loss"] = losses[0] if losses else None
    report["last_loss"] = losses[-1] if losses else None
    times = [r["step_time_s"] for r in records]
    step_time = statistics.median(times[1:] if len(times) > 1 else times) if times else None
    report["step_time_s"] = step_time
    report["step_times_s"] = times
    report["peak_memory_bytes"] = devices.peak_memory_bytes(kind)
    report["capacity_bytes"] = devices.capacity_bytes(kind, ctx.info.device)
    if records:
        report["flops_per_sample"] = records[-1]["flops_per_sample"]
        report["mfu"] = records[-1]["mfu"]

    if failure is None:
        finite_loss = all(math.isfinite(x) for x in losses)
        finite_grads = all(math.isfinite(x) for x in grad_norms)
        falling = finite_loss and len(losses) >= 2 and losses[-1] < losses[0]
        checks.append({"name": "loss_finite", "passed": finite_loss,
                       "detail": None if finite_loss else "a loss is NaN/inf"})
        checks.append({"name": "grads_finite", "passed": finite_grads,
                       "detail": None if finite_grads else "a gradient norm is NaN/inf"})
        checks.append({"name": "loss_falling", "passed": falling,
                       "detail": f"first {losses[0]:.6g}, last {losses[-1]:.6g}" if losses else None})
        state = model_state_bytes(built.policy, built.optimizer)
        projected = report["peak_memory_bytes"] - state * (1 - 1 / n_target)
        one = report["peak_memory_bytes"]
        if isinstance(built.optimizer, SignDescent):
            # AdamW's two fp32 moments per parameter that receives a gradient, not measured here.
            trained = (report["estimate"] or {}).get("1", {}).get("state_bytes", {}).get("grads")
            adam = 2 * trained if trained else 8 * sum(p.numel() for p in built.policy.parameters()
                                                       if p.requires_grad)
            report["adamw_state_bytes_analytic"] = int(adam)
            one += adam
            projected += adam / n_target
        report["model_state_bytes"] = state
        report["projected_peak_memory_bytes_per_device"] = {"1": int(one), str(n_target): int(projected)}
        cap = report["capacity_bytes"]
        if cap is None:
            report["memory_headroom"] = None
            checks.append({"name": "memory_headroom", "passed": True, "skipped": True,
                           "detail": "CPU: no fixed device capacity; headroom check skipped"})
        else:
            headroom = 1 - projected / cap
            report["memory_headroom"] = headroom
            ok = headroom >= cfg.smoke.min_memory_headroom
            checks.append({
                "name": "memory_headroom", "passed": ok,
                "detail": (f"projected peak {projected / 2**30:.2f} GiB per device on {n_target} "
                           f"device(s) of {cap / 2**30:.2f} GiB leaves {headroom:.1%} free "
                           f"(minimum smoke.min_memory_headroom = {cfg.smoke.min_memory_headroom:.0%})"),
            })
    else:
        checks.append({"name": "fits_in_memory", "passed": False, "detail": failure})

    if step_time is not None:
        micro_steps_1 = t.steps * t.global_batch_size // t.micro_batch_size
        report["projected_wall_time_s"] = {
            "1": micro_steps_1 * step_time,
            str(n_target): micro_steps_1 * step_time / n_target,
        }
        report["projection_basis"] = (
            f"{t.steps} steps × {t.global_batch_size // t.micro_batch_size} micro-batches per step "
            f"/ devices × median smoke micro-step time {step_time:.4g} s; communication and data "
            "loading not included")
    else:
        report["projected_wall_time_s"] = None
    report["checks"] = checks
    report["passed"] = all(c["passed"] for c in checks)
    messages = []
    for c in checks:
        if not c["passed"]:
            if c["name"] == "memory_headroom":
                messages.append(f"memory headroom too small: {c['detail']}. To fit: {_advice(cfg)}.")
            elif c["name"] in ("loss_finite", "grads_finite"):
                messages.append(f"{c['detail']}: lower train.lr (now {t.lr}); with bf16 try fp32; "
                                "check the dataset's stats (results/dataset/meta/stats.json)")
            elif c["name"] == "loss_falling":
                messages.append(f"the loss did not fall over {cfg.smoke.steps} steps on one fixed "
                                f"batch ({c['detail']}): check train.lr (now {t.lr}), that the base "
                                "model and data match, or raise smoke.steps")
            else:
                messages.append(c["detail"])
    report["messages"] = messages
    report["pisft_config"] = config_mod.resolved(cfg)
    with atomic_dir(cfg.results("smoke")) as tmp:
        write_json_atomic(tmp / "report.json", report)
        write_json_atomic(tmp / "pisft_config.json", config_mod.resolved(cfg))
    write_json_atomic(cfg.results("logs", "smoke_1card", "report.json"), report)
    if report["passed"]:
        ctx.log(f"passed: step {step_time:.4g} s, projected wall time on {n_target} device(s) "
                f"{report['projected_wall_time_s'][str(n_target)]:.0f} s; "
                f"report {cfg.results('smoke', 'report.json')}")
        return 0
    print(f"error: smoke_1card failed (report: {cfg.results('smoke', 'report.json')}):\n  - "
          + "\n  - ".join(messages), file=sys.stderr, flush=True)
    return SMOKE_FAILED_EXIT

