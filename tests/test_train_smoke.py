"""The smoke gate in one process: a too-small memory headroom and an out-of-memory both fail
with a report and an actionable message."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
import torch.distributed as dist
from train_fixtures import CONFIG, overrides, results_dir

from pisft import layout
from pisft import config as config_mod
from pisft import device as devices
from pisft.errors import PisftError
from pisft.gates import smoke
from pisft.train.metrics import TensorBoardSink
from pisft.train.job import Context


@pytest.fixture
def ctx(tmp_path_factory):
    res = results_dir(tmp_path_factory, "smoke_gate")
    cfg = config_mod.load(CONFIG, overrides(res, "smoke.steps=2"))
    store = dist.FileStore(str(res / "pg_store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    info = devices.DeviceInfo(kind="cpu", backend="gloo", device=torch.device("cpu"), name="cpu")
    yield Context(cfg, "smoke_1card", info, 0, 1)
    dist.destroy_process_group()


def _report(ctx):
    return json.loads(layout.results(ctx.cfg, "smoke", "report.json").read_text())


@pytest.mark.integration  # ~1 min: builds the inputs, runs the estimate and the smoke steps
def test_memory_headroom_below_minimum_fails_with_advice(ctx, monkeypatch, capsys):
    monkeypatch.setattr(devices, "capacity_bytes", lambda kind, device: 2 * 2**30)
    monkeypatch.setattr(devices, "peak_memory_bytes", lambda kind: int(1.99 * 2**30))
    assert smoke.run_smoke(ctx) == smoke.SMOKE_FAILED_EXIT
    report = _report(ctx)
    assert report["passed"] is False
    check = next(c for c in report["checks"] if c["name"] == "memory_headroom")
    assert check["passed"] is False
    # 2 processes share the model state: the projection is below the 1-process peak
    projected = report["projected_peak_memory_bytes_per_device"]
    assert projected["2"] < projected["1"]
    err = capsys.readouterr().err
    for hint in ("train.micro_batch_size", "train.precision: bf16",
                 "train.activation_checkpointing: true", "more devices"):
        assert hint in err
    # the smaller micro batches measured too (every peak reads 1.99 GiB here): none fits, and it says so
    assert "train.micro_batch_size: micro batch 4 does not fit" in err and "none fits" in err
    assert [m["micro_batch_size"] for m in report["decisions"]["train.micro_batch_size"]["measured"]] == [1]
    assert layout.results(ctx.cfg, "logs", "smoke_1card", "report.json").is_file()
    assert report["projected_wall_time_s"]["1"] > 0 and report["losses"]
    assert report["host_ops"]["ops_per_micro_step"] > 1000 and report["compile_s"] == 0.0  # eager on the CPU


@pytest.mark.integration  # ~1 min
def test_an_operation_count_that_fails_leaves_the_gates_verdict(ctx, monkeypatch, capsys):
    """The count of a micro-step's operations is a measurement after the steps ran: an error in it
    is noted in the report and on the log, and the gate decides on the steps as before."""
    from pisft.introspect import host_ops

    def broken(self):
        raise RuntimeError("a dispatch mode this torch lacks")

    monkeypatch.setattr(host_ops.DispatchedOps, "__enter__", broken)
    assert smoke.run_smoke(ctx) == 0
    report = _report(ctx)
    assert report["passed"] is True
    assert report["host_ops"] == {"error": "RuntimeError: a dispatch mode this torch lacks"}
    assert "the operations of a micro-step were not counted" in capsys.readouterr().err


@pytest.mark.integration  # ~40 s: the memory estimate for 1 and N devices
def test_out_of_memory_is_a_failed_report(ctx, monkeypatch, capsys):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(smoke.loop, "run", oom)
    assert smoke.run_smoke(ctx) == smoke.SMOKE_FAILED_EXIT
    report = _report(ctx)
    assert report["passed"] is False
    assert report["checks"][0]["name"] == "fits_in_memory"
    assert "out of device memory at micro batch 4" in capsys.readouterr().err


def test_tensorboard_option_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    # As on a host without the package: torch.utils.tensorboard's own `import tensorboard` fails.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(PisftError, match="train.tensorboard.*pip install tensorboard"):
        TensorBoardSink(tmp_path)


def test_tensorboard_sink_writes_the_numeric_metrics(tmp_path, monkeypatch):
    """With the package: every numeric metric becomes a scalar train/<key> at its step."""
    calls = []

    class SummaryWriter:  # the interface pisft uses, recording (this environment has no tensorboard)
        def __init__(self, log_dir):
            calls.append(("open", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def flush(self):
            calls.append(("flush",))

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=SummaryWriter))
    sink = TensorBoardSink(tmp_path)
    sink.write({"step": 3, "loss": 0.5, "lr": 1e-4, "mfu": None, "device": "cpu", "peak": [1, 2]})
    sink.close()
    assert calls == [("open", str(tmp_path)), ("train/loss", 0.5, 3), ("train/lr", 1e-4, 3),
                     ("flush",), ("close",)]


@pytest.mark.integration  # ~1 min: the memory estimate for 1 and N devices, then the smoke steps
def test_stateless_steps_project_what_fsdp_leaves_on_each_of_n_devices(ctx, monkeypatch):
    """pi0.5 on a 64 GB card: the whole model with AdamW state does not fit one device, so the
    smoke run takes AdamW's first step without its state. The N-device projection must equal the
    measured peak with the model state replaced by what FSDP really keeps on one of N devices:
    pisft.introspect.estimate shards the same model on N (fake) ranks and steps the fused AdamW."""
    n = ctx.cfg.world_size
    assert n > 1
    estimate = smoke._estimate(ctx.cfg)  # the real estimate, computed once for this test
    monkeypatch.setattr(smoke, "_estimate", lambda cfg: estimate)
    one, sharded = estimate["1"], estimate[str(n)]
    # a card as large as the whole-model estimate: with AdamW state it does not fit
    monkeypatch.setattr(devices, "capacity_bytes", lambda kind, device: one["total_bytes"])
    peak = one["total_bytes"] - one["state_bytes"]["optimizer"]  # the allocator's peak without AdamW
    monkeypatch.setattr(devices, "peak_memory_bytes", lambda kind: peak)
    smoke.run_smoke(ctx)
    report = _report(ctx)
    assert report["optimizer"].startswith("sign descent")
    assert report["last_loss"] < report["first_loss"]
    projected = report["projected_peak_memory_bytes_per_device"]
    # 1 device: the measured peak plus the AdamW moments the estimate's optimizer step created
    assert projected["1"] == pytest.approx(peak + one["state_bytes"]["optimizer"], rel=1e-3)
    # N devices: the whole measured model state out, one rank's FSDP shard of it (and of AdamW) in
    expected = peak - report["model_state_bytes"] + sum(sharded["state_bytes"].values())
    assert projected[str(n)] == pytest.approx(expected, rel=1e-3)
    assert projected[str(n)] < projected["1"]
    headroom = next(c for c in report["checks"] if c["name"] == "memory_headroom")
    assert f"on {n} device(s)" in headroom["detail"]


def test_sign_descent_is_adams_first_step():
    p1 = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
    p2 = torch.nn.Parameter(p1.detach().clone())
    for p in (p1, p2):
        p.grad = torch.tensor([0.3, -2.0, 1e-3])
    torch.optim.AdamW([p1], lr=0.1, weight_decay=0.01, eps=1e-12).step()
    smoke.SignDescent([p2], lr=0.1, weight_decay=0.01).step()
    torch.testing.assert_close(p2, p1)


# ------------------------------------------------------------------ the one-card gate (fast)
GIB = 2**30


def test_one_card_gate_compares_with_free_memory_and_says_so():
    """pi0.5's ~51 GiB one-card estimate on a 64 GiB card: 95% of the capacity would admit it,
    what the card reports free after the runtime and other processes may not."""
    hccl = smoke.hccl_buffer_bytes("npu", {})
    assert hccl == 400 * 2**20  # 2 x HCCL_BUFFSIZE (200 MB by default)
    roomy = smoke.one_card_gate(51 * GIB, 60 * GIB, 64 * GIB, 0.05, hccl)
    assert roomy["fits"] and roomy["decided_by"] == "free"
    assert roomy["needed_bytes"] == 51 * GIB + hccl + int(0.05 * 64 * GIB)
    tight = smoke.one_card_gate(51 * GIB, 54 * GIB, 64 * GIB, 0.05, hccl)
    assert not tight["fits"] and tight["decided_by"] == "free"
    assert "54.0 GiB free" in tight["detail"] and "free memory decided" in tight["detail"]
    assert 51 * GIB <= 0.95 * 64 * GIB  # the old rule (95% of capacity) would have said "fits"
    no_free = smoke.one_card_gate(51 * GIB, None, 64 * GIB, 0.05, hccl)
    assert no_free["fits"] and no_free["decided_by"] == "capacity"
    assert smoke.one_card_gate(51 * GIB, None, None, 0.05)["fits"]  # CPU: nothing to compare


def test_hccl_buffers_follow_hccl_buffsize_on_npu_only():
    assert smoke.hccl_buffer_bytes("npu", {"HCCL_BUFFSIZE": "512"}) == 1024 * 2**20
    assert smoke.hccl_buffer_bytes("cuda", {"HCCL_BUFFSIZE": "512"}) == 0


def test_the_gate_picks_sign_descent_when_the_free_memory_is_short():
    cfg = config_mod.load(CONFIG)
    estimate = {"1": {"total_bytes": 51 * GIB}}
    fits, label, gate = smoke._adamw_fits_one_device(
        cfg, estimate, {"free": 50 * GIB, "capacity": 64 * GIB, "hccl": 0})
    assert not fits and label.startswith("sign descent") and "free memory decided" in label
    assert gate["decided_by"] == "free"
    fits, label, _ = smoke._adamw_fits_one_device(cfg, estimate, {"free": None, "capacity": None})
    assert fits and label == "adamw"
