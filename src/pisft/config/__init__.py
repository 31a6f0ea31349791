"""The run configuration: one schema in code, the single source of keys, types and defaults.

`config/config.yaml` is both Snakemake's configfile and DVC's params file. It is merged onto
the structured schema below in OmegaConf struct mode, so an unknown key or a wrong type is an
error that names the file, the key and the nearest valid key. Derived values (world size,
gradient accumulation) are computed here, never typed by hand.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from pisft.errors import PisftError

DEFAULT_CONFIG = Path("config/config.yaml")

DEVICES = ("auto", "npu", "cuda", "cpu")
PRESETS = ("tiny", "small", "pi05")
# Each preset's action chunk (PI05Config.chunk_size; pisft.model.presets sets tiny's and small's from
# here, pi05's is LeRobot's PI05Config default, which a test holds to this).
PRESET_CHUNK_SIZES = {"tiny": 10, "small": 10, "pi05": 50}
PRECISIONS = ("fp32", "bf16")
# train.compile (pisft.train.blocks): auto is decided by the smoke gate on the run's device
# (pisft.gates.compile_trial: compiled only where it ran, agreed with eager and was faster)
TRAIN_COMPILE = ("auto", "off", "layers")
# The value of a train key the smoke gate decides on the run's device (train.compile,
# train.micro_batch_size, train.activation_checkpointing; pisft.train.decisions).
AUTO = "auto"
# train.lora_targets (pisft.train.trainable applies them).
LORA_TARGETS = ("lerobot", "openpi", "rlinf")
# data.augment: the training loaders' image augmentation (pisft.data.augment applies it).
AUGMENTS = ("none", "openpi")
# eval.precision: the inference precision (pisft.policy.precision applies it).
INFERENCE_PRECISIONS = ("auto", "bf16", "fp32")
# eval.rtc.schedule: LeRobot's RTCAttentionSchedule (lerobot/configs/types.py, LeRobot 0.6.1).
RTC_SCHEDULES = ("ZEROS", "ONES", "LINEAR", "EXP")


class PerturbationRange(NamedTuple):
    """What a strength of one `eval.perturbations` entry means and may be (pisft.rollout.perturb applies
    it; docs/robustness.md): the unit, the strength a bare name gets, the lowest and highest allowed, and
    the LIBERO suites it applies to (empty: every suite)."""

    unit: str
    default: float
    low: float
    high: float
    suites: tuple[str, ...] = ()


# eval.perturbations: the names and their strengths; strength 0 leaves an episode exactly as it is.
PERTURBATIONS = {
    "camera": PerturbationRange("degrees", 10.0, 0.0, 45.0),  # the agent view orbits its look-at point
    "lighting": PerturbationRange("intensity change", 0.5, -0.9, 4.0),  # every light's intensity x (1 + s)
    "robot_init": PerturbationRange("rad", 0.1, 0.0, 1.0),  # the arm's 7 joints moved by this norm
    "object_position": PerturbationRange("m", 0.03, 0.0, 0.15),  # each movable object slid this far
    # 1: LIBERO-Pro's paraphrase, which exists for the tasks of these four suites alone (LIBERO-90 has none;
    # pisft.rollout.paraphrases holds them, and a test holds its suites to these)
    "language": PerturbationRange("0 or 1", 1.0, 0.0, 1.0,
                                  ("libero_spatial", "libero_object", "libero_goal", "libero_10")),
    "obs_noise": PerturbationRange("std / 255", 0.05, 0.0, 1.0),  # camera pixels' Gaussian noise, std s x 255
}


# ----------------------------------------------------------------------- the trainable modes
# train.trainable (the policy) and recap.value_trainable (the RECAP value model): what a training run
# trains. pisft.train.trainable applies a mode from its entry here; the config check, the training
# job and the benchmarks read the entries too. Adding a mode is one entry (plus, for a part no entry
# freezes yet, its rule in pisft.train.trainable's `_FROZEN_PARTS`).
TRAINABLE_MODELS = {"policy": "train.trainable", "value": "recap.value_trainable"}  # the model -> its key
# What a mode freezes: "" nothing | "vision" the SigLIP vision tower | "vlm" the whole PaliGemma VLM (the
# prefix) | "base" every parameter of the base model (what trains is what the mode adds: LoRA adapters,
# a preset's fully trained modules, the value model's read-out token and bin head, which always train).
FROZEN_PARTS = ("", "vision", "vlm", "base")
# LeRobot's PaliGemmaWithExpertModel flags that freeze a part (`_set_requires_grad`, and its `train()`
# keeps that part in eval mode): a mode that freezes the same part sets its flag, and pisft checks that
# LeRobot froze at least what pisft's rule freezes.
LEROBOT_FREEZE_FLAGS = ("freeze_vision_encoder", "train_expert_only")


@dataclass(frozen=True)
class TrainableMode:
    """One trainable mode: which models take it, what it freezes, and how it is applied."""

    models: tuple[str, ...]  # of TRAINABLE_MODELS
    frozen: str  # of FROZEN_PARTS
    # A policy mode's place in bench real_size's rows (`python -m pisft bench --only real_size`): the
    # fewest parameters trained first. None for a value-model mode.
    bench_rank: int | None = None
    lora: bool = False  # LoRA adapters through peft on train.lora_targets' modules (pisft.train.trainable.lora_spec)
    lerobot_flag: str = ""  # of LEROBOT_FREEZE_FLAGS: LeRobot's own flag for the part frozen, "" none
    other_model_hint: str = ""  # said when the mode is set for a model that does not take it

    @property
    def trains_everything(self) -> bool:
        return self.frozen == "" and not self.lora

    @property
    def prefix_frozen(self) -> bool | None:
        """Whether every parameter of the VLM prefix is frozen (the frozen-prefix forward and FSDP units
        follow it, `lerobot_internals.prefix_frozen`); None: as the LoRA target preset says (`lerobot`'s
        adapters and fully trained modules are all outside the VLM)."""
        return None if self.lora else self.frozen in ("vlm", "base")


# In the order the keys' messages and docs list them.
TRAINABLE_MODE_TABLE: dict[str, TrainableMode] = {
    # every parameter (the full fine-tune)
    "all": TrainableMode(("policy", "value"), "", bench_rank=3),
    # LeRobot's train_expert_only: the PaliGemma VLM frozen, the action expert and projections train
    "expert": TrainableMode(("policy",), "vlm", bench_rank=0, lerobot_flag="train_expert_only",
                            other_model_hint="the value model has no action expert: `head` trains the read-out "
                                             "and head alone"),
    # LeRobot's freeze_vision_encoder: SigLIP frozen
    "no_vision": TrainableMode(("policy", "value"), "vision", bench_rank=2, lerobot_flag="freeze_vision_encoder"),
    # the value model's VLM prefix frozen, its read-out token and bin head train (RLinf's freeze_vlm)
    "head": TrainableMode(("value",), "base", lerobot_flag="train_expert_only"),
    # LoRA adapters on train.lora_targets' modules (the value model: their VLM part), the rest frozen
    "lora": TrainableMode(("policy", "value"), "base", bench_rank=1, lora=True),
}


def trainable_modes(model: str = "policy") -> tuple[str, ...]:
    """The modes `model` (policy | value) takes, in the table's order (read when called)."""
    return tuple(name for name, mode in TRAINABLE_MODE_TABLE.items() if model in mode.models)


def trainable_mode(name: str, model: str = "policy") -> TrainableMode:
    """The entry of mode `name` for `model`; a ValueError naming the model's modes if it takes no such mode."""
    mode = TRAINABLE_MODE_TABLE.get(name)
    if mode is None or model not in mode.models:
        raise ValueError(f"unknown trainable mode {name!r} for the {'value model' if model == 'value' else model}; "
                         f"one of {', '.join(trainable_modes(model))}")
    return mode


def is_lora_mode(name: str, model: str = "policy") -> bool:
    """Whether `name` is a LoRA mode of `model` (False for a mode it does not take)."""
    mode = TRAINABLE_MODE_TABLE.get(name)
    return mode is not None and model in mode.models and mode.lora


TRAINABLE_MODES = trainable_modes("policy")
VALUE_TRAINABLE_MODES = trainable_modes("value")


# ------------------------------------------------------------------------ what a key does: its marks
# A key's roles are marks on its field (`marked`), and every list of keys by role is read off them
# (`keys_marked`, `fingerprint_keys`): the keys each stage reads in the stage table
# (pisft.stages: a change reruns the stage under both drivers), the settings of a training run's
# fingerprint (pisft.train.checkpoint, pisft.train.run_folders), the keys a smoke report must share
# with the training it admits (pisft.train.launch), the options of a conversion (pisft.data.convert).
# A role that reruns stages is named for what they do, never for a stage.
DEMO = "demo data"  # demo_recap writes the synthetic demo dataset with them
CONVERSION = "conversion"  # convert_recap (at iteration k also recap.holdout_fraction, its row)
TRAIN_STEP = "training step"  # what a step does, not how long the run is: the smoke gate measures it
OFFLINE_EVAL = "offline evaluation"  # evaluate
CLOSED_LOOP = "closed loop"  # closed_loop
COLLECTION = "collection"  # collect_rollouts (RECAP iteration k >= 1)
VALUE = "value model"  # smoke_value and train_value
ADVANTAGE = "advantage labels"  # the advantages stage
RETRAINING = "retraining"  # what train_8card also reads at iteration k >= 1
# The run fingerprints (a checkpoint resumes only a run with the same settings): the policy's
# (train_8card) and the value model's (train_value). A section marked enters whole, its keys marked
# INPUT excepted: a key added there is covered by default.
POLICY_RUN = "policy run fingerprint"
VALUE_RUN = "value run fingerprint"
# The input data: the key names it (its content is hashed where it matters) or makes it (the demo
# generator): in no fingerprint, no option of a conversion.
INPUT = "input data"
# The model the smoke gate measured: a training admitted by its report has the same (the drivers
# follow the model through base_model; a training launched by hand checks the report).
SMOKE_MEASURED = "measured by the smoke gate"
# The pipeline's shape: which stages and inputs dvc.yaml has (pisft.workflow.dvc_yaml.shape reads each
# key marked so; a change runs config_check, which regenerates dvc.yaml when the shape moved).
DAG_SHAPE = "pipeline shape"
ROLES = (DEMO, CONVERSION, TRAIN_STEP, OFFLINE_EVAL, CLOSED_LOOP, COLLECTION, VALUE, ADVANTAGE, RETRAINING,
         POLICY_RUN, VALUE_RUN, INPUT, SMOKE_MEASURED, DAG_SHAPE)
_ROLES_FIELD = "pisft_roles"  # the field metadata that holds a key's marks


def marked(default: Any, *roles: str) -> Any:
    """A config field with its roles: `lr: float = marked(1e-3, TRAIN_STEP, POLICY_RUN)`. A list,
    a dict or a section (a config dataclass) as `default` is made anew for every config."""
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise ValueError(f"marked: unknown role(s) {unknown}; the roles are {', '.join(ROLES)}")
    metadata = {_ROLES_FIELD: roles}
    if isinstance(default, type):
        return field(default_factory=default, metadata=metadata)
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-batches each process runs per optimizer step: a global batch of `global_batch` samples
    in micro-batches of `micro_batch` on `world_size` processes (the one place this is computed)."""
    return global_batch // (micro_batch * world_size)


class ConfigError(PisftError):
    """A configuration a user wrote is wrong; the message says where and what to do."""


@dataclass
class ModelConfig:
    # `tiny` (built locally, random init, fixed seed), a local directory in LeRobot layout,
    # or `hf://<repo_id>[@revision]` on the Hugging Face hub.
    source: str = marked("tiny", SMOKE_MEASURED, DAG_SHAPE)
    # Architecture preset: `tiny` (a few million parameters) or `pi05` (gemma_2b + gemma_300m).
    preset: str = marked("tiny", SMOKE_MEASURED)
    # Tokenizer: "" means the source's own (the tiny preset builds one locally); else a local
    # directory or `hf://<repo_id>`.
    tokenizer: str = marked("", DAG_SHAPE)
    # Seed of the random initialisation of the tiny preset.
    init_seed: int = 0
    # The asset id (e.g. `physical-intelligence/libero`) whose norm_stats.json fetch_base carries
    # into the base model, from openpi's `assets/<asset_id>/` or RLinf's `<asset_id>/`; "" carries
    # the only one (several: fetch_base lists them and carries none).
    asset_id: str = ""
    # Keep a source's chunk size when it differs from model.preset's (else that is an error).
    follow_source_chunk_size: bool = False
    # The discretised state in the prompt (LeRobot's pi0.5 always; openpi's pi05_libero:
    # discrete_state_input=False). The exported model records it and every consumer follows the
    # record; a starting model that records it (a source's discrete_state_input) is followed.
    state_in_prompt: bool = True


@dataclass
class DataConfig:
    # RECAP-format LIBERO dataset(s) (LeRobot layout): one directory (demonstrations, type `sft`),
    # or a list of typed sources, each a directory or `{path: DIR, type: sft|rollout, weight: W}`
    # (`data_sources()`; weight: the source's sampling weight, default 1.0). The default is
    # written by `demo_recap`.
    recap_dir: Any = marked("results/demo_recap", CONVERSION, INPUT, DAG_SHAPE)
    # RLinf's balance_dataset_weights (ReCapMixtureDataset): a source is drawn with probability
    # proportional to weight x its training frames (true) or to its weight alone (false). Recorded in
    # the dataset (meta/source_sampling.json), read by training.
    balance_source_weights: bool = marked(True, CONVERSION)
    # Synthetic demo data (used only when recap_dir is the demo directory).
    demo_episodes_per_task: int = marked(6, DEMO, INPUT)
    demo_episode_length: int = marked(40, DEMO, INPUT)
    demo_failure_fraction: float = marked(0.2, DEMO, INPUT)
    demo_image_size: int = marked(64, DEMO, INPUT)
    demo_seed: int = marked(0, DEMO, INPUT)
    # Conversion options.
    success_only: bool = marked(False, CONVERSION)
    tasks: list[str] = marked([], CONVERSION)
    advantage_tag: str = marked("", CONVERSION)
    # RLinf's CFG recipe for advantage prompts (used when advantage_tag is set): negative frames
    # get the plain task; a label is dropped at random with this probability during training.
    # Recorded in the dataset (meta/prompt_conditioning.json), read by training; retraining at
    # iteration k >= 1 turns the labels into prompts with them.
    positive_only_conditional: bool = marked(True, CONVERSION, RETRAINING)
    unconditional_prob: float = marked(0.1, CONVERSION, RETRAINING)
    # The dataset's column for image, wrist_image, state, actions when no known LIBERO naming fits.
    columns: dict[str, str] = marked({}, CONVERSION)
    image_size: int = marked(0, CONVERSION)  # 0 keeps the input resolution
    eval_fraction: float = marked(0.2, CONVERSION)
    split_seed: int = marked(0, CONVERSION)
    # Training-time image augmentation (pisft.data.augment), read by the training stages only:
    # `none`, or `openpi` (openpi's crop, rotation and colour jitter, drawn per sample): the images
    # every step trains on (the value model's too).
    augment: str = marked("none", TRAIN_STEP, VALUE)


@dataclass
class SmokeConfig:
    steps: int = 4
    # The smoke stage fails when less than this fraction of device memory would remain free.
    min_memory_headroom: float = 0.05


@dataclass
class TrainConfig:
    """The training run. In its run's fingerprint (`POLICY_RUN`, `VALUE_RUN`: a checkpoint of other
    values is not resumed) is what changes what training computes; not in it (a run resumes across
    them): the world size and everything that only splits the same computation differently
    (nproc_per_node, nnodes, micro_batch_size -> accumulation; the global batch is in), how often
    values are fetched or saved (log_every, save_every, keep_last), data-loader workers (each sample
    is drawn from (seed, step, position), not from worker order), peak_flops, tensorboard,
    deterministic (kernel choice, not the math), and activation checkpointing (recomputes the same
    forward with the same RNG state: same values). `compile` is in the policy's: compiled blocks
    compute in another order (the CPU's fp32 losses leave eager's in the 7th digit, docs/ascend.md),
    and the fingerprint holds the mode the run executes, `auto` as the smoke gate decided it
    (pisft.train.decisions). Each checkpoint and the export record which steps ran under which
    micro batch, checkpointing and world size (pisft.train.step_record). The value run has its own
    steps, learning rates, batch and mode (`recap.value_*`)."""

    nproc_per_node: int = marked(2, TRAIN_STEP)
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    # A number, or `auto`: the largest that fits the device, chosen by smoke_1card from measured
    # peaks (pisft.gates.micro_batch); train_8card (and the RECAP value model) run the report's choice.
    micro_batch_size: int | str = marked(4, TRAIN_STEP)
    global_batch_size: int = marked(16, TRAIN_STEP, POLICY_RUN)
    steps: int = marked(150, POLICY_RUN)
    save_every: int = 50
    keep_last: int = 2
    # The advantage labelling's value model runs in it too.
    precision: str = marked("fp32", TRAIN_STEP, ADVANTAGE, POLICY_RUN, VALUE_RUN)
    seed: int = marked(0, TRAIN_STEP, POLICY_RUN, VALUE_RUN)
    lr: float = marked(1e-3, TRAIN_STEP, POLICY_RUN, VALUE_RUN)
    warmup_steps: int = marked(10, POLICY_RUN, VALUE_RUN)
    decay_lr: float = marked(1e-4, POLICY_RUN, VALUE_RUN)
    weight_decay: float = marked(1e-2, TRAIN_STEP, POLICY_RUN, VALUE_RUN)
    grad_clip: float = marked(1.0, TRAIN_STEP, POLICY_RUN, VALUE_RUN)
    # EMA of the trained weights (pisft.train.ema; openpi's ema_decay): 0 or null is off; on, the
    # exported model is the average, and every checkpoint carries it.
    ema_decay: float | None = marked(0.0, POLICY_RUN)
    # true | false | auto: off where the memory allows it at the chosen micro batch (smoke_1card decides).
    activation_checkpointing: bool | str = marked(False, TRAIN_STEP)
    # Peak dense bf16 FLOP/s of one device for MFU; 0 looks the device up in a table.
    peak_flops: float = marked(0.0, TRAIN_STEP)
    # Data-loader worker processes per training process; -1 chooses from the cores
    # (pisft.train.batches.default_workers). prefetch_factor: micro-batches each worker prepares ahead.
    num_workers: int = marked(-1, TRAIN_STEP)
    prefetch_factor: int = 4
    # The smallest FSDP unit, in parameters: smaller layer units are merged with their neighbours
    # of the same group (pisft.train.fsdp.merge_small_units). -1 chooses by device: on the CPU
    # 16M (gloo collectives cost milliseconds each; the tiny model trains with the root unit
    # alone), on an accelerator 0 (one unit per decoder layer pair and per vision layer). The
    # smoke run measures this layout.
    fsdp_min_unit_params: int = marked(-1, TRAIN_STEP)
    # Also write the per-step metrics as TensorBoard scalars (results/checkpoints/train/<run>/tensorboard;
    # needs the `tensorboard` package).
    tensorboard: bool = False
    # Fetch the step metrics from the device every this many optimizer steps (and at checkpoints
    # and the last step): one device->host synchronisation per fetch. metrics.jsonl still has
    # one line per optimizer step. Host syncs per step: the smoke run's step time and projection.
    log_every: int = marked(10, TRAIN_STEP)
    # Deterministic training: torch.use_deterministic_algorithms(True), HCCL_DETERMINISTIC=true on
    # Ascend, CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA. Slower; config/README.md has the costs.
    deterministic: bool = marked(False, TRAIN_STEP)
    # What trains (pisft.train.trainable; the modes' table: TRAINABLE_MODE_TABLE): all | expert
    # (LeRobot's train_expert_only: the PaliGemma VLM frozen, the action expert and the action/time
    # projections train) | no_vision (LeRobot's freeze_vision_encoder) | lora (LoRA adapters through
    # peft on train.lora_targets' modules). The step's gradients, optimizer state and memory follow it.
    trainable: str = marked("all", TRAIN_STEP, POLICY_RUN)
    # train.trainable: lora (or recap.value_trainable: lora): the target preset, lerobot (LeRobot's
    # pi0.5 defaults) | openpi (gemma_2b_lora + gemma_300m_lora) | rlinf (RLinf's is_lora list).
    lora_targets: str = marked("openpi", TRAIN_STEP, POLICY_RUN, VALUE_RUN)
    # The adapters' rank and alpha (scaling alpha / rank); 0: the preset's own (lerobot 16 / 8;
    # openpi 16 / 16 on the VLM, 32 / 32 on the expert; rlinf 32 / 32). A rank given replaces all
    # of the preset's ranks; alpha 0 then is LeRobot's 8 (lerobot) or the rank (openpi, rlinf).
    lora_rank: int = marked(0, TRAIN_STEP, POLICY_RUN, VALUE_RUN)
    lora_alpha: float = marked(0.0, TRAIN_STEP, POLICY_RUN, VALUE_RUN)
    # torch.compile of the training step's repeated blocks (pisft.train.blocks): off | layers (each
    # decoder layer pair and SigLIP encoder layer compiled, as torchtitan compiles each block) | auto
    # (decided by smoke_1card on the run's device: the smoke steps eager and compiled, compiled kept
    # only when it ran, agreed with eager and was faster, pisft.gates.compile_trial; on the CPU eager
    # without a trial). Compiled code is cached under results/cache/inductor. The step's time, memory
    # and last bits follow it; the mode the run executes is in its fingerprint.
    compile: str = marked("auto", TRAIN_STEP, POLICY_RUN)


@dataclass
class RtcConfig:
    """Real-time chunking (LeRobot's RTC, `lerobot.policies.rtc`) in closed_loop, and the closed
    loop's simulated inference delay (pisft.rollout.chunking). The defaults of execution_horizon,
    max_guidance_weight and schedule are LeRobot 0.6.1's `RTCConfig`'s."""

    # Each chunk after an episode's first is inpainted to agree with the unexecuted rest of the one
    # before (LeRobot's RTCProcessor); closed_loop then also runs plain chunking at the same delay.
    enabled: bool = False
    # The inference delay in control steps: the environment keeps executing the previous chunk this
    # many steps while the next is computed (0: openpi's synchronous loop).
    delay_steps: int = 0
    # LeRobot's RTC guidance window: the first delay_steps actions are held to the previous chunk,
    # the weights then fall to 0 at this index (it must exceed delay_steps under RTC).
    execution_horizon: int = 10
    max_guidance_weight: float = 10.0
    schedule: str = "LINEAR"


@dataclass
class EvalConfig:
    # At most this many held-out episodes (0: all of them).
    max_episodes: int = marked(0, OFFLINE_EVAL)
    batch_size: int = marked(32, OFFLINE_EVAL)
    # Offline: evaluate every k-th frame of each held-out episode (1: every frame).
    frame_stride: int = marked(2, OFFLINE_EVAL)
    # Seed of the flow-matching noise (fixed per frame, same for both models) and the bootstrap.
    seed: int = marked(0, OFFLINE_EVAL)
    # Bootstrap resamples of the held-out episodes for confidence intervals (0: none).
    bootstrap_samples: int = marked(1000, OFFLINE_EVAL)
    # Closed-loop LIBERO (stage closed_loop; needs the LIBERO simulator, MUJOCO_GL=egl).
    closed_loop: bool = marked(False, CLOSED_LOOP, DAG_SHAPE)
    libero_suites: list[str] = marked(["libero_spatial", "libero_object", "libero_goal", "libero_10"], CLOSED_LOOP)
    # Collection starts from the initial states after the evaluation's.
    trials_per_task: int = marked(50, CLOSED_LOOP, COLLECTION)
    replan_steps: int = marked(5, CLOSED_LOOP, COLLECTION)
    num_wait_steps: int = marked(10, CLOSED_LOOP, COLLECTION)
    closed_loop_seed: int = marked(7, CLOSED_LOOP)
    # The closed loop's seeds (each an environment seed and the root of the policy's noise seeds); []: the
    # one eval.closed_loop_seed, which a list must start with. Success is pooled over them, each beside it.
    seeds: list[int] = marked([], CLOSED_LOOP)
    # The closed loop's episodes again under each perturbation (docs/robustness.md): a name (its default
    # strength) or {name: NAME, strength: S}, names and strengths in PERTURBATIONS; []: openpi's protocol alone.
    perturbations: list[Any] = marked([], CLOSED_LOOP)
    # Images are resized with padding to this square size before they reach the policy (openpi).
    resize_size: int = marked(224, CLOSED_LOOP, COLLECTION)
    # Step limit of every episode; 0: openpi's limit of each suite (220/280/300/520, libero_90 400).
    max_steps: int = marked(0, CLOSED_LOOP)
    # Task ids evaluated in each suite; empty: every task.
    task_ids: list[int] = marked([], CLOSED_LOOP)
    # Environment worker processes; 0: one per core available to the stage. Like
    # policy_batch_wait_ms and policy_devices it changes how fast, not what (pisft.policy.fixed_shape).
    num_envs: int = 0
    # The rows of every policy forward: up to this many waiting requests share one, which is padded
    # to it when fewer wait (1: one at a time). A forward rounds by its rows, so results depend on
    # this and on nothing of the timing (pisft.policy.fixed_shape).
    policy_batch: int = marked(2, CLOSED_LOOP, COLLECTION)
    # How long a batch that could still grow (environments still simulating) is held: 0 measured
    # (pisft.policy.batching), a positive number of ms set by hand.
    policy_batch_wait_ms: float = 0.0
    # Policy replicas, one per accelerator (0: every visible device of `device`'s kind; the CPU: one).
    policy_devices: int = 0
    # The jobs closed_loop and collect_rollouts are each scattered over (pisft.rollout.plan, "Scattered
    # rollouts"): each runs a block of the episodes, a merge writes the outputs; the same bytes for any
    # number. 1: one job, as before.
    shards: int = 1
    # An MP4 (agent view | wrist camera) of the first episode of each task.
    videos: bool = marked(True, CLOSED_LOOP)
    # Classifier-free guidance of an advantage-conditioned policy (RLinf's cfgrl_guidance_scale):
    # 1.0 prompts with the positive tag alone; w > 1 blends v = (1 - w) v_uncond + w v_cond.
    cfg_scale: float = marked(1.0, OFFLINE_EVAL, CLOSED_LOOP, COLLECTION)
    # The action chunk compiled and graph-captured per batch-size bucket (pisft.policy.compiled), in
    # evaluate, closed_loop and collect_rollouts (serve --compile): true, false, or null (the default):
    # on an accelerator the stage's first chunk runs eager and compiled and the faster is chosen
    # (actions within tolerance; recorded in the stage's output), on the CPU eager without a trial
    # (pisft.policy.compiled.Trial, CPU_DEFAULT). The same actions within its tolerance, not the same bits.
    compile: bool | None = marked(None, OFFLINE_EVAL, CLOSED_LOOP, COLLECTION)
    # Inference precision: bf16 (openpi's: fp32 only where openpi keeps it), fp32, or auto (bf16 on an
    # accelerator; on the CPU, the precision the model directory records).
    precision: str = marked("auto", OFFLINE_EVAL, CLOSED_LOOP, COLLECTION)
    rtc: RtcConfig = marked(RtcConfig, CLOSED_LOOP)


THRESHOLD_SCOPES = ("global", "task")
RECAP_INITS = ("previous", "base")
VALUE_INITS = ("base", "previous")  # recap.value_init: what the value model of iteration k starts from
SOURCE_TYPES = ("sft", "rollout")


@dataclass
class RecapConfig:
    """The RECAP loop around the SFT run (README, "The RECAP loop"): iteration k >= 1 rolls
    policy k-1 out, trains a value model on the pool, labels advantages, retrains, evaluates."""

    # Iterations after the SFT run (iteration 0); 0 runs the SFT pipeline alone.
    iterations: int = marked(0, DAG_SHAPE)
    # collect_rollouts: LIBERO suite and task ids rolled out, episodes per task, step limit
    # (0: the suite's limit). Collection starts from initial states after the evaluation's
    # (state eval.trials_per_task + i for episode i) and seeds from collect_seed.
    suite: str = marked("libero_10", COLLECTION)
    task_ids: list[int] = marked([0], COLLECTION)
    episodes_per_task: int = marked(2, COLLECTION)
    max_steps: int = marked(0, COLLECTION)
    collect_seed: int = marked(1000, COLLECTION)
    # Returns as RLinf computes them: -1 per step, 0 (success) or failure_reward at the end; written
    # beside the converted dataset (returns.parquet).
    gamma: float = marked(1.0, CONVERSION, ADVANTAGE)
    failure_reward: float = marked(-300.0, CONVERSION)
    # train_value: the distributional value model (bins on [-1, 0]).
    value_bins: int = marked(201, VALUE, VALUE_RUN)
    value_steps: int = marked(50, VALUE, VALUE_RUN)
    value_lr: float = marked(5e-5, VALUE, VALUE_RUN)
    value_head_lr: float = marked(1e-4, VALUE, VALUE_RUN)
    # 0: train.global_batch_size (the value run's fingerprint holds the batch it resolves to)
    value_global_batch_size: int = marked(0, VALUE)
    # advantages: N-step lookahead, the positive fraction, where the threshold is taken (not
    # eval.batch_size, train.num_workers: they change how fast, not what).
    lookahead: int = marked(10, ADVANTAGE)
    positive_quantile: float = marked(0.3, ADVANTAGE)
    threshold_scope: str = marked("global", ADVANTAGE)
    # The fraction of the pool's episodes (per task) held out from the value model to measure it
    # (held-out rho, bin accuracy), at iteration k >= 1; the retrained policy trains on every
    # episode of the pool either way. 0: the value model trains on the whole pool too (RLinf) and
    # its held-out figures are skipped.
    holdout_fraction: float = 0.0
    # Retraining at iteration k starts from the base model or from policy k-1.
    init: str = marked("previous", RETRAINING, DAG_SHAPE)
    # What the value model of iteration k starts from: the base model (RLinf's value model starts
    # from its pretrained backbone) or policy k-1 (`pisft.layout.value_init_model`); the value run's
    # fingerprint holds the content of the model it names too.
    value_init: str = marked("base", VALUE, VALUE_RUN, DAG_SHAPE)
    # Optimizer steps of the retraining at iteration k >= 1; 0: train.steps (the SFT run's).
    policy_steps: int = marked(0, RETRAINING)
    # What of the value model trains (TRAINABLE_MODE_TABLE): all | no_vision (SigLIP frozen) | head
    # (the VLM prefix frozen, the read-out token and bin head train: RLinf's value-model freeze_vlm) |
    # lora (adapters on the VLM part of train.lora_targets, the read-out token and head in full).
    value_trainable: str = marked("all", VALUE, VALUE_RUN)


@dataclass
class PisftConfig:
    device: str = marked("auto", DAG_SHAPE)
    results_dir: str = "results"
    # `model` and `data` enter both run fingerprints whole (a key added there is covered by
    # default), their INPUT keys excepted; the value model reads all of `train` (the process layout,
    # micro batch, precision, seed and schedule shape).
    model: ModelConfig = marked(ModelConfig, POLICY_RUN, VALUE_RUN)
    data: DataConfig = marked(DataConfig, POLICY_RUN, VALUE_RUN)
    smoke: SmokeConfig = field(default_factory=SmokeConfig)
    train: TrainConfig = marked(TrainConfig, VALUE)
    eval: EvalConfig = field(default_factory=EvalConfig)
    recap: RecapConfig = field(default_factory=RecapConfig)

    # The RECAP iteration a stage runs for (set by `--iteration K`, never a config key): 0 is the
    # SFT run; k >= 1 reads and writes its own folder (`results()`).
    iteration: ClassVar[int] = 0

    # ---- derived values: computed, never typed by hand ----
    @property
    def world_size(self) -> int:
        return self.train.nproc_per_node * self.train.nnodes

    @property
    def value_global_batch_size(self) -> int:
        """Samples per value-model optimizer step: recap.value_global_batch_size, 0 meaning
        train.global_batch_size."""
        return self.recap.value_global_batch_size or self.train.global_batch_size

    @property
    def grad_accum_steps(self) -> int | None:
        """None while train.micro_batch_size is `auto` (the smoke gate chooses it)."""
        if self.train.micro_batch_size == AUTO:
            return None
        return accumulation_steps(self.train.global_batch_size, self.train.micro_batch_size, self.world_size)

    def at_iteration(self, k: int) -> PisftConfig:
        """This config as iteration k's stages see it (a copy; `iteration` set, and at k >= 1
        `train.steps` is `recap.policy_steps` when that is set)."""
        import copy

        if k < 0 or k > self.recap.iterations:
            raise ConfigError(f"iteration {k}: recap.iterations is {self.recap.iterations}, so iterations "
                              f"0..{self.recap.iterations} exist")
        out = copy.copy(self)
        out.iteration = k
        if k and self.recap.policy_steps:  # the retraining's own length (RLinf's CFG run has its own)
            out.train = dataclasses.replace(self.train, steps=self.recap.policy_steps)
        return out


@dataclass(frozen=True)
class DataSource:
    """One RECAP dataset of `data.recap_dir`: its folder and type (`sft`: demonstrations, all
    frames successful and positive; `rollout`: policy rollouts with `is_success`), and its
    sampling weight in the pool (`pisft.data.source_weights`)."""

    path: str
    type: str = "sft"
    weight: float = 1.0


def data_sources(cfg: PisftConfig) -> list[DataSource]:
    """`data.recap_dir` as a list of typed sources (a single directory: one `sft` source)."""
    value = cfg.data.recap_dir
    items = value if isinstance(value, list | tuple) else [value]
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(DataSource(item))
        else:
            out.append(DataSource(str(item["path"]), str(item.get("type", "sft")), float(item.get("weight", 1.0))))
    return out


@functools.cache
def _schema() -> dict[str, tuple[bool, tuple[str, ...]]]:
    """Every key and section of the schema (`train`, `train.lr`), in its order: whether it is a
    section (a config dataclass), and its marks."""
    out: dict[str, tuple[bool, tuple[str, ...]]] = {}

    def walk(schema: type, prefix: str) -> None:
        for f in fields(schema):
            dotted = f"{prefix}{f.name}"
            sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            out[dotted] = (is_dataclass(sub), tuple(f.metadata.get(_ROLES_FIELD, ())))
            if is_dataclass(sub):
                walk(type(sub), dotted + ".")

    walk(PisftConfig, "")
    return out


def all_keys() -> list[str]:
    """Every dotted key the schema knows, e.g. `train.micro_batch_size` (no sections)."""
    return [key for key, (section, _) in _schema().items() if not section]


def roles_of(key: str) -> tuple[str, ...]:
    """The marks of a dotted key or a section (`ROLES`); KeyError for a key the schema lacks."""
    return _schema()[key][1]


def keys_marked(role: str) -> tuple[str, ...]:
    """Every key and section marked `role`, in the schema's order (config/config.yaml's)."""
    if role not in ROLES:
        raise ValueError(f"keys_marked: unknown role {role!r}; the roles are {', '.join(ROLES)}")
    return tuple(key for key, (_, roles) in _schema().items() if role in roles)


def fingerprint_keys(run: str) -> tuple[str, ...]:
    """The dotted keys in `run`'s fingerprint (POLICY_RUN or VALUE_RUN): every key marked with it,
    and every key under a section marked with it less those marked INPUT."""
    if run not in (POLICY_RUN, VALUE_RUN):
        raise ValueError(f"fingerprint_keys: {run!r} is not a run fingerprint ({POLICY_RUN}, {VALUE_RUN})")
    schema = _schema()
    sections = [key for key, (section, roles) in schema.items() if section and run in roles]
    return tuple(key for key in all_keys() if run in schema[key][1] or (
        INPUT not in schema[key][1] and any(key.startswith(section + ".") for section in sections)))


def nearest_key(key: str) -> str | None:
    known = all_keys()
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if match:
        return match[0]
    leaf = key.rsplit(".", 1)[-1]
    by_leaf = [k for k in known if k.rsplit(".", 1)[-1] == leaf]
    if by_leaf:
        return by_leaf[0]
    match = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in known], n=1, cutoff=0.6)
    if match:
        return next(k for k in known if k.endswith("." + match[0]) or k == match[0])
    return None


# Keys whose value is a mapping of the user's own keys (checked by the cross-checks).
MAPPING_KEYS = ("data.columns",)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config mapping as dotted keys (`train.lr`); MAPPING_KEYS stay whole values."""
    out: dict[str, Any] = {}
    if isinstance(node, dict):
        for k, v in node.items():
            dotted = f"{prefix}{k}"
            if isinstance(v, dict) and dotted not in MAPPING_KEYS:
                out.update(flatten(v, dotted + "."))
            else:
                out[dotted] = v
    return out


def lookup(config: dict, dotted: str) -> Any:
    """The value of a dotted key (`data.success_only`) or a section (`model`) in a config mapping."""
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def _check_unknown_keys(raw: dict, source: str) -> None:
    known = set(all_keys())
    sections = {k.split(".")[0] for k in known if "." in k}
    for key in flatten(raw):
        if key in known:
            continue
        top = key.split(".")[0]
        if top in sections and key.count(".") == 0:
            continue
        hint = nearest_key(key)
        hint_text = f"; did you mean '{hint}'?" if hint else ""
        raise ConfigError(
            f"{source}: unknown key '{key}'{hint_text} "
            f"(every key is listed in config/README.md)"
        )


# ---------------------------------------------------------------------------------- numbers
# Every number a user can write has a kind, and each kind one rule (`NUMBER_RULES`), applied where
# the config is validated: YAML's `.nan` and `.inf` and absurd sizes passed the schema, then failed
# deep inside a stage (a NaN learning rate blamed on the loss by the smoke gate, a 1 px image
# cropped to nothing by the augmentation). A float that is not finite is refused whatever its key,
# one added later included; `NUMBER_KINDS` gives every int and float key its kind (a test fails for
# a key without one), and what the key is, for the message.
MIN_SIDE = 16  # px: an image side below it keeps nothing of a LIBERO frame (256 px) a policy sees
MAX_SIDE = 4096  # px: frames are held whole (H x W x 3 bytes each); a larger side is a typo
MAX_LORA_RANK = 1024  # pi0.5's action expert is 1024 wide: a rank reaching a layer's width is not low-rank
MAX_FAILURE_PENALTY = 1e6  # returns are float32: beyond this a failure's reward drowns the -1 per step
SEED_LIMIT = 2**32  # numpy's seeds

NUMBER_RULES: dict[str, tuple[Any, str]] = {
    "count": (lambda v: v >= 1, "must be at least 1"),
    "count_or_zero": (lambda v: v >= 0, "must be 0 or more"),
    "two_or_more": (lambda v: v >= 2, "must be at least 2"),
    "auto_or_count": (lambda v: v >= -1, "must be >= 0, or -1 to choose automatically"),
    "seed": (lambda v: 0 <= v < SEED_LIMIT, "must be a seed in [0, 2^32)"),
    "side": (lambda v: MIN_SIDE <= v <= MAX_SIDE, f"must be an image side in [{MIN_SIDE}, {MAX_SIDE}] px"),
    "side_or_keep": (lambda v: v == 0 or MIN_SIDE <= v <= MAX_SIDE,
                     f"must be 0 (keep the input's) or an image side in [{MIN_SIDE}, {MAX_SIDE}] px"),
    "lora_rank": (lambda v: 0 <= v <= MAX_LORA_RANK,
                  f"must be 0 (the preset's own) or a rank in [1, {MAX_LORA_RANK}] (pi0.5's action expert is "
                  f"{MAX_LORA_RANK} wide: a rank reaching a layer's width is not low-rank)"),
    "positive": (lambda v: v > 0, "must be > 0"),
    "weight": (lambda v: v > 0, "must be > 0"),
    "non_negative": (lambda v: v >= 0, "must be >= 0"),
    "fraction": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "open_fraction": (lambda v: 0 < v < 1, "must be in (0, 1)"),
    "probability": (lambda v: 0 <= v <= 1, "must be a probability in [0, 1]"),
    "discount": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "penalty": (lambda v: -MAX_FAILURE_PENALTY <= v <= 0, f"must be in [-{MAX_FAILURE_PENALTY:.0f}, 0]"),
    "at_least_one": (lambda v: v >= 1, "must be >= 1"),
    "decay_or_off": (lambda v: v is None or 0 <= v < 1, "must be in [0, 1)"),
}
# key -> (kind, what it is: the start of the message, may be ""; a note after the rule, may be "").
NUMBER_KINDS: dict[str, tuple[str, str, str]] = {
    "model.init_seed": ("seed", "", ""),
    "data.demo_episodes_per_task": ("count", "", ""),
    "data.demo_episode_length": ("count", "", ""),
    "data.demo_failure_fraction": ("fraction", "", ""),
    "data.demo_image_size": ("side", "", ""),
    "data.demo_seed": ("seed", "", ""),
    "data.unconditional_prob": ("probability", "", ""),
    "data.image_size": ("side_or_keep", "", ""),
    "data.eval_fraction": ("fraction", "", "0: every episode trains and `evaluate` writes a \"not run\" result"),
    "data.split_seed": ("seed", "", ""),
    "smoke.steps": ("two_or_more", "", "the smoke run checks the loss falls"),
    "smoke.min_memory_headroom": ("fraction", "", ""),
    "train.nproc_per_node": ("count", "", ""),
    "train.nnodes": ("count", "", ""),
    "train.node_rank": ("count_or_zero", "", ""),
    "train.micro_batch_size": ("count", "", ""),
    "train.global_batch_size": ("count", "", ""),
    "train.steps": ("count", "", ""),
    "train.save_every": ("count", "", ""),
    "train.keep_last": ("count", "", ""),
    "train.seed": ("seed", "", ""),
    "train.lr": ("positive", "the peak learning rate", ""),
    "train.warmup_steps": ("count_or_zero", "", ""),
    "train.decay_lr": ("non_negative", "the learning rate the schedule decays to", ""),
    "train.weight_decay": ("non_negative", "", ""),
    "train.grad_clip": ("positive", "the gradient-norm limit", ""),
    "train.ema_decay": ("decay_or_off", "the EMA's decay", "0 or null: no EMA; openpi's pi05_libero: 0.999"),
    "train.peak_flops": ("non_negative", "", "0: the device table's figure"),
    "train.num_workers": ("auto_or_count", "data-loader processes per training process", ""),
    "train.prefetch_factor": ("count", "micro-batches each data-loader worker prepares ahead", ""),
    "train.fsdp_min_unit_params": ("auto_or_count", "the smallest FSDP unit in parameters", ""),
    "train.log_every": ("count", "", ""),
    "train.lora_rank": ("lora_rank", "", ""),
    "train.lora_alpha": ("non_negative", "", "0: the preset's own"),
    "eval.max_episodes": ("count_or_zero", "", "0: every held-out episode"),
    "eval.batch_size": ("count", "", ""),
    "eval.frame_stride": ("count", "", ""),
    "eval.seed": ("seed", "", ""),
    "eval.bootstrap_samples": ("count_or_zero", "", ""),
    "eval.trials_per_task": ("count", "", ""),
    "eval.replan_steps": ("count", "", ""),
    "eval.num_wait_steps": ("count_or_zero", "", ""),
    "eval.closed_loop_seed": ("seed", "", ""),
    "eval.seeds": ("seed", "", ""),  # each of them
    "eval.resize_size": ("side", "", ""),
    "eval.max_steps": ("count_or_zero", "", "0: openpi's limit per suite"),
    "eval.task_ids": ("count_or_zero", "", ""),
    "eval.num_envs": ("count_or_zero", "", "0: one per available core"),
    "eval.policy_batch": ("count", "the rows of every policy forward",
                          "0, every environment waiting, is gone: a forward's rows change its rounding, so they are "
                          "fixed; e.g. 2, or about eval.num_envs per policy replica; docs/libero.md"),
    "eval.rtc.delay_steps": ("count_or_zero", "the inference delay in control steps", "0: openpi's synchronous loop"),
    "eval.rtc.execution_horizon": ("count", "", "LeRobot's default: 10"),
    "eval.rtc.max_guidance_weight": ("positive", "", "LeRobot's default: 10.0"),
    "eval.policy_batch_wait_ms": ("non_negative", "", "0: measured"),
    "eval.policy_devices": ("count_or_zero", "", "0: every visible device"),
    "eval.shards": ("count", "the jobs the rollouts are scattered over", "1: one job"),
    "eval.cfg_scale": ("at_least_one", "the guidance scale", "1: the positive prompt alone"),
    "recap.iterations": ("count_or_zero", "", ""),
    "recap.task_ids": ("count_or_zero", "", ""),
    "recap.episodes_per_task": ("count", "", ""),
    "recap.max_steps": ("count_or_zero", "", "0: the suite's limit"),
    "recap.collect_seed": ("seed", "", ""),
    "recap.gamma": ("discount", "the discount", ""),
    "recap.failure_reward": ("penalty", "the reward of a failed episode's last step",
                             "RLinf: -300; returns are float32, a larger penalty drowns the -1 of each step"),
    "recap.value_bins": ("two_or_more", "", "a distribution needs at least 2 bins"),
    "recap.value_steps": ("count", "", ""),
    "recap.value_lr": ("positive", "", ""),
    "recap.value_head_lr": ("positive", "", ""),
    "recap.value_global_batch_size": ("count_or_zero", "", "0: train.global_batch_size"),
    "recap.lookahead": ("count", "the N of the N-step advantage",
                        "with 0 every frame's advantage is 0: no labelling can tell frames apart"),
    "recap.positive_quantile": ("open_fraction", "the fraction of frames labelled positive", ""),
    "recap.holdout_fraction": ("fraction", "", "0: the value model trains on the whole pool and its held-out "
                                               "figures are skipped"),
    "recap.policy_steps": ("count_or_zero", "", "0: train.steps"),
}


def number_line(key: str, value: Any, kind: str, what: str = "", note: str = "") -> str | None:
    """The problem with one number of `kind` (None: it is right): not finite, or outside its kind's rule."""
    rule, text = NUMBER_RULES[kind]
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key}: {value} is not a finite number; {what or 'it'} {text}" + (f" ({note})" if note else "")
    if rule(value):
        return None
    return f"{key}: {what + ' ' if what else ''}{text}" + (f" ({note})" if note else "") + f", got {value!r}"


def _numbers(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every number in the config (each item of a list of numbers)."""
    out: list[tuple[str, Any]] = []
    for f in fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            out += _numbers(value, key + ".")
        elif isinstance(value, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            out += [(key, v) for v in value]
        elif isinstance(value, int | float) and not isinstance(value, bool) or (value is None and key in NUMBER_KINDS):
            out.append((key, value))
    return out


def number_problems(cfg: PisftConfig) -> list[str]:
    """Every number of `cfg` against the rule of its kind (`NUMBER_KINDS`); a float with no kind
    yet is still refused when not finite."""
    problems = []
    for key, value in _numbers(cfg):
        kind, what, note = NUMBER_KINDS.get(key, ("", "", ""))
        if not kind:
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{key}: {value} is not a finite number; write a number")
            continue
        line = number_line(key, value, kind, what, note)
        if line:
            problems.append(line)
    return problems


# The keys of `data.columns`: the canonical LIBERO inputs (pisft.data.libero names their columns
# in every known layout by them).
COLUMN_KEYS = ("image", "wrist_image", "state", "actions")


def _data_problems(d: DataConfig) -> list[str]:
    problems: list[str] = []
    tag = d.advantage_tag
    if tag and (tag != tag.strip() or "/" in tag or "\\" in tag):
        problems.append(f"data.advantage_tag: '{tag}' must be a bare tag (meta/advantages_<tag>.parquet) or "
                        "the file name advantages.parquet, without spaces around it or a path")
    for key, column in d.columns.items():
        if key not in COLUMN_KEYS:
            hint = difflib.get_close_matches(key, COLUMN_KEYS, n=1, cutoff=0.5)
            problems.append(f"data.columns: unknown key '{key}'"
                            + (f"; did you mean '{hint[0]}'?" if hint else "")
                            + f" (keys: {', '.join(COLUMN_KEYS)})")
        elif not isinstance(column, str) or not column.strip():
            problems.append(f"data.columns.{key}: must name a column (feature) of the dataset, got '{column}'")
    used = [c for k, c in d.columns.items() if k in COLUMN_KEYS]
    dup = sorted({c for c in used if used.count(c) > 1})
    if dup:
        problems.append(f"data.columns: column(s) {dup} given for more than one key; each key needs its own column")
    return problems


# Characters that the rules' shell commands would split or interpret (paths go unquoted).
_SHELL_UNSAFE = set(" \t\n\"'`$\\;&|<>()*?[]{}!#~")


def _value_problems(cfg: PisftConfig) -> list[str]:
    """Values that would only fail (or silently misbehave) after work has started."""
    t = cfg.train
    problems: list[str] = []
    if not t.decay_lr <= t.lr:
        problems.append(f"train.decay_lr: the learning rate the schedule decays to must be in "
                        f"[0, train.lr = {t.lr}], got {t.decay_lr}")
    bad = sorted({c for c in cfg.results_dir if c in _SHELL_UNSAFE})
    if not cfg.results_dir.strip() or bad:
        problems.append(f"results_dir: '{cfg.results_dir}' "
                        + (f"contains {' '.join(repr(c) for c in bad)}; " if bad else "is empty; ")
                        + "the workflow passes paths to shell commands unquoted: pick a path "
                        "without spaces or shell characters (or a symlink to it)")
    return problems


def _choice_problems(cfg: PisftConfig) -> list[str]:
    problems: list[str] = []
    if cfg.device not in DEVICES:
        problems.append(f"device: '{cfg.device}' is not one of {', '.join(DEVICES)}")
    if cfg.model.preset not in PRESETS:
        problems.append(f"model.preset: '{cfg.model.preset}' is not one of {', '.join(PRESETS)}")
    if cfg.train.precision not in PRECISIONS:
        problems.append(f"train.precision: '{cfg.train.precision}' is not one of {', '.join(PRECISIONS)}")
    if cfg.train.compile not in TRAIN_COMPILE:
        problems.append(f"train.compile: '{cfg.train.compile}' is not one of {', '.join(TRAIN_COMPILE)}")
    t = cfg.train
    if isinstance(t.micro_batch_size, str) and t.micro_batch_size != AUTO:
        problems.append(f"train.micro_batch_size: '{t.micro_batch_size}' must be a number of samples or auto "
                        "(the largest that fits the device, chosen by smoke_1card)")
    if isinstance(t.activation_checkpointing, str) and t.activation_checkpointing != AUTO:
        problems.append(f"train.activation_checkpointing: '{t.activation_checkpointing}' must be true, false or "
                        "auto (off where the memory allows it, chosen by smoke_1card)")
    return problems + _trainable_problems(cfg)


def _trainable_problems(cfg: PisftConfig) -> list[str]:
    """train.trainable, recap.value_trainable and the LoRA keys (pisft.train.trainable)."""
    t, r = cfg.train, cfg.recap
    chosen = {"policy": t.trainable, "value": r.value_trainable}
    problems: list[str] = []
    for model, key in TRAINABLE_MODELS.items():
        name = chosen[model]
        if name not in trainable_modes(model):
            entry = TRAINABLE_MODE_TABLE.get(name)
            hint = f" ({entry.other_model_hint})" if entry is not None and entry.other_model_hint else ""
            problems.append(f"{key}: '{name}' is not one of {', '.join(trainable_modes(model))}{hint}")
    if t.lora_targets not in LORA_TARGETS:
        problems.append(f"train.lora_targets: '{t.lora_targets}' is not one of {', '.join(LORA_TARGETS)}")
    uses_lora = any(is_lora_mode(name, model) for model, name in chosen.items())
    set_keys = [k for k, v, default in (("train.lora_rank", t.lora_rank, 0), ("train.lora_alpha", t.lora_alpha, 0.0),
                                         ("train.lora_targets", t.lora_targets, "openpi")) if v != default]
    if set_keys and not uses_lora:
        lora = {model: " | ".join(n for n in trainable_modes(model) if is_lora_mode(n, model))
                for model in TRAINABLE_MODELS}
        problems.append(f"{', '.join(set_keys)}: only meaningful with train.trainable: {lora['policy']} (or "
                        f"recap.value_trainable: {lora['value']}); train.trainable is '{t.trainable}' and "
                        f"recap.value_trainable '{r.value_trainable}': remove them or set a lora mode")
    if is_lora_mode(r.value_trainable, "value") and t.lora_targets == "lerobot":
        problems.append(f"recap.value_trainable: {r.value_trainable} with train.lora_targets: lerobot adapts only "
                        "the action expert and the action projections, which the value model does not have; set "
                        "train.lora_targets: openpi or rlinf")
    return problems


def _layout_problems(cfg: PisftConfig) -> list[str]:
    """Counts, nodes and the batch split of the training run."""
    t = cfg.train
    problems: list[str] = []
    if not 0 <= t.node_rank < max(t.nnodes, 1):
        problems.append(f"train.node_rank: must be in [0, train.nnodes), got {t.node_rank}")
    # train.nnodes > 1 with train.rdzv_endpoint empty: the nodes and the rendezvous come from the Slurm
    # job the launcher runs in (profiles/slurm); outside one it refuses, naming the by-hand keys
    # (pisft.train.slurm_nodes.for_training): where it will run is not known here
    if t.micro_batch_size == AUTO:
        # smoke_1card chooses among the micro batches that divide a process's share of the global
        # batch: the division below holds by construction for its choice
        if cfg.world_size >= 1 and t.global_batch_size % cfg.world_size:
            problems.append(f"train.global_batch_size: {t.global_batch_size} is not divisible by the world size "
                            f"{cfg.world_size}, so no micro batch (train.micro_batch_size: auto) splits it evenly")
        return problems
    if not isinstance(t.micro_batch_size, int):
        return problems
    per_step = t.micro_batch_size * max(cfg.world_size, 1)
    if t.micro_batch_size >= 1 and cfg.world_size >= 1 and t.global_batch_size % per_step:
        example = per_step * max(1, round(t.global_batch_size / per_step))
        problems.append(
            f"train.global_batch_size: {t.global_batch_size} is not divisible by "
            f"train.micro_batch_size × world size = {t.micro_batch_size} × {cfg.world_size} = "
            f"{per_step}; pick a multiple of {per_step} (e.g. {example})"
        )
    return problems


def _smoke_and_data_problems(cfg: PisftConfig) -> list[str]:
    problems: list[str] = []
    if cfg.data.augment not in AUGMENTS:
        problems.append(f"data.augment: '{cfg.data.augment}' is not one of {', '.join(AUGMENTS)} (none: the "
                        f"images as they are; openpi: openpi's training-time crop, rotation and colour jitter)")
    return problems + _data_problems(cfg.data)


# suite -> number of tasks
LIBERO_SUITES = {"libero_spatial": 10, "libero_object": 10, "libero_goal": 10, "libero_10": 10,
                 "libero_90": 90}


def _eval_problems(e: EvalConfig) -> list[str]:
    problems: list[str] = []
    for suite in e.libero_suites:
        if suite not in LIBERO_SUITES:
            problems.append(f"eval.libero_suites: unknown suite '{suite}'; one of {', '.join(LIBERO_SUITES)}")
    if not e.libero_suites:
        problems.append("eval.libero_suites: an empty list names no suite to roll out; give one or more of "
                        f"{', '.join(LIBERO_SUITES)} (eval.closed_loop: false turns the rollouts off)")
    repeated = sorted({s for s in e.libero_suites if list(e.libero_suites).count(s) > 1})
    if repeated:
        problems.append(f"eval.libero_suites: {repeated} listed more than once; each suite once (a repeat "
                        "would run the same episodes twice, narrow the interval and write one video twice)")
    n_tasks = min((LIBERO_SUITES.get(s, 90) for s in e.libero_suites), default=90)
    bad_ids = [t for t in e.task_ids if not 0 <= t < n_tasks]
    if bad_ids or len(set(e.task_ids)) != len(e.task_ids):
        problems.append(f"eval.task_ids: {list(e.task_ids)}: task ids must be distinct and in 0..{n_tasks - 1} "
                        "(the tasks of every suite in eval.libero_suites); [] evaluates every task")
    if e.precision not in INFERENCE_PRECISIONS:
        problems.append(f"eval.precision: '{e.precision}' is not one of {', '.join(INFERENCE_PRECISIONS)} (auto: bf16 "
                        "on an accelerator, the model's own on the CPU)")
    return problems + _rtc_problems(e)


def _rtc_problems(e: EvalConfig) -> list[str]:
    """eval.rtc's keys beyond their numbers' kinds (`NUMBER_KINDS`): the delay against the chunk's
    executed steps, the schedule's name."""
    r = e.rtc
    problems: list[str] = []
    if r.delay_steps > e.replan_steps:
        problems.append(f"eval.rtc.delay_steps: {r.delay_steps} is more than eval.replan_steps ({e.replan_steps}): "
                        "the next chunk is asked for while the current one is still executing, so the delay "
                        "must fit in the steps executed per chunk; lower eval.rtc.delay_steps or raise "
                        "eval.replan_steps")
    if r.enabled and r.delay_steps >= r.execution_horizon:
        problems.append(f"eval.rtc.delay_steps: {r.delay_steps} is not below eval.rtc.execution_horizon "
                        f"({r.execution_horizon}): LeRobot's RTC pulls the new chunk towards the current one only "
                        "before the horizon, and the environment executes the new chunk from index delay_steps on, "
                        "so real-time chunking would change nothing executed; raise eval.rtc.execution_horizon")
    if r.schedule not in RTC_SCHEDULES:
        problems.append(f"eval.rtc.schedule: '{r.schedule}' is not one of {', '.join(RTC_SCHEDULES)} (LeRobot's "
                        "RTCAttentionSchedule; its default: LINEAR)")
    return problems


def closed_loop_seeds(e: EvalConfig) -> list[int]:
    """The closed loop's seeds, in order: eval.seeds, or [eval.closed_loop_seed] when it is empty."""
    return [int(s) for s in e.seeds] or [e.closed_loop_seed]


def perturbation_key(name: str, strength: float) -> str:
    """A perturbation's name in metrics.json and its videos' folder: `camera_10`, `lighting_-0.5`.
    Strengths equal as numbers have one key: -0.0 is `camera_0` (adding 0.0 turns -0.0 into 0.0, IEEE 754)."""
    return f"{name}_{float(strength) + 0.0:g}"


def perturbation_conditions(e: EvalConfig) -> list[tuple[str, float]]:
    """eval.perturbations as (name, strength) pairs in the order given: a bare name, or an entry whose
    strength is empty (YAML's null), gets its default; -0.0 is 0.0 (the same condition, recorded alike)."""
    out = []
    for item in e.perturbations:
        name, strength = (item, None) if isinstance(item, str) else (item["name"], item.get("strength"))
        out.append((name, float(PERTURBATIONS[name].default if strength is None else strength) + 0.0))
    return out


def perturbation_suite_problems(conditions: list[tuple[str, float]], suites: list[str] | tuple[str, ...],
                                where: str = "eval.perturbations") -> list[str]:
    """A perturbation at a strength other than 0 on a suite it does not apply to (`PerturbationRange.suites`:
    `language` on LIBERO-90, which LIBERO-Pro does not paraphrase). The config check and the closed loop
    (`pisft.evaluate.robustness`, before any rollout) both ask this."""
    problems = []
    for name, strength in dict.fromkeys((n, s) for n, s in conditions if s != 0):
        covered = PERTURBATIONS[name].suites
        outside = [suite for suite in suites if covered and suite not in covered]
        if outside:
            problems.append(f"{where}: {name} at strength {strength:g} does not apply to {', '.join(outside)}: it "
                            f"exists for {', '.join(covered)} alone (docs/robustness.md); leave {name} out, or "
                            f"evaluate eval.libero_suites without {', '.join(outside)}")
    return problems


def chunk_problems(replan_steps: int, delay_steps: int, chunk_size: int, chunk_from: str) -> list[str]:
    """The closed loop executes eval.replan_steps actions of each chunk, a chunk after an episode's first
    from index eval.rtc.delay_steps on: both must fit in the model's chunk (`chunk_from` says whose
    chunk it is). The config check (model.preset's chunk) and the closed loop (the loaded model's) both
    ask this."""
    if replan_steps + delay_steps <= chunk_size:
        return []
    return [f"eval.replan_steps ({replan_steps}) + eval.rtc.delay_steps ({delay_steps}) exceed {chunk_from} chunk of "
            f"{chunk_size} actions (a chunk after an episode's first is executed from index delay_steps on, "
            "replan_steps of it); lower one of them"]


def cpu_replicas_problem(wanted: int) -> str | None:
    """eval.policy_devices on the CPU, where the closed loop's policy is one replica (the environments
    take the cores): the config check (device: cpu) and `pisft.policy.replicas` (the device resolved) ask it."""
    if wanted <= 1:
        return None
    return (f"eval.policy_devices: {wanted} policy replicas asked for, but the policy runs on the CPU, where it "
            "is one (the environments take the cores); set eval.policy_devices: 0, or run on accelerators "
            "(device: cuda or npu)")


def _closed_loop_problems(cfg: PisftConfig) -> list[str]:
    """What the closed loop would refuse, before any rollout, that the config alone decides: the
    model's chunk against the steps executed of it (model.preset's chunk, unless the model keeps its
    source's, model.follow_source_chunk_size), the policy's replicas on the CPU (device: cpu; `auto`
    is decided on the node), LIBERO's initial states per task."""
    e = cfg.eval
    if not e.closed_loop:
        return []
    problems: list[str] = []
    chunk = PRESET_CHUNK_SIZES.get(cfg.model.preset)
    if chunk is not None and not cfg.model.follow_source_chunk_size:
        problems += chunk_problems(e.replan_steps, e.rtc.delay_steps, chunk, f"model.preset {cfg.model.preset}'s")
    if cfg.device == "cpu" and cpu_replicas_problem(e.policy_devices):
        problems.append(cpu_replicas_problem(e.policy_devices))
    if e.trials_per_task > LIBERO_INIT_STATES:
        problems.append(f"eval.trials_per_task: {e.trials_per_task} episodes per task need as many initial states; "
                        f"LIBERO keeps {LIBERO_INIT_STATES} per task (openpi's protocol runs all 50): lower it")
    return problems


def _text_number_hint(value: Any) -> str:
    """For a number YAML 1.1 (Snakemake's reading, and `--set`'s) took for text, such as `1e1`: how to write it."""
    if not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if "e" not in value.lower() or not math.isfinite(number):
        return f" ({value!r} is text: write the number without quotes)"
    return (f" ({value!r} was read as text: YAML 1.1 reads an exponent as a number only with a dot and a sign, "
            f"so write {number:g} or {number:.1e})")


def _robustness_problems(e: EvalConfig) -> list[str]:
    """eval.seeds and eval.perturbations (docs/robustness.md)."""
    problems: list[str] = []
    seeds = list(e.seeds)
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        problems.append(f"eval.seeds: {seeds}: give distinct seeds >= 0 (each is an environment seed and the root of "
                        "the policy's noise seeds)")
    elif seeds and seeds[0] != e.closed_loop_seed:
        problems.append(f"eval.seeds: {seeds} starts with {seeds[0]} but eval.closed_loop_seed is "
                        f"{e.closed_loop_seed}: the first seed is the closed loop's own (the one a single-seed run "
                        f"uses; its videos are recorded at it): start eval.seeds with {e.closed_loop_seed} or set "
                        f"eval.closed_loop_seed: {seeds[0]}")
    known = ", ".join(PERTURBATIONS)
    seen: set[str] = set()
    before = len(problems)
    for i, item in enumerate(e.perturbations):
        where = f"eval.perturbations[{i}]"
        if isinstance(item, dict):
            unknown = sorted(set(item) - {"name", "strength"})
            if unknown:
                problems.append(f"{where}: unknown key(s) {unknown}; an entry is a name or {{name: NAME, strength: S}}")
                continue
            name, strength = item.get("name"), item.get("strength")
        else:
            name, strength = item, None
        if not isinstance(name, str) or name not in PERTURBATIONS:
            hint = difflib.get_close_matches(str(name), list(PERTURBATIONS), n=1, cutoff=0.5)
            problems.append(f"{where}: unknown perturbation {name!r}" + (f"; did you mean '{hint[0]}'?" if hint else "")
                            + f" (one of {known}; docs/robustness.md)")
            continue
        r = PERTURBATIONS[name]
        if strength is None:
            strength = r.default
        number = isinstance(strength, int | float) and not isinstance(strength, bool)
        if not number or not math.isfinite(strength) or not r.low <= strength <= r.high:
            problems.append(f"{where}: {name}'s strength {strength!r} is not a number in [{r.low:g}, {r.high:g}]"
                            + (f" ({r.unit})" if r.unit else "") + f"; e.g. {{name: {name}, strength: {r.default:g}}}"
                            + _text_number_hint(strength))
            continue
        if name == "language" and strength not in (0, 1):
            problems.append(f"{where}: language's strength {strength!r} must be 0 (the task's own instruction) or 1 "
                            "(LIBERO-Pro's paraphrase of it): there is one cited paraphrase per task")
            continue
        key = perturbation_key(name, float(strength))
        if key in seen:
            problems.append(f"{where}: {name} at strength {strength:g} is listed twice (strengths equal as numbers, "
                            f"0 and -0.0 too, or to six significant digits share the key {key!r} in metrics.json "
                            "and its videos); each perturbation and strength once")
        seen.add(key)
    if len(problems) == before:  # every entry well formed: where they apply
        problems += perturbation_suite_problems(perturbation_conditions(e), list(e.libero_suites))
    return problems


def _source_problems(d: DataConfig) -> list[str]:
    value = d.recap_dir
    items = value if isinstance(value, list | tuple) else [value]
    if not items:
        return ["data.recap_dir: an empty list names no dataset; give a directory or a list of "
                "{path: DIR, type: sft|rollout}"]
    problems: list[str] = []
    paths: list[str] = []
    for i, item in enumerate(items):
        where = "data.recap_dir" + (f"[{i}]" if isinstance(value, list | tuple) else "")
        if isinstance(item, dict):
            unknown = sorted(set(item) - {"path", "type", "weight"})
            if unknown:
                problems.append(f"{where}: unknown key(s) {unknown}; a source is "
                                "{path: DIR, type: sft|rollout, weight: W}")
            path, kind = item.get("path"), item.get("type", "sft")
            problems += _weight_problems(where, item.get("weight", 1.0))
        else:
            path, kind = item, "sft"
        if not isinstance(path, str) or not path.strip():
            problems.append(f"{where}: needs a dataset directory (a non-empty string), got {path!r}")
            continue
        if kind not in SOURCE_TYPES:
            problems.append(f"{where}: type '{kind}' is not one of {', '.join(SOURCE_TYPES)} "
                            "(sft: demonstrations, all positive; rollout: policy rollouts with is_success)")
        bad = sorted({c for c in path if c in _SHELL_UNSAFE})
        if bad:
            problems.append(f"{where}: '{path}' contains {' '.join(repr(c) for c in bad)}; the workflow "
                            "passes paths to shell commands unquoted")
        paths.append(path.rstrip("/"))
    dup = sorted({p for p in paths if paths.count(p) > 1})
    if dup:
        problems.append(f"data.recap_dir: {dup} listed more than once; each dataset once")
    return problems


def _weight_problems(where: str, weight: Any) -> list[str]:
    """A source's sampling weight (RLinf's `weight` of a train_data_paths entry): the `weight` kind."""
    number = isinstance(weight, int | float) and not isinstance(weight, bool)
    if number and math.isfinite(weight) and NUMBER_RULES["weight"][0](weight):
        return []
    return [f"{where}: weight {weight!r} is not a positive number; a source's weight is its relative share of "
            "the samples (default 1.0; data.balance_source_weights multiplies it by the source's frames): "
            "give a number > 0, e.g. weight: 0.5, or leave the source out of data.recap_dir"]


def _recap_problems(cfg: PisftConfig) -> list[str]:
    r, e = cfg.recap, cfg.eval
    problems: list[str] = []
    if cfg.data.unconditional_prob >= 1 and (r.iterations or cfg.data.advantage_tag):
        problems.append(f"data.unconditional_prob: {cfg.data.unconditional_prob} drops every advantage label "
                        "during training (every prompt is the plain task, the labels are never seen); "
                        "use a value below 1 (RLinf: 0.1)")
    if r.suite not in LIBERO_SUITES:
        problems.append(f"recap.suite: unknown suite '{r.suite}'; one of {', '.join(LIBERO_SUITES)}")
    n_tasks = LIBERO_SUITES.get(r.suite, 90)
    if not r.task_ids or any(not 0 <= t < n_tasks for t in r.task_ids) or len(set(r.task_ids)) != len(r.task_ids):
        problems.append(f"recap.task_ids: {list(r.task_ids)}: give distinct task ids in 0..{n_tasks - 1} "
                        f"of {r.suite}")
    if r.threshold_scope not in THRESHOLD_SCOPES:
        problems.append(f"recap.threshold_scope: '{r.threshold_scope}' is not one of {', '.join(THRESHOLD_SCOPES)} "
                        "(global: one threshold over all frames, as RLinf; task: one per task, as the paper)")
    if r.init not in RECAP_INITS:
        problems.append(f"recap.init: '{r.init}' is not one of {', '.join(RECAP_INITS)}")
    if r.value_init not in VALUE_INITS:
        problems.append(f"recap.value_init: '{r.value_init}' is not one of {', '.join(VALUE_INITS)} (base: the "
                        "value model starts from the base model, as RLinf's from its pretrained backbone; "
                        "previous: from the policy of iteration k - 1)")
    # train.micro_batch_size: auto: checked against the gate's choice where the value model trains
    micro = cfg.train.micro_batch_size if isinstance(cfg.train.micro_batch_size, int) else 0
    per_step = micro * max(cfg.world_size, 1)
    if r.iterations and per_step >= 1 and cfg.value_global_batch_size % per_step:
        problems.append(f"recap.value_global_batch_size: {cfg.value_global_batch_size} is not divisible by "
                        f"train.micro_batch_size × world size = {per_step}; pick a multiple of {per_step}")
    # LIBERO keeps 50 fixed initial states per task: the evaluation takes the first
    # eval.trials_per_task, collection the next ones, so the two never share a start.
    if r.iterations and e.trials_per_task + r.episodes_per_task > LIBERO_INIT_STATES:
        problems.append(f"recap.episodes_per_task: {r.episodes_per_task} collection episodes after the "
                        f"evaluation's {e.trials_per_task} exceed the {LIBERO_INIT_STATES} initial states "
                        "LIBERO keeps per task; lower one of them")
    if r.iterations and r.collect_seed == e.closed_loop_seed:
        problems.append("recap.collect_seed: equals eval.closed_loop_seed; collection and evaluation must "
                        "draw different seeds")
    if r.iterations and not e.closed_loop:
        problems.append("recap.iterations > 0 needs eval.closed_loop: true (every iteration is evaluated "
                        "in the simulator, and rollouts are collected there)")
    return problems


LIBERO_INIT_STATES = 50

# The longest list each list key takes, and why; checked before the schema reads the config (OmegaConf
# makes a node per item: 10^5 seeds took 35 s to be read, 10^6 minutes), so an absurd list is refused at
# once. Each seed and each perturbation is the whole closed-loop evaluation again (openpi's protocol:
# 2000 episodes), hence their bounds.
MAX_SEEDS = 100
MAX_PERTURBATIONS = 100
MAX_LIST_ITEMS = 1000  # a list key without a bound of its own (data.tasks, data.recap_dir)
MAX_CONFIG_BYTES = 128 << 10  # a config file's text (yaml_text), refused before it is parsed: 28x config.yaml
LIST_LIMITS: dict[str, tuple[int, str]] = {
    "eval.seeds": (MAX_SEEDS, "each seed runs the whole closed-loop evaluation again (openpi's protocol: "
                              "2000 episodes per seed)"),
    "eval.perturbations": (MAX_PERTURBATIONS, "each runs the whole closed-loop evaluation again, at every seed"),
    "eval.libero_suites": (len(LIBERO_SUITES), "each suite once"),
    "eval.task_ids": (max(LIBERO_SUITES.values()), "distinct task ids of a suite"),
    "recap.task_ids": (max(LIBERO_SUITES.values()), "distinct task ids of a suite"),
}


def _check_list_lengths(raw: dict, source: str) -> None:
    """A list longer than its key takes (`LIST_LIMITS`), refused before the schema reads it."""
    for key, value in flatten(raw).items():
        if not isinstance(value, list | tuple):
            continue
        limit, why = LIST_LIMITS.get(key, (MAX_LIST_ITEMS, "no list key needs more"))
        if len(value) > limit:
            raise ConfigError(f"{source}: {key}: a list of {len(value)} items, more than the {limit} it takes "
                              f"({why}); shorten it")


def _cross_check(cfg: PisftConfig, source: str) -> None:
    """Every problem of a schema-valid config at once: values, ranges, their combinations."""
    numbers = number_problems(cfg)
    if numbers:  # the ranges and combinations below assume numbers of the right kind
        raise ConfigError(f"{source}: invalid configuration:\n  - " + "\n  - ".join(numbers))
    problems = _choice_problems(cfg) + _layout_problems(cfg) + _smoke_and_data_problems(cfg)
    problems += _value_problems(cfg) + _eval_problems(cfg.eval) + _source_problems(cfg.data) + _recap_problems(cfg)
    problems += _robustness_problems(cfg.eval) + _closed_loop_problems(cfg)
    if problems:
        raise ConfigError(f"{source}: invalid configuration:\n  - " + "\n  - ".join(problems))


def from_dict(raw: dict | None, source: str = "<config>") -> PisftConfig:
    """Validate a plain mapping against the schema; return the typed config."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(raw).__name__}")
    _check_unknown_keys(raw, source)
    _check_list_lengths(raw, source)
    schema = OmegaConf.structured(PisftConfig)
    OmegaConf.set_struct(schema, True)
    for dotted in MAPPING_KEYS:  # the user's own keys (validated by the cross-checks)
        OmegaConf.set_struct(OmegaConf.select(schema, dotted), False)
    try:
        merged = OmegaConf.merge(schema, OmegaConf.create(raw))
    except ConfigKeyError as exc:  # pragma: no cover - caught by _check_unknown_keys first
        raise ConfigError(f"{source}: {exc.msg}") from None
    except ValidationError as exc:
        key = exc.full_key or "?"
        raise ConfigError(
            f"{source}: key '{key}' has the wrong type: {exc.msg.splitlines()[0]}"
        ) from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{source}: {exc}") from None
    cfg: PisftConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    _cross_check(cfg, source)
    return cfg


def _pyyaml_loader():
    """PyYAML's safe loader (YAML 1.1, as Snakemake reads configs) that refuses a repeated key
    instead of keeping the last one silently."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found the key {key!r} twice (first on line {seen[key] + 1}); a repeated key "
                        "silently replaces the first: keep one", key_node.start_mark)
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep)

    return Loader


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    nan = isinstance(a, float) and isinstance(b, float) and a != a and b != b  # .nan: read alike by both
    return type(a) is type(b) and (a == b or nan)


def _readings_differ(one: Any, two: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, YAML 1.1 reading, YAML 1.2 reading) of every value read differently."""
    if isinstance(one, dict) and isinstance(two, dict):
        out = []
        for key in list(dict.fromkeys([*one, *two])):
            where = f"{path}.{key}" if path else str(key)
            if key not in one or key not in two:
                out.append((where, one.get(key, "(a different key)"), two.get(key, "(a different key)")))
            else:
                out.extend(_readings_differ(one[key], two[key], where))
        return out
    if isinstance(one, list) and isinstance(two, list) and len(one) == len(two):
        return [d for i, (x, y) in enumerate(zip(one, two, strict=True))
                for d in _readings_differ(x, y, f"{path}[{i}]")]
    return [] if _same(one, two) else [(path, one, two)]


def _reading(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})" if value != "(a different key)" else str(value)


def yaml_text(text: str, source: str, *, both_readings: bool = True) -> Any:
    """The YAML document in `text` as PyYAML reads it (YAML 1.1: Snakemake), refusing a repeated
    key; with `both_readings`, also refusing any value that ruamel (YAML 1.2: DVC) reads
    differently (`010`, `0o10`, `yes`/`no`/`on`/`off`, `12:30`, `1e3`, ...), naming the key and
    how to write it so both drivers plan the same run."""
    import yaml

    if len(text) > MAX_CONFIG_BYTES:  # before either reader: 10^5 seeds took them 30 s, 10^6 minutes
        raise ConfigError(f"{source}: {len(text) // 1024} KiB of YAML; a run config is a few KiB (config/config.yaml: "
                          f"about 5), at most {MAX_CONFIG_BYTES // 1024}: no key takes a list that long (eval.seeds: "
                          f"at most {MAX_SEEDS} seeds)")
    try:
        one = yaml.load(text, Loader=_pyyaml_loader())  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    if not both_readings:
        return one
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError as RuamelError

    try:
        two = YAML(typ="safe", pure=True).load(text)  # DVC's reader: YAML 1.2, refuses repeated keys
    except RuamelError as exc:
        raise ConfigError(f"{source}: YAML 1.2 (DVC's reader) refuses it: {exc}") from None
    differ = _readings_differ(one, two)
    if differ:
        lines = [f"{key}: Snakemake (YAML 1.1) reads {_reading(a)}, DVC (YAML 1.2) reads {_reading(b)}"
                 for key, a, b in differ]
        raise ConfigError(
            f"{source}: {len(differ)} value(s) mean different things to the two drivers:\n  - "
            + "\n  - ".join(lines)
            + "\nQuote a value meant as text (e.g. \"yes\", \"12:30\", \"010\"); write a number so both "
              "read it alike: a float with a dot and a signed exponent (5.0e-5, 1.0e+3), an integer in "
              "plain decimal (8, not 010 or 0o10); true/false for a flag")
    return one


def read_yaml(path: str | Path, *, missing: str, both_readings: bool = True) -> Any:
    """The YAML document in `path` (safe loader). ConfigError naming the file when it is absent
    (`missing` says what to do), is not valid YAML (with the line and column), repeats a key, or
    (`both_readings`) holds a value YAML 1.1 and 1.2 read differently (`yaml_text`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: {missing}")
    return yaml_text(path.read_text(), str(path), both_readings=both_readings)


def _command_line_loader():
    """The loader of a value typed on a command line (`--set KEY=VALUE`, Snakemake's `--config
    KEY=VALUE`): `_pyyaml_loader` (YAML 1.1 as Snakemake reads config.yaml, a repeated key refused),
    with a flag only `true`/`false` (any case): YAML 1.1's yes/no/on/off/y/n stay text, as YAML 1.2
    (DVC) reads them, so `train.compile=off` is the mode `off`, not False (a flag still takes the
    text: OmegaConf reads "off" as false)."""
    base = _pyyaml_loader()

    class Loader(base):
        def construct_yaml_bool(self, node):
            text = self.construct_scalar(node)
            return text.lower() == "true" if text.lower() in ("true", "false") else text

    Loader.add_constructor("tag:yaml.org,2002:bool", Loader.construct_yaml_bool)
    return Loader


def read_value(text: str, source: str) -> Any:
    """A value typed on a command line, read as config.yaml is (`_command_line_loader`): `5` a
    number, `null` or nothing None, `{name: camera, strength: 5}` a mapping of a name and a number.
    ConfigError naming `source` (e.g. `--set eval.seeds=[7`) when it is not valid YAML."""
    import yaml

    try:
        return yaml.load(text, Loader=_command_line_loader())  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {' '.join(str(exc).split())}") from None


def merge_into(base: dict, more: dict) -> dict:
    """`more` merged into `base` in place, key by key into mappings on both sides (a list or a
    value replaces), as Snakemake merges `--config` and `--configfile` onto config.yaml."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge_into(base[key], value)
        else:
            base[key] = value
    return base


def command_line_values(entries: list[str], flag: str) -> dict:
    """Snakemake's `--config KEY=VALUE ...` (`flag`) as pisft reads it: each KEY a top-level key
    (Snakemake's rule), each VALUE through `read_value`, later entries merged onto earlier ones.
    Snakemake's own reading of a nested value keeps every number and `null` as text (PyYAML's
    BaseLoader: `strength: 5` is '5'); this one reads them as config.yaml and `--set` do."""
    out: dict = {}
    for entry in entries:
        if "=" not in entry:
            raise ConfigError(f"{flag} {entry}: expected KEY=VALUE, e.g. {flag} 'train={{steps: 10}}'")
        key, value = entry.split("=", 1)
        merge_into(out, {key: read_value(value, f"{flag} {entry}")})
    return out


def load(path: str | Path = DEFAULT_CONFIG, overrides: list[str] | None = None) -> PisftConfig:
    """Load and validate a YAML config file (safe loader), with optional `key=value` overrides
    (each value read by `read_value`)."""
    path = Path(path)
    raw = read_yaml(path, missing=f"config file not found; pass --config PATH (default {DEFAULT_CONFIG})")
    if raw is None:
        raise ConfigError(f"{path}: the config file is empty (or only comments): a run on code "
                          f"defaults is not what was meant; start from {DEFAULT_CONFIG}")
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected KEY=VALUE, e.g. train.steps=10")
        key, value = item.split("=", 1)
        node = raw
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                where = ".".join(parts[:i + 1])
                raise ConfigError(f"--set {item}: '{where}' is a value, not a section; set it as --set {where}=VALUE")
        node[parts[-1]] = read_value(value, f"--set {item}")
    return from_dict(raw, str(path))


def to_dict(cfg: PisftConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def resolved(cfg: PisftConfig) -> dict:
    """The config plus its derived values: what every stage output carries."""
    out = to_dict(cfg)
    out["derived"] = {"world_size": cfg.world_size, "grad_accum_steps": cfg.grad_accum_steps}
    return out


def write_resolved(cfg: PisftConfig, path: Path) -> None:
    path.write_text(json.dumps(resolved(cfg), indent=2, sort_keys=True) + "\n")
