"""Error accumulation, bootstrap intervals, training-log reading and the metrics tables."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

from pisft.errors import DataError
from pisft.evaluate import intervals, summary, train_log
from pisft.evaluate.action_error import ErrorAccumulator


def add_constant_error(acc, episode, task, err, n_frames=1, pad_from=None):
    """Frames whose raw error is `err` on every element (norm error 2 * err)."""
    c, d = acc.chunk_size, acc.action_dim
    pad = np.zeros((n_frames, c), dtype=bool)
    if pad_from is not None:
        pad[:, pad_from:] = True
    target = np.zeros((n_frames, c, d))
    pred = np.full((n_frames, c, d), err)
    # padded steps get a huge error that must not count
    pred[pad] = 1e6
    acc.add(episodes=[episode] * n_frames, tasks=[task] * n_frames, pred_norm=2 * pred,
            target_norm=target, pred_raw=pred, target_raw=target, is_pad=pad)


def test_padded_steps_are_excluded_and_errors_pool_per_element():
    acc = ErrorAccumulator(chunk_size=4, action_dim=2)
    add_constant_error(acc, 0, "a", 1.0, n_frames=2)                 # 16 elements of error 1
    add_constant_error(acc, 1, "b", 3.0, n_frames=1, pad_from=2)    # 4 valid elements of error 3
    assert acc.mean("action_l1") == pytest.approx((16 * 1 + 4 * 3) / 20)
    assert acc.mean("action_mse") == pytest.approx((16 * 1 + 4 * 9) / 20)
    assert acc.mean("action_mse_norm") == pytest.approx(4 * acc.mean("action_mse"))
    np.testing.assert_allclose(acc.per_step("action_l1"), [5 / 3, 5 / 3, 1.0, 1.0])
    np.testing.assert_allclose(acc.per_dim("action_l1"), [28 / 20, 28 / 20])
    assert acc.tasks() == {"a": [0], "b": [1]} and acc.frames() == 3
    assert acc.mean("action_l1", [1]) == pytest.approx(3.0)


def test_shape_mismatch_and_task_change_are_errors():
    acc = ErrorAccumulator(chunk_size=4, action_dim=2)
    with pytest.raises(ValueError, match="shape"):
        acc.add(episodes=[0], tasks=["a"], pred_norm=np.zeros((1, 3, 2)), target_norm=np.zeros((1, 4, 2)),
                pred_raw=np.zeros((1, 4, 2)), target_raw=np.zeros((1, 4, 2)), is_pad=np.zeros((1, 4)))
    add_constant_error(acc, 0, "a", 1.0)
    with pytest.raises(ValueError, match="two tasks"):
        add_constant_error(acc, 0, "b", 1.0)


def test_bootstrap_is_seeded_and_brackets_the_pooled_mean():
    rng = np.random.default_rng(1)
    sums = rng.gamma(2.0, 1.0, size=40) * 10
    counts = np.full(40, 10.0)
    a = intervals.bootstrap_pooled_mean(sums, counts, n_samples=500, seed=3)
    b = intervals.bootstrap_pooled_mean(sums, counts, n_samples=500, seed=3)
    c = intervals.bootstrap_pooled_mean(sums, counts, n_samples=500, seed=4)
    assert a == b and a != c
    mean = intervals.pooled_mean(sums, counts)
    assert a.low < mean < a.high
    # roughly mean ± 1.96 standard errors of the episode means
    se = np.std(sums / 10, ddof=1) / np.sqrt(40)
    assert a.high - a.low == pytest.approx(2 * 1.96 * se, rel=0.25)


def test_paired_ratio_interval():
    rng = np.random.default_rng(0)
    base = rng.gamma(2.0, 1.0, size=30)
    counts = np.ones(30)
    same = intervals.bootstrap_paired_ratio(base, base, counts, n_samples=200, seed=0)
    assert same.low == same.high == 1.0
    half = intervals.bootstrap_paired_ratio(base, base * 0.5 * rng.uniform(0.9, 1.1, 30), counts,
                                        n_samples=200, seed=0)
    assert 0.45 < half.low < half.high < 0.55


def two_models():
    base, fine = (ErrorAccumulator(chunk_size=3, action_dim=1) for _ in range(2))
    for ep, task in enumerate(["a", "a", "b"]):
        add_constant_error(base, ep, task, 2.0, n_frames=2)
        add_constant_error(fine, ep, task, 1.0 if task == "a" else 2.0, n_frames=2)
    return base, fine


def test_summary_sections_ratios_and_tables():
    base, fine = two_models()
    m = summary.summarize(base, fine, n_bootstrap=100, seed=0)
    assert m["base"]["action_mse"] == pytest.approx(4.0)
    assert m["finetuned"]["per_task"]["a"]["action_mse"] == pytest.approx(1.0)
    assert m["finetuned"]["per_task"]["b"]["action_mse"] == pytest.approx(4.0)
    assert m["comparison"]["action_mse"]["ratio"] == pytest.approx(0.5)
    assert m["improvement"] == pytest.approx(0.5)
    assert m["episodes"] == 3 and m["frames"] == 6 and m["tasks"] == 2
    json.dumps(m, allow_nan=False)  # strict JSON
    rows = list(csv.DictReader(io.StringIO(summary.per_step_csv({"base": base, "finetuned": fine}))))
    assert len(rows) == 3 and float(rows[0]["base_action_l1"]) == 2.0
    tasks = list(csv.DictReader(io.StringIO(summary.per_task_csv(m))))
    assert [t["task"] for t in tasks] == ["a", "b"] and float(tasks[0]["finetuned_action_mse"]) == 1.0


def test_models_scored_on_different_frames_are_refused():
    base, fine = two_models()
    add_constant_error(fine, 9, "c", 1.0)
    with pytest.raises(ValueError, match="other episodes"):
        summary.summarize(base, fine, n_bootstrap=0, seed=0)


def test_training_log_dedupes_resumed_steps_and_reads_memory_forms(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "loss": 2.0, "lr": 1e-4, "peak_memory_bytes": 2**30, "mem_x": 1},
        {"step": 2, "loss": 1.5, "lr": 2e-4, "peak_memory_bytes": 2**31, "mfu": None},
        {"step": 2, "loss": 1.4, "lr": 2e-4, "peak_memory_bytes": 2**31},  # resumed
        {"step": 3, "loss": float("nan"), "lr": 2e-4},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    records = train_log.read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert train_log.series(records, "loss") == ([1, 2], [2.0, 1.4])  # NaN skipped
    assert train_log.series(records, "mfu") == ([], [])
    assert train_log.memory_series(records, "peak_memory_bytes") == {"peak_memory_bytes": ([1, 2], [1.0, 2.0])}
    assert train_log.summary(records)["max_peak_memory_gib"] == 2.0
    per_device = [{"step": 1, "peak_mem": [1, 2]}, {"step": 2, "peak_mem": {"npu:0": 3}}]
    assert train_log.memory_series(per_device, "peak_mem") == {
        "peak_mem[0]": ([1], [1.0]), "peak_mem[1]": ([1], [2.0]), "peak_mem[npu:0]": ([2], [3.0])}
    assert train_log.read_metrics(tmp_path / "missing.jsonl") == []


def test_damaged_training_log_names_the_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1}\n{"step": 2, "lo\n')
    with pytest.raises(DataError, match=r"metrics.jsonl:2"):
        train_log.read_metrics(path)
