"""FSDP2 full sharding of the policy, with units on modules that are invoked through `__call__`.

FSDP2 gathers a unit's parameters in a forward pre-hook and frees them in a forward post-hook;
both run only on `module(...)`. LeRobot's pi0.5 calls `self.model.forward(...)` and, inside
`compute_layer_complete`, the projections of each decoder layer directly (`layer.self_attn.q_proj(x)`,
`layer.mlp(x)`, `layer.input_layernorm(x, cond)`), never `layer(...)`. A `fully_shard` on a decoder
layer would therefore never gather its parameters. The units here are the modules that ARE
called: per decoder layer (VLM and action expert) the q/k/v/o projections, the MLP and the
adaptive norms (expert); the SigLIP encoder layers, the patch embedding and the projector; the
token embedding; the action/time projections. Everything else (small norms) and the unused
language-model heads live in the root unit. The policy must be called as `policy(batch)`.

Mixed precision (train.precision=bf16): parameters are kept in fp32 (the optimizer's master
copy), gathered in bf16 and gradients reduced in fp32. The forward runs under
`torch.autocast(bf16)` (PolicyTask): FSDP2 casts a unit's inputs only in a normal forward, not
when activation checkpointing recomputes a unit from outside it (LeRobot checkpoints around
`compute_layer_complete`, above the units), and autocast makes every matmul agree on bf16 in
both cases; the loss (mse) runs in fp32 under autocast. The root does not cast its inputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

# Modules whose parameters stay in the root unit: they are never called (unused LM heads).
_UNCALLED = ("lm_head",)
MIN_UNIT_PARAMS = 1024  # generic fallback: smaller Linear/Embedding layers stay in the root


@dataclass(frozen=True)
class Unit:
    name: str
    group: str  # vision | vlm | expert | action | embed | other
    module: nn.Module


def _pi05_core(model: nn.Module) -> nn.Module | None:
    core = getattr(model, "model", None)
    if core is not None and hasattr(core, "paligemma_with_expert"):
        return core
    return None


def _is_tied(model: nn.Module, module: nn.Module) -> bool:
    inside = {id(p) for p in module.parameters()}
    inside_modules = {id(m) for m in module.modules()}
    for mod in model.modules():
        if id(mod) in inside_modules:
            continue
        if any(id(p) in inside for p in mod.parameters(recurse=False)):
            return True
    return False


def pi05_units(policy: nn.Module) -> list[Unit]:
    """The FSDP units of a LeRobot PI05Policy, innermost first (fully_shard order)."""
    core = _pi05_core(policy)
    if core is None:
        raise TypeError(f"{type(policy).__name__} is not a LeRobot PI05Policy")
    pwe = core.paligemma_with_expert
    pg = pwe.paligemma.model
    vision = pg.vision_tower.vision_model
    units: list[Unit] = []
    prefix = "model.paligemma_with_expert.paligemma.model"
    units.append(Unit(f"{prefix}.vision_tower.vision_model.embeddings", "vision", vision.embeddings))
    for i, layer in enumerate(vision.encoder.layers):
        units.append(Unit(f"{prefix}.vision_tower.vision_model.encoder.layers.{i}", "vision", layer))
    units.append(Unit(f"{prefix}.multi_modal_projector", "vision", pg.multi_modal_projector))
    lm = pg.language_model
    if not _is_tied(policy, lm.embed_tokens):  # pisft ties it to the (unused) lm_head: root
        units.append(Unit(f"{prefix}.language_model.embed_tokens", "embed", lm.embed_tokens))
    for group, base, layers, final_norm in (
        ("vlm", f"{prefix}.language_model", lm.layers, lm.norm),
        ("expert", "model.paligemma_with_expert.gemma_expert.model", pwe.gemma_expert.model.layers,
         pwe.gemma_expert.model.norm),
    ):
        for i, layer in enumerate(layers):
            lp = f"{base}.layers.{i}"
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                units.append(Unit(f"{lp}.self_attn.{proj}", group, getattr(layer.self_attn, proj)))
            units.append(Unit(f"{lp}.mlp", group, layer.mlp))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                mod = getattr(layer, norm)
                if getattr(mod, "dense", None) is not None:  # adaptive RMSNorm (action expert)
                    units.append(Unit(f"{lp}.{norm}", group, mod))
        if getattr(final_norm, "dense", None) is not None:
            units.append(Unit(f"{base}.norm", group, final_norm))
    for name in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"):
        units.append(Unit(f"model.{name}", "action", getattr(core, name)))
    return units


def generic_units(model: nn.Module) -> list[Unit]:
    """Fallback for other models: every Linear/Embedding with at least MIN_UNIT_PARAMS params."""
    units = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)) and not any(k in name for k in _UNCALLED):
            if sum(p.numel() for p in mod.parameters()) >= MIN_UNIT_PARAMS:
                units.append(Unit(name, "other", mod))
    return units


def choose_units(model: nn.Module) -> list[Unit]:
    return pi05_units(model) if _pi05_core(model) is not None else generic_units(model)


def _check_no_shared_params(units: list[Unit], model: nn.Module) -> None:
    owner: dict[int, str] = {}
    for unit in units:
        for p in unit.module.parameters():
            if id(p) in owner:
                raise RuntimeError(f"parameter shared by FSDP units {owner[id(p)]} and {unit.name}")
            owner[id(p)] = unit.name
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owner and not name.startswith(owner[id(p)] + "."):
            raise RuntimeError(f"parameter {name} is tied to FSDP unit {owner[id(p)]}: keep it in the root")


def mixed_precision(precision: str, *, root: bool) -> MixedPrecisionPolicy:
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    cast_forward_inputs=not root)
    return MixedPrecisionPolicy()


def shard(model: nn.Module, mesh: DeviceMesh, precision: str) -> list[Unit]:
    """Apply fully_shard to the units, then to the root. Returns the units."""
    units = choose_units(model)
    _check_no_shared_params(units, model)
    for unit in units:
        fully_shard(unit.module, mesh=mesh, mp_policy=mixed_precision(precision, root=False),
                    reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mixed_precision(precision, root=True))
    return units


def _local_numel(t: torch.Tensor) -> int:
    return t.to_local().numel() if isinstance(t, DTensor) else t.numel()


def sharding_report(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    units: Iterable[Unit]) -> dict:
    """What this rank holds: local vs global numbers of parameters and optimizer-state elements,
    and which parameters the units (not the root) cover, per group."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    local = sum(_local_numel(p) for p in params)
    opt_total = opt_local = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    opt_total += value.numel()
                    opt_local += _local_numel(value)
    covered: dict[str, int] = {}
    unit_count: dict[str, int] = {}
    in_units = 0
    for unit in units:
        n = sum(p.numel() for p in unit.module.parameters())
        covered[unit.group] = covered.get(unit.group, 0) + n
        unit_count[unit.group] = unit_count.get(unit.group, 0) + 1
        in_units += n
    return {
        "params_total": total,
        "params_local": local,
        "params_local_fraction": local / total if total else 0.0,
        "optimizer_state_total": opt_total,
        "optimizer_state_local": opt_local,
        "optimizer_state_local_fraction": opt_local / opt_total if opt_total else 0.0,
        "unit_params_by_group": covered,
        "units_by_group": unit_count,
        "root_only_params": total - in_units,
        "all_params_sharded": all(isinstance(p, DTensor) for p in params),
    }
