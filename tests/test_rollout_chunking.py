"""The closed loop's chunks under an inference delay, real-time chunking's leftover, and the jerk
at chunk boundaries (pisft.rollout.chunking; eval.rtc)."""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest

from pisft import rollout
from pisft.errors import PisftError
from pisft.evaluate import closed_loop
from pisft.policy.rtc import RTC_DELAY_KEY, RTC_PREV_KEY
from pisft.policy.rtc import RtcSettings
from pisft.rollout.chunking import ChunkSchedule, jerk_sums, pooled_jerk
from pisft.rollout.workers import InlineWorker
from test_eval_closed_loop import StandInSimulator, StandInTask, make_cfg

HORIZON = 10
WAIT = 10  # the stand-in's wait steps (dummy actions) before the policy's


class NumberedChunks:
    """Chunk k of an episode: action j is (0.001 (100 k + j), 0, ..., 0): every executed action
    says which chunk and which index it came from. Records what each request carried."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    def infer_batch(self, requests: list[dict], seeds: list[int]) -> list[dict]:
        out = []
        for obs in requests:  # one episode: request k asks for its chunk k
            k = len(self.requests)
            self.requests.append({"x": float(obs["observation/state"][0]), "prev": obs.get(RTC_PREV_KEY),
                                  "delay": obs.get(RTC_DELAY_KEY)})
            chunk = np.zeros((HORIZON, 7))
            chunk[:, 0] = 0.001 * (100 * k + np.arange(HORIZON))
            out.append({"actions": chunk})
        return out


def _roll(delay: int, rtc: bool, max_steps: int = 16) -> tuple[NumberedChunks, np.ndarray, rollout.EpisodeResult]:
    sim = StandInSimulator([StandInTask("reach 99 0 0", [99.0, 0, 0])])
    s = rollout.Settings(suites=("libero_spatial",), trials_per_task=1, replan_steps=5, num_wait_steps=WAIT, seed=7,
                         resize_size=224, max_steps=max_steps, delay_steps=delay, rtc=RtcSettings() if rtc else None)
    specs, languages = rollout.plan_episodes(sim, s, None)
    policy = NumberedChunks()
    worker = InlineWorker(sim)
    try:
        [result] = rollout.run_episodes(specs, policy, s, workers=[worker], languages=languages)
    finally:
        worker.close()
    executed = np.array(sim.envs[0].actions[WAIT:])[:, 0]
    return policy, executed, result


def _code(chunk: int, index: int) -> float:
    return 0.001 * (100 * chunk + index)


def test_without_a_delay_the_loop_is_openpis():
    policy, executed, result = _roll(delay=0, rtc=False)
    expected = [_code(k, j) for k in range(4) for j in range(5)][:16]
    np.testing.assert_allclose(executed, expected)
    assert all(r["prev"] is None for r in policy.requests)
    # the observation of request k comes after the 5 actions of chunk k - 1
    np.testing.assert_allclose([r["x"] for r in policy.requests[1:]],
                               [0.05 * sum(expected[:5 * k]) for k in range(1, len(policy.requests))])
    assert result.chunking["boundaries"] == 3  # at steps 5, 10, 15


@pytest.mark.parametrize("rtc", [False, True])
def test_with_a_delay_the_environment_keeps_executing_the_current_chunk(rtc):
    """delay 3, 5 actions a chunk: chunk 0 runs [0, 5) with the next observation taken after 2;
    every later chunk starts 3 actions in, [3, 8), its observation taken after [3, 5). Under RTC
    the request carries the current chunk's actions from where the observation was taken on."""
    policy, executed, result = _roll(delay=3, rtc=rtc, max_steps=18)
    expected = [_code(0, j) for j in range(5)] + [_code(k, j) for k in (1, 2, 3) for j in range(3, 8)]
    np.testing.assert_allclose(executed, expected[:18])
    taken_after = [2, 5 + 2, 10 + 2]  # actions executed when requests 1, 2, 3 were taken
    np.testing.assert_allclose([r["x"] for r in policy.requests[1:4]],
                               [0.05 * sum(expected[:n]) for n in taken_after])
    if not rtc:
        assert all(r["prev"] is None and r["delay"] is None for r in policy.requests)
    else:
        assert policy.requests[0]["prev"] is None  # an episode's first chunk has nothing to agree with
        first, second = policy.requests[1], policy.requests[2]
        assert first["delay"] == second["delay"] == 3
        np.testing.assert_allclose(first["prev"][:, 0], [_code(0, j) for j in range(2, HORIZON)])
        np.testing.assert_allclose(second["prev"][:, 0], [_code(1, j) for j in range(5, HORIZON)])
    actions = np.zeros((18, 7))
    actions[:, 0] = expected[:18]
    sums = jerk_sums(actions, [5, 10, 15])
    assert result.chunking == pytest.approx(sums)


def test_rtc_with_the_whole_chunk_executed_asks_for_a_plain_chunk():
    """No delay and a chunk's worth of steps per request (both allowed): nothing of the current chunk
    is left to agree with, so the request is plain (an empty leftover was refused by the policy and
    failed every episode)."""
    schedule = ChunkSchedule(8, 0, rtc=True)
    schedule.start(0)
    schedule.payload(0, np.zeros((8, 7)), lambda c: c)
    assert schedule.request(0, {"x": 1}) == {"x": 1}
    schedule = ChunkSchedule(5, 0, rtc=True)
    schedule.start(0)
    schedule.payload(0, np.zeros((8, 7)), lambda c: c)
    assert len(schedule.request(0, {"x": 1})[RTC_PREV_KEY]) == 3


def test_the_rtc_settings_are_built_once_from_eval_rtc():
    """`Settings.for_evaluation` reads eval.rtc once: its guidance keys as the `RtcSettings` the
    policy pool is given, None when eval.rtc.enabled is off; the output's record says only whether
    it is on (the policy's record holds the settings)."""
    from dataclasses import replace

    from pisft import config as C

    on = rollout.Settings.for_evaluation(C.from_dict({"eval": {"rtc": {
        "enabled": True, "delay_steps": 2, "execution_horizon": 8, "max_guidance_weight": 5.0, "schedule": "EXP"}}}))
    assert on.rtc == RtcSettings(execution_horizon=8, max_guidance_weight=5.0, schedule="EXP")
    off = rollout.Settings.for_evaluation(C.from_dict({"eval": {"rtc": {"delay_steps": 2, "execution_horizon": 8}}}))
    assert off.rtc is None and off.delay_steps == 2
    assert on.record()["rtc"] is True and off.record()["rtc"] is False
    assert list(on.record()) == list(off.record()) and on.record()["delay_steps"] == 2
    with pytest.raises(TypeError, match="Settings.rtc"):  # the bool it once was would read as on
        replace(off, rtc=False)


def test_the_config_refuses_a_delay_rtc_cannot_act_on():
    from pisft import config as C

    with pytest.raises(C.ConfigError, match=r"eval.rtc.delay_steps: 6 is more than eval.replan_steps \(5\)"):
        C.from_dict({"eval": {"rtc": {"delay_steps": 6}}})
    with pytest.raises(C.ConfigError, match=r"delay_steps: 4 is not below eval.rtc.execution_horizon \(4\).*"
                                            "raise eval.rtc.execution_horizon"):
        C.from_dict({"eval": {"rtc": {"enabled": True, "delay_steps": 4, "execution_horizon": 4}}})
    C.from_dict({"eval": {"rtc": {"delay_steps": 4, "execution_horizon": 4}}})  # a delay alone: no RTC to act
    with pytest.raises(C.ConfigError, match="eval.rtc.schedule: 'SQUARE' is not one of"):
        C.from_dict({"eval": {"rtc": {"schedule": "SQUARE"}}})


def test_lerobots_rtc_defaults_are_one_constant_that_the_config_the_policy_and_serve_read():
    """eval.rtc's defaults, pisft.policy.rtc's settings and record, and serve's --rtc-* flags: LeRobot's
    RTCConfig defaults, written once (pisft.config.LEROBOT_RTC_DEFAULTS)."""
    from lerobot.policies.rtc.configuration_rtc import RTCConfig

    from pisft import config as C
    from pisft.policy.rtc import RtcSettings
    from pisft.serve.server import build_parser

    lerobot = RTCConfig()
    defaults = {"execution_horizon": lerobot.execution_horizon, "max_guidance_weight": lerobot.max_guidance_weight,
                "schedule": lerobot.prefix_attention_schedule.value}
    assert dict(C.LEROBOT_RTC_DEFAULTS) == defaults
    rtc = C.from_dict({}).eval.rtc
    assert {key: getattr(rtc, key) for key in defaults} == defaults
    assert RtcSettings() == RtcSettings.from_config(rtc) and RtcSettings().record("x")["lerobot_defaults"] == defaults
    flags = build_parser().parse_args(["--model", "model"])
    assert (flags.rtc_execution_horizon, flags.rtc_max_guidance_weight, flags.rtc_schedule) == tuple(defaults.values())


def test_jerk_is_the_second_difference_at_the_boundaries():
    a = np.zeros((8, 7))
    a[:, 0] = [0, 1, 2, 3, 10, 11, 12, 13]  # a step at 4: a new chunk starts there
    sums = jerk_sums(a, [4])
    assert sums["boundaries"] == 1 and sums["boundary_sum"] == pytest.approx(abs(10 - 2 * 3 + 2) / 7)
    assert sums["inside"] == 5 and sums["inside_sum"] == pytest.approx(abs(11 - 20 + 3) / 7)
    assert pooled_jerk([sums, sums])["action_jerk"] == pytest.approx(6 / 7)  # pooled over both
    assert pooled_jerk([])["action_jerk"] is None


def test_the_delay_must_fit_the_chunk_and_the_steps_per_chunk():
    with pytest.raises(PisftError, match="delay_steps"):
        ChunkSchedule(5, 6)
    schedule = ChunkSchedule(5, 4)
    schedule.start(0)
    schedule.payload(0, np.zeros((8, 7)), lambda c: c[:5])
    with pytest.raises(PisftError, match="needs 9"):  # a later chunk starts 4 in: 4 + 5 > 8
        schedule.payload(0, np.zeros((8, 7)), lambda c: c[:5])


@pytest.mark.integration  # the session's whole default pipeline
def test_rtc_lowers_the_jerk_of_the_trained_model_at_chunk_boundaries(default_pipeline, tmp_path):
    """The default pipeline's fine-tuned tiny model (smooth chunks: it learned the demo's smooth
    actions) in the stand-in simulator at a delay of 3 steps: RTC (LeRobot's) agrees with the
    current chunk, so the jump at each boundary is smaller than with plain chunking. The tiny model
    reaches no goal: the mechanism, not the success, is what this shows. With two seeds both sides are
    the evaluation's own episodes at the first seed (the plain pass runs those alone)."""
    cfg = make_cfg(tmp_path, libero_suites=["libero_spatial"], trials_per_task=2, max_steps=40, videos=False,
                   rtc={"enabled": True, "delay_steps": 3}, seeds=[7, 8])
    (tmp_path / "results" / "train").mkdir(parents=True)
    shutil.copytree(default_pipeline / "results" / "train" / "model", tmp_path / "results" / "train" / "model")
    tasks = [StandInTask("put both moka pots on the stove", [99.0, 0, 0]),
             StandInTask("turn on the stove and put the moka pot on it", [0.3, 0, 0])]
    metrics = closed_loop.run(cfg, simulator=functools.partial(StandInSimulator, tasks), inline=True)
    plain, rtc = metrics["rtc_comparison"]["plain"], metrics["rtc_comparison"]["rtc"]
    assert plain["episodes"] == rtc["episodes"] == 4 and metrics["episodes"] == 8  # two seeds pooled
    assert plain["chunk_boundaries"] == rtc["chunk_boundaries"] == 4 * 7  # 4 episodes of 40 steps
    assert rtc["action_jerk"] < 0.95 * plain["action_jerk"]
    assert metrics["chunking"]["rtc"] is True and metrics["chunking"]["chunk_boundaries"] == 8 * 7
    assert metrics["inference"]["rtc"]["execution_horizon"] == 10  # LeRobot's default
    report = (tmp_path / "results" / "closed_loop" / "report.md").read_text()
    assert "Real-time chunking against plain chunking at the same delay (3 steps)" in report
    episodes = [json.loads(line) for line in
                (tmp_path / "results" / "closed_loop" / "episodes.jsonl").read_text().splitlines()]
    assert all(e["chunking"]["boundaries"] == 7 for e in episodes)
