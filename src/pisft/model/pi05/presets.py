"""Architecture presets: `tiny` (a few million parameters, CPU-fast), `small` (about 100M
parameters: pi0.5's structure at a size a CPU still trains, for checking memory figures) and
`pi05` (the real size).

A preset is the PI05Config fields that differ from LeRobot's defaults plus, for sizes LeRobot
does not know, an `Arch` (applied by `pisft.model.pi05.construction.sized_construction`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pisft.config import PRESET_CHUNK_SIZES
from pisft.model.pi05.construction import Arch, GemmaSize, VisionSize
from pisft.model.tokenizer import tiny_vocab_size


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    # PI05Config fields set by this preset (everything else: LeRobot's pi0.5 defaults).
    config: dict[str, Any]
    # Sizes LeRobot does not know; None means LeRobot's own gemma_2b + gemma_300m.
    arch: Arch | None


def _tiny_arch() -> Arch:
    return Arch(
        # 8 heads are required by LeRobot (see pisft.model.pi05.construction); head_dim keeps them small.
        vlm=GemmaSize(width=256, depth=2, mlp_dim=512, num_heads=8, num_kv_heads=1, head_dim=32),
        expert=GemmaSize(width=128, depth=2, mlp_dim=256, num_heads=8, num_kv_heads=1, head_dim=32),
        # 64 px images in 16 px patches: 16 image tokens per camera.
        vision=VisionSize(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, patch_size=16),
        vocab_size=tiny_vocab_size(),
    )


def _small_arch() -> Arch:
    # About 100M parameters (all in the layers: the vocabulary is the tiny tokenizer's), with
    # pi0.5's proportions: a VLM twice as wide as the action expert, shared head_dim and a single
    # K/V head, 8 query heads, a SigLIP-style vision tower on 128 px images (64 tokens per camera).
    return Arch(
        vlm=GemmaSize(width=768, depth=6, mlp_dim=3584, num_heads=8, num_kv_heads=1, head_dim=96),
        expert=GemmaSize(width=512, depth=6, mlp_dim=2048, num_heads=8, num_kv_heads=1, head_dim=96),
        vision=VisionSize(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                          num_attention_heads=6, patch_size=16),
        vocab_size=tiny_vocab_size(),
    )


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        config={
            "chunk_size": PRESET_CHUNK_SIZES["tiny"],
            "n_action_steps": PRESET_CHUNK_SIZES["tiny"],
            "image_resolution": (64, 64),
            "tokenizer_max_length": 48,
            "num_inference_steps": 10,
        },
        arch=_tiny_arch(),
    ),
    "small": Preset(
        name="small",
        config={
            "chunk_size": PRESET_CHUNK_SIZES["small"],
            "n_action_steps": PRESET_CHUNK_SIZES["small"],
            "image_resolution": (128, 128),
            "tokenizer_max_length": 48,
            "num_inference_steps": 10,
        },
        arch=_small_arch(),
    ),
    # LeRobot's pi0.5 defaults (gemma_2b + gemma_300m, 224 px, chunk 50: PRESET_CHUNK_SIZES, 200 prompt tokens).
    "pi05": Preset(name="pi05", config={}, arch=None),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None
