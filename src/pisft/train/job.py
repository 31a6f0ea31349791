"""What every training stage's process shares: set-up, the built model and data, the sampler.

Both training stages (`smoke_1card`, `train_8card`; `python -m pisft.train` dispatches) load
the base model (strictly) from `results/base_model` and make its processors with the dataset's
normalisation stats, through the spec of `model.preset` (pisft.model.registry), load the train
split of `results/dataset`, shard the policy with FSDP2 and run the same optimizer-step loop
(`pisft.gates.smoke`, `pisft.train.run`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from pisft import device as devices
from pisft import layout
from pisft.config import PisftConfig
from pisft.errors import PisftError
from pisft.stages import ADVANTAGES, CONVERT_RECAP, FETCH_BASE, SMOKE_1CARD, TRAIN_8CARD
from pisft.train import blocks, fsdp, optim
from pisft.train.checkpoint import seed_host_generators
from pisft.train.metrics import peak_flops_for
from pisft.train.policy_task import PolicyTask
from pisft.train.sampler import SourceMixture, StepLayout, StepSampler


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


def conditioning_of(cfg: PisftConfig, dataset_dir: Path):
    """How the trained policy's prompts are conditioned: by the iteration's labels at k >= 1,
    else as the converted dataset records."""
    from pisft.data import prompts

    if cfg.iteration:
        return prompts.recap_conditioning(cfg.iteration, cfg.data.positive_only_conditional,
                                          cfg.data.unconditional_prob)
    return prompts.for_dataset(dataset_dir)


@dataclass
class Built:
    model: nn.Module  # the trained module: the pi0.5 policy, or the RECAP value model (ValueBuilt)
    task: PolicyTask  # (or pisft.recap.value_task.ValueTask: the loop's Task protocol)
    train_set: Any
    stats: dict
    units: list[fsdp.Unit]
    optimizer: torch.optim.Optimizer
    base_dir: Path
    dataset_dir: Path
    prompt: Any = None  # the training prompt of a sample (advantage conditioning), or None
    conditioning: Any = None  # how the prompts are conditioned (data.prompts.PromptConditioning)
    trainable: Any = None  # pisft.train.trainable.Applied: the mode applied (None: built before modes)
    image_keys: tuple[str, ...] = ()  # the camera keys of a training sample (data.augment changes them)
    compiler: Any = None  # pisft.train.blocks.Compiler: how the blocks run (train.compile); None: eager


def require_inputs(cfg: PisftConfig, stage: str) -> tuple[Path, Path]:
    base, data = layout.init_model(cfg), layout.iteration(cfg).dataset
    needed = [(base / "config.json", TRAIN_8CARD.name if cfg.iteration and base != layout.base_model(cfg)
               else FETCH_BASE.name), (layout.iteration(cfg).split, CONVERT_RECAP.name)]
    labels = layout.training_labels(cfg)
    if labels is not None and stage == TRAIN_8CARD.name:  # the policy's retraining (not the value model's)
        needed.append((labels, ADVANTAGES.name))
    for path, producer in needed:
        if not path.is_file():
            raise PisftError(f"{stage}: {path} not found; run the `{producer}` stage first "
                             f"(snakemake --cores all {stage} runs what is missing)")
    return base, data


def _choose_prompt_form(ctx: Context, policy, base: Path) -> bool:
    """Whether the prompts carry the state: the starting model's record when it has one (a
    source that says, e.g. openpi's `discrete_state_input`, or policy k-1), else
    model.state_in_prompt. Recorded in the policy's info: the export's pisft_model.json carries
    it, and every consumer prompts as it says."""
    from pisft.model.policy import STATE_IN_PROMPT_KEY

    info = policy.pisft_model_info
    wanted = bool(ctx.cfg.model.state_in_prompt)
    recorded = info.get(STATE_IN_PROMPT_KEY)
    chosen = wanted if recorded is None else bool(recorded)
    if recorded is not None and chosen != wanted:
        ctx.log(f"note: {base} records state_in_prompt: {str(chosen).lower()} (how it was trained); "
                f"followed, model.state_in_prompt ({str(wanted).lower()}) is not")
    info[STATE_IN_PROMPT_KEY] = chosen
    ctx.log(f"prompts {'with' if chosen else 'without'} the discretised state")
    return chosen


T = TypeVar("T")


def local_world_size(world_size: int, env: dict[str, str] | None = None) -> int:
    """The training processes on this host (torchrun's LOCAL_WORLD_SIZE; else all of them)."""
    env = os.environ if env is None else env
    value = env.get("LOCAL_WORLD_SIZE", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else world_size


def load_turns(ctx: Context) -> int:
    """How many turns `in_turns` takes: this host's processes on the CPU, else 1."""
    return local_world_size(ctx.world_size) if not ctx.info.row.accelerator and ctx.world_size > 1 else 1


def in_turns(ctx: Context, load: Callable[[], T]) -> T:
    """`load()` on this process, one process of this host at a time on the CPU (`load_turns`).

    On the CPU the host's memory is the training memory: N processes loading at once each hold
    the whole model (and, while FSDP2 shards it, the whole tensors beside their shards) at the
    same moment. In turns, the host holds one whole model plus the shards of the processes before
    it (pi0.5 in `expert` mode on 2 processes: train_8card's peak 20.2 -> 18.6 GiB PSS,
    docs/what-has-run-where.md). `load` must not run a collective (FSDP2's `fully_shard` runs
    none; the device mesh is made before). On an accelerator every process loads at once: its
    host copy is transient, and N turns would cost N load times. Ranks of other hosts with the
    same local rank load together. The run's first line says "loaded in turns" (train.run)."""
    turns = load_turns(ctx)
    if turns == 1:
        return load()
    mine = devices.local_rank()
    result: T | None = None
    for turn in range(turns):
        if turn == mine:
            result = load()
        dist.barrier()
    return result  # type: ignore[return-value]  # every rank had its turn


def build(ctx: Context) -> Built:
    """Load model, processors and data; shard; make the optimizer. Same on every rank. The model is
    the spec of model.preset's (pisft.model.registry): its folder loaded, prepared and its processors
    made through the spec (`load_model`, `ModelSpec.load`)."""
    from pisft.data.dataset import load_split, load_stats
    # imported here, as always: what it imports (rich) draws from Python's random state on import,
    # which a checkpoint saves (the spec's load imports it when called)
    import pisft.model.policy  # noqa: F401
    from pisft.model.registry import spec_for_preset

    cfg = ctx.cfg
    base, data = require_inputs(cfg, ctx.stage)
    torch.manual_seed(cfg.train.seed)
    mesh = init_device_mesh(ctx.info.device.type, (ctx.world_size,))
    compiler = blocks.compiler_for(cfg.train.compile, ctx.info.kind, layout.compile_cache(cfg), ctx.log)
    policy, applied, units = in_turns(ctx, lambda: load_model(ctx, base, mesh, compiler))
    stats = load_stats(data)
    policy.config.device = str(ctx.info.device)
    _choose_prompt_form(ctx, policy, base)
    # the spec's processors, which follow the choice just recorded
    pre, _ = spec_for_preset(cfg.model.preset).load.processors(policy, base, stats)
    # A RECAP iteration's policy trains on the whole pool (its held-out episodes are the value
    # model's: recap.holdout_fraction); the SFT run on the train split (data.eval_fraction).
    train_set = load_split(data, "all" if cfg.iteration else "train", chunk_size=policy.config.chunk_size)
    if len(train_set) == 0:
        raise PisftError(f"{data}: the train split has no frames; check split.json and data.eval_fraction")
    optimizer = optim.build_optimizer(policy.parameters(), lr=cfg.train.lr,
                                      weight_decay=cfg.train.weight_decay,
                                      fused=devices.fused_adamw_supported(ctx.info.kind))
    task = PolicyTask(policy, pre, ctx.info.device, cfg.train.precision)
    from pisft.data.prompts import LabelledPrompts, training_prompt_fn

    labels = layout.training_labels(cfg)
    conditioning = conditioning_of(cfg, data)
    prompt = LabelledPrompts(labels, conditioning) if labels is not None else training_prompt_fn(data)
    return Built(policy, task, train_set, stats, units, optimizer, base, data,
                 prompt=prompt, conditioning=conditioning, trainable=applied,
                 image_keys=tuple(policy.config.image_features), compiler=compiler)


def load_model(ctx: Context, base: Path, mesh: Any, compiler: Any = None) -> tuple[nn.Module, Any, list[fsdp.Unit]]:
    """The policy of model.preset's spec loaded from `base` (strictly, the frozen parameters of a bf16
    run straight into bf16), prepared for training, its trainable mode applied and distributed with
    FSDP2 on `mesh`: (policy, the mode applied, its units)."""
    from pisft.model.registry import spec_for_preset

    cfg = ctx.cfg
    model = spec_for_preset(cfg.model.preset)
    policy = model.load.policy(base, device="cpu", dtype="float32", preset=cfg.model.preset,
                               hold_bf16=frozen_in_bf16(cfg))
    # One checkpointing level (per decoder layer); the unused expert lm_head detached.
    model.prepare_for_training(policy, checkpointing=cfg.train.activation_checkpointing)
    applied = apply_trainable(ctx, policy)
    # FSDP2 on N processes; one process trains unsharded, except the smoke (it measures the
    # sharded layout's memory). Moves the parameters and buffers to the device.
    units = fsdp.distribute(policy, mesh, cfg.train.precision, ctx.info.device,
                            keep_sharded=ctx.stage == SMOKE_1CARD.name,
                            min_params=cfg.train.fsdp_min_unit_params, compiler=compiler)
    return policy, applied, units


def frozen_in_bf16(cfg: PisftConfig, *, value_model: bool = False, prefix: str = ""):
    """The parameters (policy names; `prefix` + name is the trained model's) that `apply_trainable`
    will freeze and `hold_frozen_in` cast to bf16, as a predicate for `load_policy(hold_bf16=)`:
    they are loaded straight into bf16. None when nothing is held in bf16 (fp32, or a mode that trains everything)."""
    from pisft.model.registry import spec_for_preset
    from pisft.train import trainable

    mode = trainable.configured_mode(cfg, value_model=value_model)
    if cfg.train.precision != "bf16" or trainable.mode_of(mode, value_model=value_model).trains_everything:
        return None
    spec = trainable.spec_for(cfg, value_model=value_model)
    model = spec_for_preset(cfg.model.preset)

    def hold(name: str) -> bool:
        return (not any(k in name for k in model.trainable.keep_fp32)
                and not trainable.is_trainable(prefix + name, mode, spec, value_model=value_model, model=model))
    return hold


def apply_trainable(ctx: Context, model: nn.Module, *, value_model: bool = False):
    """train.trainable (or recap.value_trainable) applied before sharding: LoRA adapters injected
    (the same on every rank), frozen parameters `requires_grad=False` (FSDP2 then gives them no
    gradient, the optimizer no state), a policy's projections fused and, under bf16, frozen ones held
    in bf16 (`trainable.apply_training_layout`)."""
    from pisft.train import trainable

    cfg = ctx.cfg
    mode = trainable.configured_mode(cfg, value_model=value_model)
    applied, cast = trainable.apply_training_layout(model, mode, trainable.spec_for(cfg, value_model=value_model),
                                                    precision=cfg.train.precision, seed=cfg.train.seed,
                                                    value_model=value_model)
    if not trainable.mode_of(mode, value_model=value_model).trains_everything:
        ctx.log(f"{trainable.mode_key(value_model=value_model)}: {mode}: "
                f"{applied.trainable:,} of {applied.total:,} parameters train"
                + (f"; {cast:,} frozen ones held in bf16" if cast else ""))
    return applied


def setup_process(cfg: PisftConfig, stage: str, expected_world_size: int,
                  before_group: Callable[[PisftConfig], None] | None = None) -> Context:
    """Device, determinism and the process group; refuses a world of the wrong size; Python's and
    NumPy's generators seeded for this rank from train.seed (`checkpoint.seed_host_generators`).
    `before_group`: the stage's work that needs this process without a group (the stage table's
    `before_group`), run after determinism is set and before the group is made."""
    info = devices.setup(cfg.device)
    if cfg.train.deterministic:  # before HCCL communicator creation and the first operator
        devices.enable_determinism(info.kind)
    if before_group is not None:
        before_group(cfg)
    kwargs: dict[str, Any] = {"backend": info.backend}
    if info.row.init_with_device_id:
        kwargs["device_id"] = info.device
    dist.init_process_group(**kwargs)
    ctx = Context(cfg, stage, info, dist.get_rank(), dist.get_world_size())
    if ctx.world_size != expected_world_size:
        raise PisftError(f"{stage}: started with {ctx.world_size} processes but the config asks for "
                         f"{expected_world_size} (train.nproc_per_node × train.nnodes); start it through "
                         "`python -m pisft launch` or the workflow")
    seed_host_generators(cfg.train.seed, ctx.rank)  # a checkpoint saves their states
    return ctx


def peak_flops(ctx: Context) -> tuple[float | None, str]:
    return peak_flops_for(ctx.info.name, ctx.info.kind, ctx.cfg.train.peak_flops)


def layout_for(cfg: PisftConfig, world_size: int, global_batch: int | None = None) -> StepLayout:
    """The step layout: `global_batch` (default train.global_batch_size) in micro-batches of
    train.micro_batch_size over `world_size` processes."""
    return StepLayout(global_batch or cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)


def make_sampler(cfg: PisftConfig, train_set: Any, world_size: int,
                 global_batch: int | None = None) -> StepSampler:
    """The step sampler over `train_set` (a split of cfg's dataset; its rows' `episode_index`),
    drawing the pool's sources by their weights when convert_recap recorded weights that make
    the frames unequally likely (`pisft.data.source_weights`)."""
    return StepSampler(len(train_set), cfg.train.seed, layout_for(cfg, world_size, global_batch),
                       source_mixture(layout.iteration(cfg).dataset, train_set))


def source_mixture(dataset_dir: Path, train_set: Any) -> SourceMixture | None:
    """The weighted draw of the pool's sources over `train_set`'s rows, or None (every frame
    equally likely: one source, balanced equal weights, or a dataset without the record)."""
    from pisft.data.source_weights import SourceSampling

    sampling = SourceSampling.read(dataset_dir)
    if sampling is None:
        return None
    rows = sampling.source_of_rows(train_set.episode_index)
    return SourceMixture.of(rows, list(sampling.weights), sampling.balance)


def env_summary() -> dict[str, str]:
    rows = devices.ROWS.values()
    keys = ([k for row in rows for k in row.env_defaults] + list(devices.TRAINING_ENV_FORCED) + ["OMP_NUM_THREADS"]
            + sorted({k for row in rows for k in row.deterministic_env}))
    return {k: os.environ[k] for k in keys if k in os.environ}
