"""The domain tables a config key chooses from: devices, presets, precisions, the compile and LoRA
modes, augmentations, LeRobot's RTC schedules, the perturbations, the trainable modes, the RECAP
choices and the LIBERO suites. The lowest module of `pisft.config`: it imports nothing of pisft."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

DEVICES = ("auto", "npu", "cuda", "cpu")
# model.preset: the built-in models' presets (today pi0.5's; a process that never imports the model
# registry, such as the drivers' parse-time check, validates with these).
PRESETS = ("tiny", "small", "pi05")
# Each preset's action chunk (PI05Config.chunk_size; pisft.model.pi05.presets sets tiny's and small's from
# here, pi05's is LeRobot's PI05Config default, which a test holds to this).
PRESET_CHUNK_SIZES = {"tiny": 10, "small": 10, "pi05": 50}
# The presets of models registered at run time (pisft.model.registry.register adds them, unregister
# removes them; the config never imports the registry): preset -> its action chunk size.
_REGISTERED_PRESETS: dict[str, int] = {}


def presets() -> tuple[str, ...]:
    """model.preset's choices, read when called: the built-in presets, then the registered models'."""
    return PRESETS + tuple(_REGISTERED_PRESETS)


def preset_chunk_size(preset: str) -> int | None:
    """The action chunk of `preset` (None: no preset of that name; the config's chunk checks skip it)."""
    return PRESET_CHUNK_SIZES.get(preset, _REGISTERED_PRESETS.get(preset))


def add_presets(chunk_sizes: dict[str, int]) -> None:
    """Make a registered model's presets valid model.preset values, each with its action chunk (a
    name taken is refused, nothing added)."""
    taken = sorted(p for p in chunk_sizes if p in presets())
    if taken:
        raise ValueError(f"model.preset: {taken} are presets already")
    _REGISTERED_PRESETS.update({p: int(n) for p, n in chunk_sizes.items()})


def remove_presets(names) -> None:
    """Remove registered presets (a built-in one stays)."""
    for name in names:
        _REGISTERED_PRESETS.pop(name, None)


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
# LeRobot 0.6.1's RTCConfig defaults (lerobot/policies/rtc/configuration_rtc.py): eval.rtc's defaults,
# pisft.policy.rtc's settings and record, and serve's --rtc-* flags read them here.
LEROBOT_RTC_DEFAULTS = MappingProxyType({"execution_horizon": 10, "max_guidance_weight": 10.0, "schedule": "LINEAR"})


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
# freezes yet, its rule in each model spec that has the part: `TrainableEntry.parts`, pi0.5's in
# pisft.model.pi05.trainable's `PARTS`).
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
        follow it, `pisft.model.pi05.forward.prefix_frozen`); None: as the LoRA target preset says (`lerobot`'s
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

THRESHOLD_SCOPES = ("global", "task")
RECAP_INITS = ("previous", "base")
VALUE_INITS = ("base", "previous")  # recap.value_init: what the value model of iteration k starts from
SOURCE_TYPES = ("sft", "rollout")

# The keys of `data.columns`: the canonical LIBERO inputs (pisft.data.libero names their columns
# in every known layout by them).
COLUMN_KEYS = ("image", "wrist_image", "state", "actions")

# suite -> number of tasks
LIBERO_SUITES = {"libero_spatial": 10, "libero_object": 10, "libero_goal": 10, "libero_10": 10,
                 "libero_90": 90}
LIBERO_INIT_STATES = 50
