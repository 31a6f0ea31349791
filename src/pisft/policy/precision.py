"""The inference precision (`eval.precision`, `serve --precision`): bf16 where openpi runs bf16.

- `bf16`: the model in bf16 with float32 kept only where openpi keeps it (`pisft.model.pi05` 10.,
  `openpi_bf16`): SigLIP's patch and position embeddings, every RMSNorm (with the action expert's
  adaptive-norm projections) and the action/time projections. LeRobot's bf16 load keeps the whole
  vision tower and the multi-modal projector in float32 too (a training concern: its optimizer);
  on pi0.5 0.41B parameters whose matrix products ran in float32 at inference (issue 46's H200
  profile: 26 of 68 ms of GPU time in fp32 GEMM kernels). pi0.5 then holds 0.12B parameters in
  float32 instead of 0.53B: the expert's adaptive-norm projections (0.117B), the time MLP, SigLIP's
  embeddings, the norms.
- `fp32`: everything in float32 (LeRobot's `precision="float32"`).
- `auto` (the default): bf16 on an accelerator, as openpi serves every model
  (src/openpi/policies/policy_config.py @ 15a9616: `to_bfloat16_for_selected_params("bfloat16")`
  on a PyTorch checkpoint, `restore_params(..., dtype=jnp.bfloat16)` on a JAX one); on the CPU
  the precision the model directory records (`config.json` `dtype`: a fine-tuned model float32,
  `model.source: random` bf16), so the CPU's figures stay those of the model as trained.

`auto` is a rule, not a measurement: bf16 and float32 compute different actions (beyond the compiled
chunk's tolerance), so a choice that followed timing would make a stage's figures follow it too. It
is recorded as `eval.compile`'s decision is (`apply`'s record, in every stage's output and in what
`serve` prints): the setting, what it chose, why, and `decided_by` (`rule` for auto).

`layout="lerobot"` keeps LeRobot's own bf16 layout instead of openpi's: only to measure what the
change moves (tests/test_eval_offline.py, `bench --only inference`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pisft import device as device_mod
from pisft.config import INFERENCE_PRECISIONS
from pisft.errors import PisftError
from pisft.model.registry import spec_of

LAYOUTS = ("openpi", "lerobot")


@dataclass(frozen=True)
class PrecisionChoice:
    dtype: str  # what `load_policy` builds: "bfloat16" or "float32"
    layout: str  # bf16: "openpi" or "lerobot"; float32: "float32"
    why: str
    setting: str = "bf16"  # eval.precision as given (auto, bf16, fp32)

    @property
    def bf16(self) -> bool:
        return self.dtype == "bfloat16"


def choose(setting: str, kind: str, model_dtype: str, *, layout: str = "openpi") -> PrecisionChoice:
    """`eval.precision` on a device of `kind` for a model whose config.json says `model_dtype`."""
    if setting not in INFERENCE_PRECISIONS:
        raise PisftError(f"eval.precision: '{setting}' is not one of {', '.join(INFERENCE_PRECISIONS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if setting == "auto":
        if device_mod.row(kind).bf16_inference:
            dtype, why = "bfloat16", f"eval.precision auto: bf16 on {kind} (openpi's inference precision)"
        else:
            dtype = "bfloat16" if model_dtype == "bfloat16" else "float32"
            why = f"eval.precision auto: the model's own on the CPU ({model_dtype})"
    else:
        dtype = "bfloat16" if setting == "bf16" else "float32"
        why = f"eval.precision {setting}"
    if dtype == "float32":
        return PrecisionChoice("float32", "float32", why, setting)
    return PrecisionChoice("bfloat16", layout, why + ("" if layout == "openpi" else "; LeRobot's bf16 layout"),
                           setting)


def apply(policy, choice: PrecisionChoice) -> dict[str, Any]:
    """Lay a policy built in `choice.dtype` out as `choice` says; what runs in float32 (a record)."""
    if choice.bf16 and choice.layout == "openpi":
        spec_of(policy).bf16_layout(policy)
    return {"setting": choice.setting, "dtype": choice.dtype, "layout": choice.layout, "why": choice.why,
            "decided_by": "rule" if choice.setting == "auto" else "setting",
            "float32_parameters": spec_of(policy).float32_parts(policy)}
