"""What training, inference, RECAP, the inspection tools and the benches ask of a model: one
`ModelSpec` per model family, looked up by name (`pisft.model.registry`) instead of importing the
model's folder.

The name is the policy's type as LeRobot names it: `PreTrainedConfig.type`, the "type" of a model's
config.json ("pi05" for `PI05Config`), by which LeRobot's own policy factory picks a policy class
(lerobot/policies/factory.py, `get_policy_class(name)` and `make_policy_config(policy_type)`). So a
built policy finds its spec by itself (`registry.spec_of`). pisft's config has no `model.type` key: each
`model.preset` belongs to one spec (`ModelSpec.presets`, each with its action chunk; today every built-in
preset is pi0.5's), which `registry.spec_for_preset` finds. The config, which imports nothing of the
model, knows the built-in presets from its own table (`pisft.config.PRESETS`, `PRESET_CHUNK_SIZES`: a
driver validates a config without importing the registry); `registry.register` tells it a registered
model's (`pisft.config.add_presets`). As torchtitan gives each model a spec of callables (pytorch/torchtitan,
torchtitan/protocols/model_spec.py: the model's name, its config and its `parallelize_fn`, ...),
a spec here is the model's callables. The model's folder builds its spec (`pisft.model.pi05.spec`)
and the registry (`pisft.model.registry`) lists it: one line per model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any


@dataclasses.dataclass(frozen=True)
class ChunkEntry:
    """How a compiled program takes a policy's action chunks (pisft.policy.compiled)."""

    install: Callable[[Any, Callable], None]  # (policy, fn): every chunk runs fn in place of the model's own
    own: Callable[[Any], Callable]  # (policy) -> the model's own chunk function, bound
    pieces: Callable[[Any], dict[str, Callable]]  # (policy) -> its model calls of a guided (RTC) chunk
    pieces_installed: Callable[[Any, dict], AbstractContextManager]  # (policy, compiled pieces) -> context yielding
    # whether the denoising steps are the compiled ones (not while a guidance hook holds them)
    velocity_hooked: Callable[[Any], bool]  # (policy): a guidance hook holds its denoising step now


@dataclasses.dataclass(frozen=True)
class ValueEntry:
    """What the RECAP value model (pisft.recap.value_model) takes of a policy: its VLM prefix."""

    strip: Callable[[Any], None]  # (policy) -> None: every part but the VLM prefix removed
    width: Callable[[Any], int]  # (policy) -> the VLM's hidden width (the read-out token's)
    # (policy, images, img_masks, tokens, token_mask, readout_embeds, *, frozen_prefix) -> hidden states
    readout: Callable[..., Any]
    # (model, lead) -> the FSDP2 units (pisft.model.units.Unit) of the value model `model`, whose policy
    # is at `lead` in it ("policy."), in forward order
    fsdp_units: Callable[[Any, str], list]


@dataclasses.dataclass(frozen=True)
class TrainableEntry:
    """What the trainable modes (pisft.train.trainable, pisft.config.TRAINABLE_MODE_TABLE) take of a model."""

    # part of pisft.config.FROZEN_PARTS the model has, beyond "" (nothing) and "base" (everything) ->
    # (dotted name: "." + a parameter's name in the policy or the value model) -> whether it lies in it;
    # a mode freezing a part the model lacks is refused
    parts: Mapping[str, Callable[[str], bool]]
    lora_presets: tuple[str, ...]  # the train.lora_targets presets it offers (none: no LoRA mode)
    # (targets, rank=0, alpha=0.0, *, value_model=False) -> pisft.model.lora.LoraSpec of a preset above
    lora: Callable[..., Any] | None
    # (policy) -> the module holding LeRobot's freezing flags (pisft.config.LEROBOT_FREEZE_FLAGS) and its
    # `_set_requires_grad`; None: the model has none (pisft's rule of the part alone freezes it)
    freeze_flags: Callable[[Any], Any] | None
    keep_fp32: tuple[str, ...]  # name fragments of parameters a bf16 run keeps in float32 though frozen


@dataclasses.dataclass(frozen=True)
class LoadEntry:
    """How the training stages and the memory estimate find a model in its folder (`results/base_model`,
    a trained policy), found by `model.preset` (pisft.train.job.build, pisft.introspect.estimate)."""

    # (model_dir, *, device, dtype, preset, hold_bf16) -> the policy, loaded strictly; `preset`: the folder
    # must hold that preset; `hold_bf16(name)`: parameters held in bf16 from the start (job.frozen_in_bf16)
    policy: Callable[..., Any]
    # (model_dir, *, device, dtype) -> the folder's model of its own sizes, its weights not loaded (the
    # memory estimate builds it on the meta device)
    structure: Callable[..., Any]
    # (policy, model_dir, dataset_stats) -> (preprocessor, postprocessor): what turns a collated training
    # batch into the policy's inputs, with the folder's tokenizer and the dataset's normalisation stats
    processors: Callable[..., tuple[Any, Any]]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model family's callables. Each takes the model's policy (an `nn.Module` with a LeRobot
    `config`) unless said otherwise."""

    name: str  # LeRobot's policy type (config.json's "type")
    # the `model.preset` names that build this model -> each one's action chunk (the config's chunk checks)
    presets: Mapping[str, int]
    # (preset, *, seed, device="cpu", dtype=None) -> a randomly initialised policy of the preset
    build: Callable[..., Any]
    # (policy, *, checkpointing) -> None: the training structure (checkpointing, unused parts off)
    prepare_for_training: Callable[..., None]
    # (policy, on) -> None: per-layer activation checkpointing on a prepared policy
    set_layer_checkpointing: Callable[[Any, bool], None]
    # (policy, *, frozen_prefix=None) -> context within which `policy(batch)` is the training loss
    training_loss: Callable[..., AbstractContextManager]
    # (preprocessor) -> None: its host->device copies without blocking the host
    non_blocking_transfers: Callable[[Any], None]
    # (policy, *, lang_tokens) -> model FLOPs of one training sample (the MFU's numerator)
    training_flops_per_sample: Callable[..., float]
    # (enabled=True) -> context within which the model's attention runs fused device kernels
    fused_attention: Callable[..., AbstractContextManager]
    chunk: ChunkEntry
    # (policy, settings) -> None: real-time chunking (pisft.policy.rtc.RtcSettings) on the policy
    configure_rtc: Callable[[Any, Any], None]
    # (policy) -> the dtype its weights run in (the chunk tolerance's key)
    weights_dtype: Callable[[Any], Any]
    # (policy) -> parameters cast to bf16 where the model's reference runs bf16
    bf16_layout: Callable[[Any], int]
    # (policy) -> {part: float32 parameters} for the records of what runs in float32
    float32_parts: Callable[[Any], dict[str, int]]
    # (policy) -> whether no parameter of its VLM prefix trains (training runs the prefix without grad)
    prefix_frozen: Callable[[Any], bool]
    # (policy) -> its FSDP2 units (pisft.model.units.Unit) in forward order: pisft.train.fsdp shards
    # them (merging small ones on the CPU); torchtitan's per-model `parallelize_fn` decides the same
    fsdp_units: Callable[[Any], list]
    # (policy) -> the projections fused for training (pisft.train.trainable.apply_training_layout)
    fuse_projections: Callable[[Any], int]
    # (policy) -> the prefix's length in tokens (images and prompt; the memory estimate's sequence)
    prefix_tokens: Callable[[Any], int]
    vocab_size: Callable[[Any], int]  # (policy) -> its language model's vocabulary size
    rtc_source: str  # where its real-time chunking comes from (the RTC record's "source")
    # (module_of, parameter name) -> [(the model's own name, first row, end row)] of a parameter fused
    # for training (module_of(name): the module holding it), None: not fused (the export's names)
    fused_rows: Callable[[Callable[[str], Any], str], list[tuple[str, int, int]] | None]
    trainable: TrainableEntry  # its side of the trainable modes (parts, LoRA presets, float32 parameters)
    load: LoadEntry  # its folder loaded for training and the estimate, and its processors
    value: ValueEntry | None = None  # its VLM prefix as the RECAP value model's backbone; None: none
    # a weight detached for training (never used by the loss), exported from the base model's file
    detached_weight: str | None = None
