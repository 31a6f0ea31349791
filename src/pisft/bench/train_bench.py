"""Training-loop throughput, side by side in one process on the same model and batches.

Variants (each on a fresh copy of the same tiny model, the same in-memory collated micro-batches,
preprocessing included, AdamW, grad clipping, one process):
  ours            pisft.train.loop.run on the FSDP2-sharded policy (metrics, all-reduces, JSONL)
  bare            a plain forward/backward/clip/step loop over the same FSDP2-sharded policy
  bare_unsharded  the same plain loop on the policy without FSDP (what FSDP costs on 1 process)
  lerobot         LeRobot 0.6.1's own training step, `lerobot_train.update_policy` (the function
                  `lerobot-train` calls every step) with `accelerate.Accelerator(cpu=...)`, on the
                  unsharded policy — lerobot-train on 1 process, without its data loader
  ours_with_data  pisft's loop fed by its real DataLoader from the LeRobot dataset on disk
Rounds alternate between the variants; the best round of each is reported (less sensitive to
other load on the machine). `overhead_ratio` = ours / bare (aim >= 0.95);
`ours_vs_lerobot` = ours / lerobot.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from pisft import config as config_mod
from pisft.train import fsdp, loop, optim
from pisft.train.batches import StepDataset, make_loader, split_rand
from pisft.train.metrics import MetricsLog
from pisft.train.policy_task import PolicyTask
from pisft.train.sampler import StepLayout, StepSampler


def _inputs(cfg: config_mod.PisftConfig, work: Path) -> Path:
    """Tiny base model + small demo dataset under work/results (the stages' own code)."""
    from pisft.data import convert, demo
    from pisft.model import fetch

    root = work / "results"
    raw = config_mod.to_dict(cfg)
    raw["results_dir"] = str(root)
    raw["device"] = "cpu"
    raw["model"].update(source="tiny", preset="tiny")
    raw["data"].update(recap_dir=f"{root}/demo_recap", demo_episodes_per_task=2, demo_episode_length=24)
    small_cfg = config_mod.from_dict(raw, "train_bench")
    fetch.run(small_cfg)
    demo.run(small_cfg)
    convert.run(small_cfg)
    return root


def _ensure_process_group(work: Path) -> bool:
    if dist.is_initialized():
        return False
    store = dist.FileStore(str(work / "pg_store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return True


class _Setup:
    def __init__(self, root: Path, micro: int, n_batches: int, seed: int) -> None:
        from pisft.data.dataset import load_split, load_stats
        from pisft.model.policy import load_policy

        self.root = root
        self.base = root / "base_model"
        self.stats = load_stats(root / "dataset")
        probe = load_policy(self.base, dtype="float32")
        self.train_set = load_split(root / "dataset", "train", chunk_size=probe.config.chunk_size)
        self.micro = micro
        self.seed = seed
        self.sampler = StepSampler(len(self.train_set), seed, StepLayout(micro, micro, 1))
        task = PolicyTask(probe, None, torch.device("cpu"))
        self.draw = task.draw
        ds = StepDataset(self.train_set, seed, task.draw)
        self.batches = [default_collate([ds[r] for r in self.sampler.micro_batch(k, 0, 0)])
                        for k in range(n_batches)]

    def policy(self, *, sharded: bool):
        from torch.distributed.device_mesh import init_device_mesh

        from pisft.model.policy import load_policy, make_processors

        policy = load_policy(self.base, dtype="float32")
        pre, _ = make_processors(policy, self.base, self.stats)
        if sharded:
            fsdp.shard(policy, init_device_mesh("cpu", (1,)), "fp32")
        return policy, pre

    def stream(self):
        return (dict(b) for b in itertools.cycle(self.batches))


def _optimizer(policy, lr: float):
    opt = optim.build_optimizer(policy.parameters(), lr=lr, weight_decay=1e-2, fused=False)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def _time_steps(step_fn, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step_fn()
    t0 = time.perf_counter()
    for _ in range(steps):
        step_fn()
    return time.perf_counter() - t0


def _ours(setup: _Setup, warmup: int, steps: int, work: Path, lr: float, with_data: bool) -> float:
    policy, pre = setup.policy(sharded=True)
    opt, sched = _optimizer(policy, lr)
    task = PolicyTask(policy, pre, torch.device("cpu"))
    log = MetricsLog(work / "bench_metrics.jsonl")
    log.reset(0)
    total = warmup + steps
    if with_data:
        batches = iter(make_loader(setup.train_set, setup.sampler, rank=0, start_step=0,
                                   end_step=total, seed=setup.seed, draw=task.draw, num_workers=0))
    else:
        batches = setup.stream()
    settings = loop.LoopSettings(steps=total, accum=1, global_batch=setup.micro, grad_clip=1.0,
                                 kind="cpu", device=torch.device("cpu"), world_size=1, rank=0)
    stamps: list[float] = []

    def on_step(record: dict) -> None:
        log.append(record)
        stamps.append(time.perf_counter())

    t0 = time.perf_counter()
    loop.run(policy, opt, sched, task, batches, settings, start_step=0, on_step=on_step)
    start = stamps[warmup - 1] if warmup else t0
    return stamps[-1] - start


def _bare(setup: _Setup, warmup: int, steps: int, lr: float, sharded: bool) -> float:
    policy, pre = setup.policy(sharded=sharded)
    opt, sched = _optimizer(policy, lr)
    task = PolicyTask(policy, pre, torch.device("cpu"))
    params = [p for p in policy.parameters() if p.requires_grad]
    stream = setup.stream()
    policy.train()

    def step() -> None:
        batch, rand = split_rand(next(stream))
        loss = task.loss(policy, task.prepare(batch), rand)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()

    return _time_steps(step, warmup, steps)


def _lerobot(setup: _Setup, warmup: int, steps: int, lr: float) -> float:
    from accelerate import Accelerator
    from lerobot.scripts.lerobot_train import update_policy
    from lerobot.utils.logging_utils import AverageMeter, MetricsTracker

    policy, pre = setup.policy(sharded=False)
    opt, sched = _optimizer(policy, lr)
    accelerator = Accelerator(cpu=True)
    policy, opt = accelerator.prepare(policy, opt)
    meters = {name: AverageMeter(name, ":.3f") for name in ("loss", "grad_norm", "lr", "update_s",
                                                              "dataloading_s")}
    tracker = MetricsTracker(setup.micro, len(setup.train_set), 1, meters)
    stream = setup.stream()

    def step() -> None:
        batch, _ = split_rand(next(stream))
        update_policy(tracker, policy, pre(batch), opt, 1.0, accelerator=accelerator, lr_scheduler=sched)

    return _time_steps(step, warmup, steps)


def run(cfg: config_mod.PisftConfig, work: Path, *, steps: int = 20, warmup: int = 3,
        rounds: int = 2) -> dict[str, Any]:
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    root = _inputs(cfg, work)
    owns_pg = _ensure_process_group(work)
    micro = cfg.train.micro_batch_size
    lr = cfg.train.lr
    try:
        setup = _Setup(root, micro, n_batches=8, seed=cfg.train.seed)
        variants = {
            "ours": lambda: _ours(setup, warmup, steps, work, lr, with_data=False),
            "bare": lambda: _bare(setup, warmup, steps, lr, sharded=True),
            "bare_unsharded": lambda: _bare(setup, warmup, steps, lr, sharded=False),
            "lerobot": lambda: _lerobot(setup, warmup, steps, lr),
            "ours_with_data": lambda: _ours(setup, warmup, steps, work, lr, with_data=True),
        }
        seconds: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                seconds[name].append(fn())
    finally:
        if owns_pg:
            dist.destroy_process_group()
    sps = {k: steps * micro / min(v) for k, v in seconds.items()}
    result = {
        "what": "samples/s of one training process, tiny pi0.5, same model and in-memory batches",
        "micro_batch_size": micro,
        "steps_timed": steps,
        "warmup_steps": warmup,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "samples_per_s": sps,
        "seconds_per_round": seconds,
        "overhead_ratio": sps["ours"] / sps["bare"],
        "fsdp_1proc_ratio": sps["bare"] / sps["bare_unsharded"],
        "ours_vs_lerobot": sps["ours"] / sps["lerobot"],
        "data_pipeline_ratio": sps["ours_with_data"] / sps["ours"],
    }
    (work / "train_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> int:  # python -m pisft.bench.train_bench
    import tempfile

    cfg = config_mod.load(config_mod.DEFAULT_CONFIG)
    with tempfile.TemporaryDirectory(prefix="pisft-train-bench-") as tmp:
        print(json.dumps(run(cfg, Path(tmp)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
