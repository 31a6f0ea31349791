"""Measure the real peak memory of one training step on CPU, to check the estimate against.

    python -m pisft.introspect.measure [--preset tiny] [--micro-batch N] [--checkpointing]
                                  [--precision fp32|bf16] [--json]
    python -m pisft.introspect.measure --compare ...   # in a subprocess, with the estimate beside it

The step is pisft's training step, the same one `pisft.introspect.estimate` simulates: the policy
(random weights, `pisft.introspect.synthetic.build_random_policy`) with the training structure
(`pi05.construction.prepare_for_training`: per-layer activation checkpointing, no action-expert
lm_head), FSDP2 through `pisft.train.fsdp.shard` on a 1-process gloo group, the loss through
`PolicyTask` (autocast in bf16), fused joint attention, gradient clipping, AdamW as the training
builds it, `zero_grad(set_to_none=True)`. Inputs are a synthetic preprocessed batch
(`pisft.introspect.synthetic.synthetic_batch`).

The figure compared with the estimate is **live tensor storage**, counted by the measurement
itself: after a warm-up step at micro batch 1 (optimizer state allocated, FSDP initialised,
gradients freed), one full step runs under a storage tracker (`pisft.introspect.step_memory.StepMemory`,
a dispatch mode that sees every tensor storage an operator creates, FSDP's `resize_` of its
unsharded parameters, and each storage's release), on real tensors with real kernels and a real
gloo group. `step_peak_bytes` is the largest sum of the storages the step created and still
held, above what existed before it: gradients, FSDP's unsharded copies and buffers,
activations, recompute and temporaries. Parameters and optimizer state are counted exactly from
the tensors.

The process's resident set is recorded beside it as information (`rss_step_peak_bytes`: the peak
RSS above the pre-step RSS, with MALLOC_MMAP_THRESHOLD_=65536 so large tensors are their own
mappings). It is not compared with the estimate: it also holds what is not a tensor — oneDNN's
packed weights and scratchpads (larger on CPUs with AVX-512 BF16/AMX, whose bf16 kernels pack
differently), malloc's kept heap, the runtime — so it depends on the CPU model. docs/memory.md
explains the gap, which on an accelerator is the workspace and runtime memory the smoke gate must
leave room for.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def training_step(policy, optimizer, task, batch: dict, rand: dict, grad_clip: float = 1.0) -> Any:
    """The training's optimizer step (pisft.train.step) on one micro-batch; its loss (on the device)."""
    import torch

    from pisft.train.step import StepSettings, repeat, train_step

    settings = StepSettings(accum=1, grad_clip=grad_clip, kind="cpu", device=torch.device("cpu"))
    return train_step(policy, optimizer, task, repeat(batch, rand), settings).loss_sum


def measure(preset: str, micro_batch: int, checkpointing: bool, precision: str = "fp32",
            seed: int = 0) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pisft import device as devices
    from pisft.introspect.step_memory import StepMemory
    from pisft.introspect.synthetic import build_random_policy, synthetic_batch
    from pisft.tensors import local_bytes, optimizer_state
    from pisft.train import fsdp, optim
    from pisft.model.registry import spec_of
    from pisft.train.policy_task import PolicyTask

    cpu = torch.device("cpu")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        policy = build_random_policy(preset, cpu, checkpointing=checkpointing, seed=seed)
        fsdp.shard(policy, init_device_mesh("cpu", (1,)), precision)
        optimizer = optim.build_optimizer(policy.parameters(), lr=1e-4, weight_decay=1e-10,
                                          fused=devices.fused_adamw_supported("cpu"))
        task = PolicyTask(policy, None, cpu, precision)
        batch, rand = synthetic_batch(policy, micro_batch, cpu, seed)
        warm = synthetic_batch(policy, 1, cpu, seed)
        policy.train()
        with spec_of(policy).fused_attention():
            # Warm-up at micro batch 1 (cheaper; only its side effects matter): FSDP initialised,
            # optimizer state allocated.
            training_step(policy, optimizer, task, *warm)
            del warm
            gc.collect()
            before = _status_kib("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")
            tracker = StepMemory()
            with tracker:
                loss = float(training_step(policy, optimizer, task, batch, rand))
            peak = _status_kib("VmHWM")
        step_peak = tracker.peak()[0]
        return {"preset": preset, "micro_batch_size": micro_batch, "precision": precision,
                "activation_checkpointing": checkpointing, "world_size": 1,
                "step_peak_bytes": step_peak,
                "params_bytes": local_bytes(policy.parameters()),
                "optimizer_bytes": local_bytes(optimizer_state(optimizer)),
                "rss_step_peak_bytes": (peak - before) * 1024,
                "rss_before_step_bytes": before * 1024, "loss": loss}
    finally:
        dist.destroy_process_group()


def measure_in_subprocess(preset: str = "tiny", micro_batch: int = 32, checkpointing: bool = False,
                          precision: str = "fp32") -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pisft.introspect.measure", "--preset", preset, "--micro-batch", str(micro_batch),
           "--precision", precision, "--json"] + (["--checkpointing"] if checkpointing else [])
    out = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(preset: str, micro_batch: int, checkpointing: bool, precision: str) -> dict:
    """Measured (subprocess) and estimated step peak, parameters and optimizer state, and ratios."""
    from pisft.introspect.estimate import simulate_step
    from pisft.model.policy import build_policy

    measured = measure_in_subprocess(preset, micro_batch, checkpointing, precision)
    est = simulate_step(lambda: build_policy(preset, seed=0, device="meta"), world_size=1,
                        micro_batch=micro_batch, precision=precision, checkpointing=checkpointing)
    return {"preset": preset, "params_total": est["params_total"], "micro_batch_size": micro_batch,
            "precision": precision, "activation_checkpointing": checkpointing,
            "measured_step_peak_bytes": measured["step_peak_bytes"],
            "measured_rss_step_peak_bytes": measured["rss_step_peak_bytes"],
            "estimated_step_peak_bytes": est["step_peak_bytes"],
            "step_peak_ratio": round(est["step_peak_bytes"] / measured["step_peak_bytes"], 4),
            "measured_params_bytes": measured["params_bytes"],
            "estimated_params_bytes": est["state_bytes"]["params"],
            "measured_optimizer_bytes": measured["optimizer_bytes"],
            "estimated_optimizer_bytes": est["state_bytes"]["optimizer"],
            "estimated_total_bytes": est["bytes"]["total"],
            "measured_total_bytes": measured["step_peak_bytes"] + measured["params_bytes"]
            + measured["optimizer_bytes"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pisft.introspect.measure", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--compare", action="store_true",
                        help="measure in a subprocess (one thread, MALLOC_MMAP_THRESHOLD_) and set the "
                             "estimate (pisft.introspect.estimate.simulate_step, world size 1) beside it")
    args = parser.parse_args(argv)
    if args.compare:
        result = compare(args.preset, args.micro_batch, args.checkpointing, args.precision)
    else:
        result = measure(args.preset, args.micro_batch, args.checkpointing, args.precision)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:<26} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
