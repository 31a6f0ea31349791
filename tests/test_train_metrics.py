"""Metrics: MFU peaks table, JSON lines log with resume truncation, progress with ETA."""

from __future__ import annotations

import io

import pytest

from pisft.train.metrics import MetricsLog, Progress, mfu, peak_flops_for


@pytest.mark.parametrize("name,kind,expected", [
    ("Ascend910B1", "npu", 414e12), ("Ascend910B2", "npu", 376e12), ("Ascend910B3", "npu", 313e12),
    ("Ascend910B4", "npu", 280e12), ("NVIDIA H100 80GB HBM3", "cuda", 989e12),
    ("NVIDIA H100 PCIe", "cuda", 756e12), ("NVIDIA H200", "cuda", 989e12),
])
def test_peak_table(name, kind, expected):
    peak, source = peak_flops_for(name, kind)
    assert peak == expected
    assert source.startswith("table")


def test_peak_none_on_cpu_unknown_device_and_override():
    assert peak_flops_for("cpu", "cpu")[0] is None
    peak, source = peak_flops_for("Some Future GPU", "cuda")
    assert peak is None and "train.peak_flops" in source
    assert peak_flops_for("cpu", "cpu", override=1e12) == (1e12, "train.peak_flops")
    assert peak_flops_for("Ascend910B2", "npu", override=2e14)[0] == 2e14


def test_mfu_formula():
    assert mfu(1e12, 10.0, 100e12, 2) == pytest.approx(0.05)
    assert mfu(None, 10.0, 100e12, 2) is None
    assert mfu(1e12, 10.0, None, 2) is None


def test_metrics_log_keeps_steps_before_resume_point(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    log.reset(0)
    for step in range(1, 8):
        log.append({"step": step, "loss": 1.0 / step})
    with log.path.open("a") as fh:
        fh.write('{"step": 8, "lo')  # a line cut by a crash
    log.reset(keep_upto_step=5)
    assert [r["step"] for r in log.read()] == [1, 2, 3, 4, 5]
    log.reset(0)
    assert log.read() == []


def test_progress_lines_with_eta():
    out = io.StringIO()
    p = Progress(total=40, start=0, enabled=True, stream=out, desc="train")
    for step in range(1, 41):
        p.update({"step": step, "loss": 0.5, "grad_norm": 1.0, "lr": 1e-3, "samples_per_s": 3.0,
                  "mfu": None})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[train] step 1/40")
    assert lines[-1].startswith("[train] step 40/40 (100%)")
    assert all("ETA" in line for line in lines)
    assert 2 < len(lines) <= 22
    quiet = io.StringIO()
    Progress(total=4, start=0, enabled=False, stream=quiet).update(
        {"step": 1, "loss": 0.5, "grad_norm": 1.0, "lr": 1e-3, "samples_per_s": 3.0})
    assert quiet.getvalue() == ""
