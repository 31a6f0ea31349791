"""What a training run trains: `train.trainable` (the policy) and `recap.value_trainable` (the value model).

Policy modes (`MODES`; a check relies on the values):
- `all`: every parameter (today's full fine-tune).
- `expert`: LeRobot 0.6.1's `train_expert_only` (`PI05Config`; `PaliGemmaWithExpertModel.
  _set_requires_grad` and `.train` in `lerobot/policies/pi05/modeling_pi05.py`): the whole PaliGemma
  VLM (SigLIP, projector, Gemma 2B, its embedding) frozen and kept in eval mode; the action expert
  and the action/time projections (`action_in_proj`, `action_out_proj`, `time_mlp_in/out`) train.
  openpi's and RLinf's `train_expert_only` freeze the same (`openpi_action_model.py` `freeze_vlm`).
- `no_vision`: LeRobot's `freeze_vision_encoder`: the SigLIP vision tower frozen (eval mode), the
  projector, both Gemmas and the projections train.
- `lora`: LoRA adapters through the `peft` library (LeRobot's own path, `PreTrainedPolicy.
  wrap_with_peft` in `lerobot/policies/pretrained.py`), on the modules of a target preset
  (`train.lora_targets`, `LORA_TARGETS`, `lora_spec`): every other parameter frozen except the
  modules the preset trains in full.

The adapters are injected IN PLACE (`peft.inject_adapter_in_model`, as `LoraModel` does inside
`get_peft_model`), not by wrapping the policy in a `PeftModel`: the trained module stays LeRobot's
`PI05Policy` with its own methods (`forward`, `select_action`, `config`) and names, so the task,
the loader and the export see the same model; a LoRA-adapted `q_proj` is still the module at
`...self_attn.q_proj` (peft's `lora.Linear`, holding `base_layer` and the adapters), called as a
module by LeRobot's layer code, so pisft's FSDP2 units (pi0.5's, `pisft.model.pi05.units`, which
take the called parts of each decoder layer by path) hold the base weight and its adapters in one unit
and gather them together. A `PeftModel` would prefix every name with `base_model.model.`, reach
the policy through `__getattr__` forwarding, and keep `modules_to_save` as a second (trained) copy
of each fully trained module next to the original: twice its memory and a different FSDP layout.
Modules a preset trains in full are simply left `requires_grad=True`; the adapter alone is still
written in PEFT's layout at export (`pisft.train.export`, with those modules as `modules_to_save`).

Value-model modes (`VALUE_MODES`): `all`, `no_vision` (as above), `head` (the whole VLM prefix
frozen, the read-out token and the bin head train: RLinf's value model `freeze_vlm: true`,
`rlinf/models/embodiment/value_model/recap/value_expert.py` `_set_requires_grad`, whose read-out
runs through a separate small expert where pisft's goes through the VLM itself, so here only the
read-out token and the head are left), `lora` (the VLM part of `train.lora_targets` on the prefix,
the read-out token and head trained in full, as RLinf keeps `value_head` trainable under LoRA,
`rlinf/models/__init__.py`).

Each mode is an entry of `pisft.config.TRAINABLE_MODE_TABLE` (which models take it, what part it
freezes, whether it is LoRA, LeRobot's flag for it); the code here follows the entry and never
branches on a mode's name, so a mode that freezes a part some entry already freezes is one entry
there, and one freezing a new part adds that part's rule to each model spec that has the part
(`pisft.model.spec.TrainableEntry.parts`; `_FROZEN_PARTS` here holds the rules every model has: nothing
and everything). What is pi0.5's (the rules of its parts, its LoRA target presets, LeRobot's flags'
module, what stays float32) is in `pisft.model.pi05.trainable` (15.), behind its spec's `trainable`
entry; a model whose entry lacks a mode's part is refused that mode, naming the parts it has.

`is_trainable` is the pure rule (a parameter name -> trained or not); `apply_mode` applies a mode
to a policy (on the meta device too, so the memory estimate can count the trainable parameters of
pi0.5 without allocating them: `count_parameters`).

Sources read: LeRobot 0.6.1 (installed package); openpi's and RLinf's, for the LoRA presets, are
named in `pisft.model.pi05.trainable`.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pisft.config import (LEROBOT_FREEZE_FLAGS, LORA_TARGETS, TRAINABLE_MODELS, TrainableMode, is_lora_mode,
                          trainable_mode)
from pisft.config import TRAINABLE_MODES as MODES
from pisft.config import VALUE_TRAINABLE_MODES as VALUE_MODES
from pisft.model import registry
from pisft.model.lora import LoraSpec
from pisft.model.registry import spec_of

__all__ = ["LORA_TARGETS", "MODES", "VALUE_MODES", "LoraSpec"]

if TYPE_CHECKING:
    from torch import nn

    from pisft.model.spec import ModelSpec

_LORA_PARAM = re.compile(r"\.lora_(A|B)\.")
_VALUE_HEAD = re.compile(r"^(readout|head)\.")

# The rule of the parts every model has (`pisft.config.FROZEN_PARTS`): whether a dotted name lies in
# it. The model's own parts ("vision", "vlm" of pi0.5) are its spec's (`TrainableEntry.parts`).
_FROZEN_PARTS = {
    "": lambda _dotted: False,
    "base": lambda _dotted: True,  # all but what the mode adds (adapters, the value model's head)
}


def _part_rule(part: str, model: ModelSpec | None, mode: str):
    """The rule of `part` (what `mode` freezes): every model's, or the model's own (its spec's)."""
    if part in _FROZEN_PARTS:
        return _FROZEN_PARTS[part]
    if model is None:
        raise ValueError(f"mode {mode} freezes the model's part {part!r}: its rule needs the model's spec")
    rule = model.trainable.parts.get(part)
    if rule is None:
        raise ValueError(f"mode {mode} freezes the part {part!r}, which model {model.name!r} does not have "
                         f"(its parts: {', '.join(sorted(model.trainable.parts)) or 'none'})")
    return rule


# ------------------------------------------------------------------------------- LoRA presets
def _offering(targets: str) -> ModelSpec:
    """The registered model whose LoRA presets hold `targets` (pi0.5's: lerobot, openpi, rlinf)."""
    for name in registry.names():
        spec = registry.model_spec(name)
        if targets in spec.trainable.lora_presets:
            return spec
    raise ValueError(f"train.lora_targets: no registered model offers the preset '{targets}'")


def lora_spec(targets: str, rank: int = 0, alpha: float = 0.0, *, value_model: bool = False,
              model: ModelSpec | None = None) -> LoraSpec:
    """The preset `targets` of `model` (its spec's `TrainableEntry.lora`; None: the registered model
    that offers it) with train.lora_rank / train.lora_alpha (0: the preset's own). `value_model`: the
    preset's part on the RECAP value model. pi0.5's presets: `pisft.model.pi05.trainable.lora_preset`."""
    if targets not in LORA_TARGETS:
        raise ValueError(f"train.lora_targets: '{targets}' is not one of {', '.join(LORA_TARGETS)}")
    model = _offering(targets) if model is None else model
    if targets not in model.trainable.lora_presets:
        raise ValueError(f"train.lora_targets: model {model.name!r} has no LoRA preset '{targets}' "
                         f"(it has: {', '.join(model.trainable.lora_presets) or 'none'})")
    return model.trainable.lora(targets, rank, alpha, value_model=value_model)


# ---------------------------------------------------------------------------- the pure rule
def _model(value_model: bool) -> str:
    """The trained model's name in `pisft.config.TRAINABLE_MODELS`: the policy, or the value model."""
    return "value" if value_model else "policy"


def mode_of(mode: str, *, value_model: bool = False) -> TrainableMode:
    """`mode`'s entry in `pisft.config.TRAINABLE_MODE_TABLE` for the policy (or the value model); a
    ValueError naming the modes that model takes if it takes no such mode."""
    return trainable_mode(mode, _model(value_model))


def is_trainable(name: str, mode: str, spec: LoraSpec | None = None, *, value_model: bool = False,
                 model: ModelSpec | None = None) -> bool:
    """Whether parameter `name` (of a policy of `model`, the model's spec, or with `value_model` of the
    RECAP value model, after `apply_mode`'s adapter injection for a LoRA mode) is trained in `mode`.
    `model` may be left out for a mode that freezes nothing or everything (no part of the model's own)."""
    dotted = "." + name
    if value_model and _VALUE_HEAD.match(name):
        return True  # the read-out token and the bin head: new, always trained
    entry = mode_of(mode, value_model=value_model)
    if entry.lora:
        if spec is None:
            raise ValueError(f"mode {mode} needs its LoraSpec")
        if _LORA_PARAM.search(dotted) or spec.trains_in_full(name):
            return True
    return not _part_rule(entry.frozen, model, mode)(dotted)


# ------------------------------------------------------------------------------ applying a mode
@dataclass(frozen=True)
class Applied:
    mode: str
    spec: LoraSpec | None
    trainable: int  # parameters (elements) trained
    total: int

    def record(self) -> dict[str, Any]:
        """What pisft_model.json and the checkpoints record about the mode."""
        out: dict[str, Any] = {"mode": self.mode, "trainable_params": self.trainable, "total_params": self.total}
        if self.spec is not None:
            out["lora"] = {"targets": self.spec.preset, "rank": self.spec.rank, "alpha": self.spec.alpha,
                           "rank_pattern": dict(self.spec.rank_pattern),
                           "alpha_pattern": dict(self.spec.alpha_pattern),
                           "target_modules": self.spec.target_modules,
                           "full_modules": list(self.spec.full_modules)}
        return out


def inject_lora(model: nn.Module, spec: LoraSpec, *, seed: int) -> None:
    """peft's LoRA layers injected in place into `model` (same adapters on every process for one
    `seed`; on the meta device nothing is allocated). openpi's init draws A and B from N(0, 0.01)."""
    import torch
    from peft import inject_adapter_in_model

    meta = any(p.is_meta for p in model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(spec.peft_config(), model, adapter_name="default", low_cpu_mem_usage=meta)
        if spec.init == "openpi" and not meta:
            for name, p in model.named_parameters():
                if _LORA_PARAM.search("." + name):
                    with torch.no_grad():
                        p.normal_(0.0, 0.01)  # openpi lora.LoRAConfig.init_fn: normal(stddev=0.01)


def apply_mode(model: nn.Module, mode: str, spec: LoraSpec | None = None, *, seed: int = 0,
               value_model: bool = False) -> Applied:
    """Apply `mode` to a policy (or the value model): inject LoRA adapters (`lora`), set
    `requires_grad` by `is_trainable`, and keep frozen sub-models in eval mode the way LeRobot does
    (its `train_expert_only` / `freeze_vision_encoder` flags on the module the model spec's
    `freeze_flags` names, pi0.5's `PaliGemmaWithExpertModel`, whose own `train()` puts them back in
    eval mode). Before sharding (FSDP2 keeps requires_grad)."""
    entry = mode_of(mode, value_model=value_model)  # raises, naming the modes
    policy = model.policy if value_model else model
    spec_of_model = spec_of(policy)
    _part_rule(entry.frozen, spec_of_model, mode)  # raises for a part the model does not have
    flags = spec_of_model.trainable.freeze_flags  # None: no LeRobot flags, pisft's rule alone freezes
    holder = flags(policy) if flags is not None else None
    if entry.lora:
        if spec is None:
            raise ValueError(f"mode {mode} needs its LoraSpec (trainable.lora_spec)")
        inject_lora(model, spec, seed=seed)
    # LeRobot's flags, as the mode says (a model directory's config.json must not leak its own).
    for flag in LEROBOT_FREEZE_FLAGS if holder is not None else ():
        setattr(holder, flag, flag == entry.lerobot_flag)
    if entry.lerobot_flag and holder is not None:
        holder._set_requires_grad()  # noqa: SLF001 - LeRobot's own freezing (and eval) of the VLM / vision tower
    trained = total = 0
    for name, p in model.named_parameters():
        want = is_trainable(name, mode, spec, value_model=value_model, model=spec_of_model)
        if entry.lerobot_flag and holder is not None and not want and p.requires_grad:
            raise RuntimeError(f"{name}: LeRobot's _set_requires_grad left it trainable but pisft's rule "
                               f"freezes it in mode {mode} (LeRobot changed?)")
        p.requires_grad_(want)
        total += p.numel()
        trained += p.numel() if want else 0
    if entry.lora and not any(_LORA_PARAM.search("." + n) for n, _ in model.named_parameters()):
        raise RuntimeError(f"train.lora_targets: {spec.preset}: no module matched {spec.target_modules}")
    frozen = spec_of_model.prefix_frozen(policy)
    if entry.prefix_frozen is not None and frozen != entry.prefix_frozen:
        raise RuntimeError(f"mode {mode}: its entry says the VLM prefix is {'' if entry.prefix_frozen else 'not '}"
                           f"frozen, but {'every' if frozen else 'some'} VLM parameter is "
                           f"{'frozen' if frozen else 'trainable'} (pisft.config.TRAINABLE_MODE_TABLE)")
    model.train(model.training)  # LeRobot's train(): frozen sub-models back in eval mode
    return Applied(mode, spec, trained, total)


def apply_training_layout(model: nn.Module, mode: str, spec: LoraSpec | None, *, precision: str, seed: int = 0,
                          value_model: bool = False) -> tuple[Applied, int]:
    """The trained model's layout for `mode`, as every training run and every measurement of one
    builds it: the mode applied (`apply_mode`), a policy's decoder projections fused where a group
    trains or freezes as one (`pi05.fused.fuse_decoder_projections`; the value model's VLM
    runs LeRobot's own forward, never fused), frozen parameters held in the training precision
    (`hold_frozen_in`). Before sharding. Returns (the mode applied, the parameters cast to bf16)."""
    applied = apply_mode(model, mode, spec, seed=seed, value_model=value_model)
    if not value_model:
        spec_of(model).fuse_projections(model)
    return applied, hold_frozen_in(model, precision)


def hold_frozen_in(model: nn.Module, precision: str) -> int:
    """Hold frozen parameters in the training precision: under bf16 they are cast to bf16 (no
    fp32 master copy is needed for what the optimizer never updates), except those LeRobot keeps
    in float32 (the model spec's `TrainableEntry.keep_fp32`). Returns the number of parameters cast.
    Before sharding."""
    import torch

    if precision != "bf16":
        return 0
    keep_fp32 = spec_of(model).trainable.keep_fp32
    cast = 0
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if p.requires_grad or id(p) in seen or p.dtype != torch.float32 or any(k in name for k in keep_fp32):
            continue
        seen.add(id(p))
        p.data = p.data.to(torch.bfloat16)
        cast += p.numel()
    return cast


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Trainable and total parameters (elements; tied tensors once); works on the meta device."""
    seen: set[int] = set()
    out = {"trainable": 0, "frozen": 0, "total": 0}
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        out["total"] += p.numel()
        out["trainable" if p.requires_grad else "frozen"] += p.numel()
    return out


def spec_for_mode(mode: str, targets: str) -> LoraSpec | None:
    """The LoraSpec of the policy's `mode` with the target preset `targets` at its own rank and alpha,
    or None when the mode is not a LoRA mode (the benchmarks, which take a mode and a preset, not a
    config)."""
    return lora_spec(targets) if is_lora_mode(mode, "policy") else None


def mode_key(*, value_model: bool = False) -> str:
    """The key that sets what a run trains: train.trainable for the policy, recap.value_trainable for
    the value model (`pisft.config.TRAINABLE_MODELS`)."""
    return TRAINABLE_MODELS[_model(value_model)]


def configured_mode(cfg, *, value_model: bool = False) -> str:
    """The trainable mode `cfg` sets for the policy (or the value model): `mode_key`'s value."""
    return operator.attrgetter(mode_key(value_model=value_model))(cfg)


def spec_for(cfg, *, value_model: bool = False) -> LoraSpec | None:
    """The LoraSpec of a config (train.lora_*), or None when the mode is not a LoRA mode."""
    mode = configured_mode(cfg, value_model=value_model)
    if not is_lora_mode(mode, _model(value_model)):
        return None
    t = cfg.train
    return lora_spec(t.lora_targets, t.lora_rank, t.lora_alpha, value_model=value_model,
                     model=registry.spec_for_preset(cfg.model.preset))
