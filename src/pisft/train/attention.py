"""Scaled-dot-product attention for pi0.5's joint VLM/expert attention during training.

LeRobot's `compute_layer_complete` (the joint attention of the VLM and the action expert, every
layer) calls `modeling_gemma.eager_attention_forward` by name: explicit matmul + softmax. This
module supplies, for the training process, the same computation through
`torch.nn.functional.scaled_dot_product_attention`, which dispatches to fused kernels (flash /
memory-efficient attention on CUDA, the fused attention operator on Ascend). Same inputs, same
additive mask (kept additive: prompt padding gives all-masked query rows, which a boolean mask
would turn into NaN), same grouped-query layout. The SigLIP vision tower already uses SDPA.

The swap is of the name `modeling_gemma` inside LeRobot's pi0.5 module only (a namespace that
is transformers' Gemma module with `eager_attention_forward` replaced); nothing else changes.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F

CALL_SITE = "modeling_gemma.eager_attention_forward("


def sdpa_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **_):
    """Drop-in for transformers' Gemma `eager_attention_forward` (same signature and output)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                         dropout_p=dropout if module.training else 0.0, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def structure_problem() -> str | None:
    """None if LeRobot's pi0.5 still calls the eager attention where this module expects."""
    from lerobot.policies.pi05 import modeling_pi05

    if not hasattr(modeling_pi05, "modeling_gemma"):
        return "lerobot.policies.pi05.modeling_pi05 no longer imports modeling_gemma"
    if CALL_SITE not in inspect.getsource(modeling_pi05.compute_layer_complete):
        return f"compute_layer_complete no longer calls {CALL_SITE.rstrip('(')}"
    return None


@contextlib.contextmanager
def sdpa_joint_attention(enabled: bool = True) -> Iterator[None]:
    """Within the block, pi0.5's joint attention runs through SDPA."""
    if not enabled:
        yield
        return
    from lerobot.policies.pi05 import modeling_pi05

    problem = structure_problem()
    if problem is not None:
        raise RuntimeError(f"cannot switch pi0.5 attention to SDPA: {problem} (LeRobot changed?)")
    real = modeling_pi05.modeling_gemma
    proxy = types.SimpleNamespace(**vars(real))
    proxy.eager_attention_forward = sdpa_attention_forward
    modeling_pi05.modeling_gemma = proxy
    try:
        yield
    finally:
        modeling_pi05.modeling_gemma = real
