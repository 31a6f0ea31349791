"""Analytic training FLOPs per sample of pi0.5, read off the module sizes (any preset).

Forward FLOPs per sample (a multiply-add = 2 FLOPs):
  vision  : n_images × [patch conv + encoder Linear layers × P + attention 4·P²·d] + projector × P
  VLM     : decoder Linear layers × T_prefix        (T_prefix = n_images·P + language tokens)
  expert  : decoder Linear layers × T_suffix        (T_suffix = chunk_size)
  joint attention per layer pair: 4 · T² · (heads · head_dim)      (T = T_prefix + T_suffix)
  action/time projections: × T_suffix (time MLP: × 1)
Training = 3 × forward (backward ≈ 2 × forward). Activation recomputation is not counted (MFU
counts model FLOPs, not hardware FLOPs). Element-wise work (norms, activations) is ignored.

Inference (one action chunk, `pi05_inference_flops`): the prefix once (vision + VLM layers ×
T_prefix, prefix attention 4 · T_prefix² · (heads · head_dim) per layer, its keys and values
cached), then each of the `num_inference_steps` denoising steps: expert layers × T_suffix, the
suffix attending to the cached prefix and itself, 4 · T_suffix · T · (heads · head_dim) per layer,
and the action/time projections.
"""

from __future__ import annotations

from torch import nn


def _linear_macs(module: nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def _pi05_parts(policy: nn.Module, *, lang_tokens: int) -> dict:
    """The pieces both counts are made of: FLOPs of the vision tower, multiply-adds of the
    decoder layers and projections, and the token counts."""
    config = policy.config
    core = policy.model
    pwe = core.paligemma_with_expert
    pg = pwe.paligemma.model
    vision = pg.vision_tower.vision_model
    vcfg = pg.vision_tower.config
    patch = vcfg.patch_size
    side = vcfg.image_size // patch
    p_tokens = side * side
    d_vision = vcfg.hidden_size
    n_images = len(config.image_features)

    conv = vision.embeddings.patch_embedding
    conv_macs = p_tokens * conv.in_channels * patch * patch * conv.out_channels
    enc_macs = sum(_linear_macs(layer) for layer in vision.encoder.layers) * p_tokens
    enc_attn = len(vision.encoder.layers) * 2 * p_tokens * p_tokens * d_vision
    proj_macs = _linear_macs(pg.multi_modal_projector) * p_tokens
    vision_flops = 2 * n_images * (conv_macs + enc_macs + enc_attn + proj_macs)

    t_prefix = n_images * p_tokens + lang_tokens
    t_suffix = config.chunk_size
    vlm_layers = pg.language_model.layers
    exp_layers = pwe.gemma_expert.model.layers

    def layer_macs(layer: nn.Module, tokens: int) -> int:
        macs = 0
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            macs += _linear_macs(getattr(layer.self_attn, name)) * tokens
        macs += _linear_macs(layer.mlp) * tokens
        for norm in ("input_layernorm", "post_attention_layernorm"):
            dense = getattr(getattr(layer, norm), "dense", None)
            if dense is not None:
                macs += dense.in_features * dense.out_features  # conditioning: one vector
        return macs

    act_macs = (_linear_macs(core.action_in_proj) + _linear_macs(core.action_out_proj)) * t_suffix
    act_macs += _linear_macs(core.time_mlp_in) + _linear_macs(core.time_mlp_out)
    return {
        "vision_flops": vision_flops,
        "prefix_macs": sum(layer_macs(layer, t_prefix) for layer in vlm_layers),
        "suffix_macs": sum(layer_macs(layer, t_suffix) for layer in exp_layers),
        "action_macs": act_macs,
        "layers": len(vlm_layers),
        "heads_dim": vlm_layers[0].self_attn.q_proj.out_features,  # num_heads × head_dim
        "t_prefix": t_prefix,
        "t_suffix": t_suffix,
    }


def pi05_forward_flops(policy: nn.Module, *, lang_tokens: int) -> float:
    """One training forward of one sample: prefix and suffix together, one denoising step."""
    p = _pi05_parts(policy, lang_tokens=lang_tokens)
    t_all = p["t_prefix"] + p["t_suffix"]
    attn_macs = p["layers"] * 2 * t_all * t_all * p["heads_dim"]
    return float(p["vision_flops"] + 2 * (p["prefix_macs"] + p["suffix_macs"] + attn_macs + p["action_macs"]))


def pi05_inference_flops(policy: nn.Module, *, lang_tokens: int, num_steps: int | None = None) -> float:
    """One action chunk for one request: the prefix once, then `num_steps` denoising steps of the
    expert over the cached prefix (default: the model's `num_inference_steps`)."""
    p = _pi05_parts(policy, lang_tokens=lang_tokens)
    steps = policy.config.num_inference_steps if num_steps is None else num_steps
    t_all = p["t_prefix"] + p["t_suffix"]
    prefix = p["prefix_macs"] + p["layers"] * 2 * p["t_prefix"] * p["t_prefix"] * p["heads_dim"]
    step = p["suffix_macs"] + p["layers"] * 2 * p["t_suffix"] * t_all * p["heads_dim"] + p["action_macs"]
    return float(p["vision_flops"] + 2 * (prefix + steps * step))


def pi05_training_flops_per_sample(policy: nn.Module, *, lang_tokens: int) -> float:
    return 3.0 * pi05_forward_flops(policy, lang_tokens=lang_tokens)
