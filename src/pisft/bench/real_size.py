"""`python -m pisft bench --only real_size`: pi0.5 at its real size, one training step per mode.

For each trainable mode (`train.trainable`: pisft.train.trainable) that fits this host, one
process (`python -m pisft.bench.real_size --preset P --mode M`, one at a time: a real-size step
holds several GB) builds the policy with random weights in the training layout (frozen parameters
in bf16 except those LeRobot keeps in fp32, trainable ones in fp32 as the optimizer's master
copy), applies the mode, shards it with FSDP2 on a 1-process gloo group as the memory
measurement does (`pisft.introspect.measure`), and runs pisft's training step (`PolicyTask`:
bf16 autocast, fused joint attention, per-layer activation checkpointing, gradient clipping,
fused AdamW) on a synthetic batch at micro batch 1:

  forward_s          the loss forward of one micro-step (mean of the timed steps)
  step_s             forward + backward + clip + optimizer step + zero_grad
  measured_bytes     tensor storage at the step's peak: parameters + optimizer state + what the
                     step holds at its peak above them (`StepMemory`, as `pisft.introspect.measure`)
  estimate_bytes     the same from `pisft.introspect.estimate.simulate_step` (fake tensors, same mode)
  checkpoint_bytes   bytes on disk of one checkpoint as the training writes it (CheckpointManager)
  export_s           gathering the full state dict and writing the LeRobot model directory
In a mode whose entry freezes the whole VLM prefix (`expert`; `pisft.config.TRAINABLE_MODE_TABLE`)
the same step also runs through the joint forward (`frozen_prefix=False`: every VLM layer
recomputed in backward) for the before/after ratio (`joint_forward_s`, `joint_step_s`).
The modes run in `bench_order` (the fewest parameters trained first).

Modes whose estimated step does not fit the host's memory budget (`--max-gib`, default 24:
this 2-core host) are not run; the output says so with the estimate. Every output lives in a
scratch directory deleted after the mode (real-size checkpoints and exports are 1-13 GB).
`tests/test_bench_real_size.py` runs this code on the tiny preset.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30


def bench_order() -> tuple[str, ...]:
    """train.trainable's modes in the order this benchmark runs them: the fewest parameters trained
    first (each mode's `bench_rank` in `pisft.config.TRAINABLE_MODE_TABLE`)."""
    from pisft.config import TRAINABLE_MODE_TABLE, trainable_modes

    return tuple(sorted(trainable_modes("policy"), key=lambda m: TRAINABLE_MODE_TABLE[m].bench_rank))


MODES = bench_order()
DEFAULT_MAX_GIB = 24.0
TIMED_STEPS = 2


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build_policy_for_mode(preset: str, mode: str, *, precision: str, checkpointing: bool, seed: int,
                          lora_targets: str = "openpi"):
    """The training layout of `mode` with random weights: built in the training precision (bf16:
    LeRobot's `to_bfloat16_for_selected_params` keeps the vision path and norms in fp32), drawn
    from normal(0, 0.02), the mode applied, the projections fused, trainable parameters in fp32."""
    import torch

    from pisft.model.registry import spec_of
    from pisft.model.policy import build_random_weights
    from pisft.train import trainable as trainable_mod

    policy = build_random_weights(preset, seed=seed, dtype="bfloat16" if precision == "bf16" else "float32")
    policy.config.device = "cpu"
    spec_of(policy).prepare_for_training(policy, checkpointing=checkpointing)
    applied = trainable_mod.apply_mode(policy, mode, trainable_mod.spec_for_mode(mode, lora_targets), seed=seed)
    spec_of(policy).fuse_projections(policy)  # as trainable.apply_training_layout (already in bf16 here)
    for p in policy.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # the optimizer's fp32 master copy
    return policy, applied


def measure_mode(preset: str, mode: str, *, micro_batch: int = 1, precision: str = "bf16",
                 checkpointing: bool = True, seed: int = 0, work: Path, timed_steps: int = TIMED_STEPS,
                 lora_targets: str = "openpi") -> dict[str, Any]:
    """One mode in this process (which must have no process group): see the module docstring."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from pisft import device as devices
    from pisft.config import trainable_mode
    from pisft.introspect.step_memory import StepMemory
    from pisft.introspect.synthetic import synthetic_batch
    from pisft.model.policy import save_model
    from pisft.model.tokenizer import save_tiny_tokenizer
    from pisft.tensors import local_bytes, optimizer_state
    from pisft.train import fsdp, optim
    from pisft.model.registry import spec_of
    from pisft.train.checkpoint import CheckpointManager
    from pisft.train.policy_task import PolicyTask
    from pisft.train.step import PhaseTimes, StepSettings, repeat, train_step

    cpu = torch.device("cpu")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t0 = time.perf_counter()
        policy, applied = build_policy_for_mode(preset, mode, precision=precision, checkpointing=checkpointing,
                                                seed=seed, lora_targets=lora_targets)
        prefix_frozen = trainable_mode(mode).prefix_frozen  # the mode's entry: the whole VLM prefix frozen
        fsdp.shard(policy, init_device_mesh("cpu", (1,)), precision)
        optimizer = optim.build_optimizer(policy.parameters(), lr=1e-4, weight_decay=1e-10,
                                          fused=devices.fused_adamw_supported("cpu"))
        task = PolicyTask(policy, None, cpu, precision)
        batch, rand = synthetic_batch(policy, micro_batch, cpu, seed)
        settings = StepSettings(accum=1, grad_clip=1.0, kind="cpu", device=cpu)
        policy.train()
        build_s = time.perf_counter() - t0

        def step(frozen_prefix=None) -> tuple[float, float, float]:
            """The training's step (pisft.train.step), its forward timed."""
            task.frozen_prefix = frozen_prefix
            phases = PhaseTimes("cpu")
            start = time.perf_counter()
            outcome = train_step(policy, optimizer, task, repeat(batch, rand), settings, probe=phases)
            return phases.seconds["forward"], time.perf_counter() - start, float(outcome.loss_sum)

        out: dict[str, Any] = {"preset": preset, "mode": mode, "micro_batch_size": micro_batch,
                               "precision": precision, "activation_checkpointing": checkpointing,
                               "params_total": applied.total, "params_trainable": applied.trainable,
                               "build_s": round(build_s, 2)}
        def note(what: str) -> None:
            print(f"real_size {mode}: {what} at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

        note("built")
        with spec_of(policy).fused_attention():
            step()  # warm-up: FSDP initialised, optimizer state allocated
            gc.collect()
            note("warm-up step done")
            timed = [step() for _ in range(timed_steps)]
            note(f"timed steps {[tuple(round(x, 2) for x in t[:2]) for t in timed]}")
            out["forward_s"] = round(sum(t[0] for t in timed) / len(timed), 3)
            out["step_s"] = round(sum(t[1] for t in timed) / len(timed), 3)
            out["step_over_forward"] = round(out["step_s"] / out["forward_s"], 3)
            out["loss"] = timed[-1][2]
            if prefix_frozen:
                joint = [step(frozen_prefix=False) for _ in range(timed_steps)]
                note(f"joint-path steps {[tuple(round(x, 2) for x in t[:2]) for t in joint]}")
                out["joint_forward_s"] = round(sum(t[0] for t in joint) / len(joint), 3)
                out["joint_step_s"] = round(sum(t[1] for t in joint) / len(joint), 3)
                out["joint_step_over_forward"] = round(out["joint_step_s"] / out["joint_forward_s"], 3)
            gc.collect()
            tracker = StepMemory()
            with tracker:
                step()
            step_peak = tracker.peak()[0]
            del tracker
        out["params_bytes"] = local_bytes(policy.parameters())
        out["optimizer_bytes"] = local_bytes(optimizer_state(optimizer))
        out["measured_step_peak_bytes"] = step_peak
        out["measured_bytes"] = out["params_bytes"] + out["optimizer_bytes"] + step_peak
        note("tracked step done")
        gc.collect()
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        ckpt = CheckpointManager(work / "checkpoints", keep_last=1, rank=0, world_size=1,
                                 fingerprint={"bench": "real_size"}, config={}, log=lambda *_: None)
        path = ckpt.save(1, policy, optimizer, scheduler)
        out["checkpoint_bytes"] = _dir_bytes(path)
        note("checkpoint written")
        shutil.rmtree(path.parent, ignore_errors=True)
        optimizer.state.clear()  # the export needs the memory, not the moments
        gc.collect()
        start = time.perf_counter()
        full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        export = work / "export"
        export.mkdir()
        save_tiny_tokenizer(work / "tokenizer")
        save_model(policy, export, tokenizer_dir=work / "tokenizer", state_dict=full)
        out["export_s"] = round(time.perf_counter() - start, 2)
        out["export_bytes"] = _dir_bytes(export)
        out["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)  # other processes share the cores
        del full
        shutil.rmtree(export, ignore_errors=True)
        return out
    finally:
        dist.destroy_process_group()


def estimate_mode(preset: str, mode: str, *, micro_batch: int = 1, precision: str = "bf16",
                  checkpointing: bool = True, lora_targets: str = "openpi") -> dict[str, Any]:
    """The memory estimate of the same step (world size 1, layer units): fake tensors, seconds."""
    from pisft.introspect.estimate import simulate_step, with_mode
    from pisft.model.policy import build_policy
    from pisft.train.trainable import spec_for_mode

    make = with_mode(lambda: build_policy(preset, seed=0, device="meta", dtype="float32"), mode,
                     spec_for_mode(mode, lora_targets), precision)
    sim = simulate_step(make, world_size=1, micro_batch=micro_batch, precision=precision,
                        checkpointing=checkpointing)
    return {"estimate_bytes": int(sim["bytes"]["total"]), "estimate_step_peak_bytes": int(sim["step_peak_bytes"]),
            "estimate_params_bytes": int(sim["state_bytes"]["params"]),
            "estimate_optimizer_bytes": int(sim["state_bytes"]["optimizer"]),
            "params_trained": int(sim["params_trained"])}


def _in_subprocess(args: list[str]) -> dict[str, Any]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-m", "pisft.bench.real_size", *args]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=False)  # stderr: progress
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}); its stderr is above")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_modes(preset: str = "pi05", modes: tuple[str, ...] = MODES, *, micro_batch: int = 1,
                precision: str = "bf16", max_gib: float = DEFAULT_MAX_GIB, work: Path | None = None,
                timed_steps: int = TIMED_STEPS) -> dict[str, Any]:
    """Every mode of `modes`, each in its own process, one at a time (see the module docstring)."""
    out: dict[str, Any] = {"preset": preset, "micro_batch_size": micro_batch, "precision": precision,
                           "activation_checkpointing": True, "max_gib": max_gib, "modes": {},
                           "not_run": {}}
    for mode in modes:
        est = _in_subprocess(["--estimate", "--preset", preset, "--mode", mode, "--micro-batch", str(micro_batch),
                              "--precision", precision])
        need = est["estimate_bytes"] / GIB
        if need > max_gib:
            out["not_run"][mode] = (f"does not fit this host: the estimated step holds {need:.1f} GiB of tensors "
                                    f"(more than --max-gib {max_gib:g})")
            print(f"bench real_size: {mode}: not run, {out['not_run'][mode]}", flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix=f"pisft-real-size-{mode}-", dir=work) as tmp:
            print(f"bench real_size: {preset} {mode} (estimate {need:.1f} GiB)", flush=True)
            got = _in_subprocess(["--preset", preset, "--mode", mode, "--micro-batch", str(micro_batch),
                                  "--precision", precision, "--work", tmp, "--timed-steps", str(timed_steps)])
        got.update(est)
        got["estimate_over_measured"] = round(got["estimate_bytes"] / got["measured_bytes"], 4)
        out["modes"][mode] = got
    return out


def run(work: Path) -> dict[str, Any]:
    """The `bench --only real_size` part: pi0.5 (preset pi05) in every mode that fits here."""
    return bench_modes("pi05", work=work)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pisft.bench.real_size", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="pi05")
    parser.add_argument("--mode", action="append", choices=MODES,
                        help="one mode in this process (repeatable without --work: each in a subprocess)")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument("--work", help="scratch directory of one mode's measurement (internal)")
    parser.add_argument("--estimate", action="store_true", help="print the estimate of one mode (internal)")
    parser.add_argument("--timed-steps", type=int, default=TIMED_STEPS)
    parser.add_argument("--max-gib", type=float, default=DEFAULT_MAX_GIB)
    args = parser.parse_args(argv)
    if args.estimate or args.work:
        if not args.mode or len(args.mode) != 1:
            parser.error("--estimate and --work take exactly one --mode")
        if args.estimate:
            result = estimate_mode(args.preset, args.mode[0], micro_batch=args.micro_batch,
                                   precision=args.precision)
        else:
            result = measure_mode(args.preset, args.mode[0], micro_batch=args.micro_batch,
                                  precision=args.precision, work=Path(args.work), timed_steps=args.timed_steps)
    else:
        result = bench_modes(args.preset, tuple(args.mode or MODES), micro_batch=args.micro_batch,
                             precision=args.precision, max_gib=args.max_gib, timed_steps=args.timed_steps)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
