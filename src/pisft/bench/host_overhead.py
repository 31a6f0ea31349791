"""Host overhead as a count: operations the host dispatches per training micro-step and per
optimizer step, eager against compiled (`train.compile`), at pi0.5's real size, on any machine.

    python -m pisft bench --only host_overhead        # bench.json["host_overhead"]["pi05"], ["tiny"]
    python -m pisft.bench.host_overhead --preset pi05 --trainable all   # one setting, JSON on stdout

What is counted (`pisft.introspect.host_ops.DispatchedOps`): every aten operator that reaches the
dispatcher, views included, and every kernel a compiled graph launches itself. The step is
pisft's (`pisft.train.step`): the blocks as the training runs them (`pisft.train.blocks`), bf16
under autocast, per-layer checkpointing, FSDP2 with one unit per block as rank 0 of an 8-card
node runs it (`WORLD`: torch's fake process group, whose collectives move no data; FSDP2 takes
another, per-parameter path on a world of one) and, beside it, the unsharded layout of a
one-process run. Counts are taken after two warm-up micro-steps (a compiled block's first call
compiles it).

Where each figure comes from:
- eager at real size: pi0.5 built on the meta device with fake tensors (`pisft.introspect.estimate`'s
  FakeTensorMode and fake process group): the whole step dispatched, no arithmetic, no memory;
- compiled: a compiled graph runs only on real tensors, so it is counted on pi0.5's depth twin
  (`DEPTH_TWIN`): pi0.5's every depth and count (18 layer pairs, 27 SigLIP layers of 16 heads,
  8 query heads and 1 K/V head, two 224 px cameras of 256 patches, 200 prompt tokens, a 50-step
  chunk) with narrow widths, on the CPU. How many operations a step dispatches follows that
  structure, not the widths: the twin's eager count is recorded beside pi0.5's (`twin_check`)
  and must equal it, or the run stops.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

# pi0.5's folder by design: this bench builds pi0.5's structure (its depths) at narrow widths
from pisft.model.pi05.construction import Arch, GemmaSize, VisionSize

# pi0.5's structure (LeRobot's gemma_2b + gemma_300m, SigLIP So400m/14 at 224 px) with narrow widths.
DEPTH_TWIN = Arch(
    vlm=GemmaSize(width=64, depth=18, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=16),
    expert=GemmaSize(width=32, depth=18, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=16),
    vision=VisionSize(hidden_size=64, intermediate_size=128, num_hidden_layers=27, num_attention_heads=16,
                      patch_size=14),
    vocab_size=1024,
)
TWIN = "pi05_depth_twin"
LAYOUTS = ("fsdp", "unsharded")
MICRO_BATCH = 2
WORLD = 8  # FSDP2's layout as on one 8-card node (rank 0 counted)


def _policy(preset: str, device: str):
    """The policy to count: a preset, or pi0.5's depth twin (`DEPTH_TWIN`, pi0.5's config)."""
    from pisft.introspect.synthetic import build_random_policy
    from pisft.model.policy import build_policy, fill_random, make_config, policy_from_config

    if preset != TWIN:
        if device == "meta":
            return build_policy(preset, seed=0, device="meta")
        return build_random_policy(preset, torch.device(device), checkpointing=True)
    info = {"preset": "pi05", "arch": DEPTH_TWIN.to_dict()}
    policy = policy_from_config(make_config("pi05"), info, device=device, dtype="float32", init=False)
    if device != "meta":
        fill_random(policy, torch.Generator().manual_seed(0))
    policy.config.device = "cpu"
    return policy


def count(preset: str, trainable: str, layout: str, compile_mode: str, *, fake: bool) -> dict[str, Any]:
    """One micro-step and one optimizer step (accumulation 1) of `preset` in `trainable` mode,
    counted (this process must have no process group; it makes its own)."""
    import contextlib

    from pisft.introspect.host_ops import DispatchedOps
    from pisft.introspect.synthetic import synthetic_batch
    from pisft.model.registry import spec_of
    from pisft.train import blocks, fsdp, optim, trainable as modes
    from pisft.train.policy_task import PolicyTask
    from pisft.train.step import StepSettings, micro_step, repeat, train_step

    from pisft.introspect.simulated_step import fake_world, to_fake

    cpu = torch.device("cpu")
    policy = _policy(preset, "meta" if fake else "cpu")
    spec_of(policy).prepare_for_training(policy, checkpointing=True)
    modes.apply_training_layout(policy, trainable, modes.spec_for_mode(trainable, "openpi"), precision="bf16")
    compiler = blocks.Compiler(compile_mode, "cpu")
    fake_mode: Any = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        to_fake(policy, fake_mode)
    with fake_world(WORLD if layout == "fsdp" else 1) as mesh, fake_mode:
        if layout == "fsdp":
            fsdp.shard(policy, mesh, "bf16", compiler=compiler)
        else:  # fsdp.distribute's one-process layout (the policy is on the CPU already)
            blocks.install(fsdp.choose_units(policy), compiler)
        optimizer = optim.build_optimizer(policy.parameters(), lr=1e-5, weight_decay=1e-10, fused=True)
        task = PolicyTask(policy, None, cpu, "bf16")
        batch, rand = synthetic_batch(policy, MICRO_BATCH, cpu, seed=0)
        settings = StepSettings(accum=1, grad_clip=1.0, kind="cpu", device=cpu)
        policy.train()
        with spec_of(policy).fused_attention():
            for _ in range(2):  # warm-up: lazy initialisations, compilation
                train_step(policy, optimizer, task, repeat(batch, rand), settings)
            micro = DispatchedOps()
            with micro:
                micro_step(policy, task, batch, rand, 1)
            optimizer.zero_grad(set_to_none=True)
            whole = DispatchedOps()
            with whole:
                train_step(policy, optimizer, task, repeat(batch, rand), settings)
    return {"micro_step": micro.summary(), "step": whole.summary()}


def _in_subprocess(args: list[str], cache: Path | None) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cache is not None:
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))
    proc = subprocess.run([sys.executable, "-m", "pisft.bench.host_overhead", *args], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"host_overhead {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _one(preset: str, trainable: str, layout: str, compile_mode: str, fake: bool, cache: Path | None):
    args = ["--preset", preset, "--trainable", trainable, "--layout", layout, "--compile", compile_mode]
    result = _in_subprocess([*args, "--fake"] if fake else args, cache)
    print(f"host_overhead: {preset} {trainable} {layout} {compile_mode}{' (fake tensors)' if fake else ''}: "
          f"{result['micro_step']['total']} per micro-step, {result['step']['total']} per step",
          file=sys.stderr, flush=True)
    return result


def bench_preset(preset: str, trainable: str = "all", *, cache: Path | None = None) -> dict[str, Any]:
    """Eager and compiled counts of `preset` in both layouts (each count its own process)."""
    real_size = preset == "pi05"
    compiled_on = TWIN if real_size else preset
    out: dict[str, Any] = {"trainable": trainable, "micro_batch_size": MICRO_BATCH, "fsdp_world_size": WORLD,
                           "compiled_counted_on": compiled_on, "layouts": {}}
    for layout in LAYOUTS:
        eager = _one(preset, trainable, layout, "off", real_size, cache)
        compiled = _one(compiled_on, trainable, layout, "layers", False, cache)
        entry = {"eager": eager, "compiled": compiled}
        if real_size:  # the twin counts as pi0.5 does: its eager count, fake and real, is pi0.5's
            twin_fake = _one(TWIN, trainable, layout, "off", True, cache)
            twin_real = _one(TWIN, trainable, layout, "off", False, cache)
            check = {"pi05_eager": eager["micro_step"]["total"], "twin_eager_fake": twin_fake["micro_step"]["total"],
                     "twin_eager_cpu": twin_real["micro_step"]["total"]}
            check["equal"] = len(set(check.values())) == 1
            entry["twin_check"] = check
            if not check["equal"]:
                raise RuntimeError(f"host_overhead: pi0.5's depth twin does not dispatch as pi0.5 does "
                                   f"({check}); its compiled count would not be pi0.5's")
        out["layouts"][layout] = entry
    fsdp_counts = out["layouts"]["fsdp"]
    out["eager_ops_per_micro_step"] = fsdp_counts["eager"]["micro_step"]["total"]
    out["compiled_ops_per_micro_step"] = fsdp_counts["compiled"]["micro_step"]["total"]
    out["eager_ops_per_step"] = fsdp_counts["eager"]["step"]["total"]
    out["compiled_ops_per_step"] = fsdp_counts["compiled"]["step"]["total"]
    out["compiled_over_eager_micro_step"] = out["compiled_ops_per_micro_step"] / out["eager_ops_per_micro_step"]
    unsharded = out["layouts"]["unsharded"]
    out["unsharded_compiled_over_eager_micro_step"] = (unsharded["compiled"]["micro_step"]["total"]
                                                       / unsharded["eager"]["micro_step"]["total"])
    return out


def run(work: Path, presets: tuple[str, ...] = ("tiny", "pi05")) -> dict[str, Any]:
    cache = work / "inductor"
    return {preset: bench_preset(preset, cache=cache) for preset in presets}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pisft.bench.host_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="pi05", choices=("tiny", "small", "pi05", TWIN))
    p.add_argument("--trainable", default="all")
    p.add_argument("--layout", choices=LAYOUTS, help="one count in this process (default: every count)")
    p.add_argument("--compile", default="off", choices=("off", "layers"))
    p.add_argument("--fake", action="store_true", help="fake tensors on the meta device (eager only)")
    args = p.parse_args(argv)
    if args.layout is None:
        result = bench_preset(args.preset, args.trainable)
    else:
        if args.fake and args.compile != "off":
            p.error("--fake counts the eager step only (a compiled graph needs real tensors)")
        result = count(args.preset, args.trainable, args.layout, args.compile, fake=args.fake)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
