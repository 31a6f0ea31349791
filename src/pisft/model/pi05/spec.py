"""pi0.5's entry in the model registry (`pisft.model.registry`): its presets and the callables of this
folder that training, inference, RECAP, the inspection tools and the benches ask for.
"""

from __future__ import annotations

from pathlib import Path

from pisft.config import PRESET_CHUNK_SIZES
from pisft.model.pi05 import (attention, chunk, construction, flops, forward, fused, precision, processors, rtc,
                              trainable, units)
from pisft.model.pi05.presets import PRESETS
from pisft.model.pi05.parts import EXPERT_HEAD
from pisft.model.spec import ChunkEntry, LoadEntry, ModelSpec, TrainableEntry, ValueEntry


def build(preset: str, *, seed: int, device: str = "cpu", dtype=None):
    """A randomly initialised PI05Policy of `preset` (pisft.model.policy.build_policy). Imported when
    called: pisft.model.policy's imports (rich among them, which draws from Python's global random
    on import) stay where they were in a process's life, and so does that random state."""
    from pisft.model.policy import build_policy

    return build_policy(preset, seed=seed, device=device, dtype=dtype)


def load(model_dir, *, device: str = "cpu", dtype=None, preset: str | None = None, hold_bf16=None):
    """pisft.model.policy.load_policy (imported when called, as `build`)."""
    from pisft.model.policy import load_policy

    return load_policy(model_dir, device=device, dtype=dtype, preset=preset, hold_bf16=hold_bf16)


def structure(model_dir, *, device: str = "cpu", dtype=None):
    """The folder's PI05Policy of its own config.json and sizes (pisft_model.json), weights not loaded."""
    from pisft.model import policy as policy_mod

    info = policy_mod.read_model_info(model_dir)
    config, _ = policy_mod.read_config(Path(model_dir) / policy_mod.CONFIG_FILE)
    return policy_mod.policy_from_config(config, info, device=device, dtype=dtype)


def make_processors(policy, model_dir, dataset_stats=None):
    """pisft.model.policy.make_processors: LeRobot's pi0.5 pipelines with the folder's tokenizer."""
    from pisft.model.policy import make_processors as pi05_processors

    return pi05_processors(policy, model_dir, dataset_stats)


SPEC = ModelSpec(
    name="pi05",  # PI05Config.type
    presets={name: PRESET_CHUNK_SIZES[name] for name in PRESETS},  # the config's table (config/choices.py)
    build=build,
    prepare_for_training=construction.prepare_for_training,
    set_layer_checkpointing=construction.set_layer_checkpointing,
    training_loss=forward.sync_free_forward,
    non_blocking_transfers=processors.set_non_blocking_transfers,
    training_flops_per_sample=flops.pi05_training_flops_per_sample,
    fused_attention=attention.fused_joint_attention,
    chunk=ChunkEntry(install=chunk.install_sample_actions, own=chunk.lerobot_sample_actions,
                     pieces=chunk.rtc_pieces, pieces_installed=chunk.pieces_installed,
                     velocity_hooked=chunk.velocity_hooked),
    configure_rtc=rtc.configure,
    weights_dtype=precision.weights_dtype,
    bf16_layout=precision.openpi_bf16,
    float32_parts=precision.float32_parts,
    prefix_frozen=forward.prefix_frozen,
    fsdp_units=units.policy_units,
    fuse_projections=fused.fuse_decoder_projections,
    prefix_tokens=flops.prefix_tokens,
    vocab_size=construction.vlm_vocab,
    rtc_source=rtc.SOURCE,
    fused_rows=fused.split_rows,
    trainable=TrainableEntry(parts=trainable.PARTS, lora_presets=trainable.LORA_PRESETS, lora=trainable.lora_preset,
                             freeze_flags=trainable.freeze_flags, keep_fp32=trainable.KEEP_FP32),
    load=LoadEntry(policy=load, structure=structure, processors=make_processors),
    value=ValueEntry(strip=construction.strip_to_vlm_prefix, width=construction.vlm_width,
                     readout=forward.vlm_prefix_readout, fsdp_units=units.value_units),
    detached_weight=EXPERT_HEAD,  # the action expert's lm_head (construction.detach_expert_head)
)
