"""Training-step throughput, side by side in one run, on the same model and the same batches.

One process (each variant on a fresh copy of the same tiny pi0.5, AdamW, gradient clipping):
  ours            pisft.train.loop.run on the policy laid out as train_8card lays it out for
                  one process (`fsdp.distribute`: unsharded), fed the batches our data loader
                  yields (collated and preprocessed by its workers), kept in memory
  bare            the training's step alone (`pisft.train.step.train_step`: forward, backward,
                  clipping, the guarded AdamW step) over the same layout and batches, without the
                  loop around it (no metrics, no fetches): ours / bare is the loop's own cost
  bare_sharded    the same step on FSDP2 over a 1-process mesh (what the smoke run keeps
                  to measure the sharded layout's memory; `fsdp_sharded_1proc_ratio`)
  lerobot         LeRobot 0.6.1's own step: its preprocessor on the collated batch (lerobot-train
                  runs it in the training process) then `lerobot_train.update_policy` with an
                  `accelerate.Accelerator`, on the unsharded policy: lerobot-train without its
                  data loader
  ours_with_data  `ours` fed by the real DataLoader from the LeRobot dataset on disk, with the
                  default train.num_workers / prefetch_factor of the config
Two processes (torchrun, gloo; `pisft.bench.train_dist`): `ours` on FSDP2 over 2 processes (the
CPU's merged units, train.fsdp_min_unit_params -1; `ours_layer_units`: the layer units) vs
LeRobot's step under its own `accelerate launch --cpu --num_processes 2` (DDP), each process
with the same micro-batches.

Honest measurement (docs/benchmarks.md): every variant gets the same warm-up and timed
steps; rounds interleave the variants (the order rotates each round) and each figure is the
median over rounds; wall time AND the CPU time of the variant's processes (the training
processes and their data-loader workers, from /proc) are recorded, so `cores_used` shows
whether a ratio came from one side getting more CPU. `load_avg` is the host's load average
when the run started and ended.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from pisft import config as config_mod
from pisft import device as devices
from pisft.ports import held_port
from pisft.train import fsdp, loop, optim
from pisft.train.batches import StepDataset, make_loader, resolve_workers, split_rand
from pisft.train.metrics import MetricsLog
from pisft.train.policy_task import PolicyTask
from pisft.train.sampler import StepLayout, StepSampler
from pisft.train.step import StepSettings, train_step

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


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


def process_tree_cpu_s(pid: int | None = None) -> float:
    """user + system CPU seconds of a process and of its living descendants (from /proc)."""
    pid = os.getpid() if pid is None else pid
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK)
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen or p not in stats:
            continue
        seen.add(p)
        total += stats[p][1]
        todo += [c for c, (ppid, _) in stats.items() if ppid == p]
    return total


def load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


class Setup:
    """The model files, the train split, and the in-memory micro-batches every variant uses."""

    def __init__(self, root: Path, micro: int, n_batches: int, seed: int) -> None:
        from pisft.data.dataset import load_split, load_stats
        from pisft.model.policy import load_policy, make_processors

        self.root = root
        self.base = root / "base_model"
        self.stats = load_stats(root / "dataset")
        probe = load_policy(self.base, dtype="float32")
        self.train_set = load_split(root / "dataset", "train", chunk_size=probe.config.chunk_size)
        self.micro = micro
        self.seed = seed
        self.sampler = StepSampler(len(self.train_set), seed, StepLayout(micro, micro, 1))
        pre, _ = make_processors(probe, self.base, self.stats)
        task = PolicyTask(probe, pre, torch.device("cpu"))
        self.draw = task.draw
        ds = StepDataset(self.train_set, seed, task.draw)
        refs = [self.sampler.micro_batch(k, 0, 0) for k in range(n_batches)]
        # The data loader's work, timed on this process's CPU clock (its workers do the same):
        # reading a sample (LeRobot's row, the action chunk, the random draws) and preparing a
        # micro-batch (collation and LeRobot's preprocessing without its device step).
        t0 = time.process_time()
        items = [[ds[r] for r in batch] for batch in refs]
        t1 = time.process_time()
        self.prepared = [task.collate(b) for b in items]  # what our loader's workers yield
        t2 = time.process_time()
        self.data_cpu_ms = {"per_sample_read": 1e3 * (t1 - t0) / sum(map(len, refs)),
                            "per_micro_batch_prepare": 1e3 * (t2 - t1) / n_batches}
        self.raw = [default_collate(b) for b in items]  # what LeRobot's loop gets from its loader

    def policy(self, *, sharded: bool):
        from torch.distributed.device_mesh import init_device_mesh

        from pisft.model.registry import spec_of
        from pisft.model.policy import load_policy, make_processors

        policy = load_policy(self.base, dtype="float32")
        pre, _ = make_processors(policy, self.base, self.stats)
        spec_of(policy).prepare_for_training(policy, checkpointing=False)
        fsdp.distribute(policy, init_device_mesh("cpu", (1,)), "fp32", torch.device("cpu"),
                        keep_sharded=sharded)
        return policy, pre

    def stream(self, prepared: bool = True):
        source = self.prepared if prepared else self.raw
        return (dict(b) for b in itertools.cycle(source))


def ours_optimizer(policy, lr: float):
    """The optimizer the training stages build on the CPU (`train.job`): AdamW, fused where
    torch has the kernel."""
    opt = optim.build_optimizer(policy.parameters(), lr=lr, weight_decay=1e-2,
                                fused=devices.fused_adamw_supported("cpu"))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def lerobot_optimizer(policy, lr: float):
    """The optimizer lerobot-train builds for pi0.5 (`optim.factory.make_optimizer_and_scheduler`
    with the policy's preset): `torch.optim.AdamW` with torch's default implementation."""
    import dataclasses

    preset = dataclasses.replace(policy.config.get_optimizer_preset(), lr=lr)
    opt = preset.build(policy.get_optim_params())
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


OPTIMIZERS = {"ours": "AdamW, fused where torch has the kernel (what train.job builds)",
              "lerobot": "LeRobot's pi0.5 preset: torch.optim.AdamW, torch's default implementation "
                         "(what lerobot-train builds)"}


def timed(step_fn, warmup: int, steps: int) -> dict[str, float]:
    """Wall and CPU seconds (this process and its descendants) of `steps` calls after `warmup`."""
    for _ in range(warmup):
        step_fn()
    c0, t0 = process_tree_cpu_s(), time.perf_counter()
    for _ in range(steps):
        step_fn()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "cpu_s": process_tree_cpu_s() - c0}


def _ours(setup: Setup, warmup: int, steps: int, work: Path, lr: float, log_every: int,
               workers: int | None, prefetch: int) -> dict[str, float]:
    """loop.run over warm-up + timed steps in one call; the timed window starts when the
    warm-up's last record arrives (records arrive every log_every steps, so warm-up is a
    multiple of it)."""
    policy, pre = setup.policy(sharded=False)
    opt, sched = ours_optimizer(policy, lr)
    task = PolicyTask(policy, pre, torch.device("cpu"))
    log = MetricsLog(work / "bench_metrics.jsonl")
    log.reset(0)
    total = warmup + steps
    if workers is not None:
        batches = iter(make_loader(setup.train_set, setup.sampler, rank=0, start_step=0,
                                   end_step=total, seed=setup.seed, draw=task.draw,
                                   num_workers=workers, collate=task.collate,
                                   prefetch_factor=prefetch))
    else:
        batches = setup.stream()
    settings = loop.LoopSettings(steps=total, accum=1, global_batch=setup.micro, grad_clip=1.0,
                                 kind="cpu", device=torch.device("cpu"), world_size=1, rank=0,
                                 log_every=log_every)
    marks: dict[str, float] = {}

    def on_step(record: dict) -> None:
        log.append(record)
        if record["step"] == warmup:
            marks["c0"], marks["t0"] = process_tree_cpu_s(), time.perf_counter()

    loop.run(policy, opt, sched, task, batches, settings, start_step=0, on_step=on_step)
    return {"wall_s": time.perf_counter() - marks["t0"], "cpu_s": process_tree_cpu_s() - marks["c0"]}


def _bare(setup: Setup, warmup: int, steps: int, lr: float, sharded: bool) -> dict[str, float]:
    policy, pre = setup.policy(sharded=sharded)
    opt, sched = ours_optimizer(policy, lr)
    task = PolicyTask(policy, pre, torch.device("cpu"))
    params = [p for p in policy.parameters() if p.requires_grad]
    stream = setup.stream()
    settings = StepSettings(accum=1, grad_clip=1.0, kind="cpu", device=torch.device("cpu"))
    policy.train()

    def micro_batch() -> tuple[dict, dict]:
        batch, rand = split_rand(next(stream))
        return task.prepare(batch), rand

    def step() -> None:
        train_step(policy, opt, task, micro_batch, settings, params=params)
        sched.step()

    return timed(step, warmup, steps)


def lerobot_step_fn(policy, pre, opt, sched, accelerator, micro: int, dataset_len: int, stream):
    """One lerobot-train step: its preprocessor, then `update_policy` (LeRobot 0.6.1)."""
    from lerobot.scripts.lerobot_train import update_policy
    from lerobot.utils.logging_utils import AverageMeter, MetricsTracker

    meters = {name: AverageMeter(name, ":.3f") for name in ("loss", "grad_norm", "lr", "update_s",
                                                              "dataloading_s")}
    tracker = MetricsTracker(micro, dataset_len, 1, meters)

    def step() -> None:
        batch, _ = split_rand(next(stream))
        update_policy(tracker, policy, pre(batch), opt, 1.0, accelerator=accelerator, lr_scheduler=sched)

    return step


def lerobot_accelerator():
    """The Accelerator lerobot-train makes for an fp32 CPU policy (lerobot_train.train, 0.6.1)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    return Accelerator(step_scheduler_with_optimizer=False, mixed_precision="no",
                       kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
                       cpu=True)


def _lerobot(setup: Setup, warmup: int, steps: int, lr: float) -> dict[str, float]:
    from pisft.model.policy import load_policy, make_processors

    policy = load_policy(setup.base, dtype="float32")  # LeRobot's model as it loads it
    pre, _ = make_processors(policy, setup.base, setup.stats)
    opt, sched = lerobot_optimizer(policy, lr)
    accelerator = lerobot_accelerator()
    policy, opt = accelerator.prepare(policy, opt)
    step = lerobot_step_fn(policy, pre, opt, sched, accelerator, setup.micro, len(setup.train_set),
                           setup.stream(prepared=False))
    return timed(step, warmup, steps)


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _summarise(runs: dict[str, list[dict[str, float]]], samples: int) -> dict[str, dict]:
    out = {}
    for name, rs in runs.items():
        if not rs:
            continue
        out[name] = {
            "samples_per_s": _median([samples / r["wall_s"] for r in rs]),
            "cores_used": _median([r["cpu_s"] / r["wall_s"] for r in rs]),
            "wall_s_per_round": [round(r["wall_s"], 3) for r in rs],
            "cpu_s_per_round": [round(r["cpu_s"], 3) for r in rs],
        }
    return out


# The two-process variants run `pisft.bench.train_dist` as a script under each launcher (it imports
# this module for the shared LeRobot step, so this module only names its path).
DIST_WORKER = Path(__file__).with_name("train_dist.py")
DIST_WORLD = 2


def launch_commands(root: Path, work: Path, *, micro: int, warmup: int, steps: int, lr: float,
                    log_every: int, seed: int) -> dict[str, Callable[[Path, int], list[str]]]:
    """Each variant's command, of its result file and a rendezvous port (`pisft.ports.held_port`,
    held while it runs; torchrun's --standalone picks its own)."""
    work.mkdir(parents=True, exist_ok=True)
    accelerate = Path(sys.executable).with_name("accelerate")

    def args(variant: str, out: Path, *extra: str) -> list[str]:
        return [str(DIST_WORKER), "--variant", variant, "--root", str(root), "--micro", str(micro),
                "--warmup", str(warmup), "--steps", str(steps), "--lr", str(lr),
                "--log-every", str(log_every), "--seed", str(seed), "--out", str(out), *extra]

    def torchrun(*worker_args: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", str(DIST_WORLD), *worker_args]

    return {
        "ours": lambda out, _port: torchrun(*args("ours", out)),
        # the same, with the layer units an accelerator trains with (train.fsdp_min_unit_params=0):
        # what merging the units buys on the CPU
        "ours_layer_units": lambda out, _port: torchrun(*args("ours", out, "--min-unit-params", "0")),
        "lerobot": lambda out, port: [str(accelerate), "launch", "--multi_gpu", "--num_processes",
                                      str(DIST_WORLD), "--num_machines", "1", "--mixed_precision", "no",
                                      "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1",
                                      "--main_process_port", str(port), *args("lerobot", out)],
    }


def _two_process(setup_root: Path, work: Path, cfg: config_mod.PisftConfig, *, warmup: int,
                 steps: int, rounds: int) -> dict[str, Any]:
    """ours (torchrun, FSDP2; the CPU's merged units and the layer units) vs LeRobot (accelerate
    launch, DDP) on 2 processes, interleaved."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    launchers = launch_commands(setup_root, work, micro=cfg.train.micro_batch_size,
                                          warmup=warmup, steps=steps, lr=cfg.train.lr,
                                          log_every=cfg.train.log_every, seed=cfg.train.seed)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in launchers}
    failures: dict[str, str] = {}
    names = list(launchers)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name in failures:
                continue
            out = work / f"{name}_{r}.json"
            with held_port() as port:
                cmd = launchers[name](out, port)
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0 or not out.is_file():
                failures[name] = f"{' '.join(cmd[:4])} … exit {proc.returncode}: {proc.stderr[-1500:]}"
                continue
            runs[name].append(json.loads(out.read_text()))
    samples = 2 * cfg.train.micro_batch_size * steps
    result: dict[str, Any] = {"processes": 2, "threads_per_process": 1,
                              "variants": _summarise(runs, samples)}
    if failures:
        result["failed"] = failures
    v = result["variants"]
    if "ours" in v and "lerobot" in v:
        result["ours_vs_lerobot"] = v["ours"]["samples_per_s"] / v["lerobot"]["samples_per_s"]
    if "ours" in v and "ours_layer_units" in v:
        result["merged_vs_layer_units"] = (v["ours"]["samples_per_s"]
                                           / v["ours_layer_units"]["samples_per_s"])
    return result


# Timed steps per variant and round (a multiple of train.log_every): 40, about 2 s at one
# process. Rounds of one variant still differ by up to 30% on this 2-core host: compare medians.
TIMED_STEPS = 40


def run(cfg: config_mod.PisftConfig, work: Path, *, steps: int = TIMED_STEPS, warmup: int = 4,
        rounds: int = 3, two_process: bool = True) -> dict[str, Any]:
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    load_start = load_avg()
    root = _inputs(cfg, work)
    owns_pg = _ensure_process_group(work)
    micro = cfg.train.micro_batch_size
    lr = cfg.train.lr
    log_every = cfg.train.log_every
    workers = resolve_workers(cfg.train.num_workers, "cpu", 1)
    prefetch = cfg.train.prefetch_factor
    # Our loop fetches its values every log_every steps: warm-up and timed steps are whole
    # logging intervals (for every variant alike), so the timed window starts and ends on a fetch.
    warmup = -(-max(1, warmup) // log_every) * log_every
    steps = -(-max(1, steps) // log_every) * log_every
    try:
        setup = Setup(root, micro, n_batches=8, seed=cfg.train.seed)
        variants = {
            "ours": lambda: _ours(setup, warmup, steps, work, lr, log_every, None, prefetch),
            "bare": lambda: _bare(setup, warmup, steps, lr, sharded=False),
            "bare_sharded": lambda: _bare(setup, warmup, steps, lr, sharded=True),
            "lerobot": lambda: _lerobot(setup, warmup, steps, lr),
            "ours_with_data": lambda: _ours(setup, warmup, steps, work, lr, log_every,
                                                 workers, prefetch),
        }
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in variants}
        names = list(variants)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
                runs[name].append(variants[name]())
    finally:
        if owns_pg:
            dist.destroy_process_group()
    one = _summarise(runs, steps * micro)
    sps = {k: v["samples_per_s"] for k, v in one.items()}
    result: dict[str, Any] = {
        "what": "samples/s of the training step, tiny pi0.5, same model and batches; medians over "
                "interleaved rounds; cores_used = CPU seconds of the variant's processes "
                "(data-loader workers included) / wall seconds",
        "micro_batch_size": micro,
        "steps_timed": steps,
        "warmup_steps": warmup,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "optimizers": OPTIMIZERS,
        "data_loader": {"num_workers": workers, "train.num_workers": cfg.train.num_workers,
                        "prefetch_factor": prefetch,
                        "cpu_ms": {k: round(v, 3) for k, v in setup.data_cpu_ms.items()}},
        "one_process": {
            "layout": "unsharded (fsdp.distribute on a 1-process mesh)",
            "variants": one,
        },
        "samples_per_s": sps,
        "overhead_ratio": sps["ours"] / sps["bare"],
        # The 1-process training layout is unsharded: what FSDP costs it is nothing by construction.
        "fsdp_1proc_ratio": 1.0,
        "fsdp_sharded_1proc_ratio": sps["bare_sharded"] / sps["bare"],
        "ours_vs_lerobot": sps["ours"] / sps["lerobot"],
        "ours_with_data_vs_lerobot": sps["ours_with_data"] / sps["lerobot"],
        "data_pipeline_ratio": sps["ours_with_data"] / sps["ours"],
    }
    if two_process:
        result["two_process"] = _two_process(root, work / "two_process", cfg, warmup=warmup,
                                             steps=steps, rounds=rounds)
        result["ours_vs_lerobot_2proc"] = result["two_process"].get("ours_vs_lerobot")
    result["load_avg"] = {"start": load_start, "end": load_avg()}
    (work / "train_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:  # python -m pisft.bench.train_bench
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(config_mod.DEFAULT_CONFIG))
    parser.add_argument("--steps", type=int, default=TIMED_STEPS)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-two-process", action="store_true")
    args = parser.parse_args(argv)
    cfg = config_mod.load(args.config)
    with tempfile.TemporaryDirectory(prefix="pisft-train-bench-") as tmp:
        print(json.dumps(run(cfg, Path(tmp), steps=args.steps, warmup=args.warmup,
                             rounds=args.rounds, two_process=not args.no_two_process), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
