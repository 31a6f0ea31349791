"""pisft's training forward of pi0.5 (5., 8., 11.): `sync_free_forward` runs the loss through
`joint_forward` (a trainable VLM) or `frozen_prefix_forward` (a frozen VLM), each decoder layer pair
(or VLM layer, or expert layer) one block (`run_block`); and the value model's prefix-only pass
(`vlm_prefix_readout`, 7.). `pisft.model.pi05.checks` holds the steps of LeRobot's they must match.

Numbers (5., 9., ...) are the items of the package's docstring (`pisft.model.pi05`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from pisft.model.pi05.embedding import _embed_prefix, _embed_suffix, _loss_forward
from pisft.model.pi05.fused import FUSED_GATE_UP, FUSED_QKV, query_projection
from pisft.model.pi05.modeling import lerobot_pi05
from pisft.model.units import BLOCK_RUNNER, checkpointed


def vlm_prefix_readout(policy, images: list[torch.Tensor], img_masks: list[torch.Tensor],
                       tokens: torch.Tensor, masks: torch.Tensor, readout: torch.Tensor, *,
                       frozen_prefix: bool = False) -> torch.Tensor:
    """The final VLM hidden states (B, n, width) of `readout` tokens (B, n, width) appended to
    pi0.5's prefix (images, then language tokens): LeRobot's `embed_prefix` (as `_embed_prefix`,
    without the host->device copy of its mask row) and its prefix-only
    VLM pass (7.). The prefix attends within itself as in pi0.5 (bidirectionally, padding
    masked); each read-out token attends to the whole prefix and the read-out tokens before it,
    and no prefix token attends to a read-out token (its autoregressive mask is 1).

    `frozen_prefix` (no VLM parameter trains, or no gradient is wanted): since no prefix row
    sees a read-out column, the prefix's keys/values do not depend on the read-out tokens, so the
    prefix runs once under `torch.no_grad()` with the VLM's KV cache, and the read-out tokens run
    after it through the same layers attending to [prefix K/V, their own] -- how LeRobot's
    `sample_actions` runs its prefix and then `denoise_step`, and how `frozen_prefix_forward`
    (8.) trains the policy. The backward then runs through n tokens per layer instead of the whole
    prefix, and nothing of the prefix is kept for it (recap.value_trainable: head at real size:
    tests/test_recap_value.py checks the same logits and gradients as the joint pass)."""
    from lerobot.policies.common.vla_utils import make_att_2d_masks, prepare_attention_masks_4d

    core = policy.model
    pwe = core.paligemma_with_expert
    pwe.paligemma.model.language_model.config._attn_implementation = "eager"  # noqa: SLF001 - as sample_actions
    bsize, n = readout.shape[:2]
    # the sync-free embedding of the training step (5.): same values, no host->device copy
    with torch.no_grad() if frozen_prefix else contextlib.nullcontext():
        embs, pad, att = _embed_prefix(core, images, img_masks, tokens, masks)
    ones = torch.ones(bsize, n, dtype=torch.bool, device=pad.device)
    readout = readout.to(embs.dtype)
    if not frozen_prefix:
        pad_all = torch.cat([pad, ones], dim=1)
        mask_4d = prepare_attention_masks_4d(make_att_2d_masks(pad_all, torch.cat([att, ones], dim=1)))
        (hidden, _), _ = pwe.forward(attention_mask=mask_4d, position_ids=torch.cumsum(pad_all, dim=1) - 1,
                                     past_key_values=None, inputs_embeds=[torch.cat([embs, readout], dim=1), None],
                                     use_cache=False)
        return hidden[:, -n:]
    with torch.no_grad():
        _, cache = pwe.forward(attention_mask=prepare_attention_masks_4d(make_att_2d_masks(pad, att)),
                               position_ids=torch.cumsum(pad, dim=1) - 1, past_key_values=None,
                               inputs_embeds=[embs, None], use_cache=True)
    # denoise_step's mask and positions: the prefix's padding, then the read-out block
    mask_2d = torch.cat([pad[:, None, :].expand(bsize, n, pad.shape[1]), make_att_2d_masks(ones, ones)], dim=2)
    position_ids = pad.sum(dim=-1, keepdim=True) + torch.cumsum(ones, dim=1) - 1
    (hidden, _), _ = pwe.forward(attention_mask=prepare_attention_masks_4d(mask_2d), position_ids=position_ids,
                                 past_key_values=cache, inputs_embeds=[readout, None], use_cache=False)
    return hidden


@contextlib.contextmanager
def sync_free_forward(policy, *, frozen_prefix: bool | None = None) -> Iterator[None]:
    """Within the block, `policy(batch)` returns the training loss tensor: no host sync, no
    tensor copied from a Python list, no float64 (5.).

    `frozen_prefix`: run the prefix once without grad (`frozen_prefix_forward`, 8.); None:
    exactly when every VLM parameter is frozen (`prefix_frozen`). True with a trainable VLM
    parameter is refused (its gradient would silently be zero)."""
    core = policy.model
    frozen = prefix_frozen(policy)
    if frozen_prefix and not frozen:
        raise ValueError("frozen_prefix=True but the PaliGemma VLM has trainable parameters: the frozen-prefix "
                         "forward would give them no gradient; freeze the VLM (train.trainable: expert) or "
                         "leave frozen_prefix to None")
    use_frozen = frozen if frozen_prefix is None else frozen_prefix
    policy.forward = _loss_forward.__get__(policy)
    core.embed_prefix = _embed_prefix.__get__(core)
    core.embed_suffix = _embed_suffix.__get__(core)
    core.forward = (frozen_prefix_forward if use_frozen else joint_forward).__get__(core)
    try:
        yield
    finally:
        del policy.forward
        del core.embed_prefix
        del core.embed_suffix
        del core.forward


# ------------------------------------------------------------------------------------------------
# 8. The frozen prefix: prefix once without grad, then the expert's layers over the suffix.

def prefix_frozen(policy) -> bool:
    """Whether no parameter of the PaliGemma VLM (the whole prefix) is trainable (8.)."""
    paligemma = policy.model.paligemma_with_expert.paligemma
    return not any(p.requires_grad for p in paligemma.parameters())


def _rotary(rotary_emb, like: torch.Tensor, position_ids: torch.Tensor):
    dummy = torch.zeros(like.shape[0], like.shape[2], like.shape[-1], device=like.device, dtype=like.dtype)
    return rotary_emb(dummy, position_ids)


def _qkv(layer, hidden, cond):
    m = lerobot_pi05()
    hidden, gate = m.layernorm_forward(layer.input_layernorm, hidden, cond)
    shape = (*hidden.shape[:-1], -1, layer.self_attn.head_dim)
    attn = layer.self_attn
    fused = getattr(attn, FUSED_QKV, None)  # 12.
    if fused is not None:
        q, k, v = fused(hidden).split(fused.pisft_split, dim=-1)
    else:
        q, k, v = attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)
    return q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2), gate


def _layer_out(layer, hidden, att_output, gate, cond):
    """compute_layer_complete's second half for one stream: o_proj, residuals, MLP."""
    m = lerobot_pi05()
    if att_output.dtype != layer.self_attn.o_proj.weight.dtype:
        att_output = att_output.to(layer.self_attn.o_proj.weight.dtype)
    out = m._gated_residual(hidden, layer.self_attn.o_proj(att_output), gate)  # noqa: SLF001
    after_first_residual = out.clone()
    out, gate = m.layernorm_forward(layer.post_attention_layernorm, out, cond)
    up = getattr(layer.mlp, FUSED_GATE_UP, None) or layer.mlp.up_proj  # 12.
    if up.weight.dtype == torch.bfloat16:
        out = out.to(dtype=torch.bfloat16)
    return m._gated_residual(after_first_residual, layer.mlp(out), gate)  # noqa: SLF001


def _attend(layer, q, k, v, mask):
    m = lerobot_pi05()
    out, _ = m.modeling_gemma.eager_attention_forward(layer.self_attn, q, k, v, mask, layer.self_attn.scaling)
    return out.reshape(q.shape[0], -1, 1 * 8 * layer.self_attn.head_dim)


def prefix_layer(layer, hidden, mask, position_ids, rotary_emb, *, last: bool = False):
    """One VLM layer over the prefix alone: (its output, its post-rotary keys, its values). The
    last layer's output is None: no loss reads it, only its keys and values (11.)."""
    m = lerobot_pi05()
    q, k, v, gate = _qkv(layer, hidden, None)
    cos, sin = _rotary(rotary_emb, q, position_ids)
    q, k = m.modeling_gemma.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    if last:
        return None, k, v
    return _layer_out(layer, hidden, _attend(layer, q, k, v, mask), gate, None), k, v


def suffix_layer(layer, hidden, prefix_k, prefix_v, mask, position_ids, cond, rotary_emb):
    """One action-expert layer over the suffix, attending to [prefix K/V, its own K/V]."""
    m = lerobot_pi05()
    q, k, v, gate = _qkv(layer, hidden, cond)
    cos, sin = _rotary(rotary_emb, q, position_ids)
    q, k = m.modeling_gemma.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    k = torch.cat([prefix_k, k], dim=2)
    v = torch.cat([prefix_v, v], dim=2)
    return _layer_out(layer, hidden, _attend(layer, q, k, v, mask), gate, cond)


def pair_layer(vlm_layer, expert_layer, prefix, suffix, mask, position_ids, cond, rotary_emb, *,
               last: bool = False):
    """`compute_layer_complete` for one (VLM layer, expert layer) pair, stream by stream (the same
    steps, `_LAYER_STEPS`): both streams' queries, keys and values, one joint attention, each
    stream's output projection, residuals and MLP. Returns (prefix out, suffix out). The last
    pair's VLM stream stops after the attention (its output is None): its output projection and
    MLP feed only the VLM's final norm, which no loss reads (11.)."""
    m = lerobot_pi05()
    qp, kp, vp, gate_p = _qkv(vlm_layer, prefix, None)
    qs, ks, vs, gate_s = _qkv(expert_layer, suffix, cond)
    q, k, v = torch.cat([qp, qs], dim=2), torch.cat([kp, ks], dim=2), torch.cat([vp, vs], dim=2)
    cos, sin = _rotary(rotary_emb, q, position_ids)
    q, k = m.modeling_gemma.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    att = _attend(vlm_layer, q, k, v, mask)
    n = prefix.shape[1]
    suffix = _layer_out(expert_layer, suffix, att[:, n:], gate_s, cond)
    if last:
        return None, suffix
    return _layer_out(vlm_layer, prefix, att[:, :n], gate_p, None), suffix


# ------------------------------------------------------------------------------------------------
# 11. The training forward, block by block. `PI05Pytorch.forward` is run as pisft's own loop over
# the repeated blocks (`joint_forward`; `frozen_prefix_forward` for a frozen VLM): the same steps
# (`_CORE_FORWARD_STEPS`), each decoder layer pair (or VLM layer, or expert layer) one call of
# `run_block`. A block is then the unit of FSDP2 (its gather and reduce-scatter), of activation
# checkpointing and of torch.compile (pisft.train.blocks installs a runner on the block's first
# layer; torchtitan compiles and shards each TransformerBlock the same way). LeRobot's own loop
# (`PaliGemmaWithExpertModel.forward`) calls `compute_layer_complete` on the layers' parts, never a
# module holding the block, so neither FSDP2's hooks nor a compiled region could hold a whole block.
# The last VLM layer's output projection and MLP are not run: their output reaches only the VLM's
# final norm, which no loss reads (LeRobot computes them and autograd gives them no gradient).

def layers_checkpointed(core) -> bool:
    """Whether the decoder layers recompute their forward in backward (`enable_layer_checkpointing`)."""
    return bool(getattr(core.paligemma_with_expert.gemma_expert.model, "gradient_checkpointing", False))


def run_block(anchor, fn, *args, checkpoint: bool = False, partner=None, **kwargs):
    """`fn(*args, **kwargs)`, one block of the training forward whose first layer is `anchor`,
    recomputed in backward when `checkpoint`: through the runner pisft.train.blocks installed on
    `anchor` (FSDP2's forward method, torch.compile), or plainly without one. `partner`: a layer the
    block also runs (a pair's expert layer); when it is a block of its own (a frozen VLM's layout,
    pisft.model.pi05.units, run through the joint forward) its runner wraps this one without compiling or
    checkpointing anything, so that its FSDP2 unit is gathered too."""
    outer = getattr(partner, BLOCK_RUNNER, None) if partner is not None else None
    if outer is not None:
        return outer(functools.partial(run_block, anchor, fn, checkpoint=checkpoint), *args, plain=True, **kwargs)
    runner = getattr(anchor, BLOCK_RUNNER, None)
    if runner is not None:
        return runner(fn, *args, checkpoint=checkpoint, **kwargs)
    return checkpointed(fn, *args, **kwargs) if checkpoint else fn(*args, **kwargs)


def _inputs(self, images, img_masks, tokens, masks, actions, noise, time, *, frozen: bool):
    """PI05Pytorch.forward up to its decoder: the flow-matching target, both streams' embeddings
    (the prefix without grad when `frozen`), the joint mask and positions."""
    from lerobot.policies.common.vla_utils import make_att_2d_masks, prepare_attention_masks_4d

    time_expanded = time[:, None, None]
    x_t = time_expanded * noise + (1 - time_expanded) * actions
    u_t = noise - actions
    with torch.no_grad() if frozen else contextlib.nullcontext():
        prefix_embs, prefix_pad_masks, prefix_att_masks = self.embed_prefix(images, img_masks, tokens, masks)
    suffix_embs, suffix_pad_masks, suffix_att_masks, adarms_cond = self.embed_suffix(x_t, time)
    vlm = self.paligemma_with_expert.paligemma.model.language_model
    if query_projection(vlm.layers[0].self_attn).weight.dtype == torch.bfloat16:  # LeRobot reads q_proj's
        suffix_embs = suffix_embs.to(dtype=torch.bfloat16)
        prefix_embs = prefix_embs.to(dtype=torch.bfloat16)
    pad_masks = torch.cat([prefix_pad_masks, suffix_pad_masks], dim=1)
    att_masks = torch.cat([prefix_att_masks, suffix_att_masks], dim=1)
    position_ids = torch.cumsum(pad_masks, dim=1) - 1
    mask_4d = prepare_attention_masks_4d(make_att_2d_masks(pad_masks, att_masks))
    return u_t, prefix_embs, suffix_embs, adarms_cond, mask_4d, position_ids


def _loss(self, expert, hidden, adarms_cond, u_t):
    """PI05Pytorch.forward after its decoder: the expert's final norm, the action projection, the loss."""
    import torch.nn.functional as F

    suffix_out, _ = lerobot_pi05().layernorm_forward(expert.norm, hidden, adarms_cond)
    suffix_out = suffix_out[:, -self.config.chunk_size:].to(dtype=torch.float32)
    v_t = self.action_out_proj(suffix_out)
    return F.mse_loss(u_t, v_t, reduction="none")


def joint_forward(self, images, img_masks, tokens, masks, actions, noise, time):
    """PI05Pytorch.forward (a trainable VLM): same inputs, same per-element losses, each layer pair
    one block (11.)."""
    pwe = self.paligemma_with_expert
    vlm = pwe.paligemma.model.language_model
    expert = pwe.gemma_expert.model
    u_t, prefix, suffix, cond, mask_4d, position_ids = _inputs(self, images, img_masks, tokens, masks, actions,
                                                               noise, time, frozen=False)
    checkpointing = layers_checkpointed(self) and self.training
    last = len(vlm.layers) - 1
    for i, (vlm_layer, expert_layer) in enumerate(zip(vlm.layers, expert.layers, strict=True)):
        prefix, suffix = run_block(vlm_layer, pair_layer, vlm_layer, expert_layer, prefix, suffix, mask_4d,
                                   position_ids, cond, vlm.rotary_emb, last=i == last, checkpoint=checkpointing,
                                   partner=expert_layer)
    return _loss(self, expert, suffix, cond, u_t)


def frozen_prefix_forward(self, images, img_masks, tokens, masks, actions, noise, time):
    """PI05Pytorch.forward for a frozen VLM (8.): same inputs, same per-element losses; each VLM
    layer and each expert layer one block (11.)."""
    pwe = self.paligemma_with_expert
    vlm = pwe.paligemma.model.language_model
    expert = pwe.gemma_expert.model
    u_t, hidden, suffix, cond, mask_4d, position_ids = _inputs(self, images, img_masks, tokens, masks, actions,
                                                               noise, time, frozen=True)
    n = hidden.shape[1]
    kv = []
    last = len(vlm.layers) - 1
    with torch.no_grad():
        for i, layer in enumerate(vlm.layers):
            hidden, k, v = run_block(layer, prefix_layer, layer, hidden, mask_4d[:, :, :n, :n],
                                     position_ids[:, :n], vlm.rotary_emb, last=i == last)
            kv.append((k, v))
    checkpointing = layers_checkpointed(self) and self.training
    suffix_mask, suffix_pos = mask_4d[:, :, n:, :], position_ids[:, n:]
    for layer, (k, v) in zip(expert.layers, kv, strict=True):
        suffix = run_block(layer, suffix_layer, layer, suffix, k, v, suffix_mask, suffix_pos, cond, vlm.rotary_emb,
                           checkpoint=checkpointing)
    return _loss(self, expert, suffix, cond, u_t)
