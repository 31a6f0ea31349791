"""Fused projections for training (12.; pisft.train.trainable fuses, pisft.train.export_weights
splits).

Numbers (5., 9., ...) are the items of the package's docstring (`pisft.model.pi05`).
"""

from __future__ import annotations

from typing import Any

import torch


# 12. Fused projections for training (`fuse_decoder_projections`). Each Gemma decoder layer's
# q/k/v projections become one Linear (`qkv_proj`, rows q then k then v) and its MLP's gate/up one
# Linear (`gate_up_proj`, rows gate then up), as Huawei's pi0.5 recipe for Ascend fuses them
# (hicann/cann-recipes-embodied-intelligence, manipulation/pi05/train: the QKV and the gate/up
# projections): one matrix product instead of three (two), and one FSDP2 parameter instead of
# three (two) to gather, cast and reduce each step. The values are the same: a fused product's
# rows are the separate products' rows. Fused after loading (the file keeps LeRobot's names and
# strict loading holds) and split on export (`split_name`, pisft.train.export_weights); only the
# training model is fused (pisft's layer functions, pisft.model.pi05.forward, read either), never a LoRA-adapted
# projection (peft wraps the separate ones) nor a model LeRobot's own forward runs.

FUSED_QKV = "qkv_proj"  # on a decoder layer's self_attn
FUSED_GATE_UP = "gate_up_proj"  # on a decoder layer's mlp
_QKV_PARTS = ("q_proj", "k_proj", "v_proj")
_GATE_UP_PARTS = ("gate_proj", "up_proj")


class FusedGemmaMLP(torch.nn.Module):
    """LeRobot's `pi_gemma.GemmaMLP` (down_proj(act(gate_proj(x)) * up_proj(x))) with gate and up
    in one product (`gate_up_proj`)."""

    def __init__(self, gate_up_proj: torch.nn.Linear, down_proj: torch.nn.Linear, act_fn: Any) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _fused_linear(parts: list[torch.nn.Linear]) -> torch.nn.Linear | None:
    """One Linear holding `parts`' rows, or None when they cannot be one parameter (a LoRA-wrapped
    part, a bias on some only, parts that train and parts that do not, mixed dtypes)."""
    if any(type(p) is not torch.nn.Linear for p in parts):  # exactly nn.Linear: peft's LoRA layers wrap it
        return None
    weights = [p.weight for p in parts]
    biases = [p.bias for p in parts]
    if (len({w.requires_grad for w in weights}) > 1 or len({w.dtype for w in weights}) > 1
            or len({b is None for b in biases}) > 1):
        return None
    fused = torch.nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=biases[0] is not None,
                            device=weights[0].device, dtype=weights[0].dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat(weights, dim=0))
        if biases[0] is not None:
            fused.bias.copy_(torch.cat(biases, dim=0))
    fused.requires_grad_(weights[0].requires_grad)
    fused.pisft_split = [p.out_features for p in parts]
    return fused


def query_projection(attn):
    """A decoder layer's Linear that makes its queries: `q_proj`, or fused, `qkv_proj`."""
    return getattr(attn, FUSED_QKV, None) or attn.q_proj


def attention_projections(attn) -> list:
    """A decoder layer's Linear layers that make its queries, keys and values (one when fused)."""
    fused = getattr(attn, FUSED_QKV, None)
    return [fused] if fused is not None else [getattr(attn, n) for n in _QKV_PARTS]


def query_width(attn) -> int:
    """Query heads x head dim of a decoder layer's attention (fused or not)."""
    return int(attn.config.num_attention_heads * attn.head_dim)


def decoder_layers(policy) -> list:
    """Every Gemma decoder layer of the policy: the VLM's, then the action expert's."""
    pwe = policy.model.paligemma_with_expert
    return [*pwe.paligemma.model.language_model.layers, *pwe.gemma_expert.model.layers]


def fuse_decoder_projections(policy) -> int:
    """Fuse each decoder layer's q/k/v and gate/up projections in place (12.); returns the
    number of fused products. Call after the trainable mode is applied (a LoRA-wrapped or
    partly trained group stays as it is), before sharding."""
    fused_count = 0
    for layer in decoder_layers(policy):
        attn = layer.self_attn
        if getattr(attn, FUSED_QKV, None) is None:
            fused = _fused_linear([getattr(attn, n) for n in _QKV_PARTS])
            if fused is not None:
                for n in _QKV_PARTS:
                    delattr(attn, n)
                setattr(attn, FUSED_QKV, fused)
                fused_count += 1
        mlp = layer.mlp
        if not isinstance(mlp, FusedGemmaMLP):
            fused = _fused_linear([getattr(mlp, n) for n in _GATE_UP_PARTS])
            if fused is not None:
                layer.mlp = FusedGemmaMLP(fused, mlp.down_proj, mlp.act_fn)
                fused_count += 1
    return fused_count


def split_name(name: str) -> list[tuple[str, int, int]] | None:
    """A fused parameter's name -> (LeRobot's name, first row, end row) of each part; None: not fused."""
    for fused, parts in ((f"self_attn.{FUSED_QKV}.", _QKV_PARTS), (f"mlp.{FUSED_GATE_UP}.", _GATE_UP_PARTS)):
        if fused in name:
            return [(name.replace(fused, fused.rsplit(".", 2)[0] + f".{part}."), -1, -1) for part in parts]
    return None


def split_rows(module_of, name: str) -> list[tuple[str, int, int]] | None:
    """`split_name` with each part's rows, read off the fused Linear (`module_of(name)`)."""
    parts = split_name(name)
    if parts is None:
        return None
    sizes = module_of(name).pisft_split
    out, start = [], 0
    for (plain, _, _), size in zip(parts, sizes, strict=True):
        out.append((plain, start, start + size))
        start += size
    return out
