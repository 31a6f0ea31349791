"""Metrics: MFU peaks table, JSON lines log with resume truncation, progress with ETA."""

from __future__ import annotations

import io

import pytest

from pisft.train.metrics import PEAK_FLOPS_TABLE, MetricsLog, Progress, mfu, peak_flops_for


# Device names as the drivers report them (torch.npu / torch.cuda get_device_name) and the row of
# PEAK_FLOPS_TABLE each one means. First match wins, so an early broad pattern would shadow a row.
DEVICE_NAMES = [
    ("Ascend910B1", "npu", "Ascend 910B1"), ("Ascend910B2", "npu", "Ascend 910B2"),
    ("Ascend910B3", "npu", "Ascend 910B3"), ("Ascend910B4", "npu", "Ascend 910B4"),
    ("Ascend910_9391", "npu", "Ascend 910C (per die)"), ("Ascend910C", "npu", "Ascend 910C (per die)"),
    ("Ascend910B", "npu", "Ascend 910B (unknown variant: 910B3 figure)"),
    ("NVIDIA H200", "cuda", "NVIDIA H200"), ("NVIDIA H100 PCIe", "cuda", "NVIDIA H100 PCIe"),
    ("NVIDIA H100 NVL", "cuda", "NVIDIA H100 NVL"), ("NVIDIA H100 80GB HBM3", "cuda", "NVIDIA H100 SXM"),
    ("NVIDIA H800", "cuda", "NVIDIA H100 SXM"), ("NVIDIA A100-SXM4-80GB", "cuda", "NVIDIA A100"),
]


@pytest.mark.parametrize("name,kind,label", DEVICE_NAMES)
def test_a_device_name_finds_its_own_row(name, kind, label):
    peak, source = peak_flops_for(name, kind)
    assert source == f"table: {label}"
    assert peak == next(flops for _, flops, row in PEAK_FLOPS_TABLE if row == label)


def test_every_row_is_reachable_and_unknown_910b_uses_the_910b3_figure():
    assert {label for _, _, label in DEVICE_NAMES} == {row for _, _, row in PEAK_FLOPS_TABLE}
    assert peak_flops_for("Ascend910B", "npu")[0] == peak_flops_for("Ascend910B3", "npu")[0]
    # case does not matter (some drivers report upper case)
    assert peak_flops_for("ASCEND910B2", "npu") == peak_flops_for("Ascend910B2", "npu")


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


def test_progress_line_every_log_every_steps_and_at_the_end():
    """The trainers pass train.log_every: one line per fetch of the step values (a resumed run
    from step 7 too), each with step/total, loss, lr, samples/s and an ETA; and the last step."""
    out = io.StringIO()
    p = Progress(total=45, start=7, enabled=True, stream=out, desc="train_8card", every=10)
    for step in range(8, 46):
        p.update({"step": step, "loss": 0.25, "grad_norm": 1.0, "lr": 2e-4, "samples_per_s": 40.0,
                  "mfu": 0.31})
    lines = out.getvalue().splitlines()
    assert [int(line.split()[2].split("/")[0]) for line in lines] == [10, 20, 30, 40, 45]
    assert lines[0].startswith("[train_8card] step 10/45 (22%) loss 0.2500 grad_norm 1.000 lr 2.00e-04 "
                               "40.0 samples/s mfu 31.0% ETA ")
    assert lines[-1].endswith("ETA 0:00:00")
