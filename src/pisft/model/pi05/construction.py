"""Building a pi0.5 policy pisft's way: the sizes LeRobot does not know (1.), tied VLM embeddings (2.),
construction on the meta device (4.), the training structure (5.: per-layer checkpointing, no
expert lm_head) and the value model's backbone without the action expert (7.).

Numbers (5., 9., ...) are the items of the package's docstring (`pisft.model.pi05`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from pisft.model.pi05.modeling import PATCH_LOCK, lerobot_pi05, patched

# LeRobot's hard-coded sizes that the tiny preset must never inherit (see the structure test).
LEROBOT_HARDCODED = {"vocab": 257152, "siglip_intermediate": 4304, "projection_dim": 2048}
# The attention output reshape in compute_layer_complete assumes exactly this many heads.
REQUIRED_NUM_HEADS = 8


@dataclasses.dataclass(frozen=True)
class GemmaSize:
    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class VisionSize:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    patch_size: int


@dataclasses.dataclass(frozen=True)
class Arch:
    """Sizes of a pi0.5-architecture model that LeRobot does not know (the tiny preset)."""

    vlm: GemmaSize
    expert: GemmaSize
    vision: VisionSize
    vocab_size: int

    def validate(self) -> None:
        problems = []
        for name, size in (("vlm", self.vlm), ("expert", self.expert)):
            if size.num_heads != REQUIRED_NUM_HEADS:
                problems.append(f"{name}.num_heads must be {REQUIRED_NUM_HEADS} (LeRobot reshapes "
                                f"attention output with a hard-coded 8 * head_dim)")
        if self.vlm.depth != self.expert.depth:
            problems.append("vlm.depth and expert.depth must be equal (layers run in pairs)")
        if (self.vlm.head_dim, self.vlm.num_kv_heads) != (self.expert.head_dim, self.expert.num_kv_heads):
            problems.append("vlm and expert must share head_dim and num_kv_heads (joint attention)")
        if problems:
            raise ValueError("invalid model sizes: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Arch:
        return cls(
            vlm=GemmaSize(**raw["vlm"]),
            expert=GemmaSize(**raw["expert"]),
            vision=VisionSize(**raw["vision"]),
            vocab_size=int(raw["vocab_size"]),
        )


@contextlib.contextmanager
def sized_construction(arch: Arch | None) -> Iterator[None]:
    """Within this block, `PI05Policy(config)` builds a model of `arch`'s sizes (None: LeRobot's)."""
    if arch is None:
        yield
        return
    arch.validate()
    m = lerobot_pi05()
    real_vlm_cls = m.PaliGemmaForConditionalGenerationWithPiGemma
    real_expert_cls = m.PiGemmaForCausalLM
    real_gemma_config_cls = m.GemmaConfig

    def get_gemma_config(variant: str):
        size = {"gemma_2b": arch.vlm, "gemma_300m": arch.expert}.get(variant)
        if size is None:
            raise ValueError(f"unknown gemma variant {variant!r}")
        return real_gemma_config_cls(**dataclasses.asdict(size))

    def build_vlm(config):
        v = arch.vision
        config.vocab_size = arch.vocab_size
        config._vocab_size = arch.vocab_size  # noqa: SLF001 (LeRobot sets it too)
        config.image_token_index = arch.vocab_size
        config.text_config.vocab_size = arch.vocab_size
        config.projection_dim = arch.vlm.width
        config.hidden_size = arch.vlm.width
        vc = config.vision_config
        vc.hidden_size = v.hidden_size
        vc.intermediate_size = v.intermediate_size
        vc.num_hidden_layers = v.num_hidden_layers
        vc.num_attention_heads = v.num_attention_heads
        vc.patch_size = v.patch_size
        vc.projection_dim = arch.vlm.width
        config.text_config.num_image_tokens = (vc.image_size // vc.patch_size) ** 2
        return real_vlm_cls(config=config)

    def build_expert(config):
        config.vocab_size = arch.vocab_size
        return real_expert_cls(config=config)

    with PATCH_LOCK, patched(m, {
        "get_gemma_config": get_gemma_config,
        "PaliGemmaForConditionalGenerationWithPiGemma": build_vlm,
        "PiGemmaForCausalLM": build_expert,
    }):
        yield


def vlm_embedding_pair(policy) -> tuple[torch.nn.Linear, torch.nn.Embedding]:
    paligemma = policy.model.paligemma_with_expert.paligemma
    return paligemma.lm_head, paligemma.model.language_model.embed_tokens


def tie_vlm_embeddings(policy) -> None:
    """Make PaliGemma's lm_head share embed_tokens' weight (as its config declares)."""
    lm_head, embed = vlm_embedding_pair(policy)
    lm_head.weight = embed.weight


def vlm_embeddings_tied(policy) -> bool:
    lm_head, embed = vlm_embedding_pair(policy)
    return lm_head.weight is embed.weight


def enable_layer_checkpointing(policy) -> None:
    """Activation checkpointing per joint decoder layer only (5.)."""
    core = policy.model
    core.gradient_checkpointing_enabled = False
    core.paligemma_with_expert.gemma_expert.model.gradient_checkpointing = True


def set_layer_checkpointing(policy, on: bool) -> None:
    """Per-layer checkpointing on or off on a policy prepared for training (the flag `run_block`
    reads at every forward: the smoke gate measures both settings on one built model)."""
    policy.model.gradient_checkpointing_enabled = False
    policy.model.paligemma_with_expert.gemma_expert.model.gradient_checkpointing = bool(on)


def prepare_for_training(policy, *, checkpointing: bool) -> None:
    """The training structure of 5.: per-layer checkpointing, no expert lm_head."""
    if checkpointing:
        enable_layer_checkpointing(policy)
    detach_expert_head(policy)


def detach_expert_head(policy) -> torch.nn.Module | None:
    """Remove the unused action-expert lm_head from `policy`; return it (None if absent)."""
    expert = policy.model.paligemma_with_expert.gemma_expert
    head = getattr(expert, "lm_head", None)
    if head is not None:
        expert.lm_head = None
    return head


# The modules of PI05Pytorch that only the action expert's suffix uses (6.).
ACTION_ONLY_MODULES = ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")


def strip_to_vlm_prefix(policy) -> None:
    """Remove the action expert and the action/time projections from `policy` (6.)."""
    core = policy.model
    core.paligemma_with_expert.gemma_expert = None
    for name in ACTION_ONLY_MODULES:
        setattr(core, name, None)


def vlm_width(policy) -> int:
    return int(policy.model.paligemma_with_expert.paligemma.model.language_model.config.hidden_size)


def vlm_vocab(policy) -> int:
    """The VLM's vocabulary size (its token embedding's rows)."""
    return policy.model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.num_embeddings


def build_on_meta(make: Any, config) -> Any:
    """Run `make(config)` (PI05Policy) on the meta device: no memory is allocated."""
    saved = config.device
    config.device = "meta"
    try:
        with torch.device("meta"):
            return make(config)
    finally:
        config.device = saved
