"""Analytic training FLOPs per sample of pi0.5, read off the module sizes (any preset).

Forward FLOPs per sample (a multiply-add = 2 FLOPs):
  vision  : n_images × [patch conv + encoder Linear layers × P + attention 4·P²·d] + projector × P
  VLM     : decoder Linear layers × T_prefix        (T_prefix = n_images·P + language tokens),
            less the last layer's output projection and MLP (no loss reads them: pisft's training
            forward does not run them, `pisft.model.pi05` 11.)
  expert  : decoder Linear layers × T_suffix        (T_suffix = chunk_size)
  joint attention per layer pair: 4 · T² · (heads · head_dim)      (T = T_prefix + T_suffix)
  action/time projections: × T_suffix (time MLP: × 1)
Training (`pi05_training_flops_per_sample`): 3 × forward with every parameter trained (backward
≈ 2 × forward); with parts frozen (`train.trainable`) each part's backward is what its
`requires_grad` leaves to do (see the function). Activation recomputation is not counted (MFU
counts model FLOPs, not hardware FLOPs). Element-wise work (norms, activations) is ignored.

Inference (one action chunk, `pi05_inference_flops`): the prefix once (vision + VLM layers ×
T_prefix, prefix attention 4 · T_prefix² · (heads · head_dim) per layer, its keys and values
cached), then each of the `num_inference_steps` denoising steps: expert layers × T_suffix, the
suffix attending to the cached prefix and itself, 4 · T_suffix · T · (heads · head_dim) per layer,
and the action/time projections.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pisft.model.pi05.forward import prefix_frozen
from pisft.model.pi05.fused import attention_projections, query_width
from pisft.model.pi05.parts import (CORE, EXPERT_LAYERS, LANGUAGE_MODEL, PALIGEMMA, PROJECTOR, VISION_MODEL,
                                    VISION_TOWER, VLM_LAYERS, part)


@dataclass(frozen=True)
class _Shape:
    """The modules and token counts both counts read off a PI05Policy."""

    core: nn.Module  # PI05Pytorch: the action/time projections
    projector: nn.Module  # PaliGemma's multi-modal projector (image features -> VLM width)
    vision: nn.Module  # the SigLIP vision model
    patch: int
    p_tokens: int  # patches per image
    d_vision: int
    n_images: int
    vlm_layers: nn.ModuleList
    exp_layers: nn.ModuleList
    t_prefix: int
    t_suffix: int

    @property
    def heads_dim(self) -> int:  # num_heads × head_dim
        return query_width(self.vlm_layers[0].self_attn)


def _shape(policy: nn.Module, *, lang_tokens: int) -> _Shape:
    vcfg = part(policy, VISION_TOWER).config
    p_tokens = (vcfg.image_size // vcfg.patch_size) ** 2
    n_images = len(policy.config.image_features)
    return _Shape(part(policy, CORE), part(policy, PROJECTOR), part(policy, VISION_MODEL),
                  vcfg.patch_size, p_tokens, vcfg.hidden_size, n_images, part(policy, VLM_LAYERS),
                  part(policy, EXPERT_LAYERS), n_images * p_tokens + lang_tokens, policy.config.chunk_size)


def prefix_tokens(policy: nn.Module) -> int:
    """The prefix's length in tokens: each camera's image patches at the config's image resolution
    and the prompt's `tokenizer_max_length` (the memory estimate's sequence)."""
    cfg = policy.config
    vision = part(policy, PALIGEMMA).config.vision_config
    per_image = (cfg.image_resolution[0] // vision.patch_size) ** 2
    n_cams = len([k for k in cfg.input_features if k.startswith("observation.images.")])
    return n_cams * per_image + cfg.tokenizer_max_length


def _linear_macs(module: nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def _pi05_parts(policy: nn.Module, *, lang_tokens: int) -> dict:
    """The pieces both counts are made of: FLOPs of the vision tower, multiply-adds of the
    decoder layers and projections, and the token counts."""
    sh = _shape(policy, lang_tokens=lang_tokens)
    core, projector, vision = sh.core, sh.projector, sh.vision
    patch, p_tokens, n_images = sh.patch, sh.p_tokens, sh.n_images

    conv = vision.embeddings.patch_embedding
    conv_macs = p_tokens * conv.in_channels * patch * patch * conv.out_channels
    enc_macs = sum(_linear_macs(layer) for layer in vision.encoder.layers) * p_tokens
    enc_attn = len(vision.encoder.layers) * 2 * p_tokens * p_tokens * sh.d_vision
    proj_macs = _linear_macs(projector) * p_tokens
    vision_flops = 2 * n_images * (conv_macs + enc_macs + enc_attn + proj_macs)

    def layer_macs(layer: nn.Module, tokens: int) -> int:
        macs = 0
        for proj in (*attention_projections(layer.self_attn), layer.self_attn.o_proj):
            macs += _linear_macs(proj) * tokens
        macs += _linear_macs(layer.mlp) * tokens
        for norm in ("input_layernorm", "post_attention_layernorm"):
            dense = getattr(getattr(layer, norm), "dense", None)
            if dense is not None:
                macs += dense.in_features * dense.out_features  # conditioning: one vector
        return macs

    act_macs = (_linear_macs(core.action_in_proj) + _linear_macs(core.action_out_proj)) * sh.t_suffix
    act_macs += _linear_macs(core.time_mlp_in) + _linear_macs(core.time_mlp_out)
    last = sh.vlm_layers[-1]
    return {
        "vision_flops": vision_flops,
        "prefix_macs": sum(layer_macs(layer, sh.t_prefix) for layer in sh.vlm_layers),
        # what the training forward leaves out of the last VLM layer (its output feeds no loss)
        "unread_prefix_macs": (_linear_macs(last.self_attn.o_proj) + _linear_macs(last.mlp)) * sh.t_prefix,
        "suffix_macs": sum(layer_macs(layer, sh.t_suffix) for layer in sh.exp_layers),
        "action_macs": act_macs,
        "layers": len(sh.vlm_layers),
        "heads_dim": sh.heads_dim,
        "t_prefix": sh.t_prefix,
        "t_suffix": sh.t_suffix,
    }


def pi05_forward_flops(policy: nn.Module, *, lang_tokens: int) -> float:
    """One training forward of one sample: prefix and suffix together, one denoising step (each
    layer's attention over the whole sequence; with a frozen VLM the last layer's prefix rows not
    at all, as `_walk_training_step` counts)."""
    p = _pi05_parts(policy, lang_tokens=lang_tokens)
    t_all = p["t_prefix"] + p["t_suffix"]
    attn_macs = p["layers"] * 2 * t_all * t_all * p["heads_dim"]
    if prefix_frozen(policy):
        attn_macs -= 2 * p["t_prefix"] * t_all * p["heads_dim"]
    prefix = p["prefix_macs"] - p["unread_prefix_macs"]
    return float(p["vision_flops"] + 2 * (prefix + p["suffix_macs"] + attn_macs + p["action_macs"]))


def pi05_inference_flops(policy: nn.Module, *, lang_tokens: int, num_steps: int | None = None) -> float:
    """One action chunk for one request: the prefix once, then `num_steps` denoising steps of the
    expert over the cached prefix (default: the model's `num_inference_steps`)."""
    p = _pi05_parts(policy, lang_tokens=lang_tokens)
    steps = policy.config.num_inference_steps if num_steps is None else num_steps
    t_all = p["t_prefix"] + p["t_suffix"]
    prefix = p["prefix_macs"] + p["layers"] * 2 * p["t_prefix"] * p["t_prefix"] * p["heads_dim"]
    step = p["suffix_macs"] + p["layers"] * 2 * p["t_suffix"] * t_all * p["heads_dim"] + p["action_macs"]
    return float(p["vision_flops"] + 2 * (prefix + steps * step))


def _trains(*modules: nn.Module) -> bool:
    return any(p.requires_grad for m in modules for p in m.parameters())


class _StepFlops:
    """One training step's FLOPs per sample, summed in the forward's order: each matrix product's
    forward, and what its backward adds (`pi05_training_flops_per_sample`)."""

    def __init__(self) -> None:
        self.forward = 0.0
        self.total = 0.0

    def linears(self, module: nn.Module, tokens: int, upstream: bool) -> bool:
        """Each nn.Linear of `module` (LoRA's base layer and its A and B each one) over `tokens`:
        the gradient of its weight where it trains, of its input where something before it trains
        (`upstream`). Returns whether something up to and including `module` trains (the
        `upstream` of what reads its output)."""
        for m in module.modules():
            if isinstance(m, nn.Linear):
                flops = 2.0 * m.in_features * m.out_features * tokens
                self.add(flops, int(m.weight.requires_grad) + int(upstream))
        return upstream or _trains(module)

    def attention(self, flops: float, upstream: bool) -> None:
        self.add(flops, 2 if upstream else 0)  # the gradients of queries, keys and values

    def add(self, flops: float, backward_multiples: int) -> None:
        self.forward += flops
        self.total += flops * (1 + backward_multiples)


def _walk_training_step(policy: nn.Module, *, lang_tokens: int) -> _StepFlops:
    """The parts of `pi05_forward_flops`, in the forward's order, with a flag carried along: does
    something before this point train (then the gradient of this point's input is needed)."""
    sh = _shape(policy, lang_tokens=lang_tokens)
    core, vision, p_tokens = sh.core, sh.vision, sh.p_tokens
    t_all = sh.t_prefix + sh.t_suffix
    walk = _StepFlops()

    # The vision tower, once per camera image (the images are inputs: no gradient before them).
    images = _StepFlops()
    conv = vision.embeddings.patch_embedding
    images.add(2.0 * p_tokens * conv.in_channels * sh.patch * sh.patch * conv.out_channels,
               int(conv.weight.requires_grad))
    up = _trains(vision.embeddings)
    for layer in vision.encoder.layers:
        attn = layer.self_attn
        up = _trains(layer.layer_norm1) or up
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):  # SigLIP's: never fused
            images.linears(proj, p_tokens, up)
        up = up or _trains(attn.q_proj, attn.k_proj, attn.v_proj)
        images.attention(4.0 * p_tokens * p_tokens * sh.d_vision, up)
        up = images.linears(attn.out_proj, p_tokens, up)
        up = images.linears(layer.mlp, p_tokens, _trains(layer.layer_norm2) or up)
    up = images.linears(sh.projector, p_tokens, _trains(vision.post_layernorm) or up)
    walk.forward += sh.n_images * images.forward
    walk.total += sh.n_images * images.total

    time_trains = _trains(core.time_mlp_in, core.time_mlp_out)

    def keys_and_values(layer: nn.Module, tokens: int, up: bool) -> bool:
        """A decoder layer's input norm and q/k/v projections; the flag after them."""
        up = _trains(layer.input_layernorm) or up
        projections = attention_projections(layer.self_attn)
        for proj in projections:
            walk.linears(proj, tokens, up)
        return up or _trains(*projections)

    def after_attention(layer: nn.Module, tokens: int, up: bool) -> bool:
        """The rest of a decoder layer: output projection, adaRMS conditioning, MLP."""
        up = walk.linears(layer.self_attn.o_proj, tokens, up)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            dense = getattr(getattr(layer, norm), "dense", None)
            if dense is not None:  # adaRMS conditioning: one vector, from the time MLP
                walk.linears(dense, 1, time_trains)
        up = _trains(layer.post_attention_layernorm) or up
        return walk.linears(layer.mlp, tokens, up)

    # The decoder pairs: the prefix (images and prompt) through the VLM, the suffix (noisy actions,
    # the time conditioning the expert's norms) through the expert; each suffix layer reads the
    # prefix's keys and values of its layer. The last VLM layer's attention output projection and
    # MLP feed no loss (the VLM's final norm goes to no head): the training forward does not run
    # them, and with a frozen VLM (its prefix alone, `pisft.model.pi05` 8.) not the prefix's own
    # attention of that layer either.
    frozen = prefix_frozen(policy)
    up_p = up or _trains(part(policy, LANGUAGE_MODEL).embed_tokens)
    up_s = walk.linears(core.action_in_proj, sh.t_suffix, False)
    up_s = walk.linears(core.time_mlp_in, 1, False) or up_s
    up_s = walk.linears(core.time_mlp_out, 1, up_s) or up_s
    for i, (vlm, exp) in enumerate(zip(sh.vlm_layers, sh.exp_layers, strict=True)):
        last = i == len(sh.vlm_layers) - 1
        up_p = keys_and_values(vlm, sh.t_prefix, up_p)
        up_s = keys_and_values(exp, sh.t_suffix, up_s) or up_p
        # joint attention: each stream's query rows over all keys (4 · rows · T · heads_dim)
        if not (last and frozen):
            walk.attention(4.0 * sh.t_prefix * t_all * sh.heads_dim, up_p and not last)
        walk.attention(4.0 * sh.t_suffix * t_all * sh.heads_dim, up_s)
        if not last:
            up_p = after_attention(vlm, sh.t_prefix, up_p)
        up_s = after_attention(exp, sh.t_suffix, up_s)
    walk.linears(core.action_out_proj, sh.t_suffix, up_s)
    return walk


def pi05_training_flops_per_sample(policy: nn.Module, *, lang_tokens: int) -> float:
    """Model FLOPs of one training step (forward and backward) of one sample, as the parameters'
    `requires_grad` say (`train.trainable`). Each matrix product counts its forward once, plus
    once more for the gradient of its weight where that trains, plus once more for the gradient
    of its input where something before it in the forward trains (a frozen vision tower before a
    trained model, `expert`'s frozen prefix, which runs without grad: forward only; LoRA's frozen
    base layers: forward and input gradient). Attention: twice its forward more wherever a
    gradient passes. Parts no loss reads (the last VLM layer's output projection and MLP) are not
    run and count nothing. With everything trained this is about 3 × forward (less the first layers'
    input gradients); MFU counts these model FLOPs, not the recomputation of checkpointing.
    `tests/test_train_fsdp.py` holds it against torch's FLOP counter in every mode."""
    return _walk_training_step(policy, lang_tokens=lang_tokens).total
