"""The real-size benchmark's code on the tiny preset (so it cannot rot): every mode measured in its
own process, the estimate beside the measurement, and a mode over the memory budget not run."""

from __future__ import annotations

import pytest

from pisft.bench import real_size

KEYS = ("forward_s", "step_s", "estimate_bytes", "measured_bytes", "checkpoint_bytes", "export_s")


@pytest.mark.integration
def test_real_size_bench_on_the_tiny_preset(tmp_path):
    out = real_size.bench_modes("tiny", ("expert", "lora"), work=tmp_path, timed_steps=1)
    assert set(out["modes"]) == {"expert", "lora"} and out["not_run"] == {}
    for mode, got in out["modes"].items():
        assert all(got[k] > 0 for k in KEYS), (mode, got)
        assert 0 < got["params_trainable"] < got["params_total"]
        # the estimate simulates the same step (docs/memory.md): parameters and AdamW state to the
        # byte, the step's peak 8 bytes below the training step's (its two float32 scalars)
        assert got["estimate_params_bytes"] == got["params_bytes"], got
        assert got["estimate_optimizer_bytes"] == got["optimizer_bytes"], got
        assert got["measured_step_peak_bytes"] - got["estimate_step_peak_bytes"] == 2 * 4, got
        assert got["measured_bytes"] - got["estimate_bytes"] == 2 * 4, got
    assert {"joint_forward_s", "joint_step_s"} <= set(out["modes"]["expert"])  # before/after
    assert list(tmp_path.iterdir()) == []  # checkpoints and exports deleted after each mode


@pytest.mark.integration
def test_a_mode_over_the_memory_budget_is_not_run_and_says_why(tmp_path):
    out = real_size.bench_modes("tiny", ("all",), work=tmp_path, max_gib=0.001)
    assert out["modes"] == {} and "does not fit" in out["not_run"]["all"]
