"""The fused joint attention equals LeRobot's eager attention on every real token (CPU), and on
an NPU the joint attention calls npu_fusion_attention with grouped K/V and a boolean mask; the
batch reaches an NPU without blocking copies."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from lerobot.policies.common.vla_utils import make_att_2d_masks, prepare_attention_masks_4d
from transformers.models.gemma import modeling_gemma

from pisft.model.pi05 import attention

HEADS, KV_HEADS, HEAD_DIM = 8, 1, 16
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # fp32, the CPU kernel against matmul + softmax


def _joint_inputs(seed: int = 0):
    """pi0.5's layout: [image | prompt with padding | action chunk], prefix-LM + causal suffix."""
    g = torch.Generator().manual_seed(seed)
    batch, image, prompt, chunk = 3, 6, 7, 5
    n = image + prompt + chunk
    pad = torch.ones(batch, n, dtype=torch.bool)
    pad[0, image + 4:image + prompt] = False  # prompt padding: rows with no key at all
    pad[1, image + 6:image + prompt] = False
    ar = torch.zeros(batch, n, dtype=torch.bool)
    ar[:, image + prompt] = True  # the action chunk starts a new block
    mask = prepare_attention_masks_4d(make_att_2d_masks(pad, ar))
    q = torch.randn(batch, HEADS, n, HEAD_DIM, generator=g)
    k = torch.randn(batch, KV_HEADS, n, HEAD_DIM, generator=g)
    v = torch.randn(batch, KV_HEADS, n, HEAD_DIM, generator=g)
    return q, k, v, mask, pad


def _module():
    return types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, training=True)


def _eager(q, k, v, mask):
    out, _ = modeling_gemma.eager_attention_forward(_module(), q, k, v, mask, 1 / math.sqrt(HEAD_DIM))
    return out


def test_fused_equals_eager_on_every_real_token():
    q, k, v, mask, pad = _joint_inputs()
    assert attention.kernel_for(q) == "sdpa"
    fused, _ = attention.fused_attention_forward(_module(), q, k, v, mask, 1 / math.sqrt(HEAD_DIM))
    eager = _eager(q, k, v, mask)
    torch.testing.assert_close(fused[pad], eager[pad], **TOLERANCE)
    assert torch.isfinite(fused).all()  # padded rows attend to themselves: no NaN anywhere


def test_no_query_row_is_left_without_a_key():
    _, _, _, mask, pad = _joint_inputs()
    allowed = attention.allowed_mask(mask, mask.shape[-2], mask.shape[-1])
    assert allowed.dtype == torch.bool
    assert allowed.any(dim=-1).all()
    real = pad[:, None, :, None] & pad[:, None, None, :]
    assert torch.equal(allowed & real, (mask == 0) & real)  # real tokens: exactly LeRobot's mask


def _stand_in_fusion_attention(calls):
    """npu_fusion_attention's documented contract: BNSD, atten_mask True = NOT attended, Nq a
    multiple of Nkv (GQA), returns (attention_out, softmax_max, softmax_sum, ...)."""

    def npu_fusion_attention(query, key, value, head_num, input_layout, *, atten_mask=None,
                             scale=1.0, keep_prob=1.0, **_):
        calls.append({"layout": input_layout, "head_num": head_num, "kv_heads": key.shape[1],
                      "mask_dtype": None if atten_mask is None else atten_mask.dtype})
        assert input_layout == "BNSD" and head_num == query.shape[1]
        assert head_num % key.shape[1] == 0 and keep_prob == 1.0
        group = head_num // key.shape[1]
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        scores = query @ key.transpose(-1, -2) * scale
        if atten_mask is not None:
            assert not atten_mask.all(dim=-1).any(), "a fully masked row (not supported by the kernel)"
            scores = scores.masked_fill(atten_mask, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ value, None, None, None, 0, 0, 0)

    return npu_fusion_attention


def test_npu_runs_npu_fusion_attention_with_grouped_kv(monkeypatch):
    calls: list[dict] = []
    stand_in = types.ModuleType("torch_npu")
    stand_in.npu_fusion_attention = _stand_in_fusion_attention(calls)
    monkeypatch.setitem(sys.modules, "torch_npu", stand_in)
    q, k, v, mask, pad = _joint_inputs(1)
    # A bf16 query on an NPU picks the fused operator (CPU tensors stand in for NPU ones here).
    monkeypatch.setattr(attention, "kernel_for", lambda query: "npu_fusion_attention")
    fused, _ = attention.fused_attention_forward(_module(), q, k, v, mask, 1 / math.sqrt(HEAD_DIM))
    assert calls == [{"layout": "BNSD", "head_num": HEADS, "kv_heads": KV_HEADS, "mask_dtype": torch.bool}]
    torch.testing.assert_close(fused[pad], _eager(q, k, v, mask)[pad], **TOLERANCE)


@pytest.mark.parametrize(("device", "dtype", "kernel"), [
    ("cpu", torch.float32, "sdpa"), ("meta", torch.bfloat16, "sdpa"),
])
def test_kernel_choice_off_npu(device, dtype, kernel):
    assert attention.kernel_for(torch.empty(1, device=device, dtype=dtype)) == kernel


@pytest.mark.parametrize(("dtype", "kernel"), [
    (torch.bfloat16, "npu_fusion_attention"), (torch.float16, "npu_fusion_attention"),
    (torch.float32, "sdpa"),  # fp32 training on an NPU: torch_npu's SDPA with the boolean mask
])
def test_kernel_choice_on_npu(dtype, kernel):
    query = types.SimpleNamespace(device=types.SimpleNamespace(type="npu"),
                                  dtype=dtype)
    assert attention.kernel_for(query) == kernel


def test_host_to_device_copies_do_not_block_on_any_accelerator():
    """LeRobot's device step sets non_blocking only for "cuda"; pisft sets it for npu too."""
    from lerobot.processor import DeviceProcessorStep

    from pisft.model.pi05.processors import set_non_blocking_transfers

    steps = [DeviceProcessorStep(device="cpu"), DeviceProcessorStep(device="cpu")]
    steps[1].device = "npu"  # as LeRobot's __post_init__ leaves it for npu:<i>
    pipeline = types.SimpleNamespace(steps=steps)
    set_non_blocking_transfers(pipeline)
    assert [s.non_blocking for s in steps] == [False, True]


def _stand_in_rotary_mul(calls):
    """npu_rotary_mul's documented contract on an Atlas A2 (torch_npu API reference 7.0.0), "half"
    mode: a 4-D input, D even and below 896, B and N below 1000, r1/r2 of layout 11SD, B1SD or
    BNSD for a BNSD input; output r1 * x + r2 * cat(-x2, x1)."""

    def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
        calls.append(("rotary_mul", tuple(x.shape), tuple(r1.shape)))
        assert rotary_mode == "half" and x.dim() == r1.dim() == r2.dim() == 4
        b, n, s, d = x.shape
        assert d % 2 == 0 and d < 896 and b < 1000 and n < 1000
        assert r1.shape == r2.shape and r1.shape[2:] == (s, d) and r1.shape[0] in (1, b) and r1.shape[1] in (1, n)
        assert x.dtype == r1.dtype == r2.dtype
        x1, x2 = torch.chunk(x, 2, -1)
        return r1 * x + r2 * torch.cat((-x2, x1), dim=-1)

    return npu_rotary_mul


def _stand_in_rms_norm(calls):
    """npu_rms_norm's documented contract: float16/bfloat16/float32, gamma of the input's last
    dimension and its dtype; returns (x * rsqrt(mean(x^2) + eps) * gamma, rstd)."""

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        calls.append(("rms_norm", tuple(x.shape)))
        assert x.dtype in (torch.float16, torch.bfloat16, torch.float32) and gamma.dtype == x.dtype
        assert gamma.shape == (x.shape[-1],)
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
        return x * rstd * gamma, rstd

    return npu_rms_norm


@pytest.mark.parametrize("frozen", [False, True], ids=["pair", "frozen_prefix"])
def test_npu_decoder_layers_run_the_fused_kernels_with_the_same_result(monkeypatch, frozen):
    """On an NPU a decoder layer's rotary embedding and RMS norms (plain and adaRMS) run as
    npu_rotary_mul and npu_rms_norm, its attention as npu_fusion_attention (stand-ins that hold
    the documented contracts; CPU tensors stand in for NPU ones): the layer's outputs equal the
    eager path's."""
    from pisft.introspect.synthetic import synthetic_batch
    from pisft.model.pi05.forward import sync_free_forward
    from pisft.model.policy import build_policy
    from pisft.train.policy_task import injected_flow_samples

    policy = build_policy("tiny", seed=0)
    for p in policy.parameters():  # LeRobot starts the adaRMS projections at zero: give them a value
        if p.dim() and not p.abs().sum():
            torch.nn.init.normal_(p, std=0.05)
    if frozen:
        policy.model.paligemma_with_expert.paligemma.requires_grad_(False)
    batch, rand = synthetic_batch(policy, 2, torch.device("cpu"), seed=3)

    def loss():
        with injected_flow_samples(policy.model, rand["noise"], rand["time"]), \
                sync_free_forward(policy), torch.no_grad():
            return policy(batch)

    with attention.fused_joint_attention():
        plain = loss()
    calls: list = []
    stand_in = types.ModuleType("torch_npu")  # imported before the swap, as on an NPU host
    stand_in.npu_fusion_attention = _stand_in_fusion_attention([])
    stand_in.npu_rotary_mul = _stand_in_rotary_mul(calls)
    stand_in.npu_rms_norm = _stand_in_rms_norm(calls)
    monkeypatch.setitem(sys.modules, "torch_npu", stand_in)
    monkeypatch.setattr(attention, "on_npu", lambda t: True)
    monkeypatch.setattr(attention, "kernel_for", lambda query: "npu_fusion_attention")
    with attention.fused_joint_attention():
        fused = loss()
    depth = len(policy.model.paligemma_with_expert.gemma_expert.model.layers)
    kinds = [c[0] for c in calls]
    # q and k: once per joint layer pair, once per VLM layer and once per expert layer when frozen
    assert kinds.count("rotary_mul") == (4 if frozen else 2) * depth
    assert kinds.count("rms_norm") >= 4 * depth - 2  # two per layer of each stream (the last VLM: one)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
