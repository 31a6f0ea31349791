"""Fused attention for pi0.5's joint VLM/expert attention during training.

LeRobot's `compute_layer_complete` (the joint attention of the VLM and the action expert, every
layer) calls `modeling_gemma.eager_attention_forward` by name: K/V repeated to every query head,
explicit matmul + softmax with an additive float mask. For the training process this module
supplies the same computation through a fused kernel:

- The mask becomes boolean (True = may attend). LeRobot's additive mask holds only 0 and
  -2.38e38 (`OPENPI_ATTENTION_MASK_VALUE`); anything below -1e30 counts as masked.
- Fully padded query rows (prompt padding: every key masked) would be NaN in some fused kernels
  and are excluded by npu_fusion_attention's varlen constraints. Such a row attends to itself
  instead. Its output differs from eager attention (which averages all values), but no real
  token ever attends to a padded key and the loss reads only the action tokens, so every real
  token, the loss and the gradients are unchanged (tests/test_train_attention.py).
- K/V are NOT repeated: the kernels take grouped heads (pi0.5: 8 query heads, 1 K/V head).

Kernels:
- NPU (bf16/fp16 inputs): `torch_npu.npu_fusion_attention(q, k, v, head_num, "BNSD",
  atten_mask=<True = masked>, scale=...)`, the fused FlashAttention operator of 910B. Per its
  documentation (Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_fusion_attention.md)
  `atten_mask` is bool/uint8 with 1 = not attended, shapes BNSS/B1SS/11SS/SS, and Nq may be
  any integer multiple of Nkv (GQA). torch_npu's own `scaled_dot_product_attention` takes this
  kernel only for a boolean mask or none (op_plugin/ops/opapi/ScaledDotProductAttentionKernelNpuOpApi.cpp);
  an additive float mask falls back to matmul + softmax, which is what LeRobot's eager path did.
- CUDA, CPU and NPU in fp32: `torch.nn.functional.scaled_dot_product_attention` with the boolean
  mask and `enable_gqa=True` (flash / memory-efficient kernels on CUDA).

The swap is of the name `modeling_gemma` inside LeRobot's pi0.5 module only (a namespace that
is transformers' Gemma module with `eager_attention_forward` replaced); nothing else changes.

On an NPU two more of a decoder layer's element-wise chains become one Ascend kernel each (the
layer functions of `pisft.model.pi05.forward` call both through LeRobot's module names, which
the same context swaps; elsewhere the originals run):
- the rotary embedding: `torch_npu.npu_rotary_mul(x, cos, sin)` in "half" mode is
  `x * cos + rotate_half(x) * sin`, transformers' `apply_rotary_pos_emb` per tensor (Ascend
  op-plugin 7.3.0's torch_npu-npu_rotary_mul page under its docs/context; Atlas A2 constraints, torch_npu API
  reference 7.0.0 "torch_npu.npu_rotary_mul": a 4-D BNSD input with D < 896 and even, B and N
  below 1000, cos/sin of layout 11SD, B1SD or BNSD; pi0.5's q/k are (B, 8 or 1, S, 256) and its
  cos/sin (B, 1, S, 256));
- the RMS norm: `torch_npu.npu_rms_norm(x, gamma, epsilon)[0]` is x · rsqrt(mean(x²) + eps) · gamma
  (torch_npu API reference "torch_npu.npu_rms_norm"; float16/bfloat16/float32, gamma of the last
  dimension's size). LeRobot's `PiGemmaRMSNorm` computes in float32 and scales by 1 + weight
  (plain) or by 1 + scale and shifts (adaRMS, from the time conditioning): the kernel takes the
  float32 input with gamma = 1 + weight, or gamma = 1 before the adaRMS modulation.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import types
from typing import Any
from collections.abc import Iterator

import torch
import torch.nn.functional as F

CALL_SITE = "modeling_gemma.eager_attention_forward("
FUSED_MARK = "_pisft_fused"  # on the namespace that stands for modeling_gemma while the swap is in place
MASKED_BELOW = -1e30  # LeRobot's additive mask: 0 (attend) or -2.38e38 (masked)
NPU_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def allowed_mask(attention_mask: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """Boolean (B, 1|H, Q, K) mask, True = may attend; no query row left without a key."""
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask > MASKED_BELOW
    diagonal = torch.eye(q_len, k_len, dtype=torch.bool, device=allowed.device)
    empty = ~allowed.any(dim=-1, keepdim=True)
    return allowed | (empty & diagonal)


def kernel_for(query: torch.Tensor) -> str:
    if query.device.type == "npu" and query.dtype in NPU_FUSED_DTYPES:
        return "npu_fusion_attention"
    return "sdpa"


def fused_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **_):
    """Drop-in for transformers' Gemma `eager_attention_forward` (same signature and output)."""
    if dropout and module.training:
        raise ValueError("pi0.5's joint attention has no dropout; got dropout > 0")
    mask = None
    if attention_mask is not None:
        mask = allowed_mask(attention_mask, query.shape[-2], key.shape[-2])
    if kernel_for(query) == "npu_fusion_attention":
        out = _npu_module().npu_fusion_attention(
            query, key, value, query.shape[1], "BNSD",
            atten_mask=None if mask is None else ~mask, scale=scaling, keep_prob=1.0)[0]
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def on_npu(t: torch.Tensor) -> bool:
    """Whether the NPU's fused element-wise kernels apply to `t` (replaced in tests)."""
    return t.device.type == "npu"


class _Kernels:
    """What the drop-ins call, set when `fused_joint_attention` is entered: an import inside a
    compiled block would break its graph (Dynamo does not trace imports), so nothing is imported
    there. `npu`: torch_npu when the process has imported it (it does on an NPU, `pisft.device`)."""

    npu: Any = None
    rotary: Any = None  # transformers' apply_rotary_pos_emb
    layernorm_forward: Any = None  # LeRobot's pi_gemma.layernorm_forward


def _npu_module():
    return _Kernels.npu if _Kernels.npu is not None else importlib.import_module("torch_npu")


def fused_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """Drop-in for transformers' Gemma `apply_rotary_pos_emb`: `npu_rotary_mul` on an NPU."""
    if not on_npu(q):
        return _Kernels.rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _Kernels.npu.npu_rotary_mul(q, cos, sin), _Kernels.npu.npu_rotary_mul(k, cos, sin)


def fused_rms_norm(layernorm, x, cond=None):
    """Drop-in for LeRobot's `layernorm_forward(layernorm, x, cond)` (pi_gemma.PiGemmaRMSNorm:
    (output, gate)): `npu_rms_norm` on an NPU, the same float32 computation."""
    if not on_npu(x):
        return _Kernels.layernorm_forward(layernorm, x, cond)
    dtype = x.dtype
    if cond is None or layernorm.dense is None:
        normed = _Kernels.npu.npu_rms_norm(x.float(), 1.0 + layernorm.weight.float(), layernorm.eps)[0]
        return normed.to(dtype), None
    ones = torch.ones(x.shape[-1], dtype=torch.float32, device=x.device)
    normed = _Kernels.npu.npu_rms_norm(x.float(), ones, layernorm.eps)[0]
    modulation = layernorm.dense(cond)
    if x.dim() == 3:
        modulation = modulation.unsqueeze(1)
    scale, shift, gate = modulation.chunk(3, dim=-1)
    return (normed * (1 + scale.float()) + shift.float()).to(dtype), gate.to(dtype)


def _real_layernorm_forward():
    from lerobot.policies import pi_gemma

    return pi_gemma.layernorm_forward


def structure_problem() -> str | None:
    """None if LeRobot's pi0.5 still calls the eager attention where this module expects."""
    from lerobot.policies.pi05 import modeling_pi05

    if not hasattr(modeling_pi05, "modeling_gemma"):
        return "lerobot.policies.pi05.modeling_pi05 no longer imports modeling_gemma"
    if CALL_SITE not in inspect.getsource(modeling_pi05.compute_layer_complete):
        return f"compute_layer_complete no longer calls {CALL_SITE.rstrip('(')}"
    if getattr(modeling_pi05, "layernorm_forward", None) is not _real_layernorm_forward():
        return "modeling_pi05.layernorm_forward is no longer pi_gemma.layernorm_forward"
    from lerobot.policies import pi_gemma

    if "1.0 + self.weight.float()" not in inspect.getsource(pi_gemma.PiGemmaRMSNorm.forward):
        return "pi_gemma.PiGemmaRMSNorm no longer scales by 1 + weight: revisit fused_rms_norm"
    return None


@contextlib.contextmanager
def fused_joint_attention(enabled: bool = True) -> Iterator[None]:
    """Within the block, pi0.5's joint attention runs through a fused kernel."""
    if not enabled:
        yield
        return
    from lerobot.policies.pi05 import modeling_pi05

    problem = structure_problem()
    if problem is not None:
        raise RuntimeError(f"cannot switch pi0.5 attention to a fused kernel: {problem} (LeRobot changed?)")
    real = modeling_pi05.modeling_gemma
    if getattr(real, FUSED_MARK, False):  # already inside one (the smoke gate's estimate): nothing to do
        yield
        return
    _Kernels.npu = sys.modules.get("torch_npu")
    _Kernels.rotary = real.apply_rotary_pos_emb
    _Kernels.layernorm_forward = modeling_pi05.layernorm_forward
    proxy = types.SimpleNamespace(**vars(real))
    setattr(proxy, FUSED_MARK, True)
    proxy.eager_attention_forward = fused_attention_forward
    proxy.apply_rotary_pos_emb = fused_rotary
    modeling_pi05.modeling_gemma = proxy
    modeling_pi05.layernorm_forward = fused_rms_norm
    try:
        yield
    finally:
        modeling_pi05.modeling_gemma = real
        modeling_pi05.layernorm_forward = _Kernels.layernorm_forward
