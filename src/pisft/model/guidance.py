"""Classifier-free guidance of an advantage-conditioned pi0.5 (`eval.cfg_scale`, `serve --cfg-scale`).

The rule is RLinf's (`rlinf/models/embodiment/openpi_cfg/openpi_cfg_action_model.py`,
`sample_actions` with `cfgrl_guidance_scale` w): at every flow-matching denoising step the
velocity is

    v = (1 - w) * v_uncond + w * v_cond

where v_cond is the velocity under the positive prompt (`"<task>\\nAdvantage: positive"`) and
v_uncond under the plain task prompt, both at the same x_t and t, starting from the same noise.

- w = 1 is the positive prompt alone: pisft then runs LeRobot's sampler untouched, one forward
  pass per step (RLinf computes both branches and weights the plain one by 0).
- w > 1: ONE forward pass of a DOUBLED batch per step. The request is stacked with itself, the
  first half prompted with the positive prompt and the second with the plain task
  (`doubled_batch`); the noise is repeated, so both halves start from the same x_1. LeRobot's
  `sample_actions` embeds both prefixes and keeps their KV cache in one pass; at every step
  (`pi05.chunk.velocity_hook`) the two halves' velocities are blended and the blend is
  given to both halves, so they stay identical and share the noise and the time schedule; the
  first half is the guided chunk. Cost: about twice the compute per chunk (the SigLIP image
  embedding, the prefix pass and each step's expert pass all run on 2 rows per request).
- A model trained without advantage prompts has no conditioned branch: the scale does not
  apply (`applied_scale` is 1) and the records say so (`record`, `note`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pisft.errors import PisftError
from pisft.model.pi05.chunk import velocity_hook

SOURCE = ("RLinf cfgrl_guidance_scale (rlinf/models/embodiment/openpi_cfg/openpi_cfg_action_model.py): "
          "v = (1 - w) * v_uncond + w * v_cond at every denoising step")
METHOD = "one forward pass of a doubled batch (positive prompt | plain task) per denoising step"


def check_scale(scale: float, where: str = "eval.cfg_scale") -> float:
    """The scale as a float; a PisftError naming `where` when it is not a finite number >= 1."""
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise PisftError(f"{where}: the guidance scale must be a number >= 1, got {scale!r}") from None
    if not math.isfinite(value) or value < 1.0:
        raise PisftError(f"{where}: the guidance scale must be a finite number >= 1 (1: the positive "
                         f"prompt alone; RLinf's default), got {scale!r}")
    return value


def applied_scale(scale: float, conditioning: Any) -> float:
    """The scale that takes effect: `scale` for an advantage-conditioned model, else 1."""
    return float(scale) if conditioning.conditioned else 1.0


def note(scale: float, conditioning: Any) -> str | None:
    """One line when a requested scale is ignored (the model has no conditioned prompt)."""
    if conditioning.conditioned or float(scale) == 1.0:
        return None
    return (f"cfg_scale {float(scale):g} ignored: the model was trained on plain task prompts "
            f"(no advantage conditioning), so there is no conditioned velocity to guide with")


def describe(scale: float, conditioning: Any) -> str:
    """One sentence for reports and logs."""
    if not conditioning.conditioned:
        return note(scale, conditioning) or "no guidance (the model is not advantage-conditioned)"
    if float(scale) == 1.0:
        return "guidance scale 1: the positive prompt alone (one forward pass per denoising step)"
    return (f"classifier-free guidance, scale {float(scale):g}: v = (1 - w)·v_uncond + w·v_cond with the "
            f"plain task prompt as the unconditioned branch ({METHOD})")


def record(scale: float, conditioning: Any) -> dict[str, Any]:
    """What metrics, reports and serve's metadata record about guidance."""
    used = applied_scale(scale, conditioning)
    return {"cfg_scale": used, "cfg_scale_requested": float(scale), "guided": used != 1.0,
            "note": note(scale, conditioning), "method": METHOD if used != 1.0 else None,
            "source": SOURCE, "describe": describe(scale, conditioning)}


def doubled_batch(batch: dict, unconditioned_tasks: Sequence[str]) -> dict:
    """`batch` stacked with itself: rows [0, B) keep `batch["task"]` (the conditioned prompts),
    rows [B, 2B) get `unconditioned_tasks`. Tensors with a batch dimension and per-row lists are
    repeated; anything else is kept as is."""
    tasks = list(batch["task"])
    n = len(tasks)
    if len(unconditioned_tasks) != n:
        raise ValueError(f"{len(unconditioned_tasks)} unconditioned prompts for a batch of {n}")
    out: dict = {}
    for key, value in batch.items():
        if key == "task":
            out[key] = tasks + list(unconditioned_tasks)
        elif isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == n:
            out[key] = torch.cat([value, value])
        elif isinstance(value, (list, tuple)) and len(value) == n:
            out[key] = list(value) + list(value)
        else:
            out[key] = value
    return out


def blend(scale: float, n: int | None = None) -> Callable:
    """The `velocity_hook` hook: the doubled batch's step velocity -> the guided velocity, for
    both halves. `n`: the requests (rows [0, n) conditioned, [n, 2n) plain); rows after 2n (a
    compiled chunk pads the batch to its bucket, `pisft.policy.compiled`) keep their own velocity
    and are dropped after. None: the batch is exactly the two halves."""
    w = float(scale)

    def hook(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        def guided(x_t: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
            v = velocity(x_t, timestep)
            half = v.shape[0] // 2 if n is None else n
            v_cond, v_uncond, rest = v[:half], v[half:2 * half], v[2 * half:]
            v = (1.0 - w) * v_uncond + w * v_cond  # RLinf's cfgrl_guidance_scale rule
            return torch.cat([v, v, rest])
        return guided

    return hook


@torch.no_grad()
def predict_normalized(policy, preprocessor, batch: dict, unconditioned_tasks: Sequence[str],
                       noise: torch.Tensor, scale: float, **rtc: Any) -> torch.Tensor:
    """Guided, normalised action chunks (B, chunk, action_dim) of a raw batch whose `task` holds
    the conditioned prompts; `noise` (B, chunk, max_action_dim) on the policy's device. `rtc`:
    real-time chunking's `inference_delay` and `prev_chunk_left_over` (B, T, A), given to both
    halves (`pisft.policy.rtc`)."""
    n = noise.shape[0]
    processed = preprocessor(doubled_batch(batch, unconditioned_tasks))
    if rtc.get("prev_chunk_left_over") is not None:
        rtc = {**rtc, "prev_chunk_left_over": torch.cat([rtc["prev_chunk_left_over"]] * 2)}
    with velocity_hook(policy, blend(scale, n)):
        normalized = policy.predict_action_chunk(processed, noise=torch.cat([noise, noise]), **rtc)
    return normalized[:n]
