"""The two-process part of the train_loop bench: one training-step timing per launch.

`ours` runs under torchrun (gloo): pisft's loop on the FSDP2-sharded policy (`fsdp.distribute`
over 2 processes), each rank fed its micro-batches of the same global batches, prepared as our
data loader's workers prepare them. `lerobot` runs under LeRobot's own launcher, `accelerate
launch --multi_gpu --num_processes 2` (torchrun underneath; the Accelerator that lerobot-train
makes, with cpu=True, turns it into DDP over gloo: accelerate's `--cpu` launch of several
processes needs mpirun, which this host does not have): LeRobot's preprocessor then
`lerobot_train.update_policy` on the unsharded policy, each rank with the same micro-batches.
Rank 0 writes {"wall_s": slowest rank, "cpu_s": sum over the ranks (data workers included)}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from pisft.bench.train_bench import DIST_WORLD as WORLD

VARIANTS = ("ours", "lerobot")
N_BATCHES = 8


def _items(root: Path, micro: int, seed: int, rank: int, draw) -> list[list[dict]]:
    from pisft.data.dataset import load_split
    from pisft.train.batches import StepDataset
    from pisft.train.sampler import StepLayout, StepSampler

    chunk = int(json.loads((root / "base_model" / "config.json").read_text())["chunk_size"])
    train_set = load_split(root / "dataset", "train", chunk_size=chunk)
    sampler = StepSampler(len(train_set), seed, StepLayout(WORLD * micro, micro, WORLD))
    ds = StepDataset(train_set, seed, draw)
    return [[ds[r] for r in sampler.micro_batch(k, rank, 0)] for k in range(N_BATCHES)], len(train_set)


def _ours(a: argparse.Namespace) -> dict[str, float] | None:
    import itertools

    from torch.distributed.device_mesh import init_device_mesh

    from pisft.bench.train_bench import ours_optimizer, process_tree_cpu_s
    from pisft.data.dataset import load_stats
    from pisft.model.registry import spec_of
    from pisft.model.policy import load_policy, make_processors
    from pisft.train import fsdp, loop
    from pisft.train.policy_task import PolicyTask

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = a.root / "base_model"
    policy = load_policy(base, dtype="float32")
    pre, _ = make_processors(policy, base, load_stats(a.root / "dataset"))
    spec_of(policy).prepare_for_training(policy, checkpointing=False)
    fsdp.distribute(policy, init_device_mesh("cpu", (WORLD,)), "fp32", torch.device("cpu"),
                    min_params=a.min_unit_params)
    task = PolicyTask(policy, pre, torch.device("cpu"))
    items, _ = _items(a.root, a.micro, a.seed, rank, task.draw)
    prepared = [task.collate(b) for b in items]
    batches = (dict(b) for b in itertools.cycle(prepared))
    opt, sched = ours_optimizer(policy, a.lr)
    settings = loop.LoopSettings(steps=a.warmup + a.steps, accum=1, global_batch=WORLD * a.micro,
                                 grad_clip=1.0, kind="cpu", device=torch.device("cpu"),
                                 world_size=WORLD, rank=rank, log_every=a.log_every)
    marks: dict[str, float] = {}

    def on_step(record: dict) -> None:
        if record["step"] == a.warmup:  # a fetch: both ranks have just met in its collectives
            marks["c0"], marks["t0"] = process_tree_cpu_s(), time.perf_counter()

    loop.run(policy, opt, sched, task, batches, settings, start_step=0, on_step=on_step)
    return _reduce(time.perf_counter() - marks["t0"], process_tree_cpu_s() - marks["c0"], rank)


def _lerobot(a: argparse.Namespace) -> dict[str, float] | None:
    import itertools

    from pisft.bench.train_bench import (lerobot_accelerator, lerobot_optimizer, lerobot_step_fn,
                                         process_tree_cpu_s)
    from pisft.data.dataset import load_stats
    from pisft.model.policy import load_policy, make_processors
    from pisft.train.policy_task import PolicyTask

    accelerator = lerobot_accelerator()
    rank = accelerator.process_index
    if accelerator.num_processes != WORLD:
        raise SystemExit(f"accelerate started {accelerator.num_processes} process(es), not {WORLD}")
    base = a.root / "base_model"
    policy = load_policy(base, dtype="float32")
    pre, _ = make_processors(policy, base, load_stats(a.root / "dataset"))
    draw = PolicyTask(policy, pre, torch.device("cpu")).draw
    items, n = _items(a.root, a.micro, a.seed, rank, draw)
    raw = [default_collate(b) for b in items]
    opt, sched = lerobot_optimizer(policy, a.lr)
    policy, opt = accelerator.prepare(policy, opt)
    step = lerobot_step_fn(policy, pre, opt, sched, accelerator, a.micro, n,
                           (dict(b) for b in itertools.cycle(raw)))
    for _ in range(a.warmup):
        step()
    accelerator.wait_for_everyone()
    c0, t0 = process_tree_cpu_s(), time.perf_counter()
    for _ in range(a.steps):
        step()
    accelerator.wait_for_everyone()
    return _reduce(time.perf_counter() - t0, process_tree_cpu_s() - c0, rank)


def _reduce(wall: float, cpu: float, rank: int) -> dict[str, float] | None:
    walls = torch.tensor([wall], dtype=torch.float32)
    cpus = torch.tensor([cpu], dtype=torch.float32)
    dist.all_reduce(walls, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpus, op=dist.ReduceOp.SUM)
    return {"wall_s": float(walls), "cpu_s": float(cpus)} if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-unit-params", type=int, default=-1,
                   help="ours: train.fsdp_min_unit_params (-1: by device, the CPU's merged units)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    result = _ours(a) if a.variant == "ours" else _lerobot(a)
    if result is not None:
        a.out.write_text(json.dumps(result) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
