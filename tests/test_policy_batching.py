"""The one batching rule (pisft.policy.batching): who joins a forward, how long a batch is held,
the one failure rule. Both front ends (the closed loop's thread pool, the server's asyncio
batcher) are tested with it in test_eval_batched_policy.py and test_serve_batch.py."""

from __future__ import annotations

import pytest
import torch

from pisft.policy.batching import BatchRule, answer_each, rewinding


def test_oldest_first_one_per_key_at_most_max_batch():
    rule = BatchRule(max_batch=3)
    jobs = [("a", 1), ("b", 2), ("a", 3), ("c", 4), ("d", 5)]
    batch, rest = rule.take(jobs, key=lambda j: j[0])
    assert batch == [("a", 1), ("b", 2), ("c", 4)] and rest == [("a", 3), ("d", 5)]
    assert BatchRule().take(jobs, key=lambda j: j[0])[0] == [("a", 1), ("b", 2), ("c", 4), ("d", 5)]
    assert rule.limit(7) == 3 and BatchRule().limit(7) == 7


def test_a_hand_set_wait_holds_until_the_oldest_has_waited_it():
    rule = BatchRule(wait_s=0.05)
    assert rule.hold_s(now=10.0, oldest=9.98, waiting=1, could_join=4) == pytest.approx(0.03)
    assert rule.hold_s(now=10.0, oldest=9.9, waiting=1, could_join=4) is None  # waited long enough
    assert rule.hold_s(now=10.0, oldest=10.0, waiting=4, could_join=4) is None  # nobody else can join
    assert BatchRule(max_batch=2, wait_s=0.05).hold_s(now=10.0, oldest=10.0, waiting=2, could_join=4) is None


def test_the_measured_wait_holds_for_environments_expected_within_a_forward():
    rule = BatchRule()
    # nothing measured yet: no forecast, no hold
    assert rule.expected(9.99) is None
    assert rule.hold_s(now=10.0, oldest=10.0, waiting=1, could_join=2, expected=[rule.expected(9.99)]) is None
    rule.simulated(0.02)
    assert rule.hold_s(now=10.0, oldest=10.0, waiting=1, could_join=2, expected=[rule.expected(9.99)]) is None
    rule.forward_done(0.1)
    # answered at 9.99, expected back at 10.01, before the oldest has waited one forward (10.1)
    assert rule.expected(9.99) == pytest.approx(10.01)
    assert rule.hold_s(now=10.0, oldest=10.0, waiting=1, could_join=2,
                       expected=[rule.expected(9.99)]) == pytest.approx(0.1)
    # expected back after a forward's time: go now (a long simulation never holds a batch)
    assert rule.hold_s(now=10.0, oldest=10.0, waiting=1, could_join=2, expected=[rule.expected(10.2)]) is None
    # an episode's start has its own mean: none measured, no forecast, no hold
    assert rule.expected(9.99, "start") is None
    assert rule.hold_s(now=10.0, oldest=10.0, waiting=1, could_join=2, expected=[None]) is None
    rule.simulated(0.05, "start")
    assert rule.expected(9.99, "start") == pytest.approx(10.04)
    # held at most one forward from the oldest request
    assert rule.hold_s(now=10.2, oldest=10.0, waiting=1, could_join=2, expected=[rule.expected(9.99)]) is None
    assert BatchRule(adaptive=False).hold_s(now=10.0, oldest=10.0, waiting=1, could_join=2) is None


def test_a_failed_forward_is_retried_request_by_request_from_each_requests_own_noise():
    calls: list[int] = []

    def forward(items, noises):
        calls.append(len(items))
        draws = [float(torch.randn(1, generator=g)) for g in noises]  # drawn before it fails
        if "bad" in items:
            raise ValueError("a request the model cannot take")
        return [{"x": item, "noise": d} for item, d in zip(items, draws, strict=True)]

    noises = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    out = answer_each(forward, ["a", "bad", "c"], rewinding(noises))
    assert calls == [3, 1, 1, 1]
    assert str(out[1].error) == "a request the model cannot take" and out[1].reply is None
    for k, seed in ((0, 1), (2, 3)):
        assert out[k].error is None
        assert out[k].reply["noise"] == float(torch.randn(1, generator=torch.Generator().manual_seed(seed)))
    fresh = [torch.Generator().manual_seed(s) for s in (1, 2)]
    assert [o.reply for o in answer_each(forward, ["a", "c"], rewinding(fresh))] == [
        {"x": "a", "noise": float(torch.randn(1, generator=torch.Generator().manual_seed(1)))},
        {"x": "c", "noise": float(torch.randn(1, generator=torch.Generator().manual_seed(2)))}]
