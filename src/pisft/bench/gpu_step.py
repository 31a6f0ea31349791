"""Real-size pi0.5 training step on one accelerator: step time, samples/s, MFU, peak memory.

    python -m pisft.bench.gpu_step                      # cuda, pi05, bf16, every mode, micro 4-32, AC off/on,
                                                        # eager and compiled (train.compile off, layers)
    python -m pisft.bench.gpu_step --trainable expert   # one train.trainable mode
    python -m pisft.bench.gpu_step --compile layers     # the compiled step only
    python -m pisft.bench.gpu_step --device npu         # the same on an Ascend card
    python -m pisft.bench.gpu_step --preset tiny --device cpu --micro 2 --max-micro 2 --steps 1  # dry run

The step measured is the training's (`pisft.train.step.train_step`: forward, backward, clipping,
the optimizer step skipped on the device when the gradient is not finite; `--ema` adds the EMA),
with the blocks run as the training runs them (`pisft.train.blocks`, `--compile`). Per run, after
the timed steps, one more step is profiled (torch.profiler; torch_npu.profiler on an NPU): the
device's busy time (the kernels' own device time), kernel launches per step (the host's launch
calls) and their ratio to the step time (`device_busy_fraction`: well below 1 is a host-bound
step), and one more step with a device synchronisation around each phase (`phase_s`). The first
step of each setting holds a compiled run's compilation (`first_step_s`).

The model is pi0.5 at full size (PaliGemma gemma_2b + gemma_300m expert, 3.35B parameters in the
training model) with random weights (allocated without initialisation, moved to the accelerator,
normal(0, 0.02) matrices, zero vectors): the step costs the same as with real weights. The step
is pisft's own: the training structure (per-layer activation checkpointing, no action-expert
lm_head), the layout of a one-process training run (`--layout unsharded`, `fsdp.distribute`; or
FSDP2 on one process, `--layout fsdp`, as the smoke stage keeps it: fp32 master weights, bf16
compute with fp32 reduction), gradient clipping, the flow-matching loss through `policy(batch)`.
Inputs are synthetic preprocessed batches (two 224x224 cameras, the tokenizer's full prompt
length, 50x7 actions). For each trainable mode (`--trainable`, `train.trainable`'s values:
`pisft.train.trainable` applied as the training applies it, frozen parameters held in bf16, LoRA
on `--lora-targets`), each activation-checkpointing setting and each `--compile` setting: micro
batch 4, then doubling up to --max-micro or until the
device runs out of memory (the largest that fitted is reported). MFU divides the mode's own model
FLOPs (`pisft.model.pi05.flops.pi05_training_flops_per_sample`: a frozen part costs its forward only).
Output: JSON on stdout and in --out, with peak allocated and peak reserved memory per run.

What fits one device. One device holds the whole model state here: fp32 parameters, fp32
gradients and AdamW's two fp32 moments, 16 bytes per trained parameter (about 48 GiB for
pi0.5 trained in full; frozen parameters 2 bytes, in bf16), plus FSDP's bf16 compute copies and
the activations. Before measuring, the step's peak
is estimated for this device (`pisft.introspect.estimate.simulate_step`, fake tensors, world size 1)
and compared with the device's capacity less --headroom:
- it fits: the step uses AdamW (fused where available), as in training;
- it does not (pi0.5 with AdamW is about 51 GiB of tensors at micro batch 4 on one device,
  close to what a 64 GB Ascend 910B holds; more at a larger micro batch): the step is AdamW's
  first step without AdamW's state (`pisft.gates.smoke.SignDescent`,
  p <- p (1 - lr wd) - lr sign(g), AdamW's bias-corrected first update), the way the smoke
  stage measures pi0.5 on one card. Forward, backward, FSDP and clipping are the training's;
  the optimizer update is a cheap elementwise pass instead of fused AdamW, and the peak lacks
  AdamW's 8 bytes per trained parameter (on N devices FSDP divides the model state by N: the
  training run holds 1/N of it).
Which one ran is printed before the runs and recorded (`optimizer`, `optimizer_plan`, and
`optimizer` in every run); `--optimizer adamw|sign_descent` forces one. With several cards at
hand, the full AdamW step at real size is what the smoke and training stages measure on N
processes (`peak_memory_bytes_per_rank` and `peak_reserved_bytes_per_rank` in metrics.jsonl).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pisft import device as devices
from pisft.bench.arguments import names_from
from pisft.train import blocks, fsdp, optim
from pisft.model.registry import spec_for_preset, spec_of
from pisft.train.metrics import mfu, peak_flops_for
from pisft.train.policy_task import PolicyTask
from pisft.train.step import NO_PROBE, PhaseTimes, StepSettings, repeat, train_step
from pisft.train.trainable import LORA_TARGETS, MODES
from pisft.introspect.synthetic import build_random_policy, synthetic_batch

GIB = 2**30
ADAMW = "adamw"
SIGN_DESCENT = "sign_descent"  # AdamW's first step without its state (pisft.gates.smoke)
DESCRIPTIONS = {ADAMW: "AdamW (the training's optimizer step)",
                SIGN_DESCENT: "AdamW's first step without AdamW's state (sign descent, as the smoke stage)"}


LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel", "aclopCompileAndExecute",
                "aclnnExecute")  # the host's kernel-launch calls in a profile (CUDA; Ascend's ACL)


def _profiler(kind: str):
    """torch.profiler with the device's activity (torch_npu.profiler on an NPU: the row's), or None (CPU)."""
    make = devices.row(kind).profiler
    return None if make is None else make()


def profiled_step(step, kind: str) -> dict[str, Any]:
    """One step under the device profiler: the device's busy seconds (each kernel's own device
    time) and the host's kernel launches."""
    profiler = _profiler(kind)
    if profiler is None:
        return {}
    with profiler as prof:
        step()
        devices.synchronize(kind)
    events = prof.key_averages()
    busy_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events)
    launches = sum(e.count for e in events if e.key in LAUNCH_CALLS)
    return {"device_busy_s": busy_us / 1e6, "kernel_launches": int(launches)}


def measure(policy, optimizer, kind: str, device: torch.device, micro: int, *, steps: int,
            warmup: int, peak: float | None, precision: str, ema: Any = None) -> dict[str, Any]:
    """The training's step (`pisft.train.step.train_step`) at micro batch `micro`: the first
    step's time, the median of `steps` timed steps after `warmup`, a profiled step, phase times."""
    task = PolicyTask(policy, None, device, precision)
    batch, rand = synthetic_batch(policy, micro, device, seed=micro)
    settings = StepSettings(accum=1, grad_clip=1.0, kind=kind, device=device)
    params = [p for p in policy.parameters() if p.requires_grad]
    devices.reset_peak_memory(kind)
    times, losses = [], []

    def step(probe=NO_PROBE):
        return train_step(policy, optimizer, task, repeat(batch, rand), settings, params=params, ema=ema,
                          probe=probe)

    for i in range(1 + warmup + steps):
        devices.synchronize(kind)
        t0 = time.perf_counter()
        outcome = step()
        devices.synchronize(kind)
        times.append(time.perf_counter() - t0)
        losses.append(float(outcome.loss_sum))
    timed = times[1 + warmup:]
    median = statistics.median(timed)
    sps = micro / median
    flops = spec_of(policy).training_flops_per_sample(policy, lang_tokens=policy.config.tokenizer_max_length)
    allocated, reserved = devices.peak_memory_bytes(kind), devices.peak_reserved_bytes(kind)
    out = {"micro_batch_size": micro, "first_step_s": times[0], "step_time_s": median, "step_times_s": timed,
           "samples_per_s": sps, "flops_per_sample": flops, "mfu": mfu(flops, sps, peak, 1),
           "peak_memory_bytes": allocated, "peak_memory_gib": allocated / GIB,
           "peak_reserved_bytes": reserved, "peak_reserved_gib": reserved / GIB, "losses": losses[1 + warmup:]}
    profile = profiled_step(step, kind)
    if profile:
        out |= profile | {"device_busy_fraction": profile["device_busy_s"] / median}
    phases = PhaseTimes(kind)
    step(phases)
    out["phase_s"] = phases.seconds
    return out


def estimate_one_device(preset: str, micro: int, precision: str, checkpointing: bool, mode: str = "all",
                        lora_targets: str = "openpi") -> dict[str, int]:
    """Estimated peak bytes of this benchmark's step on one device in `mode`: with AdamW, and
    without AdamW's state (pisft.introspect.estimate.simulate_step at world size 1; no process group here)."""
    from pisft.introspect.estimate import simulate_step, with_mode
    from pisft.model.policy import build_policy
    from pisft.train.trainable import spec_for_mode

    make = with_mode(lambda: build_policy(preset, seed=0, device="meta"), mode, spec_for_mode(mode, lora_targets),
                     precision)
    est = simulate_step(make, world_size=1, micro_batch=micro, precision=precision, checkpointing=checkpointing)
    return {ADAMW: est["bytes"]["total"], SIGN_DESCENT: est["bytes"]["total"] - est["bytes"]["optimizer"]}


def plan_optimizer(args: argparse.Namespace, checkpointing: bool, capacity: int | None,
                   mode: str = "all") -> dict[str, Any]:
    """Which optimizer step this device can hold in `mode`: AdamW if it fits, else its stateless first step."""
    if args.optimizer != "auto":
        return {"optimizer": args.optimizer, "reason": f"--optimizer {args.optimizer}"}
    if capacity is None:
        return {"optimizer": ADAMW, "reason": "no fixed device capacity (CPU): AdamW"}
    need = estimate_one_device(args.preset, args.micro, args.precision, checkpointing, mode, args.lora_targets)
    budget = capacity * (1 - args.headroom)
    plan = {"estimated_peak_bytes": need, "capacity_bytes": capacity, "budget_bytes": int(budget)}
    head = (f"{args.preset} {mode} at micro batch {args.micro}, checkpointing {'on' if checkpointing else 'off'}: "
            f"the step with AdamW needs about {need[ADAMW] / GIB:.1f} GiB (estimate) on one device of "
            f"{capacity / GIB:.1f} GiB ({args.headroom:.0%} kept free)")
    if need[ADAMW] <= budget:
        return plan | {"optimizer": ADAMW, "reason": head + ": it fits"}
    reason = (head + f": it does not fit; without AdamW's state (8 bytes per trained parameter) "
              f"about {need[SIGN_DESCENT] / GIB:.1f} GiB")
    if need[SIGN_DESCENT] > budget:
        reason += (" (that does not fit either by the estimate: a micro batch that runs out of "
                   "memory is recorded as such; use several cards)")
    return plan | {"optimizer": SIGN_DESCENT, "reason": reason}


def make_optimizer(kind: str, policy, name: str) -> torch.optim.Optimizer:
    if name == SIGN_DESCENT:
        from pisft.gates.smoke import SignDescent

        return SignDescent([p for p in policy.parameters() if p.requires_grad], lr=2.5e-5, weight_decay=1e-10)
    return optim.build_optimizer(policy.parameters(), lr=2.5e-5, weight_decay=1e-10,
                                 fused=devices.fused_adamw_supported(kind))


def run(args: argparse.Namespace) -> dict[str, Any]:
    kind = devices.resolve_kind(args.device)
    devices.apply_process_env(kind)
    dev = devices.local_device(kind, 0)
    name = devices.device_name(kind, dev)
    peak, peak_source = peak_flops_for(name, kind, args.peak_flops)
    capacity = devices.capacity_bytes(kind, dev)
    # Planned before the process group exists (the estimate runs its own fake one).
    plans = {m: {str(c): plan_optimizer(args, c, capacity, m) for c in args.checkpointing} for m in args.trainable}
    for m in args.trainable:
        for c in args.checkpointing:
            plan = plans[m][str(c)]
            print(f"{m}, checkpointing {'on' if c else 'off'}: measuring {DESCRIPTIONS[plan['optimizer']]}; "
                  f"{plan['reason']}", flush=True)
    if not dist.is_initialized():
        store = dist.FileStore(str(Path(args.out).with_suffix(".store")), 1)
        dist.init_process_group(devices.backend_for(kind), store=store, rank=0, world_size=1)
    mesh = init_device_mesh(dev.type, (1,))
    out: dict[str, Any] = {"device": name, "kind": kind, "preset": args.preset,
                           "precision": args.precision, "trainable": list(args.trainable),
                           "lora_targets": args.lora_targets, "peak_flops": peak,
                           "peak_flops_source": peak_source,
                           "capacity_bytes": capacity, "optimizer_plan": plans,
                           "optimizer": {m: {c: v["optimizer"] for c, v in p.items()} for m, p in plans.items()},
                           "params": {}, "largest_micro_batch": {}, "runs": []}
    with spec_for_preset(args.preset).fused_attention():
        _measure_all(args, out, kind, dev, mesh, peak)
    dist.destroy_process_group()
    return out


def build_for_mode(args, dev, mode: str, checkpointing: bool):
    """The random policy on `dev` in the training layout of `mode` (`pisft.train.job.apply_trainable`'s
    order: the mode applied, frozen parameters held in the training precision), not yet sharded."""
    from pisft.train import trainable

    policy = build_random_policy(args.preset, dev, checkpointing=checkpointing)
    applied, _ = trainable.apply_training_layout(policy, mode, trainable.spec_for_mode(mode, args.lora_targets),
                                                 precision=args.precision)
    return policy, applied


def _measure_all(args, out, kind, dev, mesh, peak) -> None:
    for mode in args.trainable:
        for checkpointing in args.checkpointing:
            for compile_mode in args.compile:
                _measure_setting(args, out, kind, dev, mesh, peak, mode, checkpointing, compile_mode)


def _measure_setting(args, out, kind, dev, mesh, peak, mode: str, checkpointing: bool, compile_mode: str) -> None:
    """One mode at one checkpointing and compile setting: micro batch --micro, doubled up to
    --max-micro or until the device runs out of memory."""
    from pisft.train.ema import make_ema

    torch._dynamo.reset()  # noqa: SLF001 - the settings before compiled the same block functions: each its own
    policy, applied = build_for_mode(args, dev, mode, checkpointing)
    compiler = blocks.compiler_for(compile_mode, kind, Path(args.out).parent / "inductor", print)
    fsdp.distribute(policy, mesh, args.precision, dev, keep_sharded=args.layout == "fsdp", min_params=0,
                    compiler=compiler)
    which = out["optimizer"][mode][str(checkpointing)]
    optimizer = make_optimizer(kind, policy, which)
    ema = make_ema(policy, args.ema_decay) if args.ema_decay else None
    out["params"][mode] = {"total": applied.total, "trainable": applied.trainable}
    setting = {"trainable": mode, "activation_checkpointing": checkpointing, "optimizer": which,
               "compile": compiler.mode, "layout": args.layout, "ema_decay": args.ema_decay}
    micro, largest = args.micro, None
    while micro <= args.max_micro:
        try:
            res = measure(policy, optimizer, kind, dev, micro, steps=args.steps,
                          warmup=args.warmup, peak=peak, precision=args.precision, ema=ema) | setting
            out["runs"].append(res)
            largest = micro
            print(json.dumps({k: v for k, v in res.items() if k != "step_times_s"}), flush=True)
        except Exception as exc:
            if not devices.out_of_memory(exc):
                raise
            out["runs"].append({"micro_batch_size": micro, **setting, "oom": True})
            print(f"{mode}, micro batch {micro}, checkpointing {checkpointing}, compile {compiler.mode}: "
                  "out of memory", flush=True)
            break
        finally:
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            devices.empty_cache(kind)
        micro *= 2
    out["largest_micro_batch"].setdefault(mode, {})[f"{checkpointing}/{compiler.mode}"] = largest
    del policy, optimizer, ema
    gc.collect()
    devices.empty_cache(kind)


def _modes(text: str) -> list[str]:
    return names_from(text, MODES, "mode", " (train.trainable's values)")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pisft.bench.gpu_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "npu", "cpu", "auto"))
    p.add_argument("--preset", default="pi05", choices=("pi05", "small", "tiny"))
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--micro", type=int, default=4, help="first micro batch (then doubled)")
    p.add_argument("--max-micro", type=int, default=32, help="stop doubling above this")
    p.add_argument("--steps", type=int, default=5, help="timed steps per setting")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--trainable", default=",".join(MODES), type=_modes,
                   help=f"train.trainable modes to measure, comma-separated (default: all of {', '.join(MODES)})")
    p.add_argument("--lora-targets", default="openpi", choices=LORA_TARGETS,
                   help="train.lora_targets of the lora mode")
    p.add_argument("--checkpointing", default="off,on",
                   type=lambda s: [{"off": False, "on": True}[x] for x in s.split(",")])
    p.add_argument("--compile", default="off,layers", type=lambda s: s.split(","),
                   help="train.compile settings to measure, comma-separated (off, layers)")
    p.add_argument("--layout", default="unsharded", choices=("unsharded", "fsdp"),
                   help="unsharded: a one-process training run's layout; fsdp: FSDP2 on one process (the smoke's)")
    p.add_argument("--ema-decay", type=float, default=0.0, help="train.ema_decay (0: no EMA, the default config)")
    p.add_argument("--peak-flops", type=float, default=0.0, help="override the peak table")
    p.add_argument("--optimizer", default="auto", choices=("auto", ADAMW, SIGN_DESCENT),
                   help="auto: AdamW if the estimated step fits the device, else its stateless first step")
    p.add_argument("--headroom", type=float, default=0.10,
                   help="fraction of the device kept free when deciding what fits (reserved memory, "
                        "HCCL/NCCL buffers and the runtime context are not in the estimate)")
    p.add_argument("--out", default="results/bench/gpu_step.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
