"""`bench --only closed_loop`: the policy side of closed_loop, one request at a time against
batched, at a small size. Structure and consistency only: no verdict rests on this host's speed."""

from __future__ import annotations

import importlib

import pytest

from pisft.bench import closed_loop_bench
from pisft.bench import run as bench_run
from pisft.bench.stand_in_simulator import StandInSimulator
from pisft.rollout import libero_sim


def test_closed_loop_is_a_bench_part():
    module, func = bench_run.COMPONENT_BENCHES["closed_loop"].split(":")
    assert getattr(importlib.import_module(module), func) is closed_loop_bench.run
    assert "closed_loop" in bench_run.part_names()


def test_the_stand_in_simulator_answers_as_libero_does():
    sim = StandInSimulator(3)
    suite = sim.suite("libero_10")
    env = sim.make_env(suite.get_task(2), resolution=libero_sim.RENDER_RESOLUTION, seed=7)
    env.seed(7)
    env.reset()
    obs = env.set_init_state(suite.get_task_init_states(2)[4])
    request = libero_sim.policy_request(obs, suite.get_task(2).language, resize=224)
    assert request["observation/image"].shape == (224, 224, 3)
    assert request["observation/state"].shape == (8,)
    moved, _, done, _ = env.step([1.0, 0, 0, 0, 0, 0, -1])
    assert not done and moved["robot0_eef_pos"][0] == pytest.approx(0.04 + 0.01)  # never succeeds
    with pytest.raises(ValueError, match="renders at 256"):
        sim.make_env(suite.get_task(0), resolution=128, seed=7)


@pytest.mark.integration  # ~10-20 s: 2 spawned environment processes (twice) and the tiny model, seven passes
def test_closed_loop_bench_figures_are_consistent(tmp_path):
    out = closed_loop_bench.run(tmp_path, num_envs=2, episodes_per_env=1, max_steps=10, slow_step_s=0.01)
    slow = out["simulation_dominates"]
    runs = [out["sequential"], out["batched"], out["batched_no_hold"], out["batched_waiting"], slow["no_hold"],
            slow["default"]]
    # the same episodes in every run: 2 episodes x 10 steps / 5 per chunk
    assert [r["requests"] for r in runs] == [4] * 6 and [r["episodes"] for r in runs] == [2] * 6
    for r in runs:
        assert r["requests_per_s"] == pytest.approx(r["requests"] / r["wall_s"])
        assert 1 <= r["mean_policy_batch"] <= r["max_policy_batch"] <= 2
    assert out["sequential"]["max_policy_batch"] == 1 and out["sequential"]["policy_batch_limit"] == 1
    assert out["batched_vs_sequential_requests_per_s"] == pytest.approx(
        out["batched"]["requests_per_s"] / out["sequential"]["requests_per_s"])
    assert out["mean_policy_batch"] == out["batched"]["mean_policy_batch"]
    for name in ("batched_no_hold", "batched_waiting"):
        assert out[f"{name}_vs_sequential_requests_per_s"] == pytest.approx(
            out[name]["requests_per_s"] / out["sequential"]["requests_per_s"])
    assert slow["step_s"] == 0.01 and slow["default_vs_no_hold_requests_per_s"] == pytest.approx(
        slow["default"]["requests_per_s"] / slow["no_hold"]["requests_per_s"])
    # the batched chunks are the sequential ones, within fp32 rounding (bit for bit on the CPUs
    # measured so far, with one policy thread; not asserted, as it rests on the CPU's kernels)
    assert out["actions_match"] is True and out["actions_max_abs_diff"] <= out["actions_atol"]
