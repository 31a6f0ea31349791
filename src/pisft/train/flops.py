"""Analytic training FLOPs per sample of pi0.5, read off the module sizes (any preset).

Forward FLOPs per sample (a multiply-add = 2 FLOPs):
  vision  : n_images × [patch conv + encoder Linear layers × P + attention 4·P²·d] + projector × P
  VLM     : decoder Linear layers × T_prefix        (T_prefix = n_images·P + language tokens)
  expert  : decoder Linear layers × T_suffix        (T_suffix = chunk_size)
  joint attention per layer pair: 4 · T² · (heads · head_dim)      (T = T_prefix + T_suffix)
  action/time projections: × T_suffix (time MLP: × 1)
Training = 3 × forward (backward ≈ 2 × forward). Activation recomputation is not counted (MFU
counts model FLOPs, not hardware FLOPs). Element-wise work (norms, activations) is ignored.
"""

from __future__ import annotations

from torch import nn


def _linear_macs(module: nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def pi05_forward_flops(policy: nn.Module, *, lang_tokens: int) -> float:
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

    dec_macs = sum(layer_macs(layer, t_prefix) for layer in vlm_layers)
    dec_macs += sum(layer_macs(layer, t_suffix) for layer in exp_layers)
    t_all = t_prefix + t_suffix
    attn0 = vlm_layers[0].self_attn
    heads_dim = attn0.q_proj.out_features  # num_heads × head_dim
    attn_macs = len(vlm_layers) * 2 * t_all * t_all * heads_dim
    act_macs = (_linear_macs(core.action_in_proj) + _linear_macs(core.action_out_proj)) * t_suffix
    act_macs += _linear_macs(core.time_mlp_in) + _linear_macs(core.time_mlp_out)
    return float(vision_flops + 2 * (dec_macs + attn_macs + act_macs))


def pi05_training_flops_per_sample(policy: nn.Module, *, lang_tokens: int) -> float:
    return 3.0 * pi05_forward_flops(policy, lang_tokens=lang_tokens)
