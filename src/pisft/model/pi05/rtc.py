"""LeRobot's real-time chunking on a pi0.5 policy (`lerobot.policies.rtc`, LeRobot 0.6.1), through
LeRobot's interface, never a copy: `PI05Config.rtc_config` (an `RTCConfig`),
`PI05Policy.init_rtc_processor()`, and `predict_action_chunk(..., inference_delay=,
prev_chunk_left_over=)`. What RTC does and how pisft's callers use it: pisft.policy.rtc.
"""

from __future__ import annotations

from typing import Any

from pisft.errors import PisftError

# What the records of an RTC run name as its implementation (pisft.policy.rtc.RtcSettings.record).
SOURCE = ("LeRobot 0.6.1 lerobot.policies.rtc (RTCProcessor, RTCConfig; PI05Config.rtc_config, "
          "predict_action_chunk(inference_delay=, prev_chunk_left_over=))")


def configure(policy, settings: Any) -> None:
    """LeRobot's RTC on `policy`: its `RTCConfig` and `RTCProcessor` (`init_rtc_processor`), with
    `settings`' (pisft.policy.rtc.RtcSettings) horizon, guidance weight and schedule."""
    from lerobot.configs import RTCAttentionSchedule
    from lerobot.policies.rtc.configuration_rtc import RTCConfig

    if getattr(policy.config, "use_relative_actions", False):  # a leftover is normalised, never made relative
        raise PisftError("real-time chunking: this model predicts relative actions (use_relative_actions in its "
                         "config.json), whose leftovers pisft does not convert; turn eval.rtc.enabled (serve: "
                         "--rtc) off for it")

    try:
        schedule = RTCAttentionSchedule[settings.schedule]
    except KeyError:
        raise PisftError(f"eval.rtc.schedule: '{settings.schedule}' is not one of "
                         f"{', '.join(s.name for s in RTCAttentionSchedule)}") from None
    policy.config.rtc_config = RTCConfig(enabled=True, prefix_attention_schedule=schedule,
                                         max_guidance_weight=settings.max_guidance_weight,
                                         execution_horizon=settings.execution_horizon)
    policy.init_rtc_processor()
