"""Worker processes for tests/test_collective_audit.py, started by torchrun with the stand-in
torch_npu (tests/stand_ins) on PYTHONPATH, so that backend "hccl" is gloo with HCCL's dtype table
enforced. Each rank writes its result to OUT_DIR/rank_<r>.json and exits 0.

  python -m torch.distributed.run --standalone --nproc_per_node 2 tests/hccl_workers.py OUT_DIR \
      collectives
  python -m torch.distributed.run --standalone --nproc_per_node 2 tests/hccl_workers.py OUT_DIR \
      train CONFIG RESULTS_DIR CHECKPOINT_DIR
  python -m torch.distributed.run --standalone --nproc_per_node 2 tests/hccl_workers.py OUT_DIR \
      in_flight exit_process|teardown

Each ends as pisft's torchrun workers do (`pisft.device.exit_process`), `in_flight teardown`
through the interpreter's teardown.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch_npu


def _attempt(fn) -> str | None:
    """None if fn() ran, else the error message."""
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None


def collectives() -> dict:
    dist.init_process_group("hccl")
    world = dist.get_world_size()
    out = {"backend": dist.get_backend(), "stand_in": getattr(torch_npu, "STAND_IN", False)}

    out["all_reduce_float64"] = _attempt(lambda: dist.all_reduce(torch.ones(3, dtype=torch.float64)))
    out["reduce_scatter_uint8"] = _attempt(lambda: dist.reduce_scatter_tensor(
        torch.zeros(1, dtype=torch.uint8), torch.ones(world, dtype=torch.uint8)))
    out["reduce_scatter_bool"] = _attempt(lambda: dist.reduce_scatter_tensor(
        torch.zeros(1, dtype=torch.bool), torch.ones(world, dtype=torch.bool)))
    out["all_reduce_band"] = _attempt(lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32),
                                                              op=dist.ReduceOp.BAND))

    ok = {}
    t = torch.ones(3, dtype=torch.float32)
    ok["all_reduce_float32"] = _attempt(lambda: dist.all_reduce(t))
    ok["all_reduce_float32_value"] = float(t[0])
    ok["all_reduce_int64"] = _attempt(lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64)))
    # torch_npu casts bool/uint8 to int32 before an all_reduce: accepted.
    ok["all_reduce_bool"] = _attempt(lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool)))
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    ok["all_gather_float64"] = _attempt(
        lambda: dist.all_gather(gathered, torch.full((2,), float(dist.get_rank()), dtype=torch.float64)))
    ok["all_gather_float64_values"] = [float(g[0]) for g in gathered]
    ok["broadcast_float64"] = _attempt(lambda: dist.broadcast(torch.ones(2, dtype=torch.float64), src=0))
    objs = [None] * world
    ok["all_gather_object"] = _attempt(lambda: dist.all_gather_object(objs, {"rank": dist.get_rank()}))
    ok["barrier"] = _attempt(dist.barrier)
    # The other operations torch routes to a process group, each delegated with its options.
    rank = dist.get_rank()
    ok["reduce"] = _attempt(lambda: dist.reduce(torch.ones(2), dst=0))
    gathered_list = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
    ok["gather"] = _attempt(lambda: dist.gather(torch.full((2,), float(rank)), gathered_list, dst=0))
    ok["scatter"] = _attempt(lambda: dist.scatter(
        torch.zeros(2), [torch.full((2,), float(r)) for r in range(world)] if rank == 0 else None, src=0))
    ok["all_to_all_single"] = _attempt(lambda: dist.all_to_all_single(
        torch.zeros(world), torch.full((world,), float(rank))))
    peer = 1 - rank
    ok["send_recv"] = _attempt(lambda: (dist.send(torch.ones(1), peer) if rank == 0
                                        else dist.recv(torch.zeros(1), peer)))
    ok["reduce_scatter_float32"] = _attempt(lambda: dist.reduce_scatter(
        torch.zeros(1), [torch.ones(1) for _ in range(world)]))
    from pisft.introspect import collective_audit

    out["counted"] = collective_audit.LOG.as_dict()
    out["accepted"] = ok
    dist.destroy_process_group()
    return out


def train(config: str, results_dir: str, ckpt_dir: str) -> dict:
    """The real training path (build: load, shard with FSDP2, AdamW; loop.run) on backend hccl,
    2 optimizer steps with gradient accumulation, then one checkpoint save."""
    from pisft import config as config_mod
    from pisft import device as devices
    from pisft.introspect import collective_audit
    from pisft.train import loop
    from pisft.train.checkpoint import CheckpointManager
    from pisft.train.run_folders import run_fingerprint
    from pisft.train.batches import make_loader
    from pisft.train.run import loop_settings, lr_scheduler
    from pisft.train.job import Context, build, make_sampler

    overrides = [f"results_dir={results_dir}", f"data.recap_dir={results_dir}/demo_recap",
                 "device=cpu", "train.nproc_per_node=2", "train.micro_batch_size=2",
                 "train.global_batch_size=8", "train.steps=2", "train.warmup_steps=1",
                 "train.save_every=50", "train.num_workers=0",
                 "train.compile=off"]  # build() runs what the launcher resolved: no `auto` here
    cfg = config_mod.load(config, overrides)
    dist.init_process_group("hccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    info = devices.DeviceInfo(kind="cpu", backend="hccl", device=torch.device("cpu"), name="cpu")
    ctx = Context(cfg, "train_8card", info, rank, world)
    built = build(ctx)
    t = cfg.train
    scheduler = lr_scheduler(cfg, built.optimizer)
    sampler = make_sampler(cfg, built.train_set, world)
    loader = make_loader(built.train_set, sampler, rank=rank, start_step=0, end_step=t.steps,
                         seed=t.seed, draw=built.task.draw, num_workers=0)
    settings = loop_settings(ctx)
    records = loop.run(built.model, built.optimizer, scheduler, built.task, iter(loader), settings,
                       start_step=0)
    manager = CheckpointManager(Path(ckpt_dir), keep_last=1, rank=rank, world_size=world,
                                fingerprint=run_fingerprint(cfg), config=config_mod.resolved(cfg),
                                log=lambda _msg: None)
    saved = manager.save(t.steps, built.model, built.optimizer, scheduler)
    out = {
        "backend": dist.get_backend(),
        "accum": cfg.grad_accum_steps,
        "steps": [r["step"] for r in records],
        "losses": [r["loss"] for r in records],
        "checkpoint": str(saved),
        "collectives": collective_audit.LOG.as_dict(),
        "violations": collective_audit.LOG.violations,
    }
    dist.destroy_process_group()
    return out


def in_flight(ending: str) -> dict:
    """Collectives still in gloo's worker threads when the process ends, their group held past
    `destroy_process_group` (as torch's DTensor caches hold FSDP2's mesh): `ending` "exit_process"
    ends as every pisft worker does (`pisft.device.exit_process`), "teardown" through the
    interpreter's teardown, which aborts the process (issue 47)."""
    dist.init_process_group("hccl")
    HELD.append(dist.distributed_c10d._get_default_group())  # as the caches keep it
    for _ in range(1000):  # temporaries: a worker thread drops the last reference to each
        dist.all_reduce(torch.ones(20_000), async_op=True)
    dist.destroy_process_group()
    return {"held": type(HELD[0]).__name__, "ending": ending}


HELD: list = []  # alive until the process ends


def main(argv: list[str]) -> int:
    out_dir, what, *args = argv
    rank = int(os.environ.get("RANK", "0"))
    result = {"collectives": collectives, "train": train, "in_flight": in_flight}[what](*args)
    result["rank"] = rank
    Path(out_dir, f"rank_{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if sys.argv[3:4] == ["teardown"]:
        raise SystemExit(code)
    from pisft.device import exit_process

    exit_process(code)
