"""bf16 where openpi runs bf16 (10.; pisft.policy.precision).

Numbers (5., 9., ...) are the items of the package's docstring (`pisft.model.pi05`).
"""

from __future__ import annotations

import torch


# openpi's `to_bfloat16_for_selected_params` keeps these (name substrings, relative to
# PaliGemmaWithExpertModel) in float32: Physical-Intelligence/openpi @ 15a9616,
# src/openpi/models_pytorch/gemma_pytorch.py.
OPENPI_FP32 = ("vision_tower.vision_model.embeddings.patch_embedding.weight",
               "vision_tower.vision_model.embeddings.patch_embedding.bias",
               "vision_tower.vision_model.embeddings.position_embedding.weight",
               "input_layernorm", "post_attention_layernorm", "model.norm")
# What LeRobot 0.6.1 keeps besides (its params_to_keep_float32), checked by structure_problems.
LEROBOT_FP32 = ("vision_tower", "multi_modal_projector", "input_layernorm", "post_attention_layernorm",
                "model.norm")
_BF16_HOOK = "_pisft_bf16_encoder_hook"


def _vision(policy):
    return policy.model.paligemma_with_expert.paligemma.model.vision_tower.vision_model


def _cast_embeddings(encoder, args, kwargs):
    """SigLIP's encoder gets its embeddings in its layers' dtype (openpi's cast, 10.)."""
    dtype = encoder.layers[0].self_attn.q_proj.weight.dtype
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None and embeds.dtype != dtype:
        kwargs = {**kwargs, "inputs_embeds": embeds.to(dtype)}
    return args, kwargs


def openpi_bf16(policy) -> int:
    """Cast a bf16 policy's float32 parameters to bf16 except openpi's (`OPENPI_FP32`) and the
    action/time projections (10.); returns how many parameters were cast. A policy built in
    float32 is refused: its float32 layout is LeRobot's `precision="float32"`, not a bf16 one."""
    pwe = policy.model.paligemma_with_expert
    q = pwe.paligemma.model.language_model.layers[0].self_attn.q_proj.weight
    if q.dtype != torch.bfloat16:
        raise ValueError("openpi_bf16: the policy was not built in bf16 (config.dtype = 'bfloat16')")
    cast = 0
    for name, p in pwe.named_parameters():
        if p.dtype == torch.float32 and not any(sel in name for sel in OPENPI_FP32):
            p.data = p.data.to(torch.bfloat16)
            cast += p.numel()
    encoder = _vision(policy).encoder
    if not getattr(encoder, _BF16_HOOK, False):
        encoder.register_forward_pre_hook(_cast_embeddings, with_kwargs=True)
        setattr(encoder, _BF16_HOOK, True)
    return cast


def float32_parts(policy) -> dict[str, int]:
    """Float32 parameters per part of the policy (`model.<part>`, the VLM's vision tower, projector,
    language model and the expert apart), for the records of what runs in float32."""
    out: dict[str, int] = {}
    for name, p in policy.named_parameters():
        if p.dtype != torch.float32:
            continue
        parts = name.split(".")
        key = ".".join(parts[1:5] if parts[1] == "paligemma_with_expert" and parts[2] == "paligemma"
                       else parts[1:3] if parts[1] == "paligemma_with_expert" else parts[1:2])
        out[key] = out.get(key, 0) + p.numel()
    return out


def weights_dtype(policy) -> torch.dtype:
    """The dtype the policy's decoder weights run in (its first VLM layer's query projection)."""
    return policy.model.paligemma_with_expert.paligemma.model.language_model.layers[0].self_attn.q_proj.weight.dtype
