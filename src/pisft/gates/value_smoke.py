"""The `smoke_value` gate: the value model's first optimizer steps on one device, before
`train_value` takes every device (as `smoke_1card` gates `train_8card`).

A gate sits above what it gates (`pisft.recap.value_training`) and the smoke checks it shares
with `smoke_1card` (`pisft.gates.smoke.training_checks`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import torch

from pisft import layout
from pisft.data.augment import make_augment
from pisft.gates.smoke import training_checks
from pisft.io import atomic_dir, write_json_atomic
from pisft.recap.value_task import ValueTask
from pisft.recap.value_training import _optimizer, _pieces
from pisft.train import decisions, loop
from pisft.train.batches import StepDataset
from pisft.train.job import Context, apply_trainable, make_sampler


def smoke_value_steps(ctx: Context, steps: int | None = None) -> dict[str, Any]:
    """The value model's first `steps` (default smoke.steps) optimizer steps on this process's
    device, unsharded, on the first micro-batch of the real run at the peak learning rates: the
    losses and gradient norms, and the checks the policy's smoke run makes (loss finite,
    gradients finite, loss falling). Needs the process group (smoke_1card's one process)."""
    cfg, t = ctx.cfg, ctx.cfg.train
    steps = steps or cfg.smoke.steps
    p = _pieces(cfg, ctx.stage, ctx.info.device)
    apply_trainable(ctx, p.model, value_model=True)
    p.model.to(ctx.info.device)
    optimizer = _optimizer(cfg, p.model, ctx.info.kind)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    task = ValueTask(p.collate, ctx.info.device, t.precision)
    first = make_sampler(cfg, p.train_set, 1, cfg.value_global_batch_size).micro_batch(0, 0, 0)
    # the run's first micro-batch as its training loader gives it (data.augment included)
    ds = StepDataset(p.train_set, t.seed, None, augment=make_augment(cfg.data.augment, p.train_set.image_keys))
    fixed = p.collate([ds[ref] for ref in first])
    settings = loop.LoopSettings(steps=steps, accum=1, global_batch=t.micro_batch_size, grad_clip=t.grad_clip,
                                 kind=ctx.info.kind, device=ctx.info.device, world_size=1, rank=0,
                                 stop_on_nonfinite=False, log_every=steps)

    def on_step(record: dict) -> None:  # smoke_1card's step line
        ctx.log(f"smoke step {record['step']}/{steps}: loss {record['loss']:.5f} "
                f"grad_norm {record['grad_norm']:.4f} {record['step_time_s']:.3f} s")

    records = loop.run(p.model, optimizer, scheduler, task, (dict(fixed) for _ in itertools.count()),
                       settings, start_step=0, on_step=on_step)
    losses = [r["loss"] for r in records]
    grad_norms = [r["grad_norm"] for r in records]
    checks = training_checks(losses, grad_norms)
    return {"losses": losses, "grad_norms": grad_norms, "checks": checks,
            "passed": all(c["passed"] for c in checks)}


def run_value_smoke(ctx: Context) -> int:
    """The `smoke_value` stage: the value model's first `smoke.steps` optimizer steps on one
    device, before `train_value` takes every device (as smoke_1card gates train_8card). Writes
    `value_smoke/report.json` (losses, gradient norms, the checks, `passed`); exit 3 when a check
    fails, with what failed."""
    # `auto` micro batch and checkpointing as the policy's smoke gate decided them (pisft.train.decisions)
    ctx = dataclasses.replace(ctx, cfg=decisions.for_training(ctx.cfg, ctx.log))
    cfg = ctx.cfg
    t0 = time.perf_counter()
    result = smoke_value_steps(ctx)
    failed = [c for c in result["checks"] if not c["passed"]]
    report = {**result, "stage": ctx.stage, "iteration": cfg.iteration, "device": str(ctx.info.device),
              "micro_batch_size": cfg.train.micro_batch_size, "precision": cfg.train.precision,
              "wall_time_s": round(time.perf_counter() - t0, 2),
              "messages": [f"{c['name']}: {c.get('detail', 'failed')}" for c in failed]}
    if ctx.is_main:
        with atomic_dir(layout.iteration(cfg).value_smoke) as tmp:
            write_json_atomic(tmp / layout.REPORT_FILE, report)
    if failed:
        print("error: smoke_value failed:\n  - " + "\n  - ".join(report["messages"])
              + "\n  (lower recap.value_lr / recap.value_head_lr, or check the dataset's returns)", flush=True)
        return 3
    ctx.log(f"passed: losses {', '.join(f'{x:.4g}' for x in result['losses'])}")
    return 0
