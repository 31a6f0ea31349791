"""FSDP2 full sharding of the policy: the model's units (its spec's `fsdp_units`), sharded in forward order.

Which modules form a unit is the model's own concern (`ModelSpec.fsdp_units`, as torchtitan's
per-model `parallelize`; pi0.5's, one unit per decoder layer pair and the vision layers gathered
once, are `pisft.model.pi05.units`, 14.); a unit is a `pisft.model.units.Unit`. A model that declares
its own `fsdp_units()` (the RECAP value model) is asked first; a model no spec knows gets the generic
units (`generic_units`). Here, whatever the model: `fully_shard` on each unit, then the root;
forward prefetch is explicit (each unit starts the next unit's all-gather); backward prefetch is
FSDP2's default. Each block (the training forward's repeated layers, a unit's `anchors`) gets its
runner (`pisft.train.blocks`), the unit's registered FSDP2 forward method: FSDP2 gathers a unit's
parameters in a forward pre-hook and frees them in a forward post-hook, both run on `module(...)` or
on a registered forward method. A checkpointed block recomputes its function in backward, not the
unit's forward method, so the prefetch of the forward does not run again there. Everything no unit
holds lives in the root unit.

Mixed precision (train.precision=bf16): parameters are kept in fp32 (the optimizer's master
copy), gathered in bf16 and gradients reduced in fp32. The forward runs under
`torch.autocast(bf16)` (PolicyTask), which makes every matmul agree on bf16 whether a unit is
sharded or not (one process trains unsharded, `distribute`); the loss (mse) runs in fp32 under
autocast. The root does not cast its inputs.

On the CPU (gloo) the units are coarser (`merge_small_units`, `CPU_MIN_UNIT_PARAMS`): there a
collective costs milliseconds of host time whatever its size, and a model's layer units cost more than
their arithmetic at small sizes. Measured on 2 processes, 1 thread each, tiny pi0.5 (2.2M
parameters), per optimizer step: the 7 layer units + root 185-205 ms, one unit per group 163-174
ms, the root alone 121-147 ms, LeRobot's DDP 107-115 ms, no synchronisation at all 68 ms
(docs/benchmarks.md). Accelerators keep the layer units (HCCL/NCCL collectives cost tens of
microseconds; what the units save there is memory).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from pisft import device as devices
from pisft.train import host_memory
from pisft.tensors import local_numel, optimizer_state
from pisft.train import blocks
from pisft.model import registry
from pisft.model.units import Unit  # the model-neutral unit (the training job's types name it here)

# Modules whose parameters stay in the root unit: they are never called (unused LM heads).
_UNCALLED = ("lm_head",)
MIN_UNIT_PARAMS = 1024  # generic fallback: smaller Linear/Embedding layers stay in the root


def generic_units(model: nn.Module) -> list[Unit]:
    """Fallback for other models: every Linear/Embedding with at least MIN_UNIT_PARAMS params."""
    units = []
    for name, mod in model.named_modules():
        if (isinstance(mod, (nn.Linear, nn.Embedding)) and not any(k in name for k in _UNCALLED)
                and sum(p.numel() for p in mod.parameters()) >= MIN_UNIT_PARAMS):
            units.append(Unit(name, "other", (mod,)))
    return units


def choose_units(model: nn.Module, min_unit_params: int = 0) -> list[Unit]:
    """The model's units: its own `fsdp_units()` when it declares them (e.g. the RECAP value
    model), its spec's (`ModelSpec.fsdp_units`, a policy whose type a spec is registered under),
    else the generic ones."""
    declared = getattr(model, "fsdp_units", None)
    kind = getattr(getattr(model, "config", None), "type", None)
    if callable(declared):
        units = declared()
    elif kind in registry.names():
        units = registry.model_spec(kind).fsdp_units(model)
    else:
        units = generic_units(model)
    return merge_small_units(units, min_unit_params) if min_unit_params > 0 else units


# The smallest unit on the CPU: every unit below it is merged with its neighbours of the
# same group, so the tiny model trains with the root unit alone and a full-size one (SigLIP layers
# of 15M parameters, decoder layer pairs of about 130M) keeps one unit per decoder layer pair.
CPU_MIN_UNIT_PARAMS = 16_000_000


def merge_small_units(units: list[Unit], min_params: int) -> list[Unit]:
    """Consecutive units of one group merged until each holds at least `min_params` parameters.

    A remainder below it joins the group's previous merged unit; a group smaller than
    `min_params` in all is left to the root unit. Groups are never mixed (a vision unit stays
    gathered until its backward, a decoder unit does not), and the order stays the forward order.
    """
    out: list[Unit] = []
    pending: list[Unit] = []

    def merged(parts: list[Unit]) -> Unit:
        if len(parts) == 1:
            return parts[0]
        anchors = tuple(a for u in parts for a in u.anchors)
        # Several blocks in one unit: its first block gathers it (pisft.train.blocks), and it stays
        # gathered until its backward, as the blocks after the first need it too.
        return Unit(f"{parts[0].name}..{parts[-1].name}", parts[0].group, tuple(m for u in parts for m in u.modules),
                    parts[0].reshard_after_forward and len(anchors) <= 1, anchors,
                    tuple(m for u in parts for m in u.compiled_modules))

    def close_group() -> None:
        if pending and out and out[-1].group == pending[0].group:
            out[-1] = merged([out[-1], *pending])
        pending.clear()  # a whole group below min_params: its parameters stay in the root

    for unit in units:
        if pending and unit.group != pending[0].group:
            close_group()
        if pending and unit.reshard_after_forward != pending[0].reshard_after_forward:
            raise RuntimeError(f"units {pending[0].name} and {unit.name} of group {unit.group} "
                               "differ in reshard_after_forward")
        pending.append(unit)
        if sum(u.numel() for u in pending) >= min_params:
            out.append(merged(pending))
            pending.clear()
    close_group()
    return out


def min_unit_params(kind: str, configured: int = -1) -> int:
    """The smallest FSDP unit for training on devices of `kind` (cpu | cuda | npu | ...):
    `configured` (train.fsdp_min_unit_params) when >= 0, else by kind (see the module docstring)."""
    if configured >= 0:
        return configured
    return CPU_MIN_UNIT_PARAMS if devices.on_host(kind) else 0  # a type without a row (meta): 0


def _check_no_shared_params(units: list[Unit], model: nn.Module) -> None:
    owner: dict[int, str] = {}
    prefixes: dict[str, tuple[str, ...]] = {}
    names = {id(m): n for n, m in model.named_modules()}
    for unit in units:
        prefixes[unit.name] = tuple(names[id(m)] + "." for m in unit.modules)
        for p in unit.parameters():
            if id(p) in owner:
                raise RuntimeError(f"parameter shared by FSDP units {owner[id(p)]} and {unit.name}")
            owner[id(p)] = unit.name
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owner and not name.startswith(prefixes[owner[id(p)]]):
            raise RuntimeError(f"parameter {name} is tied to FSDP unit {owner[id(p)]}: keep it in the root")


def mixed_precision(precision: str, *, root: bool) -> MixedPrecisionPolicy:
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    cast_forward_inputs=not root)
    return MixedPrecisionPolicy()


def shard(model: nn.Module, mesh: DeviceMesh, precision: str, *, min_params: int = 0,
          compiler: blocks.Compiler | None = None) -> list[Unit]:
    """Apply fully_shard to the units (in forward order), then to the root; set forward prefetch;
    give the blocks their runners (`pisft.train.blocks.install`: compiled by `compiler`, default
    none). `min_params`: merge smaller units (`merge_small_units`; 0: the layer units)."""
    units = choose_units(model, min_params)
    _check_no_shared_params(units, model)
    for unit in units:
        target = unit.modules[0] if len(unit.modules) == 1 else list(unit.modules)
        fully_shard(target, mesh=mesh, mp_policy=mixed_precision(precision, root=False),
                    reshard_after_forward=unit.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mixed_precision(precision, root=True))
    for unit, following in zip(units, units[1:]):
        unit.modules[0].set_modules_to_forward_prefetch([following.modules[0]])
    _install_blocks(model, units, compiler)
    host_memory.return_freed_memory()  # the whole tensors the shards replaced (pisft.train.host_memory)
    return units


def _install_blocks(model: nn.Module, units: list[Unit], compiler: blocks.Compiler | None) -> None:
    """Every block its runner (`pisft.train.blocks.install`): the blocks of `units`, and those of a group
    below the smallest unit, left to the root unit (the tiny model's on the CPU), whose runners compile
    and checkpoint them without a unit of their own (before, `train.compile: layers` compiled none of them)."""
    placed = {id(m) for u in units for m in (*u.anchors, *u.compiled_modules)}
    left = [u for u in choose_units(model) if not any(id(m) in placed for m in (*u.anchors, *u.compiled_modules))]
    blocks.install([*units, *left], compiler or blocks.Compiler())


def distribute(model: nn.Module, mesh: DeviceMesh, precision: str, device: torch.device, *,
               keep_sharded: bool = False, min_params: int = -1,
               compiler: blocks.Compiler | None = None) -> list[Unit]:
    """The training layout: FSDP2 units (`shard`) on more than one process; on one process the
    same model unsharded on `device`, unless `keep_sharded`.

    With one process there is nothing to shard: FSDP2 would still copy every unit into an
    all-gather buffer and out of a reduce-scatter buffer, run its hooks, and make the optimizer
    and the gradient clipping work on DTensors, for the same numbers. Unsharded, the model,
    the optimizer (AdamW over the same parameters, fp32 master weights) and the precision policy
    are the same: with train.precision=bf16 every matmul runs in bf16 under the task's
    `torch.autocast` (as under FSDP's bf16 compute copies) and gradients accumulate in fp32
    (as FSDP's fp32 reduce_dtype); ops autocast keeps in fp32 (norms, embeddings) then read the
    fp32 weights instead of their bf16 copies. Checkpoints (DCP) and the export are
    layout-independent: a 1-process run resumes an N-process checkpoint and the reverse
    (docs/workflow.md, "Checkpoints belong to a run").

    `min_params` (train.fsdp_min_unit_params; -1: by device, `min_unit_params`): smaller units
    are merged (`merge_small_units`); on the CPU by default up to `CPU_MIN_UNIT_PARAMS`.

    `keep_sharded`: the smoke run keeps FSDP2 on its 1-process mesh, because it measures the
    memory of the sharded layout that the N-process run will use (its gathered unit buffers;
    see the smoke report's projection).

    `compiler` (`pisft.train.blocks.Compiler`, train.compile): how the blocks run; default eager.
    """
    smallest = min_unit_params(device.type, min_params)
    if keep_sharded or mesh.size() > 1:
        return shard(model, mesh, precision, min_params=smallest, compiler=compiler)
    units = choose_units(model, smallest)
    _check_no_shared_params(units, model)
    model.to(device)
    _install_blocks(model, units, compiler)
    return units


def sharding_report(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    units: Iterable[Unit]) -> dict:
    """What this rank holds: local vs global numbers of parameters and optimizer-state elements,
    and which parameters the units (not the root) cover, per group."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    local = sum(local_numel(p) for p in params)
    opt_total = opt_local = 0
    if optimizer is not None:
        for value in optimizer_state(optimizer):
            opt_total += value.numel()
            opt_local += local_numel(value)
    covered: dict[str, int] = {}
    unit_count: dict[str, int] = {}
    in_units = 0
    for unit in units:
        n = unit.numel()
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
