"""The GPU step benchmark's code path, dry-run on CPU with the tiny preset: bf16 mixed precision
with and without activation checkpointing through FSDP2 (the Ascend/GPU training settings), and
the choice of what one device can hold (AdamW, or AdamW's first step without its state) against a
stand-in device capacity."""

from __future__ import annotations

import math

import pytest
import torch

from pisft import device as devices
from pisft.bench import gpu_step


def _args(tmp_path, *extra, device="cpu", trainable="all"):
    return gpu_step.parse(["--device", device, "--preset", "tiny", "--micro", "2", "--max-micro", "2",
                           "--steps", "2", "--warmup", "0", "--trainable", trainable,
                           "--out", str(tmp_path / "g.json"), *extra,
                           # eager unless asked: the compiled step is tests/test_train_compile.py's
                           *(() if "--compile" in extra else ("--compile", "off"))])


NO_GPU = ("no CUDA GPU here (torch.cuda.is_available() is False): the bf16 step is checked on the CPU "
          "only; on a host with a GPU this test runs it there")


@pytest.mark.integration  # ~15-55 s each: whole training steps of the tiny model
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason=NO_GPU))])
def test_bf16_step_with_and_without_activation_checkpointing(tmp_path, capsys, device):
    result = gpu_step.run(_args(tmp_path, device=device))
    assert result["kind"] == device
    runs = result["runs"]
    assert [r["activation_checkpointing"] for r in runs] == [False, True]
    for r in runs:
        assert r["micro_batch_size"] == 2 and not r.get("oom")
        assert all(math.isfinite(x) for x in r["losses"])
        assert r["step_time_s"] > 0 and r["flops_per_sample"] > 0
        assert r["optimizer"] == "adamw"
        if device == "cpu":
            assert r["mfu"] is None  # no peak figure for CPU
            assert r["peak_reserved_bytes"] == r["peak_memory_bytes"]  # CPU: both the peak RSS
        else:  # the caching allocator's figures, from this device
            assert r["peak_reserved_bytes"] >= r["peak_memory_bytes"] > 0
            assert (r["mfu"] is None) == (result["peak_flops"] is None)
    # same weights, same batch: checkpointing changes memory, not the numbers
    assert runs[0]["losses"][0] == runs[1]["losses"][0]
    assert result["largest_micro_batch"] == {"all": {"False/off": 2, "True/off": 2}}
    assert result["optimizer"] == {"all": {"False": "adamw", "True": "adamw"}}
    out = capsys.readouterr().out
    if device == "cpu":  # no fixed capacity: today's behaviour (AdamW), and the output says so
        assert "measuring AdamW (the training's optimizer step); no fixed device capacity" in out
    else:  # the GPU's capacity holds the tiny step with AdamW
        assert result["device"] == torch.cuda.get_device_name(0) and result["capacity_bytes"] > 0
        assert all(plan["reason"].endswith("it fits") for plan in result["optimizer_plan"]["all"].values())


@pytest.fixture(scope="module")
def need():
    """The estimate for the tiny step (micro 2, bf16, checkpointing on), computed once."""
    return gpu_step.estimate_one_device("tiny", 2, "bf16", True)


@pytest.fixture
def cached_estimate(monkeypatch, need):
    monkeypatch.setattr(gpu_step, "estimate_one_device", lambda *args: dict(need))
    return need


def _capacity_for(budget: float, headroom: float = 0.10) -> int:
    return int(budget / (1 - headroom))


@pytest.mark.integration  # ~15-55 s each: whole training steps of the tiny model
def test_the_choice_follows_the_device_capacity(tmp_path, cached_estimate):
    need = cached_estimate
    assert need["sign_descent"] < need["adamw"]  # AdamW's moments are part of the peak
    args = _args(tmp_path, "--checkpointing", "on")
    roomy = gpu_step.plan_optimizer(args, True, _capacity_for(need["adamw"] * 1.01))
    assert roomy["optimizer"] == "adamw" and roomy["reason"].endswith("it fits")
    between = gpu_step.plan_optimizer(args, True, _capacity_for((need["adamw"] + need["sign_descent"]) / 2))
    assert between["optimizer"] == "sign_descent"
    assert "does not fit; without AdamW's state" in between["reason"]
    assert "either" not in between["reason"]
    cramped = gpu_step.plan_optimizer(args, True, _capacity_for(need["sign_descent"] * 0.5))
    assert cramped["optimizer"] == "sign_descent" and "use several cards" in cramped["reason"]
    forced = gpu_step.plan_optimizer(_args(tmp_path, "--optimizer", "adamw"), True, 1)
    assert forced["optimizer"] == "adamw"


@pytest.mark.integration  # ~15-55 s each: whole training steps of the tiny model
def test_a_device_too_small_for_adamw_measures_the_stateless_first_step(tmp_path, monkeypatch, capsys,
                                                                        cached_estimate):
    """pi0.5 + AdamW on one 64 GB card, in miniature: a stand-in capacity between the two peaks."""
    need = cached_estimate
    capacity = _capacity_for((need["adamw"] + need["sign_descent"]) / 2)
    monkeypatch.setattr(devices, "capacity_bytes", lambda kind, device: capacity)
    result = gpu_step.run(_args(tmp_path, "--checkpointing", "on"))
    assert result["capacity_bytes"] == capacity
    assert result["optimizer"] == {"all": {"True": "sign_descent"}}
    plan = result["optimizer_plan"]["all"]["True"]
    assert plan["estimated_peak_bytes"] == need and plan["budget_bytes"] < need["adamw"]
    (run,) = result["runs"]
    assert run["optimizer"] == "sign_descent" and not run.get("oom")
    assert all(math.isfinite(x) for x in run["losses"])
    out = capsys.readouterr().out
    assert "checkpointing on: measuring AdamW's first step without AdamW's state" in out
    assert "does not fit" in out


@pytest.mark.integration  # ~30 s: whole training steps of the tiny model in three modes
def test_each_trainable_mode_is_measured_with_its_own_flops(tmp_path):
    """--trainable: each mode built as the training builds it; MFU's FLOPs are the mode's own (a
    frozen prefix costs its forward only), and the optimizer holds the trained parameters only."""
    result = gpu_step.run(_args(tmp_path, "--checkpointing", "on", trainable="all,expert,lora"))
    runs = {r["trainable"]: r for r in result["runs"]}
    assert sorted(runs) == ["all", "expert", "lora"] and result["trainable"] == ["all", "expert", "lora"]
    assert all(not r.get("oom") and all(math.isfinite(x) for x in r["losses"]) for r in runs.values())
    params = result["params"]
    assert params["all"]["trainable"] == params["all"]["total"]
    assert 0 < params["expert"]["trainable"] < params["expert"]["total"]
    assert 0 < params["lora"]["trainable"] < params["lora"]["total"]
    assert runs["expert"]["flops_per_sample"] < 0.6 * runs["all"]["flops_per_sample"]
    assert runs["expert"]["flops_per_sample"] < runs["lora"]["flops_per_sample"] < runs["all"]["flops_per_sample"]
    assert result["largest_micro_batch"] == {m: {"True/off": 2} for m in ("all", "expert", "lora")}


def test_an_unknown_mode_is_refused_naming_the_modes(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _args(tmp_path, trainable="all,frozen")
    err = capsys.readouterr().err
    assert "'all,frozen'" in err and "expert" in err and "no_vision" in err and "lora" in err
