"""`bench --only closed_loop`: the policy side of closed_loop, one request at a time against
batched by arrival time and at a fixed shape, at a small size. Structure and consistency only:
no verdict rests on this host's speed."""

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


@pytest.mark.integration  # ~20-30 s: 2 spawned environment processes (twice) and the tiny model, eleven passes
def test_closed_loop_bench_figures_are_consistent(tmp_path):
    out = closed_loop_bench.run(tmp_path, num_envs=2, episodes_per_env=1, max_steps=10, slow_step_s=0.01)
    slow = out["simulation_dominates"]
    runs = [out["sequential"], out["batched"], out["batched_no_hold"], out["batched_waiting"], out["fixed"],
            out["fixed_waiting"], out["fixed_half"], slow["no_hold"], slow["default"], slow["fixed"]]
    # the same episodes in every run: 2 episodes x 10 steps / 5 per chunk
    assert [r["requests"] for r in runs] == [4] * 10 and [r["episodes"] for r in runs] == [2] * 10
    for r in runs:
        assert r["requests_per_s"] == pytest.approx(r["requests"] / r["wall_s"])
        assert 1 <= r["mean_policy_batch"] <= r["max_policy_batch"] <= 2
    assert out["sequential"]["max_policy_batch"] == 1 and out["sequential"]["policy_batch_limit"] == 1
    assert (out["fixed"]["forward_rows"], out["fixed_half"]["forward_rows"], out["batched"]["forward_rows"]) \
        == (2, 1, None)
    assert out["batched_vs_sequential_requests_per_s"] == pytest.approx(
        out["batched"]["requests_per_s"] / out["sequential"]["requests_per_s"])
    assert out["mean_policy_batch"] == out["batched"]["mean_policy_batch"]
    for name in ("batched_no_hold", "batched_waiting", "fixed", "fixed_waiting", "fixed_half"):
        assert out[f"{name}_vs_sequential_requests_per_s"] == pytest.approx(
            out[name]["requests_per_s"] / out["sequential"]["requests_per_s"])
    assert out["fixed_vs_batched_requests_per_s"] == pytest.approx(
        out["fixed"]["requests_per_s"] / out["batched"]["requests_per_s"])
    assert slow["step_s"] == 0.01 and slow["default_vs_no_hold_requests_per_s"] == pytest.approx(
        slow["default"]["requests_per_s"] / slow["no_hold"]["requests_per_s"])
    # the fixed-shape runs give the same bits whatever their batches (the stages' guarantee); the
    # arrival-time runs' bits follow their batches, so they are only reported
    assert out["fixed_actions_match"] is True
    assert out["arrival_actions_max_abs_diff"] < 1e-3 and isinstance(out["arrival_actions_match"], bool)
