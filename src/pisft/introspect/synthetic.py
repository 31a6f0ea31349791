"""A training step's stand-ins: a full-size policy with random weights and a synthetic batch.

Used by the memory estimate (`pisft.introspect.estimate`), its CPU measurement (`pisft.introspect.measure`)
and the one-device benchmark (`pisft.bench.gpu_step`): the step costs the same as with real
weights and data.
"""

from __future__ import annotations

from typing import Any

import torch

CAMERAS = ("observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb")


def build_random_policy(preset: str, device: torch.device, *, checkpointing: bool, seed: int = 0):
    """Full-size policy without the (slow, CPU) random init: allocated on CPU with correct
    buffers, moved to the device, then its matrices drawn from normal(0, 0.02) there."""
    from pisft.model.policy import fill_random, get_preset, make_config, policy_from_config

    spec = get_preset(preset)
    info = {"preset": preset, "arch": spec.arch.to_dict() if spec.arch is not None else None}
    policy = policy_from_config(make_config(preset), info, device="cpu", dtype="float32", init=False)
    policy.to(device)
    fill_random(policy, torch.Generator(device=device).manual_seed(seed))
    policy.config.device = str(device)
    from pisft.model.registry import spec_of

    # The training structure: per-layer checkpointing only, no action-expert lm_head.
    spec_of(policy).prepare_for_training(policy, checkpointing=checkpointing)
    return policy


def synthetic_batch(policy, micro: int, device: torch.device, seed: int) -> tuple[dict, dict]:
    cfg = policy.config
    g = torch.Generator().manual_seed(seed)
    h, w = cfg.image_resolution
    batch: dict[str, Any] = {k: torch.rand(micro, 3, h, w, generator=g) for k in CAMERAS}
    n_tok = cfg.tokenizer_max_length
    from pisft.model.registry import spec_of

    vocab = spec_of(policy).vocab_size(policy)
    batch["observation.language.tokens"] = torch.randint(0, min(vocab, 1000), (micro, n_tok), generator=g)
    batch["observation.language.attention_mask"] = torch.ones(micro, n_tok, dtype=torch.bool)
    batch["observation.state"] = torch.rand(micro, 8, generator=g) * 2 - 1
    batch["action"] = torch.rand(micro, cfg.chunk_size, 7, generator=g) * 2 - 1
    batch = {k: v.to(device) for k, v in batch.items()}
    rand = {"noise": torch.randn(micro, cfg.chunk_size, cfg.max_action_dim, generator=g).to(device),
            "time": (torch.rand(micro, generator=g) * 0.999 + 0.001).to(device)}
    return batch, rand
