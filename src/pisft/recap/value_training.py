"""The `train_value` stage: the distributional value model on the pool, under torchrun/FSDP2.

Started like `train_8card` (`python -m pisft launch train_value`: torchrun with
train.nproc_per_node x train.nnodes processes) and run by the same machinery
(`pisft.train.run.run_plan`): the run folder `results/checkpoints/value/run-<fingerprint>`
locked by rank 0 (`RunLock`), verified DCP checkpoints every train.save_every steps with
automatic resume (`CheckpointManager`), the deterministic sample order of `StepSampler`, the
data loader with workers, the optimizer-step loop with accumulation, clipping and non-finite
step skipping.

What differs from the policy (`value_plan`):
- the model: `value_model.ValueModel` from the base model, or from policy k-1 with
  `recap.value_init: previous` (the policy's VLM prefix, a read-out token and a bin head),
  trained on the train split with targets from `dataset/returns.parquet`;
- recap.value_steps optimizer steps of cfg.value_global_batch_size samples (micro batch
  train.micro_batch_size, accumulation derived);
- AdamW (train.weight_decay, openpi's betas) with two parameter groups: the backbone at
  recap.value_lr, the read-out token and the head at recap.value_head_lr (RLinf's
  `optim.lr` / `optim.value_lr`); the policy's warmup + cosine shape (train.warmup_steps, decaying
  to train.decay_lr / train.lr of each group's peak at the last step);
- the fingerprint: the value settings (recap.value_init among them), the model it starts from,
  the dataset and the returns file.

Output, `results/value/` (one atomic rename on rank 0):
  model/              `value_model.save`: model.safetensors (what trained; the frozen tensors stay
                      in the model it started from), value_model.json, MANIFEST.json
  metrics.json        held-out Spearman rho (V vs the normalised return), bin accuracy, MAE, the
                      frame count, first and last training loss, steps, the return range, bins
  calibration.png     V against the normalised return, held-out frames
  metrics.jsonl       one line per optimizer step (resumes included)
  train_summary.json  world size, device, resume point, wall time, sharding figures
  pisft_config.json   the resolved config

The `smoke_value` gate before it: `pisft.gates.value_smoke`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from pisft import layout
from pisft import device as devices
from pisft import disk_space
from pisft.config import PisftConfig
from pisft.errors import PisftError
from pisft.io import atomic_dir, sha256_file, write_json_atomic
from pisft.layout import RETURNS_FILE, SPLIT_FILE
from pisft.recap import value_metrics, value_model
from pisft.train.run_folders import latest_checkpoint_text, value_fingerprint
from pisft.recap.value_data import PromptCollate, ReturnRange, ValueFrames, read_returns
from pisft.recap.value_task import ValueTask
from pisft.stages import CONVERT_RECAP, FETCH_BASE, TRAIN_8CARD
from pisft.train import decisions, fsdp, optim
from pisft.base_identity import base_record
from pisft.train.run_folders import run_folder
from pisft.train.run import RunPlan, run_plan
from pisft.train.job import Built, Context, apply_trainable, frozen_in_bf16, in_turns

def require_value_inputs(cfg: PisftConfig, stage: str) -> tuple[Path, Path]:
    """The model the value model starts from (`layout.value_init_model`: the base model, or
    policy k-1 with `recap.value_init: previous`) and the pool, both present."""
    base, data, k = layout.value_init_model(cfg), layout.iteration(cfg).dataset, cfg.iteration
    policy = TRAIN_8CARD.rule(max(k - 1, 0))  # the rule that writes policy k-1
    start = f"the value model's start, recap.value_init: {cfg.recap.value_init}"
    for path, producer, what in ((base / "config.json", FETCH_BASE.name if base == layout.base_model(cfg) else policy,
                                  f" ({start})"), (data / SPLIT_FILE, CONVERT_RECAP.name, "")):
        if not path.is_file():
            raise PisftError(f"{stage}: {path} not found{what}; run the `{producer}` stage first "
                             f"(snakemake --cores all {stage} runs what is missing)")
    if not (data / RETURNS_FILE).is_file():
        raise PisftError(f"{stage}: {data / RETURNS_FILE} not found; the RECAP loop's returns step writes it "
                         f"with the pool (snakemake --cores all {stage} runs what is missing)")
    return base, data


def scheduler_for(cfg: PisftConfig, optimizer: torch.optim.Optimizer):
    """The policy's warmup + cosine shape over recap.value_steps; every group decays to
    train.decay_lr / train.lr of its own peak."""
    r, t = cfg.recap, cfg.train
    return optim.build_scheduler(optimizer, lr=r.value_lr, warmup_steps=t.warmup_steps,
                                 decay_lr=r.value_lr * t.decay_lr / t.lr, steps=r.value_steps)


@dataclass
class ValueBuilt(Built):
    returns: pd.DataFrame | None = None
    scale: ReturnRange | None = None


@dataclass
class _Pieces:
    model: value_model.ValueModel
    train_set: ValueFrames
    collate: PromptCollate
    returns: pd.DataFrame
    scale: ReturnRange
    base: Path
    data: Path


def _pieces(cfg: PisftConfig, stage: str, device: torch.device) -> _Pieces:
    """The value model from `require_value_inputs`' model (the base model or policy k-1, per
    recap.value_init), the train frames, the prompt collate (CPU)."""
    from pisft.model.policy import TOKENIZER_DIR
    from pisft.model.tokenizer import load_tokenizer

    base, data = require_value_inputs(cfg, stage)
    torch.manual_seed(cfg.train.seed)
    returns = read_returns(data)
    scale = ReturnRange.of(returns)
    model = value_model.from_base(base, bins=cfg.recap.value_bins, preset=cfg.model.preset,
                                  seed=cfg.train.seed,
                                  hold_bf16=frozen_in_bf16(cfg, value_model=True, prefix="policy."))
    model.policy.config.device = str(device)
    image_keys = tuple(model.policy.config.image_features)
    train_set = ValueFrames(data, "train", returns, scale, image_keys)
    collate = PromptCollate(load_tokenizer(base / TOKENIZER_DIR), int(model.policy.config.tokenizer_max_length))
    return _Pieces(model, train_set, collate, returns, scale, base, data)


def _optimizer(cfg: PisftConfig, model: value_model.ValueModel, kind: str) -> torch.optim.Optimizer:
    r = cfg.recap
    groups = [{"params": model.backbone_parameters(), "lr": r.value_lr},
              {"params": model.head_parameters(), "lr": r.value_head_lr}]
    return optim.build_optimizer(groups, lr=r.value_lr, weight_decay=cfg.train.weight_decay,
                                 fused=devices.fused_adamw_supported(kind))


def build_value(ctx: Context) -> ValueBuilt:
    """The value model sharded with FSDP2 (unsharded on one process), its task, data, optimizer."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg = ctx.cfg
    if cfg.train.activation_checkpointing:
        ctx.log("note: train.activation_checkpointing is not applied to the value model (its VLM layers "
                "run without recomputation)")
    mesh = init_device_mesh(ctx.info.device.type, (ctx.world_size,))

    def load_and_shard():
        p = _pieces(cfg, ctx.stage, ctx.info.device)
        applied = apply_trainable(ctx, p.model, value_model=True)  # before sharding
        units = fsdp.distribute(p.model, mesh, cfg.train.precision, ctx.info.device,
                                min_params=cfg.train.fsdp_min_unit_params)
        return p, applied, units

    p, applied, units = in_turns(ctx, load_and_shard)
    optimizer = _optimizer(cfg, p.model, ctx.info.kind)  # after sharding: the sharded parameters
    task = ValueTask(p.collate, ctx.info.device, cfg.train.precision)
    return ValueBuilt(p.model, task, p.train_set, {}, units, optimizer, p.base, p.data,
                      trainable=applied, image_keys=p.train_set.image_keys, returns=p.returns, scale=p.scale)


def value_plan(ctx: Context) -> RunPlan:
    cfg, r = ctx.cfg, ctx.cfg.recap
    require_value_inputs(cfg, ctx.stage)  # the fingerprint reads them
    fingerprint = value_fingerprint(cfg)
    return RunPlan(
        stage=ctx.stage, steps=r.value_steps, global_batch=cfg.value_global_batch_size,
        ckpt_root=run_folder(layout.iteration(cfg).value_checkpoints, fingerprint), fingerprint=fingerprint,
        output=layout.iteration(cfg).value, build=build_value,
        scheduler=lambda optimizer: scheduler_for(cfg, optimizer), export=export_value,
        nonfinite_advice=(f"Lower recap.value_lr (now {r.value_lr}) and recap.value_head_lr (now "
                          f"{r.value_head_lr}) or raise train.warmup_steps"))


def run_value_training(ctx: Context) -> int:
    """The train_value stage in one torchrun process: `auto` micro batch and checkpointing as the
    policy's smoke gate decided them on this device (the value model, the policy's VLM prefix with
    a head, is the smaller one; pisft.train.decisions)."""
    auto = ctx.cfg.train.micro_batch_size == decisions.AUTO
    ctx = dataclasses.replace(ctx, cfg=decisions.for_training(ctx.cfg, ctx.log))
    return run_plan(ctx, dataclasses.replace(value_plan(ctx), keeps_micro_batch=auto))


# ----------------------------------------------------------------------------------------- export
def _losses(metrics_path: Path) -> list[float]:
    lines = metrics_path.read_text().splitlines() if metrics_path.is_file() else []
    return [float(json.loads(line)["loss"]) for line in lines if line.strip()]


HELDOUT_SKIPPED = ("held-out figures skipped: recap.holdout_fraction 0 (the value model trains on the whole "
                   "pool, as RLinf's); set it > 0 to measure it on episodes it does not train on")


def export_value(ctx: Context, built: ValueBuilt, metrics_log: Any, summary: dict, resolved: dict) -> None:
    """Held-out metrics (every process predicts a share), then the model gathered to rank 0,
    which writes results/value/ atomically. Collective."""
    from pisft.model.policy import WEIGHTS_FILE
    from pisft.train.export_weights import write_policy_weights

    from pisft.data.dataset import split_episodes

    cfg = ctx.cfg
    t0 = time.perf_counter()
    # The pool's held-out episodes are the value model's only (recap.holdout_fraction); with none
    # (0: it trains on the whole pool, as RLinf) its held-out figures are skipped.
    heldout = None
    if split_episodes(built.dataset_dir)["eval"]:
        heldout = ValueFrames(built.dataset_dir, "eval", built.returns, built.scale, built.train_set.image_keys)
        pred = value_metrics.predict(built.model, heldout, built.task, batch_size=cfg.eval.batch_size,
                                     rank=ctx.rank, world_size=ctx.world_size)

    # One tensor at a time, LoRA adapters merged (collective). The frozen tensors stay in the
    # model it started from: the file holds what trained (value_model.ValueModelConfig.frozen_from).
    has_frozen = any(not p.requires_grad for p in built.model.parameters())

    def write_weights(path: Path | None) -> None:
        write_policy_weights(built.model, built.base_dir / WEIGHTS_FILE, path, is_main=ctx.is_main,
                             prefix="policy.", frozen=not has_frozen)

    if not ctx.is_main:
        write_weights(None)
        return
    losses = _losses(metrics_log.path)
    skipped = {"spearman_heldout": None, "bin_accuracy_heldout": None, "mae_heldout": None,
               "frames_heldout": 0, "heldout_note": HELDOUT_SKIPPED}
    metrics = {
        **(value_metrics.heldout_metrics(pred["value"], pred["bin"], heldout.target.astype(np.float64),
                                         cfg.recap.value_bins) if heldout is not None else skipped),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "steps": cfg.recap.value_steps,
        "bins": cfg.recap.value_bins,
        "return_min": built.scale.min,
        "return_max": built.scale.max,
        "frames_train": len(built.train_set),
        "heldout_inference_s": time.perf_counter() - t0,
    }
    config = value_model.ValueModelConfig(
        base_model=str(built.base_dir), preset=cfg.model.preset, bins=cfg.recap.value_bins,
        return_min=built.scale.min, return_max=built.scale.max,
        base_config_sha256=sha256_file(built.base_dir / "config.json"),
        frozen_from=base_record(built.base_dir) if has_frozen else None,
        frozen_dtype="bfloat16" if has_frozen and frozen_in_bf16(cfg, value_model=True) is not None else "float32")
    rho = metrics["spearman_heldout"]
    with disk_space.export_room(layout.iteration(cfg).value, None, what="export of the value model",
                                checkpoints=lambda: latest_checkpoint_text(cfg, ctx.stage),
                                extra_bytes=disk_space.model_bytes(built.model, frozen=not has_frozen)), \
            atomic_dir(layout.iteration(cfg).value) as tmp:
        (tmp / "model").mkdir()
        value_model.save(built.model, tmp / "model", config, write_weights=write_weights)
        write_json_atomic(tmp / "metrics.json", metrics)
        if heldout is not None:
            value_metrics.calibration_plot(
                heldout.target, pred["value"], tmp / "calibration.png",
                title=(f"value model, {metrics['frames_heldout']} held-out frames, Spearman rho "
                       + (f"{rho:.3f}" if rho is not None else "undefined")))
        shutil.copy2(metrics_log.path, tmp / layout.TRAIN_METRICS_FILE)
        write_json_atomic(tmp / "train_summary.json", {**summary, "stage": ctx.stage})
        write_json_atomic(tmp / "pisft_config.json", resolved)
    ctx.log(f"held-out: Spearman rho {rho}, bin accuracy {metrics['bin_accuracy_heldout']}, "
            f"{metrics['frames_heldout']} frames" if heldout is not None else HELDOUT_SKIPPED)
