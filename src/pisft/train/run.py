"""A training stage inside one process: resume, train, checkpoint, export.

`run_training` is the `train_8card` stage (the policy). The loop around the optimizer steps
(run folder lock, verified checkpoints, resume, metrics, data loader, export) is `run_plan`'s,
for any `RunPlan`: the RECAP value model (`pisft.recap.value_training`) trains through it too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pisft import layout
from pisft import config as config_mod
from pisft.errors import PisftError
from pisft.train import decisions, loop, optim, step_record
from pisft.base_identity import base_record
from pisft.train.checkpoint import CheckpointManager
from pisft.train.run_folders import checkpoint_root, other_runs, run_fingerprint
from pisft.train.batches import make_loader, resolve_workers
from pisft.data.augment import augment_record, make_augment
from pisft.train.ema import ema_record, make_ema
from pisft.train.export import export_model
from pisft.train.fsdp import sharding_report
from pisft.train.guard import RunLock, RunLockHeld
from pisft.train.metrics import MetricsLog, Progress, TensorBoardSink
from pisft.train.job import (
    Built,
    Context,
    build,
    env_summary,
    load_turns,
    make_sampler,
    peak_flops,
    require_inputs,
)


@dataclass
class RunPlan:
    """What a training stage trains, how long, where its checkpoints and output go."""

    stage: str
    steps: int  # optimizer steps of the run
    global_batch: int  # samples per optimizer step (micro batch: train.micro_batch_size)
    ckpt_root: Path  # the run folder (one per fingerprint)
    fingerprint: dict[str, Any]  # what a checkpoint must share with this run to be resumed
    output: Path  # the stage's output folder (written by `export`)
    build: Callable[[Context], Built]  # model, task, train set, optimizer (same on every rank)
    scheduler: Callable[[Any], Any]  # optimizer -> learning-rate scheduler
    export: Callable[[Context, Built, MetricsLog, dict, dict], None]  # collective; rank 0 writes
    nonfinite_advice: str  # what to change when a loss or gradient is not finite
    ema_decay: float = 0.0  # train.ema_decay for the policy (pisft.train.ema); 0: no EMA
    keeps_micro_batch: bool = False  # train.micro_batch_size was auto: a resume keeps the one it started with


def lr_scheduler(cfg, optimizer):
    """The run's warmup + cosine schedule (train.lr, warmup_steps, decay_lr, steps)."""
    t = cfg.train
    return optim.build_scheduler(optimizer, lr=t.lr, warmup_steps=t.warmup_steps,
                                 decay_lr=t.decay_lr, steps=t.steps)


def loop_settings(ctx: Context, peak: float | None = None, *, steps: int | None = None,
                  global_batch: int | None = None) -> loop.LoopSettings:
    """The optimizer-step loop's settings for this process: train.steps and
    train.global_batch_size unless given (a RunPlan's)."""
    cfg, t = ctx.cfg, ctx.cfg.train
    global_batch = global_batch or t.global_batch_size
    return loop.LoopSettings(
        steps=steps or t.steps, accum=config_mod.accumulation_steps(global_batch, t.micro_batch_size, cfg.world_size),
        global_batch=global_batch, grad_clip=t.grad_clip, kind=ctx.info.kind,
        device=ctx.info.device, world_size=ctx.world_size, rank=ctx.rank, peak_flops=peak,
        save_every=t.save_every, log_every=t.log_every)


def policy_plan(ctx: Context) -> RunPlan:
    """The train_8card stage's plan: the policy, train.steps at train.global_batch_size."""
    cfg, t = ctx.cfg, ctx.cfg.train
    require_inputs(cfg, ctx.stage)  # the fingerprint (hence the run folder) reads them
    return RunPlan(
        stage=ctx.stage, steps=t.steps, global_batch=t.global_batch_size,
        ckpt_root=checkpoint_root(cfg), fingerprint=run_fingerprint(cfg), output=layout.iteration(cfg).train,
        build=build, scheduler=lambda optimizer: lr_scheduler(cfg, optimizer), export=export_model,
        nonfinite_advice=f"Lower train.lr (now {t.lr}) or raise train.warmup_steps",
        ema_decay=t.ema_decay or 0.0)


def run_training(ctx: Context) -> int:
    """train_8card: what the smoke gate decided for `auto` keys (its report, pisft.train.decisions),
    then the plan."""
    auto = ctx.cfg.train.micro_batch_size == decisions.AUTO
    ctx = dataclasses.replace(ctx, cfg=decisions.for_training(ctx.cfg, ctx.log))
    return run_plan(ctx, dataclasses.replace(policy_plan(ctx), keeps_micro_batch=auto))


def run_plan(ctx: Context, plan: RunPlan) -> int:
    """Lock the run folder, build, resume, train, export: one training stage in this process."""
    cfg = ctx.cfg
    t_start = time.perf_counter()
    # Locked before anything in the folder is read or written, and before the (slow) model load,
    # so a second trainer stops at once; held until this process ends.
    lock = _lock_run_folder(ctx, plan.ckpt_root)
    try:
        built = plan.build(ctx)
        scheduler = plan.scheduler(built.optimizer)
        resolved = config_mod.resolved(cfg)
        ckpt = CheckpointManager(plan.ckpt_root, keep_last=cfg.train.keep_last, rank=ctx.rank,
                                 world_size=ctx.world_size, fingerprint=plan.fingerprint,
                                 config=resolved, log=ctx.log, base=base_record(built.base_dir))
        return _train(ctx, plan, built, scheduler, resolved, ckpt, t_start)
    finally:
        lock.release()


def _keep_micro_batch(ctx: Context, started: Any, global_batch: int) -> Context:
    """train.micro_batch_size: auto, resumed: the micro batch the run started with, where it fits this
    device (not above the gate's choice, the largest that fits) and splits the global batch over this
    world size; else the gate's, saying why."""
    chosen = ctx.cfg.train.micro_batch_size
    if not isinstance(started, int) or started == chosen:
        return ctx
    if started > chosen:
        why = f"it does not fit this device (the smoke gate's largest that fits is {chosen})"
    elif global_batch % (started * ctx.world_size):
        why = f"it does not split the global batch {global_batch} over {ctx.world_size} process(es)"
    else:
        ctx.log(f"train.micro_batch_size: auto: keeps {started}, the micro batch this run started with "
                f"(the smoke gate chose {chosen} on this device)")
        return dataclasses.replace(ctx, cfg=decisions.with_train(ctx.cfg, micro_batch_size=started))
    ctx.log(f"train.micro_batch_size: auto: cannot keep {started}, the micro batch this run started with: {why}; "
            f"continues at {chosen}")
    return ctx


def _lock_run_folder(ctx: Context, ckpt_root: Path) -> RunLock:
    """Rank 0 holds the run folder's lock for the whole run; every rank stops if it is taken."""
    lock = RunLock(ckpt_root)
    problem: list[str | None] = [None]
    if ctx.is_main:
        try:
            lock.acquire(ctx.stage)
        except RunLockHeld as exc:
            problem[0] = str(exc)
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise RunLockHeld(problem[0] if ctx.is_main else "rank 0 found the run folder in use")
    return lock


def _train(ctx: Context, plan: RunPlan, built, scheduler, resolved: dict,
           ckpt: CheckpointManager, t_start: float) -> int:
    cfg = ctx.cfg
    t = cfg.train
    ckpt_root = plan.ckpt_root
    start_step = 0
    resumed_from = None
    ema = make_ema(built.model, plan.ema_decay)  # the loaded weights, before any step (openpi)
    found = ckpt.find_resume()
    state = None
    if found is not None:
        state = ckpt.load(found, built.model, built.optimizer, scheduler, ema=ema)
        start_step = int(state["step"])
        resumed_from = {"path": str(found.path), "step": start_step,
                        "world_size": state.get("world_size")}
        ctx.log(f"resuming from {found.path} (step {start_step}, written by "
                f"{state.get('world_size')} processes; now {ctx.world_size})")
    else:
        ctx.log(f"starting from step 0; checkpoints go to {ckpt_root}")
    earlier = step_record.before(state, start_step)
    if plan.keeps_micro_batch and earlier:
        ctx = _keep_micro_batch(ctx, earlier[-1].get("train.micro_batch_size"), plan.global_batch)
        cfg, t = ctx.cfg, ctx.cfg.train
        resolved = ckpt.config = config_mod.resolved(cfg)  # what the checkpoints and the export record
    # which steps ran under which settings (pisft.train.step_record): a mix is said in one line
    now = step_record.settings(
        cfg, ctx.world_size, built.compiler.mode if built.compiler is not None else "off")
    mixed = step_record.mixed_line(earlier, now, start_step) if start_step < plan.steps else None  # steps to run
    if mixed is not None:
        ctx.log(f"note: {mixed}")
    others = other_runs(cfg, ckpt_root)
    if others and ctx.is_main:
        ctx.log(f"checkpoints of {len(others)} earlier run(s) this one cannot resume (other settings, inputs or "
                f"parameter layout: pisft.train.run_folders.run_fingerprint) are kept in "
                f"{ckpt_root.parent} ({', '.join(p.name for p in others)}); delete them to free space")
    metrics_log = MetricsLog(ckpt_root / layout.TRAIN_METRICS_FILE)
    if ctx.is_main:
        metrics_log.reset(keep_upto_step=start_step)

    sampler = make_sampler(cfg, built.train_set, ctx.world_size, plan.global_batch)
    if sampler.mixture is not None:
        ctx.log("the pool's sources drawn by weight (data.recap_dir, data.balance_source_weights; "
                f"RLinf's rule): {sampler.mixture.describe()}")
    workers = resolve_workers(t.num_workers, ctx.info.kind, t.nproc_per_node)
    # data.augment: the training loader only (evaluation, held-out figures and inference never)
    augment = make_augment(cfg.data.augment, built.image_keys)
    loader = make_loader(built.train_set, sampler, rank=ctx.rank, start_step=start_step,
                         end_step=plan.steps, seed=t.seed, draw=built.task.draw,
                         num_workers=workers, prompt=built.prompt, collate=built.task.collate,
                         pin_memory=ctx.info.row.accelerator, prefetch_factor=t.prefetch_factor,
                         augment=augment)
    peak, peak_source = peak_flops(ctx)
    turns = " (loaded in turns)" if load_turns(ctx) > 1 else ""
    ctx.log(f"{ctx.world_size} process(es) on {ctx.info.kind} ({ctx.info.name}){turns}, "
            f"micro batch {t.micro_batch_size} × accumulation {sampler.layout.accum} × "
            f"{ctx.world_size} = global batch {plan.global_batch}; steps {start_step}..{plan.steps}; "
            f"train set {len(built.train_set)} frames")
    compiled = built.compiler is not None and built.compiler.enabled
    blocks = built.compiler.describe() if built.compiler is not None else "eager"
    ctx.log(f"precision {t.precision}; {'FSDP2' if ctx.world_size > 1 else 'unsharded (one process)'}; "
            f"blocks {blocks} (train.compile: {t.compile}); "
            f"data-loader workers {workers} per process (train.num_workers {t.num_workers}); "
            f"peak FLOP/s: {peak_source}"
            + (f"; EMA of the trained weights, decay {ema.decay}" if ema is not None else "")
            + (f"; image augmentation {cfg.data.augment} on {', '.join(augment.image_keys)}"
               if augment is not None else ""))
    progress = Progress(plan.steps, start_step, enabled=ctx.is_main, desc=plan.stage, every=t.log_every)
    tb = TensorBoardSink(ckpt_root / "tensorboard") if (t.tensorboard and ctx.is_main) else None

    def on_step(record: dict) -> None:
        if ctx.is_main and compiled and record["step"] == start_step + 1:
            ctx.log(f"first step {record['step_time_s']:.1f} s (the blocks' compilation included; "
                    f"cached in {layout.compile_cache(cfg)})")
        if ctx.is_main:
            record = {**record, "epoch": sampler.epoch_of(record["step"])}
            metrics_log.append(record)
            progress.update(record)
            if tb is not None:
                tb.write(record)

    def save(step: int) -> None:
        path = ckpt.save(step, built.model, built.optimizer, scheduler, ema=ema,
                         extra={"step_settings": step_record.upto(earlier, now, start_step, step)})
        ctx.log(f"checkpoint {path}")

    settings = loop_settings(ctx, peak, steps=plan.steps, global_batch=plan.global_batch)
    try:
        loop.run(built.model, built.optimizer, scheduler, built.task, iter(loader), settings,
                 start_step=start_step, on_step=on_step, save=save, ema=ema)
    except loop.NonFiniteError as exc:
        raise PisftError(
            f"{plan.stage}: {exc}. {plan.nonfinite_advice}; with "
            "bf16 try train.precision: fp32 to rule out overflow; check the data "
            f"({built.dataset_dir}/conversion_report.json). The last good checkpoint is kept in "
            f"{ckpt_root}."
        ) from None
    finally:
        progress.close()
        if tb is not None:
            tb.close()

    report = sharding_report(built.model, built.optimizer, built.units)
    summary = {
        "stage": plan.stage,
        "steps": plan.steps,
        "world_size": ctx.world_size,
        "device": {"kind": ctx.info.kind, "name": ctx.info.name, "backend": ctx.info.backend},
        "resumed_from": resumed_from,
        "wall_time_s": time.perf_counter() - t_start,
        "peak_flops": peak,
        "peak_flops_source": peak_source,
        "sharding_rank0": report,
        "environment": env_summary(),
        "step_settings": step_record.upto(earlier, now, start_step, plan.steps),
        "mixed_settings": mixed,
    }
    if ema is not None:  # the exported model is the average (openpi's checkpoints hand it out)
        ema.copy_to(built.model)
    summary["weights"] = ema_record(ema)
    summary["augment"] = augment_record(augment)
    if hasattr(built.model, "pisft_model_info"):  # the policy's pisft_model.json says which
        built.model.pisft_model_info["weights"] = ema_record(ema)
        built.model.pisft_model_info["augment"] = augment_record(augment)
        built.model.pisft_model_info["step_settings"] = summary["step_settings"]
        built.model.pisft_model_info["mixed_settings"] = mixed
    plan.export(ctx, built, metrics_log, summary, resolved)
    dist.barrier()
    ctx.log(f"done: {plan.output}")
    return 0

