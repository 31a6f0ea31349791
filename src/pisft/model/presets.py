"""Architecture presets: `tiny` (a few million parameters, CPU-fast) and `pi05` (the real size).

A preset is the PI05Config fields that differ from LeRobot's defaults plus, for sizes LeRobot
does not know, an `Arch` (applied by `lerobot_internals.sized_construction`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pisft.model.lerobot_internals import Arch, GemmaSize, VisionSize
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
        # 8 heads are required by LeRobot (see lerobot_internals); head_dim keeps them small.
        vlm=GemmaSize(width=256, depth=2, mlp_dim=512, num_heads=8, num_kv_heads=1, head_dim=32),
        expert=GemmaSize(width=128, depth=2, mlp_dim=256, num_heads=8, num_kv_heads=1, head_dim=32),
        # 64 px images in 16 px patches: 16 image tokens per camera.
        vision=VisionSize(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, patch_size=16),
        vocab_size=tiny_vocab_size(),
    )


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        config={
            "chunk_size": 10,
            "n_action_steps": 10,
            "image_resolution": (64, 64),
            "tokenizer_max_length": 48,
            "num_inference_steps": 10,
        },
        arch=_tiny_arch(),
    ),
    # LeRobot's pi0.5 defaults (gemma_2b + gemma_300m, 224 px, chunk 50, 200 prompt tokens).
    "pi05": Preset(name="pi05", config={}, arch=None),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None
