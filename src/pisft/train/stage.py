"""One training process (started by torchrun): the `smoke_1card` and `train_8card` stages.

Both stages load the base model (strictly) from `results/base_model`, the processors with the
dataset's normalisation stats, the train split of `results/dataset`, shard the policy with FSDP2
and run the same optimizer-step loop. `train_8card` checkpoints, resumes by itself from the
latest complete checkpoint and exports the final model; `smoke_1card` writes a go/no-go report.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from pisft import device as devices
from pisft.config import PisftConfig
from pisft.errors import PisftError
from pisft.train import fsdp, optim
from pisft.train.metrics import peak_flops_for
from pisft.train.policy_task import PolicyTask
from pisft.train.sampler import StepLayout, StepSampler

STAGES = ("smoke_1card", "train_8card")


@dataclass
class Context:
    cfg: PisftConfig
    stage: str
    info: devices.DeviceInfo
    rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, msg: str) -> None:
        if self.is_main:
            print(f"[{self.stage}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Built:
    policy: nn.Module
    task: PolicyTask
    train_set: Any
    stats: dict
    units: list[fsdp.Unit]
    optimizer: torch.optim.Optimizer
    base_dir: Path
    dataset_dir: Path
    prompt: Any = None  # the training prompt of a sample (advantage conditioning), or None


def _sha256_of(paths: list[Path], listed: list[Path] = ()) -> str | None:
    """sha256 over the content of `paths` and the names and sizes of the files under `listed`.

    The dataset's bulk (parquet/video files, possibly many GB) enters by name and size only:
    any change in its content also changes meta/stats.json (statistics over every frame),
    which is hashed in full. Hashing it all would cost minutes per start at LIBERO size.
    """
    h = hashlib.sha256()
    seen = False
    for p in paths:
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
            seen = True
    for folder in listed:
        for f in sorted(folder.rglob("*")) if folder.is_dir() else ():
            if f.is_file():
                h.update(f"{f.relative_to(folder.parent).as_posix()}:{f.stat().st_size}".encode())
                seen = True
    return h.hexdigest() if seen else None


# Settings that change what training computes, beyond the files hashed above. Not in it (a run
# resumes across them): the world size and everything that only splits the same computation
# differently (train.nproc_per_node, nnodes, micro_batch_size -> accumulation; the global batch
# is in), the device, how often values are fetched or saved (log_every, save_every, keep_last),
# data-loader workers (each sample is drawn from (seed, step, position), not from worker order),
# peak_flops, tensorboard, deterministic (kernel choice, not the math) and activation
# checkpointing (recomputes the same forward with the same RNG state: same values).
# `model` and `data` enter whole (a key added there is covered by default), except the data
# path (its content is hashed) and the demo generator's keys (they only make the input data).
FINGERPRINT_SECTIONS = ("model", "data")
FINGERPRINT_EXCLUDED = ("data.recap_dir", "data.demo_")
FINGERPRINT_KEYS = (
    "train.global_batch_size", "train.steps", "train.seed", "train.lr", "train.warmup_steps",
    "train.decay_lr", "train.weight_decay", "train.grad_clip", "train.precision",
)


def run_fingerprint(cfg: PisftConfig) -> dict[str, Any]:
    """What a checkpoint must share with the current run to be resumed (world size excluded).

    Every setting that changes what training computes (FINGERPRINT_SECTIONS, FINGERPRINT_KEYS)
    and the content of
    its inputs: the base model (its sha256 MANIFEST: weights, tokenizer, config) and the
    dataset (split, features, statistics, prompt conditioning, episode index, data files).
    """
    from pisft.config import lookup, to_dict

    base = cfg.results("base_model")
    data = cfg.results("dataset")
    values = to_dict(cfg)
    sections = {f"{section}.{key}": value for section in FINGERPRINT_SECTIONS
                for key, value in values[section].items()
                if not f"{section}.{key}".startswith(FINGERPRINT_EXCLUDED)}
    return {
        **sections,
        **{key: lookup(values, key) for key in FINGERPRINT_KEYS},
        "base_model": _sha256_of([base / "MANIFEST.json", base / "config.json"]),
        "dataset": _sha256_of([data / "split.json", data / "meta" / "info.json",
                               data / "meta" / "stats.json", data / "meta" / "prompt_conditioning.json",
                               data / "meta" / "tasks.parquet"],
                              listed=[data / "data", data / "meta" / "episodes", data / "videos"]),
    }


def _require_inputs(cfg: PisftConfig, stage: str) -> tuple[Path, Path]:
    base, data = cfg.results("base_model"), cfg.results("dataset")
    for path, producer in ((base / "config.json", "fetch_base"), (data / "split.json", "convert_recap")):
        if not path.is_file():
            raise PisftError(f"{stage}: {path} not found; run the `{producer}` stage first "
                             f"(snakemake --cores all {stage} runs what is missing)")
    return base, data


def build(ctx: Context) -> Built:
    """Load model, processors and data; shard; make the optimizer. Same on every rank."""
    from pisft.data.dataset import load_split, load_stats
    from pisft.model import lerobot_internals as internals
    from pisft.model.policy import load_policy, make_processors

    cfg = ctx.cfg
    base, data = _require_inputs(cfg, ctx.stage)
    torch.manual_seed(cfg.train.seed)
    policy = load_policy(base, device="cpu", dtype="float32", preset=cfg.model.preset)
    stats = load_stats(data)
    policy.config.device = str(ctx.info.device)
    pre, _ = make_processors(policy, base, stats)
    train_set = load_split(data, "train", chunk_size=policy.config.chunk_size)
    if len(train_set) == 0:
        raise PisftError(f"{data}: the train split has no frames; check split.json and data.eval_fraction")
    # One checkpointing level (per decoder layer); the unused expert lm_head detached.
    internals.prepare_for_training(policy, checkpointing=cfg.train.activation_checkpointing)
    mesh = init_device_mesh(ctx.info.device.type, (ctx.world_size,))
    units = fsdp.shard(policy, mesh, cfg.train.precision)  # moves shards and buffers to the device
    optimizer = optim.build_optimizer(policy.parameters(), lr=cfg.train.lr,
                                      weight_decay=cfg.train.weight_decay,
                                      fused=devices.fused_adamw_supported(ctx.info.kind))
    task = PolicyTask(policy, pre, ctx.info.device, cfg.train.precision)
    from pisft.data.prompts import training_prompt_fn

    return Built(policy, task, train_set, stats, units, optimizer, base, data,
                 prompt=training_prompt_fn(data))


def setup_process(cfg: PisftConfig, stage: str) -> Context:
    info = devices.setup(cfg.device)
    if cfg.train.deterministic:  # before HCCL communicator creation and the first operator
        devices.enable_determinism(info.kind)
    kwargs: dict[str, Any] = {"backend": info.backend}
    if info.kind == "cuda":
        kwargs["device_id"] = info.device
    dist.init_process_group(**kwargs)
    ctx = Context(cfg, stage, info, dist.get_rank(), dist.get_world_size())
    expected = 1 if stage == "smoke_1card" else cfg.world_size
    if ctx.world_size != expected:
        raise PisftError(f"{stage}: started with {ctx.world_size} processes but the config asks for "
                         f"{expected} (train.nproc_per_node × train.nnodes); start it through "
                         "`python -m pisft launch` or the workflow")
    return ctx


def peak_flops(ctx: Context) -> tuple[float | None, str]:
    return peak_flops_for(ctx.info.name, ctx.info.kind, ctx.cfg.train.peak_flops)


def main(stage: str, cfg: PisftConfig) -> int:
    if stage not in STAGES:
        raise PisftError(f"unknown training stage '{stage}'; one of {', '.join(STAGES)}")
    from pisft.train.attention import fused_joint_attention

    ctx = setup_process(cfg, stage)
    try:
        with fused_joint_attention():  # fused attention kernels for the joint VLM/expert attention
            if stage == "smoke_1card":
                from pisft.train.smoke import run_smoke

                return run_smoke(ctx)
            from pisft.train.run import run_training

            return run_training(ctx)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def layout_for(cfg: PisftConfig, world_size: int) -> StepLayout:
    return StepLayout(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)


def make_sampler(cfg: PisftConfig, train_set: Any, world_size: int) -> StepSampler:
    return StepSampler(len(train_set), cfg.train.seed, layout_for(cfg, world_size))


def env_summary() -> dict[str, str]:
    keys = (list(devices.ASCEND_ENV_DEFAULTS) + list(devices.TRAINING_ENV_FORCED) + ["OMP_NUM_THREADS"]
            + sorted({k for env in devices.DETERMINISTIC_ENV.values() for k in env}))
    return {k: os.environ[k] for k in keys if k in os.environ}
