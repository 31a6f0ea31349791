"""pisft.introspect.estimate: parameter count and per-device peak memory of the training step (run on
fake tensors), checked against a measured CPU step at two sizes."""

from __future__ import annotations

import json

import pytest

from pisft.config import from_dict
from pisft.introspect.estimate import estimate_memory


def _cfg(tmp_path, model=None, **train):
    micro, nproc = train.get("micro_batch_size", 4), train.get("nproc_per_node", 2)
    train.setdefault("global_batch_size", micro * 2 * nproc)
    train.setdefault("fsdp_min_unit_params", 0)  # the layer units (an accelerator's layout)
    return from_dict({"results_dir": str(tmp_path / "results"), "model": model or {}, "train": train})


def _training_model(preset: str):
    from pisft.model.pi05.construction import prepare_for_training
    from pisft.model.policy import build_policy

    policy = build_policy(preset, seed=0, device="meta")
    prepare_for_training(policy, checkpointing=False)
    return policy


@pytest.mark.parametrize(("device", "configured", "expected"), [
    ("cpu", -1, 16_000_000), ("npu", -1, 0), ("cuda", -1, 0), ("cpu", 0, 0), ("npu", 5_000_000, 5_000_000)])
def test_the_estimate_simulates_the_units_the_run_will_have(tmp_path, monkeypatch, device, configured,
                                                             expected):
    from pisft.introspect import estimate

    seen = {}

    def simulate(make, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop after the layout was chosen")

    monkeypatch.setattr(estimate, "simulate_step", simulate)
    cfg = from_dict({"results_dir": str(tmp_path), "device": device,
                     "train": {"fsdp_min_unit_params": configured}})
    with pytest.raises(RuntimeError, match="stop after"):
        estimate_memory(cfg)
    assert seen["min_unit_params"] == expected


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_a_fetched_base_of_another_preset_is_not_the_model_estimated(tmp_path, monkeypatch, capsys, preset):
    """`pisft estimate --set model.preset=...` after a run of another preset: the estimate is the
    asked preset's model, not the stale fetched base's (its JSON said "preset: pi05" over the tiny model)."""
    from pisft import layout
    from pisft.introspect import estimate
    from pisft.model import policy as policy_mod

    cfg = from_dict({"results_dir": str(tmp_path), "model": {"preset": preset}})
    base = layout.base_model(cfg)
    base.mkdir(parents=True)
    tiny = policy_mod.build_policy("tiny", seed=0, device="meta")
    policy_mod.write_config(tiny.config, base / policy_mod.CONFIG_FILE)
    (base / policy_mod.MODEL_INFO_FILE).write_text(json.dumps(policy_mod.model_info(tiny)))
    seen = {}

    def simulate(make, **kwargs):
        seen["preset"] = policy_mod.model_info(make())["preset"]
        raise RuntimeError("stop after the model was built")

    monkeypatch.setattr(estimate, "simulate_step", simulate)
    with pytest.raises(RuntimeError, match="stop after"):
        estimate_memory(cfg)
    assert seen["preset"] == preset
    err = capsys.readouterr().err
    assert ("holds a tiny model, the config asks for model.preset small" in err) == (preset == "small")


@pytest.fixture(scope="module")
def tiny_estimates(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("est")
    return {
        "base": estimate_memory(_cfg(tmp, micro_batch_size=8)),
        "batch16": estimate_memory(_cfg(tmp, micro_batch_size=16)),
        "ckpt": estimate_memory(_cfg(tmp, micro_batch_size=8, activation_checkpointing=True)),
        "world1": estimate_memory(_cfg(tmp, micro_batch_size=8), world_size=1),
        "bf16": estimate_memory(_cfg(tmp, micro_batch_size=8, precision="bf16")),
    }


@pytest.mark.integration  # ~25-50 s each: memory simulations on fake tensors
def test_counts_sharding_and_the_training_structure(tiny_estimates):
    from pisft.train.fsdp import choose_units

    base, world1 = tiny_estimates["base"], tiny_estimates["world1"]
    model = _training_model("tiny")
    total = sum(p.numel() for p in model.parameters())
    # the training model: LeRobot's minus the action expert's lm_head (never in the loss)
    assert model.model.paligemma_with_expert.gemma_expert.lm_head is None
    assert base["params_total"] == total
    assert 0 < base["params_trained"] < total  # the VLM's last MLP etc. get no gradient
    assert base["fsdp_units"] == len(choose_units(model))
    state, state1 = base["state_bytes"], world1["state_bytes"]
    # FSDP2 pads dim 0 of each shard to a multiple of the world size: a little above P/W
    assert 4 * total / 2 <= state["params"] < 4 * total / 2 * 1.05
    assert 8 * base["params_trained"] / 2 <= state["optimizer"] < 8 * base["params_trained"] / 2 * 1.05
    assert state1["params"] == 4 * total and state1["optimizer"] == 8 * base["params_trained"]
    assert state1["grads"] == 4 * base["params_trained"]
    # parameters and AdamW moments are held throughout the step: at the peak too
    assert base["bytes"]["params"] == state["params"] and base["bytes"]["optimizer"] == state["optimizer"]
    assert 0 <= base["bytes"]["grads"] <= state["grads"]
    assert base["bytes"]["total"] == sum(v for k, v in base["bytes"].items() if k != "total")
    assert base["total_bytes"] == base["bytes"]["total"]
    assert base["step_peak_bytes"] == base["total_bytes"] - state["params"] - state["optimizer"]
    assert base["sequence"] == {"prefix_tokens": 2 * 16 + 48, "suffix_tokens": 10}
    assert base["peak_phase"] in ("forward", "backward", "clip + optimizer")


@pytest.mark.integration  # ~25-50 s each: memory simulations on fake tensors
def test_activations_follow_micro_batch_checkpointing_and_precision(tiny_estimates):
    act = {k: v["bytes"]["activations"] for k, v in tiny_estimates.items()}
    gathered = {k: v["bytes"]["gathered"] for k, v in tiny_estimates.items()}
    assert act["batch16"] / act["base"] > 1.6
    # the peak may fall at another moment of the forward at micro 16 (fewer layers gathered, more
    # activations held); at that moment micro 8 held half the activations and no more than its
    # peak, so twice its peak's activations and gathered layers, less those gathered then, bound it
    assert act["batch16"] <= 1.02 * 2 * (act["base"] + gathered["base"] - gathered["batch16"])
    # checkpointing: the decoder layers hold their inputs only; on the tiny model the cameras'
    # tensors (saved for the patch embedding's backward) are most of what is left, so the peak is
    # what drops (45.6 -> 40.8 MB; the forward without it holds no unrun last-layer MLP: #45)
    assert act["ckpt"] < act["base"]
    assert tiny_estimates["ckpt"]["total_bytes"] < 0.92 * tiny_estimates["base"]["total_bytes"]
    assert act["bf16"] < act["base"]
    # bf16 compute copies (2 bytes) instead of fp32 ones
    assert tiny_estimates["bf16"]["bytes"]["gathered"] < tiny_estimates["base"]["bytes"]["gathered"]


@pytest.mark.integration  # ~25-50 s each: memory simulations on fake tensors
def test_estimate_uses_the_fetched_model_config(tmp_path):
    from pisft.model import fetch

    cfg = _cfg(tmp_path, micro_batch_size=4)
    before = estimate_memory(cfg)
    fetch.run(cfg)
    after = estimate_memory(cfg)
    assert after["model"].endswith("base_model") and before["model"] == "preset tiny"
    assert after["params_total"] == before["params_total"]
    assert after["total_bytes"] == before["total_bytes"]


@pytest.mark.integration  # ~25-50 s each: memory simulations on fake tensors
def test_cli_json(tmp_path, capsys):
    from pisft import cli

    config = tmp_path / "c.yaml"
    config.write_text(f"results_dir: {tmp_path / 'results'}\ntrain:\n  ema_decay: 0.999\n")
    assert cli.main(["estimate", "--config", str(config), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params_total"] > 1_000_000 and out["gib"]["total"] > 0
    # train.ema_decay: an fp32 copy of each trained parameter's shard (all of them train here, so
    # as many bytes as the fp32 parameter shards), held through the step: part of the peak
    assert out["bytes"]["ema"] == out["state_bytes"]["ema"] == out["state_bytes"]["params"]
    assert out["bytes"]["total"] == sum(v for k, v in out["bytes"].items() if k != "total")
    assert cli.main(["estimate", "--config", str(config)]) == 0
    text = capsys.readouterr().out
    assert "activations + temporaries" in text and "docs/memory.md" in text
    assert "EMA of trained params (fp32)" in text
    assert cli.main(["estimate", "--config", str(config), "--set", "train.ema_decay=0"]) == 0
    assert "EMA of trained" not in capsys.readouterr().out  # off: no line for it


@pytest.mark.integration
def test_inside_a_process_group_the_estimate_runs_in_a_subprocess(tmp_path):
    """The smoke stage asks for the estimate from a training process (a gloo/HCCL group exists)."""
    import torch.distributed as dist

    cfg = _cfg(tmp_path, micro_batch_size=4)
    here = estimate_memory(cfg)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        there = estimate_memory(cfg)
        assert estimate_memory(cfg, world_size=1)["world_size"] == 1  # computed in the same subprocess
    finally:
        dist.destroy_process_group()
    assert there == here


# The estimate against a measured CPU step (pisft.introspect.measure: the same training step for real,
# FSDP2 on one gloo process, real kernels; the live tensor storage at the step's peak, counted by
# the measurement): tiny in bf16 (the Ascend/CUDA precision) and a 104M-parameter preset in fp32
# (bf16 matmuls are too slow on a CPU without bf16 units). RSS is recorded beside it, never
# compared: it holds oneDNN's packed weights and scratchpads, which differ by CPU model (2.2x the
# tensors on a CPU with AMX, 2.0x on an AMD EPYC with AVX-512 BF16; docs/memory.md).
MEASURED_SIZES = [("tiny", 8, "bf16"), ("small", 4, "fp32")]


@pytest.mark.integration
@pytest.mark.parametrize(("preset", "micro", "precision"), MEASURED_SIZES)
def test_estimate_matches_a_measured_cpu_step(tmp_path, preset, micro, precision):
    from pisft.introspect.estimate import simulate_step
    from pisft.introspect.measure import measure_in_subprocess
    from pisft.model.policy import build_policy

    measured = measure_in_subprocess(preset, micro_batch=micro, checkpointing=True, precision=precision)
    est = simulate_step(lambda: build_policy(preset, seed=0, device="meta"), world_size=1,
                        micro_batch=micro, precision=precision, checkpointing=True)
    if preset == "small":
        assert est["params_total"] >= 100_000_000
    # The estimate runs the step on fake tensors (docs/memory.md, "How far it is checked"): the
    # measured peak to the byte, less the two float32 scalars the training step (pisft.train.step)
    # holds through its backward and the simulated one does not make: its loss sum and the
    # `loss / accum` the backward starts from (with both added the simulation meets it exactly).
    # (An estimate that forgot the per-layer checkpointing was 1.30 x.)
    assert measured["step_peak_bytes"] - est["step_peak_bytes"] == 2 * 4, (preset, est["step_peak_bytes"], measured)
    assert measured["rss_step_peak_bytes"] > 0  # information only
    assert measured["params_bytes"] == est["state_bytes"]["params"]
    assert measured["optimizer_bytes"] == est["state_bytes"]["optimizer"]


@pytest.mark.integration
def test_pi05_estimate_on_fake_tensors(tmp_path):
    cfg = _cfg(tmp_path / "none", model={"preset": "pi05", "source": "/data/pi05_base"},
               nproc_per_node=8, micro_batch_size=4, global_batch_size=32, precision="bf16",
               activation_checkpointing=True)
    est = estimate_memory(cfg)
    # 3.617B in LeRobot's model, minus the action expert's lm_head (257152 x 1024)
    assert est["params_total"] == 3_616_757_520 - 257_152 * 1024
    assert est["sequence"] == {"prefix_tokens": 2 * 256 + 200, "suffix_tokens": 50}
    # sharded state over 8 devices: (4 + 4 + 8) bytes per trained parameter / 8, about 6 GiB
    assert 5.5 < sum(est["state_bytes"].values()) / 2**30 < 6.5
    assert est["peak_phase"] == "backward"
    assert 10 < est["gib"]["total"] < 40


def test_the_measurement_counts_live_tensor_storage_on_real_tensors():
    """StepMemory on real tensors (what pisft.introspect.measure runs the step under): the peak is
    the largest sum of the storages alive together, views and in-place results add nothing,
    a freed storage and FSDP's resize_ to 0 and back are followed."""
    import torch

    from pisft.introspect.step_memory import StepMemory

    held = torch.zeros(1000)  # exists before: the baseline, not counted
    tracker = StepMemory()
    with tracker:
        a = torch.ones(1000)  # 4000 bytes
        b = a.view(10, 100)  # a view: no new storage
        a.add_(1)  # in place: no new storage
        c = torch.ones(500, dtype=torch.float64)  # 4000 bytes; 8000 live
        del a, b, c  # 0 live
        d = torch.ones(250)  # 1000 bytes
        held.untyped_storage().resize_(0)  # FSDP frees a storage from before: -4000 -> -3000
        held.untyped_storage().resize_(12000)  # and gathers it again: +12000 -> 9000 above the start
        del d
    peak, _, _ = tracker.peak()
    assert peak == 9000  # above the 8000 of a and c together
