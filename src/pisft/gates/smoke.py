"""The `smoke_1card` stage: a few optimizer steps on one process, then a go/no-go report.

Each smoke step is one micro-batch at the real micro batch size, precision and activation
checkpointing of the training run, on the same fixed micro-batch (the first one of the run,
with its fixed flow-matching draws) at the peak learning rate: a model that can learn must
lower that loss within a few steps.

Checks (all must pass): loss finite, gradients finite, loss falling (last < first), memory
headroom. Before the steps, the one-card gate (`one_card_gate`) decides whether the whole model
with AdamW state fits this card, against the memory the device reports free, not its capacity.
The run that the smoke stage gates is the N-process train_8card run, where the
parameters, gradients and optimizer state are sharded N ways; the report gives the measured
1-process peak and the projected per-device peak on N devices (measured peak minus the
(N-1)/N of the model state that sharding removes), and the headroom check applies to the latter.
CPU has no fixed capacity: the headroom check is skipped there, with a note.

The gate also decides, on this device, what the run it guards executes where the config says
`auto` (the report's `decisions`, pisft.train.decisions; train_8card's workers follow it):
`train.compile: auto` runs the smoke steps eagerly, then compiled from the same start, and keeps
the compiled blocks only when they ran, agreed with eager and were faster (pisft.gates.compile_trial;
on the CPU the trial is skipped, with the reason). The report's step figures are the chosen mode's.
`train.micro_batch_size: auto` and `train.activation_checkpointing: auto` are sized first, from a
measured step per candidate (pisft.gates.micro_batch); the smoke steps then run at the choice.

`results/smoke/report.json` is written even when a check fails (a copy also goes to
`results/logs/smoke_1card/report.json`, which survives a workflow's cleanup of failed outputs);
the process then exits with status 3 and an actionable message.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from pisft import layout
from pisft import config as config_mod
from pisft import device as devices
from pisft.data.augment import make_augment
from pisft.device import hccl_buffer_bytes, out_of_memory
from pisft.gates import compile_trial, micro_batch
from pisft.model.registry import spec_of
from pisft.io import atomic_dir, write_json_atomic
from pisft.stages import SMOKE_1CARD
from pisft.tensors import local_bytes, optimizer_state
from pisft.train import blocks, loop
from pisft.train.batches import StepDataset
from pisft.train.decisions import AUTO, CHECKPOINTING, COMPILE, DECISIONS, MICRO_BATCH, decision, with_train
from pisft.train.job import Context, build, env_summary, make_sampler, peak_flops

SMOKE_FAILED_EXIT = 3


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters + gradients (same size) + optimizer state held by this process.

    A gradient is counted for each parameter the optimizer stepped (it keeps state for those):
    pi0.5 has trainable parameters the loss never reaches, which hold no gradient in training.
    """
    stepped = {id(p) for p in optimizer.state}
    total = 0
    for p in model.parameters():
        has_grad = id(p) in stepped if stepped else p.requires_grad
        total += local_bytes(p) * (2 if has_grad else 1)
    return total + local_bytes(optimizer_state(optimizer, scalars=True))


def _estimate(cfg: Any) -> Any:
    """pisft.introspect.estimate's analytic per-device memory for 1 and for N devices (informative)."""
    try:
        from pisft.introspect.estimate import estimate_memory
    except ImportError:
        return None
    out: dict[str, Any] = {}
    for n in sorted({1, cfg.world_size}):
        try:
            est = estimate_memory(cfg, world_size=n)
            out[str(n)] = {"total_bytes": est["total_bytes"], "bytes": est["bytes"],
                           "state_bytes": est["state_bytes"]}
        except Exception as exc:  # noqa: BLE001 - an estimate is informative only
            out[str(n)] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def estimate_before_group(cfg: Any) -> None:
    """smoke_1card's `before_group` (pisft.stages): `_estimate`'s estimates made in this process
    before it joins its process group (pisft.introspect.estimate.estimate_before_process_group), so
    that `_report_head` reads them instead of starting a process. A failure here is left to
    `_estimate`, which asks again inside the group and records the error in the report."""
    try:
        from pisft.introspect.estimate import estimate_before_process_group

        estimate_before_process_group(_estimated(cfg))
    except Exception:  # noqa: BLE001 - informative only: `_estimate` records the error
        pass


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
                self.state[p]["stepped"] = True  # (no tensor: holds no memory) see model_state_bytes
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(p.grad), alpha=-group["lr"])


def one_card_gate(estimate_bytes: int, free: int | None, capacity: int | None,
                  headroom_fraction: float, hccl_bytes: int = 0) -> dict[str, Any]:
    """Whether the whole model with AdamW state (the estimate for one device) fits this card.

    Compared with the memory the device reports FREE before the model is built (what the
    runtime context, other processes and earlier allocations leave), not with its capacity:
    needed = estimate + HCCL's buffers (outside the allocator) + `headroom_fraction` of the
    capacity (smoke.min_memory_headroom: the estimate's own error, operator workspaces and the
    allocator's fragmentation, which no estimate counts; docs/memory.md). Without a free figure
    (a device whose runtime has no mem_get_info) the capacity decides; on the CPU nothing does.
    `decided_by` names the figure that decided.
    """
    if capacity is None:
        return {"fits": True, "decided_by": None, "detail": "CPU: no fixed device capacity"}
    headroom = int(headroom_fraction * capacity)
    needed = int(estimate_bytes) + int(hccl_bytes) + headroom
    limit, decided_by = (free, "free") if free is not None else (capacity, "capacity")
    gib = 2**30
    return {
        "fits": needed <= limit, "decided_by": decided_by,
        "estimate_bytes": int(estimate_bytes), "hccl_buffer_bytes": int(hccl_bytes),
        "headroom_bytes": headroom, "needed_bytes": needed,
        "free_bytes": free, "capacity_bytes": capacity,
        "detail": (f"one device needs about {needed / gib:.1f} GiB (estimate {estimate_bytes / gib:.1f}"
                   f" + HCCL buffers {hccl_bytes / gib:.2f} + headroom {headroom / gib:.1f} = "
                   f"{headroom_fraction:.0%} of {capacity / gib:.1f}); the device reports "
                   + (f"{free / gib:.1f} GiB free" if free is not None else "no free figure")
                   + f": the {decided_by} memory decided"),
    }


def _adamw_fits_one_device(cfg: Any, estimate: Any, gate_inputs: dict[str, Any]) -> tuple[bool, str, dict]:
    """AdamW, or sign descent when the whole model with AdamW state would not fit (see
    `one_card_gate`); the gate's figures go to the report (`one_card_gate`)."""
    capacity = gate_inputs.get("capacity")
    if capacity is None or not isinstance(estimate, dict) or "total_bytes" not in estimate.get("1", {}):
        return True, "adamw", {"fits": True, "decided_by": None,
                               "detail": "no device capacity or no estimate: AdamW"}
    gate = one_card_gate(estimate["1"]["total_bytes"], gate_inputs.get("free"), capacity,
                         cfg.smoke.min_memory_headroom, gate_inputs.get("hccl", 0))
    if gate["fits"]:
        return True, "adamw", gate
    return False, (f"sign descent (AdamW's first step without its state): {gate['detail']}; "
                   "the state is added to the N-device projection analytically"), gate


def _advice(cfg: Any) -> str:
    t = cfg.train
    tips = []
    if t.micro_batch_size == AUTO or t.micro_batch_size > 1:
        tips.append(f"lower train.micro_batch_size (now {t.micro_batch_size}; the global batch "
                    "stays the same through more accumulation steps)")
    if t.precision != "bf16":
        tips.append("set train.precision: bf16")
    if t.activation_checkpointing is False:
        tips.append("set train.activation_checkpointing: true (or auto)")
    tips.append(f"use more devices (train.nproc_per_node / train.nnodes, now {cfg.world_size}): "
                "parameters, gradients and optimizer state are sharded across them")
    return "; or ".join(tips)


def run_smoke(ctx: Context) -> int:
    """Run the smoke steps, check them, project memory and wall time, write the report."""
    written = ctx.cfg
    report = _report_head(ctx)
    run = _run_steps(ctx, report)
    ctx = run.ctx or ctx  # the micro batch and checkpointing the gate decided (`auto`), as measured
    cfg = ctx.cfg
    report["micro_batch_size"] = ctx.cfg.train.micro_batch_size
    report["activation_checkpointing"] = ctx.cfg.train.activation_checkpointing
    compiler = getattr(run.built, "compiler", None)
    report["compiled"] = bool(compiler is not None and compiler.enabled)
    report.update(_step_figures(ctx, run, report["compiled"]))
    if run.failure is not None:
        checks = [{"name": "fits_in_memory", "passed": False, "detail": run.failure}]
    else:
        checks = training_checks(report["losses"], report["grad_norms"])
        projection = _memory_projection(ctx, run, report)
        report.update(projection)
        checks.append(headroom_check(projection["projected_peak_memory_bytes_per_device"][str(cfg.world_size)],
                                     report["capacity_bytes"], cfg.world_size,
                                     cfg.smoke.min_memory_headroom))
        report["memory_headroom"] = checks[-1].pop("headroom")
        if not checks[-1]["passed"] and isinstance(cfg.train.micro_batch_size, int) and cfg.train.micro_batch_size > 1:
            checks[-1]["detail"] += f"; {MICRO_BATCH}: {_name_largest_fitting(ctx, run, report)}"
    report.update(wall_time_projection(cfg, report["step_time_s"]))
    report["checks"] = checks
    report["passed"] = all(c["passed"] for c in checks)
    report["messages"] = [failure_message(cfg, c) for c in checks if not c["passed"]]
    report["pisft_config"] = config_mod.resolved(written)  # as written: train_8card's must match it
    return _write_and_judge(ctx, report)


# ------------------------------------------------------------------------------------ running
@dataclass
class SmokeRun:
    records: list[dict[str, Any]] = field(default_factory=list)  # one per smoke step (loop.run)
    built: Any = None  # the stage's Built (model, optimizer), None if building ran out of memory
    failure: str | None = None  # the out-of-memory message, if the steps did not fit
    peak_memory_bytes: int | None = None  # the steps' peak, read before the operation count's micro-step
    ctx: Any = None  # the stage's Context with `auto` micro batch and checkpointing as decided (None: failed)
    gate_inputs: dict[str, Any] = field(default_factory=dict)  # free memory, capacity, HCCL's buffers
    peak_flops: float | None = None
    start: list | None = None  # the weights before the first step (a host copy), when a search needs them


def _report_head(ctx: Context) -> dict[str, Any]:
    cfg, t = ctx.cfg, ctx.cfg.train
    return {
        "stage": SMOKE_1CARD.name,
        "device": {"kind": ctx.info.kind, "name": ctx.info.name, "backend": ctx.info.backend},
        "micro_batch_size": t.micro_batch_size,
        "precision": t.precision,
        "activation_checkpointing": t.activation_checkpointing,
        "trainable": t.trainable,
        "compile": t.compile,
        "smoke_steps": cfg.smoke.steps,
        "target_world_size": cfg.world_size,
        "environment": env_summary(),
        "estimate": _estimate(_estimated(cfg)),
        # the settings the estimate is made at (`auto` ones as 1 and off: `_estimated`)
        "estimate_at": {"micro_batch_size": _estimated(cfg).train.micro_batch_size,
                        "activation_checkpointing": _estimated(cfg).train.activation_checkpointing},
    }


def _estimated(cfg: Any) -> Any:
    """The config the estimate is made for: `auto` micro batch and checkpointing as 1 and off (the
    estimate then gives the sizing its FSDP buffers, which do not depend on them; the report's
    `estimate_at`)."""
    t = cfg.train
    if AUTO not in (t.micro_batch_size, t.activation_checkpointing):
        return cfg
    return with_train(cfg, micro_batch_size=1 if t.micro_batch_size == AUTO else t.micro_batch_size,
                      activation_checkpointing=False if t.activation_checkpointing == AUTO
                      else t.activation_checkpointing)


def _run_steps(ctx: Context, report: dict[str, Any]) -> SmokeRun:
    """Build the stage and run the smoke steps; an out-of-memory is a failure, not a crash."""
    cfg, t = ctx.cfg, ctx.cfg.train
    run = SmokeRun()
    trial = compile_trial.wants_trial(t.compile, ctx.info.kind)
    report[DECISIONS] = {COMPILE: compile_trial.as_written(t.compile)}
    try:
        gate_inputs = {  # read before the model exists: what this card really has for it
            "free": devices.free_memory_bytes(ctx.info.kind, ctx.info.device),
            "capacity": devices.capacity_bytes(ctx.info.kind, ctx.info.device),
            "hccl": hccl_buffer_bytes(ctx.info.kind)}
        first = compile_trial.first_mode(t.compile)  # auto: eager first, then the trial
        # `auto` checkpointing is built off and switched when sized (pi05.construction.set_layer_checkpointing)
        run.built = build(dataclasses.replace(ctx, cfg=_estimated(with_train(cfg, compile=first))))
        fits, report["optimizer"], report["one_card_gate"] = _adamw_fits_one_device(
            cfg, report["estimate"], gate_inputs)
        if not fits:
            run.built.optimizer = SignDescent(run.built.model.parameters(), lr=t.lr,
                                              weight_decay=t.weight_decay)
        peak, report["peak_flops_source"] = peak_flops(ctx)
        sizes = gate_inputs["capacity"] is not None
        start = compile_trial.snapshot(run.built.model) if trial or sizes else None
        run.gate_inputs, run.peak_flops, run.start = gate_inputs, peak, start
        sized = _size(ctx, run, report, gate_inputs, peak, start)
        if sized is None:
            return run
        run.ctx = ctx = sized
        run.records, batch = _steps(ctx, run.built, peak)
        run.peak_memory_bytes = devices.peak_memory_bytes(ctx.info.kind)
        if trial:
            report[DECISIONS][COMPILE] = _compile_trial(ctx, run, peak, start)
        try:
            report["host_ops"] = _host_ops(ctx, run.built, batch)
        except Exception as exc:  # a measurement of a step that ran: the gate's verdict stands without it
            if out_of_memory(exc):
                raise
            ctx.log(f"note: the operations of a micro-step were not counted ({type(exc).__name__}: {exc})")
            report["host_ops"] = {"error": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        run.failure = (f"out of device memory at micro batch {ctx.cfg.train.micro_batch_size} on one device "
                       f"({type(exc).__name__}). To fit: {_advice(ctx.cfg)}.")
    return run


def _sizing(ctx: Context, run: SmokeRun, report: dict[str, Any], gate_inputs: dict[str, Any],
            peak: float | None, start: list | None) -> tuple[micro_batch.Sizing, dict[str, int], list[int]]:
    """The search of pisft.gates.micro_batch on the built model: one optimizer step of the smoke batch
    per (micro batch, checkpointing) measured, the weights (`start`; else only the optimizer state)
    restored after; the figures it fits against; the candidates."""
    cfg, t, kind = ctx.cfg, ctx.cfg.train, ctx.info.kind
    capacity = gate_inputs["capacity"]
    free = gate_inputs["free"] if gate_inputs["free"] is not None else capacity
    figures = {"free": free, "capacity": capacity, "margin": int(cfg.smoke.min_memory_headroom * capacity),
               "hccl": int(gate_inputs["hccl"])}

    def measure(m: int, checkpointing: bool) -> tuple[int, int] | None:
        spec_of(run.built.model).set_layer_checkpointing(run.built.model, checkpointing)
        sized = dataclasses.replace(ctx, cfg=with_train(cfg, micro_batch_size=m,
                                                        activation_checkpointing=checkpointing))
        devices.reset_peak_memory(kind)
        try:
            _steps(sized, run.built, peak, steps=1)
            got = (devices.peak_memory_bytes(kind), model_state_bytes(run.built.model, run.built.optimizer))
        except Exception as exc:
            if not out_of_memory(exc):
                raise
            got = None
        if start is not None:
            compile_trial.restore(run.built.model, start, run.built.optimizer)
        else:
            run.built.optimizer.zero_grad(set_to_none=True)
            run.built.optimizer.state.clear()
        devices.empty_cache(kind)
        return got

    sizing = micro_batch.Sizing(measure, cfg.world_size, micro_batch.extra_n(report["estimate"], cfg.world_size),
                                free - figures["margin"] - figures["hccl"])
    batches = [t.global_batch_size, *([cfg.value_global_batch_size] if cfg.recap.iterations else [])]
    return sizing, figures, micro_batch.candidates(batches, cfg.world_size)


def _size(ctx: Context, run: SmokeRun, report: dict[str, Any], gate_inputs: dict[str, Any], peak: float | None,
          start: list | None) -> Context | None:
    """`auto` train.micro_batch_size and train.activation_checkpointing on this device
    (pisft.gates.micro_batch): the Context the smoke steps then run with, or None with `run.failure`
    said. Explicit values run as written (the smoke steps and the headroom check measure them;
    `_name_largest_fitting` names the largest that fits when they do not)."""
    t = ctx.cfg.train
    if AUTO not in (t.micro_batch_size, t.activation_checkpointing):
        line = ("as written; measured by the smoke steps (memory_headroom)" if gate_inputs["capacity"] is not None
                else "as written (no device memory figure to fit: the CPU)")
        report[DECISIONS][MICRO_BATCH] = decision(t.micro_batch_size, t.micro_batch_size, line)
        report[DECISIONS][CHECKPOINTING] = decision(t.activation_checkpointing, t.activation_checkpointing, line)
        return ctx
    if gate_inputs["capacity"] is None:
        run.failure = micro_batch.NO_FIGURE
        return None
    sizing, figures, sizes = _sizing(ctx, run, report, gate_inputs, peak, start)
    result = micro_batch.decide(t.micro_batch_size, t.activation_checkpointing, sizes, sizing)
    entry, ckpt_entry = micro_batch.entries(t.micro_batch_size, t.activation_checkpointing, result, sizing,
                                            **figures)
    report[DECISIONS][MICRO_BATCH], report[DECISIONS][CHECKPOINTING] = entry, ckpt_entry
    if result["chosen"] is None:
        run.failure = f"{MICRO_BATCH}: {entry['line']}. To fit: {_advice(ctx.cfg)}."
        return None
    m, checkpointing = result["chosen"]
    spec_of(run.built.model).set_layer_checkpointing(run.built.model, checkpointing)
    ctx.log(f"{MICRO_BATCH}: {m}, {CHECKPOINTING}: {str(checkpointing).lower()} "
            f"({entry['line']}; {ckpt_entry['line']})")
    return dataclasses.replace(ctx, cfg=with_train(ctx.cfg, micro_batch_size=m,
                                                   activation_checkpointing=checkpointing))


def _name_largest_fitting(ctx: Context, run: SmokeRun, report: dict[str, Any]) -> str:
    """An explicit micro batch failed the headroom check: the largest smaller one that fits, measured
    (the decision entry records it; train_8card's launcher refuses the failed report before torchrun)."""
    t = ctx.cfg.train
    sizing, figures, sizes = _sizing(ctx, run, report, run.gate_inputs, run.peak_flops, run.start)
    smaller = [m for m in sizes if m < t.micro_batch_size]
    result = {"chosen": None, "largest_fitting": sizing.largest(smaller, bool(t.activation_checkpointing))}
    entry, _ = micro_batch.entries(t.micro_batch_size, t.activation_checkpointing, result, sizing, **figures)
    report[DECISIONS][MICRO_BATCH] = entry
    return entry["line"]


def _compile_trial(ctx: Context, run: SmokeRun, peak: float | None, start: list) -> dict[str, Any]:
    """train.compile: auto on this device: the smoke steps again with the blocks compiled, from the
    same start (pisft.gates.compile_trial); the run's figures become the chosen mode's."""
    cfg, built, kind = ctx.cfg, run.built, ctx.info.kind
    compiled: dict[str, Any] = {}

    def steps() -> tuple[list, int]:
        ctx.log("train.compile: auto: the same steps with the blocks compiled (the trial)")
        compiled["records"], _ = _steps(ctx, built, peak)
        compiled["peak"] = devices.peak_memory_bytes(kind)
        return compiled["records"], compiled["peak"]

    entry = compile_trial.run_trial(
        built.compiler, lambda: blocks.compiler_for("layers", kind, layout.compile_cache(cfg), ctx.log), steps,
        compile_trial.figures(run.records, run.peak_memory_bytes), cfg.train.precision,
        lambda: compile_trial.restore(built.model, start, built.optimizer))
    ctx.log(f"train.compile: auto -> {entry['chosen']}: {entry['line']}")
    if entry["chosen"] == "layers":
        run.records, run.peak_memory_bytes = compiled["records"], compiled["peak"]
    return entry


def _steps(ctx: Context, built: Any, peak: float | None,
           steps: int | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """smoke.steps (or `steps`) optimizer steps on the run's first micro-batch at the peak learning
    rate; their records and that micro-batch (collated)."""
    from torch.utils.data import default_collate

    cfg, t = ctx.cfg, ctx.cfg.train
    first = make_sampler(cfg, built.train_set, 1).micro_batch(0, 0, 0)  # the real run's first
    ds = StepDataset(built.train_set, t.seed, built.task.draw, built.prompt,  # as the training loader
                     augment=make_augment(cfg.data.augment, built.image_keys))
    fixed = default_collate([ds[ref] for ref in first])
    batches = (dict(fixed) for _ in itertools.count())
    scheduler = torch.optim.lr_scheduler.LambdaLR(built.optimizer, lambda _: 1.0)
    settings = loop.LoopSettings(
        steps=steps or cfg.smoke.steps, accum=1, global_batch=t.micro_batch_size, grad_clip=t.grad_clip,
        kind=ctx.info.kind, device=ctx.info.device, world_size=1, rank=0, peak_flops=peak,
        stop_on_nonfinite=False, log_every=t.log_every)

    def on_step(record: dict) -> None:
        ctx.log(f"smoke step {record['step']}/{cfg.smoke.steps}: loss {record['loss']:.5f} "
                f"grad_norm {record['grad_norm']:.4f} {record['step_time_s']:.3f} s")

    devices.reset_peak_memory(ctx.info.kind)
    return loop.run(built.model, built.optimizer, scheduler, built.task, batches, settings,
                    start_step=0, on_step=on_step), fixed


def _host_ops(ctx: Context, built: Any, collated: dict[str, Any]) -> dict[str, Any]:
    """The operations one micro-step of this run dispatches (`pisft.introspect.host_ops`: aten
    operators and compiled kernels; the count behind the host's share of a step), counted on
    one more micro-step of the smoke batch after the steps, its gradients then dropped."""
    from pisft.introspect.host_ops import DispatchedOps
    from pisft.train.batches import split_rand
    from pisft.train.step import micro_step

    batch, rand = split_rand(dict(collated))
    batch = built.task.prepare(batch)
    rand = {k: v.to(ctx.info.device) for k, v in rand.items()}
    counter = DispatchedOps()
    with counter:
        micro_step(built.model, built.task, batch, rand, 1)
    built.optimizer.zero_grad(set_to_none=True)
    summary = counter.summary()
    kernels = "CPU-side compiled kernels (not counted off the CPU)" if ctx.info.row.accelerator else "compiled kernels"
    return {"ops_per_micro_step": summary["total"], "aten_ops": summary["aten_ops"],
            "compiled_kernels": summary["compiled_kernels"], "counted": f"aten operators and {kernels}",
            "most_dispatched": summary["most_dispatched"]}


def _step_figures(ctx: Context, run: SmokeRun, compiled: bool = False) -> dict[str, Any]:
    """Losses, gradient norms, step times (median without the first), peak memory, MFU; the first
    step's own time and, compiled, what it took beyond a later step (the compilation; null with one
    step, which has no later step to compare with)."""
    records = run.records
    losses = [r["loss"] for r in records]
    times = [r["step_time_s"] for r in records]
    later = statistics.median(times[1:]) if len(times) > 1 else None
    figures: dict[str, Any] = {
        "first_step_time_s": times[0] if times else None,
        "compile_s": (max(0.0, times[0] - later) if later is not None else None) if compiled else 0.0,
        "losses": losses,
        "grad_norms": [r["grad_norm"] for r in records],
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "step_time_s": statistics.median(times[1:] if len(times) > 1 else times) if times else None,
        "step_times_s": times,
        "peak_memory_bytes": (run.peak_memory_bytes if run.peak_memory_bytes is not None
                              else devices.peak_memory_bytes(ctx.info.kind)),
        "capacity_bytes": devices.capacity_bytes(ctx.info.kind, ctx.info.device),
    }
    if records:
        figures["flops_per_sample"] = records[-1]["flops_per_sample"]
        figures["mfu"] = records[-1]["mfu"]
    return figures


# ------------------------------------------------------------------------------------- checks
def training_checks(losses: list[float], grad_norms: list[float]) -> list[dict[str, Any]]:
    """Loss finite, gradients finite, loss falling (last < first)."""
    finite_loss = all(math.isfinite(x) for x in losses)
    finite_grads = all(math.isfinite(x) for x in grad_norms)
    falling = finite_loss and len(losses) >= 2 and losses[-1] < losses[0]
    return [
        {"name": "loss_finite", "passed": finite_loss,
         "detail": None if finite_loss else "a loss is NaN/inf"},
        {"name": "grads_finite", "passed": finite_grads,
         "detail": None if finite_grads else "a gradient norm is NaN/inf"},
        {"name": "loss_falling", "passed": falling,
         "detail": f"first {losses[0]:.6g}, last {losses[-1]:.6g}" if losses else None},
    ]


def headroom_check(projected: float, capacity: int | None, n_target: int,
                   minimum: float) -> dict[str, Any]:
    """The projected per-device peak against the device's capacity (skipped on the CPU).

    The returned check carries `headroom` (the free fraction, None on the CPU) for the report.
    """
    if capacity is None:
        return {"name": "memory_headroom", "passed": True, "skipped": True, "headroom": None,
                "detail": "CPU: no fixed device capacity; headroom check skipped"}
    headroom = 1 - projected / capacity
    return {"name": "memory_headroom", "passed": headroom >= minimum, "headroom": headroom,
            "detail": (f"projected peak {projected / 2**30:.2f} GiB per device on {n_target} "
                       f"device(s) of {capacity / 2**30:.2f} GiB leaves {headroom:.1%} free "
                       f"(minimum smoke.min_memory_headroom = {minimum:.0%})")}


# -------------------------------------------------------------------------- memory projection
def project_memory(peak_one: int, state_bytes: int, n_target: int,
                   adamw_state_bytes: float = 0) -> dict[str, int]:
    """Per-device peak on 1 and on `n_target` devices from the measured 1-process peak.

    Sharding over N devices removes (N-1)/N of the model state (parameters, gradients,
    optimizer state) from each device; AdamW state the smoke run did not hold
    (`adamw_state_bytes`, the sign-descent case) is added whole on 1 device, 1/N on N.
    """
    one = peak_one + adamw_state_bytes
    projected = peak_one - state_bytes * (1 - 1 / n_target) + adamw_state_bytes / n_target
    return {"1": int(one), str(n_target): int(projected)}


def _memory_projection(ctx: Context, run: SmokeRun, report: dict[str, Any]) -> dict[str, Any]:
    policy, optimizer = run.built.model, run.built.optimizer
    fields: dict[str, Any] = {}
    adam = 0
    if isinstance(optimizer, SignDescent):
        # AdamW's two fp32 moments per parameter that receives a gradient, not measured here.
        trained = (report["estimate"] or {}).get("1", {}).get("state_bytes", {}).get("grads")
        adam = 2 * trained if trained else 8 * sum(p.numel() for p in policy.parameters()
                                                   if p.requires_grad)
        fields["adamw_state_bytes_analytic"] = int(adam)
    state = model_state_bytes(policy, optimizer)
    fields["model_state_bytes"] = state
    fields["tensors_vs_estimate"] = tensors_vs_estimate(policy, optimizer, report.get("estimate"))
    fields["projected_peak_memory_bytes_per_device"] = project_memory(
        report["peak_memory_bytes"], state, ctx.cfg.world_size, adam)
    return fields


def tensors_vs_estimate(policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        estimate: Any) -> dict[str, Any]:
    """The model state this 1-device smoke run holds, tensor by tensor (parameters in their
    training dtypes, the optimizer's moments), beside the estimate's for 1 device
    (`pisft.introspect.estimate`, the same train.trainable mode applied): what the mode froze
    shows in both."""
    from pisft.train.trainable import count_parameters

    params = local_bytes(policy.parameters())
    moments = local_bytes(optimizer_state(optimizer))
    out: dict[str, Any] = {"measured_params_bytes": params, "measured_optimizer_bytes": moments,
                           "params": count_parameters(policy)}
    one = (estimate or {}).get("1", {}).get("state_bytes") if isinstance(estimate, dict) else None
    if one:
        out["estimated_params_bytes"] = one["params"]
        out["estimated_optimizer_bytes"] = one["optimizer"]
        out["params_ratio"] = round(one["params"] / params, 4) if params else None
        out["optimizer_ratio"] = round(one["optimizer"] / moments, 4) if moments else None
    return out


def wall_time_projection(cfg: Any, step_time: float | None) -> dict[str, Any]:
    """Wall time of the training run on 1 and on N devices from the median smoke step."""
    if step_time is None:
        return {"projected_wall_time_s": None}
    t, n_target = cfg.train, cfg.world_size
    micro_steps_1 = t.steps * t.global_batch_size // t.micro_batch_size
    return {
        "projected_wall_time_s": {"1": micro_steps_1 * step_time,
                                  str(n_target): micro_steps_1 * step_time / n_target},
        "projection_basis": (
            f"{t.steps} steps × {t.global_batch_size // t.micro_batch_size} micro-batches per step "
            f"/ devices × median smoke micro-step time {step_time:.4g} s; communication and data "
            "loading not included"),
    }


# ------------------------------------------------------------------------------------- report
def failure_message(cfg: Any, check: dict[str, Any]) -> str:
    """What a failed check means and what to do about it."""
    t = cfg.train
    if check["name"] == "memory_headroom":
        return f"memory headroom too small: {check['detail']}. To fit: {_advice(cfg)}."
    if check["name"] in ("loss_finite", "grads_finite"):
        return (f"{check['detail']}: lower train.lr (now {t.lr}); with bf16 try fp32; "
                "check the dataset's stats (results/dataset/meta/stats.json)")
    if check["name"] == "loss_falling":
        return (f"the loss did not fall over {cfg.smoke.steps} steps on one fixed "
                f"batch ({check['detail']}): check train.lr (now {t.lr}), that the base "
                "model and data match, or raise smoke.steps")
    return check["detail"]


def _write_and_judge(ctx: Context, report: dict[str, Any]) -> int:
    """Write the report (and its copy under logs/); log the verdict; the exit status."""
    cfg, n_target = ctx.cfg, ctx.cfg.world_size
    with atomic_dir(layout.smoke(cfg)) as tmp:
        write_json_atomic(tmp / layout.REPORT_FILE, report)
        write_json_atomic(tmp / "pisft_config.json", report["pisft_config"])
    write_json_atomic(layout.iteration(cfg).stage_logs(SMOKE_1CARD.name) / layout.REPORT_FILE, report)
    if report["passed"]:
        ctx.log(f"passed: step {report['step_time_s']:.4g} s, projected wall time on {n_target} "
                f"device(s) {report['projected_wall_time_s'][str(n_target)]:.0f} s; "
                f"report {layout.smoke_report(cfg)}")
        return 0
    print(f"error: smoke_1card failed (report: {layout.smoke_report(cfg)}):\n  - "
          + "\n  - ".join(report["messages"]), file=sys.stderr, flush=True)
    return SMOKE_FAILED_EXIT
