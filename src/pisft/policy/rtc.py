"""Real-time chunking through LeRobot's own RTC (LeRobot 0.6.1; the model's spec turns it on:
`pisft.model.pi05.rtc` for pi0.5).

A robot that asks for its next chunk while it still executes the current one keeps executing
that one for the `delay` control steps the inference takes. RTC (Black et al., "Real-Time
Execution of Action Chunking Flow Policies", 2025) denoises the next chunk as an inpainting of
the current one's unexecuted rest: LeRobot's `RTCProcessor.denoise_step` pulls each Euler step's
predicted chunk towards that rest with prefix weights 1 over the first `delay` actions, falling
to 0 at `execution_horizon` (`schedule`: LeRobot's `RTCAttentionSchedule`), scaled by a guidance
weight clamped at `max_guidance_weight`. pisft turns it on through LeRobot's interface, never a
copy: `PI05Config.rtc_config` (an `RTCConfig`), `PI05Policy.init_rtc_processor()`, and
`predict_action_chunk(..., inference_delay=, prev_chunk_left_over=)`.

The defaults are LeRobot's `RTCConfig` (lerobot/policies/rtc/configuration_rtc.py):
execution_horizon 10, max_guidance_weight 10.0, prefix_attention_schedule LINEAR.

The leftover (`prev_chunk_left_over`) is in the model's normalised space, as LeRobot's own RTC
engine keeps it (`lerobot/rollout/inference/rtc.py`: the chunk before the postprocessor). pisft's
callers hold raw actions (what the robot executes, what `serve` answered); `chunk_kwargs`
normalises them with the preprocessor's own `NormalizerProcessorStep`, as LeRobot re-expresses a
leftover it holds in robot units (`lerobot/policies/rtc/relative.py`,
`reanchor_relative_rtc_prefix`). Quantile normalisation is affine and unclamped, so that is the
model's chunk to float32 rounding.

Rows of one forward must share the delay and the leftover's length (LeRobot's RTC takes one
`inference_delay` and caps the guidance window at the leftover's length): `group_key` groups them
(`pisft.policy.libero.LiberoPolicy.predict_many`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

# LeRobot 0.6.1's RTCConfig defaults (lerobot/policies/rtc/configuration_rtc.py), one constant in pisft.config
from pisft.config import LEROBOT_RTC_DEFAULTS as LEROBOT_DEFAULTS

if TYPE_CHECKING:
    import torch

# torch is imported by the functions that run the model's RTC, not by this module: `RtcSettings` is
# read by the closed loop's settings (pisft.rollout.settings), which every LIBERO environment
# process imports, and those processes never need torch (its import is 2-4 CPU s a process).

# A request's raw leftover of its previous chunk (T, action_dim) and the delay in control steps
# (pisft.policy.libero's module docstring); the prepared request holds both under RTC_KEY.
RTC_PREV_KEY = "rtc/prev_actions"
RTC_DELAY_KEY = "rtc/delay_steps"
RTC_KEY = "pisft.rtc"


@dataclass(frozen=True)
class RtcSettings:
    execution_horizon: int = LEROBOT_DEFAULTS["execution_horizon"]
    max_guidance_weight: float = LEROBOT_DEFAULTS["max_guidance_weight"]
    schedule: str = LEROBOT_DEFAULTS["schedule"]

    @classmethod
    def from_config(cls, rtc: Any) -> RtcSettings:
        """`eval.rtc`'s guidance keys."""
        return cls(int(rtc.execution_horizon), float(rtc.max_guidance_weight), str(rtc.schedule))

    def record(self, source: str) -> dict[str, Any]:
        """What a run records of its RTC; `source`: the model's RTC implementation (`ModelSpec.rtc_source`)."""
        return {"enabled": True, **asdict(self), "lerobot_defaults": dict(LEROBOT_DEFAULTS), "source": source}


def configure(policy, settings: RtcSettings) -> None:
    """LeRobot's RTC on `policy` (its `RTCConfig` and `RTCProcessor`), as the policy's model spec
    turns it on."""
    from pisft.model.registry import spec_of

    spec_of(policy).configure_rtc(policy, settings)


def normalized(predictor, actions: torch.Tensor) -> torch.Tensor:
    """Raw actions (..., action_dim) in the model's normalised space (the preprocessor's
    `NormalizerProcessorStep`, module docstring)."""
    import torch
    from lerobot.processor import NormalizerProcessorStep, TransitionKey, create_transition

    step = next((s for s in getattr(predictor.preprocessor, "steps", ())
                 if isinstance(s, NormalizerProcessorStep)), None)
    if step is None:
        raise ValueError("the preprocessor has no NormalizerProcessorStep to normalise an RTC leftover")
    out = step(create_transition(action=actions.to(torch.float32)))[TransitionKey.ACTION]
    return out.to(torch.float32)


def chunk_kwargs(predictor, prev_actions: torch.Tensor, delay: int) -> dict[str, Any]:
    """`predict_action_chunk`'s RTC arguments for raw leftovers `prev_actions` (B, T, action_dim)."""
    if predictor.rtc is None:
        raise ValueError("a previous chunk was given but RTC is off for this model (enable_rtc first)")
    import torch

    prev = torch.as_tensor(prev_actions, dtype=torch.float32)
    if prev.ndim != 3 or prev.shape[1] < 1 or prev.shape[2] != predictor.action_dim:
        raise ValueError(f"the previous chunk's actions have shape {tuple(prev.shape)}; expected "
                         f"(batch, steps >= 1, {predictor.action_dim})")
    if not 0 <= int(delay) <= predictor.chunk_size:
        raise ValueError(f"the inference delay {delay} is not in 0..{predictor.chunk_size} control steps")
    return {"inference_delay": int(delay),
            "prev_chunk_left_over": normalized(predictor, prev).to(predictor.device)}


def whole_steps(value: Any) -> int | None:
    """A request's count of control steps (`rtc/delay_steps`, serve's `rtc/executed_steps`) as an int:
    a whole number (Python's int or a NumPy integer scalar, as msgpack-numpy decodes them); None for
    anything else, a flag, an array (a 1-element one too) or a float included."""
    import numpy as np

    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        return None
    return int(value)


def delay_problem(delay: Any, chunk_size: int, key: str) -> str | None:
    """What is wrong with a request's inference delay `delay` (sent as `key`) for a model of
    `chunk_size` actions, or None: a whole number of control steps in 0..chunk_size."""
    steps = whole_steps(delay)
    if steps is None or not 0 <= steps <= chunk_size:
        return f"'{key}' must be a whole number of control steps in 0..{chunk_size}, got {delay!r}"
    return None


def group_key(prev: Any, delay: int) -> tuple[int, int] | None:
    """Rows with the same key share one forward: None (no leftover: a plain chunk), else (delay,
    the leftover's length)."""
    return None if prev is None else (int(delay), int(len(prev)))
