"""pi0.5's side of the trainable modes (15.; pisft.train.trainable applies them): the rule of each part
a mode freezes (`PARTS`), its LoRA target presets (`lora_preset`, train.lora_targets), the module
holding LeRobot's freezing flags (`freeze_flags`) and what LeRobot keeps in float32 (`KEEP_FP32`).

Numbers (5., 9., ...) are the items of the package's docstring (`pisft.model.pi05`).

Sources read (commits): openpi Physical-Intelligence/openpi@15a9616a00943ada6c20a0f158e3adb39df2ccac
(`src/openpi/models/gemma.py` variants `gemma_2b_lora`, `gemma_300m_lora`; `src/openpi/models/lora.py`;
`src/openpi/models/pi0_config.py` `get_freeze_filter`; `src/openpi/training/config.py`
`pi0_libero_low_mem_finetune`); RLinf RLinf/RLinf@a3816b596478dcd8a5c69a6ec1468c9519f77b5b
(`rlinf/models/__init__.py`, the `cfg.is_lora` branch); LeRobot 0.6.1 (installed package).
"""

from __future__ import annotations

import re
from typing import Any

from pisft.model.lora import LoraSpec
from pisft.model.pi05.parts import (EXPERT, EXPERT_LAYERS, EXPERT_NAME, PALIGEMMA, PALIGEMMA_WITH_EXPERT, PROJECTOR,
                                    VISION_TOWER, VLM_LAYERS, below, in_core, lerobot_targets, part)
from pisft.model.pi05.precision import LEROBOT_FP32

# Name fragments (dotted module paths inside a LeRobot PI05Policy, or the value model's `policy.`).
_VLM = f".{in_core(PALIGEMMA)}."  # LeRobot: `self.paligemma.parameters()` (train_expert_only)
_VISION = f".{in_core(VISION_TOWER)}."  # LeRobot: freeze_vision_encoder

# The rule of each part of pi0.5 a mode freezes (`pisft.config.FROZEN_PARTS`; "" nothing and "base"
# everything are every model's, pisft.train.trainable): whether a dotted name ("." + a parameter's
# name) lies in it.
PARTS = {
    "vision": lambda dotted: _VISION in dotted,
    "vlm": lambda dotted: _VLM in dotted,
}

# The parameters LeRobot keeps in float32 when a pi0.5 is built in bfloat16
# (`PaliGemmaWithExpertModel.to_bfloat16_for_selected_params`, `params_to_keep_float32`): frozen
# parameters are held in bf16 under train.precision=bf16 (pisft.train.trainable.hold_frozen_in), except these.
KEEP_FP32 = LEROBOT_FP32


def freeze_flags(policy: Any) -> Any:
    """The module holding LeRobot's freezing flags (`freeze_vision_encoder`, `train_expert_only`) and
    its `_set_requires_grad`: the `PaliGemmaWithExpertModel`."""
    return part(policy, PALIGEMMA_WITH_EXPERT)


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

# LeRobot's defaults (`lerobot/configs/default.py` PeftConfig: r = 16, lora_alpha None, which
# leaves peft's LoraConfig default lora_alpha = 8).
LEROBOT_RANK, LEROBOT_ALPHA = 16, 8.0
# openpi: gemma_2b_lora rank 16 alpha 16 on the VLM, gemma_300m_lora rank 32 alpha 32 on the expert.
OPENPI_VLM_RANK, OPENPI_EXPERT_RANK = 16, 32
RLINF_RANK = 32  # RLinf's seed config (`actor.model.lora_rank: 32`); lora_alpha = lora_rank
LORA_PRESETS = ("lerobot", "openpi", "rlinf")  # the train.lora_targets presets pi0.5 offers


def lora_preset(targets: str, rank: int = 0, alpha: float = 0.0, *, value_model: bool = False) -> LoraSpec:
    """The preset `targets` (lerobot | openpi | rlinf) with train.lora_rank / train.lora_alpha
    (0: the preset's own; a rank given replaces every rank of the preset; alpha 0 is LeRobot's 8
    for `lerobot`, the rank for `openpi` and `rlinf`, as they set it).

    `value_model`: the preset's VLM part on the RECAP value model (no action expert there; names
    start with `policy.`). `lerobot` adapts only the expert and the projections: refused."""
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
    if targets != "rlinf":
        raise ValueError(f"train.lora_targets: pi0.5 has no preset '{targets}' (it has {', '.join(LORA_PRESETS)})")
    # rlinf: get_peft_model on paligemma only (r = alpha = lora_rank, gaussian init, no dropout);
    # the action expert and the projections keep requires_grad and train in full.
    r = rank or RLINF_RANK
    full = () if value_model else (in_core(EXPERT), *_PROJECTION_MODULES)
    vlm = re.escape(in_core(PALIGEMMA))
    return LoraSpec("rlinf", rf"{lead}{vlm}\..*\.{_RLINF_SUFFIXES}", r,
                    alpha or float(r), init="gaussian", full_modules=full)
