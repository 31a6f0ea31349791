"""The smoke gate in one process: a too-small memory headroom and an out-of-memory both fail
with a report and an actionable message."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from train_fixtures import CONFIG, overrides, results_dir

from pisft import config as config_mod
from pisft import device as devices
from pisft.train import smoke
from pisft.train.metrics import TensorBoardSink
from pisft.train.stage import Context


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
    return json.loads(ctx.cfg.results("smoke", "report.json").read_text())


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
    assert ctx.cfg.results("logs", "smoke_1card", "report.json").is_file()
    assert report["projected_wall_time_s"]["1"] > 0 and report["losses"]


def test_out_of_memory_is_a_failed_report(ctx, monkeypatch, capsys):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(smoke.loop, "run", oom)
    assert smoke.run_smoke(ctx) == smoke.SMOKE_FAILED_EXIT
    report = _report(ctx)
    assert report["passed"] is False
    assert report["checks"][0]["name"] == "fits_in_memory"
    assert "out of device memory at micro batch 4" in capsys.readouterr().err


def test_tensorboard_option_needs_the_package(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        from pisft.errors import PisftError

        with pytest.raises(PisftError, match="train.tensorboard"):
            TensorBoardSink(tmp_path)
        return
    sink = TensorBoardSink(tmp_path)
    sink.write({"step": 1, "loss": 0.5, "mfu": None})
    sink.close()
    assert any(tmp_path.iterdir())


def test_model_state_too_big_for_one_device_uses_stateless_steps(ctx, monkeypatch):
    """pi0.5 on a 64 GB card: whole model + AdamW state does not fit one device; the smoke run
    takes AdamW's first step without its state and adds the state to the projection."""
    grads = 4 * 2_000_000
    monkeypatch.setattr(smoke, "_estimate", lambda cfg: {
        "1": {"total_bytes": 70 * 2**30, "state_bytes": {"grads": grads}},
        "2": {"total_bytes": 40 * 2**30, "state_bytes": {"grads": grads // 2}}})
    monkeypatch.setattr(devices, "capacity_bytes", lambda kind, device: 64 * 2**30)
    monkeypatch.setattr(devices, "peak_memory_bytes", lambda kind: 30 * 2**30)
    assert smoke.run_smoke(ctx) == 0
    report = _report(ctx)
    assert report["optimizer"].startswith("sign descent")
    assert report["last_loss"] < report["first_loss"]
    assert report["adamw_state_bytes_analytic"] == 2 * grads
    projected = report["projected_peak_memory_bytes_per_device"]
    assert projected["1"] == 30 * 2**30 + 2 * grads
    assert report["passed"] is True


def test_sign_descent_is_adams_first_step():
    p1 = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
    p2 = torch.nn.Parameter(p1.detach().clone())
    for p in (p1, p2):
        p.grad = torch.tensor([0.3, -2.0, 1e-3])
    torch.optim.AdamW([p1], lr=0.1, weight_decay=0.01, eps=1e-12).step()
    smoke.SignDescent([p2], lr=0.1, weight_decay=0.01).step()
    torch.testing.assert_close(p2, p1)
