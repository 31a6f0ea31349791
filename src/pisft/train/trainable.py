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
there, and one freezing a new part adds that part's rule to `_FROZEN_PARTS` here.

`is_trainable` is the pure rule (a parameter name -> trained or not); `apply_mode` applies a mode
to a policy (on the meta device too, so the memory estimate can count the trainable parameters of
pi0.5 without allocating them: `count_parameters`).

Sources read (commits): openpi Physical-Intelligence/openpi@15a9616a00943ada6c20a0f158e3adb39df2ccac
(`src/openpi/models/gemma.py` variants `gemma_2b_lora`, `gemma_300m_lora`; `src/openpi/models/lora.py`;
`src/openpi/models/pi0_config.py` `get_freeze_filter`; `src/openpi/training/config.py`
`pi0_libero_low_mem_finetune`); RLinf RLinf/RLinf@a3816b596478dcd8a5c69a6ec1468c9519f77b5b
(`rlinf/models/__init__.py`, the `cfg.is_lora` branch); LeRobot 0.6.1 (installed package).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pisft.config import (LEROBOT_FREEZE_FLAGS, LORA_TARGETS, TRAINABLE_MODELS, TrainableMode, is_lora_mode,
                          trainable_mode)
from pisft.config import TRAINABLE_MODES as MODES
from pisft.config import VALUE_TRAINABLE_MODES as VALUE_MODES
from pisft.model.pi05.parts import (EXPERT, EXPERT_LAYERS, EXPERT_NAME, PALIGEMMA, PALIGEMMA_WITH_EXPERT, PROJECTOR,
                                    VISION_TOWER, VLM_LAYERS, below, in_core, lerobot_targets, part)
from pisft.model.pi05.precision import LEROBOT_FP32
from pisft.model.registry import spec_of

__all__ = ["LORA_TARGETS", "MODES", "VALUE_MODES"]

if TYPE_CHECKING:
    from torch import nn

# Name fragments (dotted module paths inside a LeRobot PI05Policy, or the value model's `policy.`).
_VLM = f".{in_core(PALIGEMMA)}."  # LeRobot: `self.paligemma.parameters()` (train_expert_only)
_VISION = f".{in_core(VISION_TOWER)}."  # LeRobot: freeze_vision_encoder
_LORA_PARAM = re.compile(r"\.lora_(A|B)\.")
_VALUE_HEAD = re.compile(r"^(readout|head)\.")

# The rule of each part a mode freezes (`pisft.config.FROZEN_PARTS`): whether a dotted name lies in it.
_FROZEN_PARTS = {
    "": lambda _dotted: False,
    "vision": lambda dotted: _VISION in dotted,
    "vlm": lambda dotted: _VLM in dotted,
    "base": lambda _dotted: True,  # all but what the mode adds (adapters, the value model's head)
}

# The parameters LeRobot keeps in float32 when a pi0.5 is built in bfloat16
# (`PaliGemmaWithExpertModel.to_bfloat16_for_selected_params`, `params_to_keep_float32`): frozen
# parameters are held in bf16 under train.precision=bf16 (`hold_frozen_in`), except these.
KEEP_FP32 = LEROBOT_FP32


# ------------------------------------------------------------------------------- LoRA presets
# Linear layers of a Gemma decoder layer (LeRobot/transformers names; openpi's einsums
# q/kv/qkv_einsum + attn_vec_einsum are q/k/v/o_proj, its FeedForward gating_einsum + linear are
# gate/up/down_proj).
_GEMMA_LINEARS = r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
_VLM_LAYERS = re.escape(in_core(VLM_LAYERS)) + r"\.\d+\."
_EXPERT_LAYERS = re.escape(in_core(EXPERT_LAYERS)) + r"\.\d+\."
_EXPERT_ANYWHERE = rf".*{EXPERT_NAME}\..*"  # a module of the action expert, at any depth
_PROJECTION_MODULES = ("model.action_in_proj", "model.action_out_proj", "model.time_mlp_in", "model.time_mlp_out")
# RLinf's target list (`rlinf/models/__init__.py`): proj, qkv, fc1, fc2, q, kv, fc3, out_proj,
# q_proj ... down_proj, lm_head, applied to PaliGemma (`PALIGEMMA`) only. Of these,
# PaliGemma (transformers 5.5.4) has q/k/v/o_proj and gate/up/down_proj (Gemma), q/k/v/out_proj and
# fc1/fc2 (SigLIP); proj, qkv, q, kv, fc3 name no module of it. lm_head is left out: pi0.5 never
# calls the VLM's LM head (tied to the token embedding), so its adapter would get no gradient.
_RLINF_SUFFIXES = r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|out_proj|fc1|fc2)"


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA target preset resolved: what peft adapts, with which rank, and what trains in full."""

    preset: str
    target_modules: str  # a regex peft full-matches against module names
    rank: int
    alpha: float
    rank_pattern: dict[str, int] = field(default_factory=dict)  # peft: regex -> rank
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    init: str = "peft"  # peft (A kaiming-uniform, B zero) | gaussian (peft's) | openpi (A, B ~ N(0, 0.01))
    # Modules trained in full beside the adapters: dotted suffixes of module names (PEFT's
    # `modules_to_save` matching, `key.endswith(name)`; the adapter export lists them so).
    full_modules: tuple[str, ...] = ()

    def trains_in_full(self, name: str) -> bool:
        dotted = "." + name
        return any(f".{m}." in dotted for m in self.full_modules)

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=self.target_modules,
                          rank_pattern=dict(self.rank_pattern), alpha_pattern=dict(self.alpha_pattern),
                          lora_dropout=0.0, bias="none",
                          init_lora_weights="gaussian" if self.init == "gaussian" else True)

    def scaling(self, module_name: str) -> float:
        """alpha / rank of the adapter on `module_name` (peft's `scaling`, not rank-stabilised)."""
        from peft.utils.other import get_pattern_key

        rank = self.rank_pattern.get(get_pattern_key(self.rank_pattern, module_name), self.rank)
        alpha = self.alpha_pattern.get(get_pattern_key(self.alpha_pattern, module_name), self.alpha)
        return alpha / rank


# LeRobot's defaults (`lerobot/configs/default.py` PeftConfig: r = 16, lora_alpha None, which
# leaves peft's LoraConfig default lora_alpha = 8).
LEROBOT_RANK, LEROBOT_ALPHA = 16, 8.0
# openpi: gemma_2b_lora rank 16 alpha 16 on the VLM, gemma_300m_lora rank 32 alpha 32 on the expert.
OPENPI_VLM_RANK, OPENPI_EXPERT_RANK = 16, 32
RLINF_RANK = 32  # RLinf's seed config (`actor.model.lora_rank: 32`); lora_alpha = lora_rank


def lora_spec(targets: str, rank: int = 0, alpha: float = 0.0, *, value_model: bool = False) -> LoraSpec:
    """The preset `targets` (lerobot | openpi | rlinf) with train.lora_rank / train.lora_alpha
    (0: the preset's own; a rank given replaces every rank of the preset; alpha 0 is LeRobot's 8
    for `lerobot`, the rank for `openpi` and `rlinf`, as they set it).

    `value_model`: the preset's VLM part on the RECAP value model (no action expert there; names
    start with `policy.`). `lerobot` adapts only the expert and the projections: refused."""
    if targets not in LORA_TARGETS:
        raise ValueError(f"train.lora_targets: '{targets}' is not one of {', '.join(LORA_TARGETS)}")
    lead = r"(.*\.)?"
    if targets == "lerobot":
        if value_model:
            raise ValueError("train.lora_targets: lerobot adapts only the action expert and the action "
                             "projections, which the value model does not have; use openpi or rlinf")
        r = rank or LEROBOT_RANK
        return LoraSpec("lerobot", lerobot_targets(), r, alpha or LEROBOT_ALPHA)
    if targets == "openpi":
        # gemma.py: LoRA on attention (q, kv, attn_vec einsums) and MLP (gating, linear) of each
        # Gemma; pi0_config.get_freeze_filter: frozen = `.*llm.*` and not `.*lora.*` (both Gemmas:
        # embedding, layers, norms); trained in full: everything outside the LLM, i.e. SigLIP (`img`)
        # with its head and the action/time projections. openpi's attention adapters are per head
        # (lora.Einsum on (heads, D, H) with axes (-2, -1)): N heads x rank r there, one rank-r
        # adapter per projection here (peft's lora.Linear), fewer parameters for the same modules.
        vlm_rank = rank or OPENPI_VLM_RANK
        expert_rank = rank or OPENPI_EXPERT_RANK
        layers = _VLM_LAYERS if value_model else f"({_VLM_LAYERS}|{_EXPERT_LAYERS})"
        rank_pattern = {} if value_model or rank else {_EXPERT_ANYWHERE: expert_rank}
        alpha_pattern = ({} if value_model or alpha or rank
                         else {_EXPERT_ANYWHERE: float(expert_rank)})
        full = (*(below(path, PALIGEMMA_WITH_EXPERT)
                  for path in (VISION_TOWER, PROJECTOR)),
                *(() if value_model else _PROJECTION_MODULES))
        return LoraSpec("openpi", f"{lead}{layers}{_GEMMA_LINEARS}", vlm_rank, alpha or float(vlm_rank),
                        rank_pattern, alpha_pattern, init="openpi", full_modules=full)
    # rlinf: get_peft_model on paligemma only (r = alpha = lora_rank, gaussian init, no dropout);
    # the action expert and the projections keep requires_grad and train in full.
    r = rank or RLINF_RANK
    full = () if value_model else (in_core(EXPERT), *_PROJECTION_MODULES)
    vlm = re.escape(in_core(PALIGEMMA))
    return LoraSpec("rlinf", rf"{lead}{vlm}\..*\.{_RLINF_SUFFIXES}", r,
                    alpha or float(r), init="gaussian", full_modules=full)


# ---------------------------------------------------------------------------- the pure rule
def _model(value_model: bool) -> str:
    """The trained model's name in `pisft.config.TRAINABLE_MODELS`: the policy, or the value model."""
    return "value" if value_model else "policy"


def mode_of(mode: str, *, value_model: bool = False) -> TrainableMode:
    """`mode`'s entry in `pisft.config.TRAINABLE_MODE_TABLE` for the policy (or the value model); a
    ValueError naming the modes that model takes if it takes no such mode."""
    return trainable_mode(mode, _model(value_model))


def is_trainable(name: str, mode: str, spec: LoraSpec | None = None, *, value_model: bool = False) -> bool:
    """Whether parameter `name` (of a PI05Policy, or with `value_model` of the RECAP value model,
    after `apply_mode`'s adapter injection for a LoRA mode) is trained in `mode`."""
    dotted = "." + name
    if value_model and _VALUE_HEAD.match(name):
        return True  # the read-out token and the bin head: new, always trained
    entry = mode_of(mode, value_model=value_model)
    if entry.lora:
        if spec is None:
            raise ValueError(f"mode {mode} needs its LoraSpec")
        if _LORA_PARAM.search(dotted) or spec.trains_in_full(name):
            return True
    return not _FROZEN_PARTS[entry.frozen](dotted)


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


def _pwe(model: nn.Module, value_model: bool) -> nn.Module:
    policy = model.policy if value_model else model
    return part(policy, PALIGEMMA_WITH_EXPERT)


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
    """Apply `mode` to a PI05Policy (or the value model): inject LoRA adapters (`lora`), set
    `requires_grad` by `is_trainable`, and keep frozen sub-models in eval mode the way LeRobot does
    (its `train_expert_only` / `freeze_vision_encoder` flags on `PaliGemmaWithExpertModel`, whose
    own `train()` puts them back in eval mode). Before sharding (FSDP2 keeps requires_grad)."""
    entry = mode_of(mode, value_model=value_model)  # raises, naming the modes
    pwe = _pwe(model, value_model)
    if entry.lora:
        if spec is None:
            raise ValueError(f"mode {mode} needs its LoraSpec (trainable.lora_spec)")
        inject_lora(model, spec, seed=seed)
    # LeRobot's flags, as the mode says (a model directory's config.json must not leak its own).
    for flag in LEROBOT_FREEZE_FLAGS:
        setattr(pwe, flag, flag == entry.lerobot_flag)
    if entry.lerobot_flag:
        pwe._set_requires_grad()  # noqa: SLF001 - LeRobot's own freezing (and eval) of the VLM / vision tower
    trained = total = 0
    for name, p in model.named_parameters():
        want = is_trainable(name, mode, spec, value_model=value_model)
        if entry.lerobot_flag and not want and p.requires_grad:
            raise RuntimeError(f"{name}: LeRobot's _set_requires_grad left it trainable but pisft's rule "
                               f"freezes it in mode {mode} (LeRobot changed?)")
        p.requires_grad_(want)
        total += p.numel()
        trained += p.numel() if want else 0
    if entry.lora and not any(_LORA_PARAM.search("." + n) for n, _ in model.named_parameters()):
        raise RuntimeError(f"train.lora_targets: {spec.preset}: no module matched {spec.target_modules}")
    policy = model.policy if value_model else model
    frozen = spec_of(policy).prefix_frozen(policy)
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
    in float32 (`KEEP_FP32`). Returns the number of parameters cast. Before sharding."""
    import torch

    if precision != "bf16":
        return 0
    cast = 0
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if p.requires_grad or id(p) in seen or p.dtype != torch.float32 or any(k in name for k in KEEP_FP32):
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
    return lora_spec(t.lora_targets, t.lora_rank, t.lora_alpha, value_model=value_model)
