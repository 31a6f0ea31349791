"""pisft.model.estimate: parameter count and per-device memory, checked against a measured peak."""

from __future__ import annotations

import json

import pytest

from pisft.config import from_dict
from pisft.model.estimate import estimate_memory


def _cfg(tmp_path, **train):
    train.setdefault("global_batch_size", train.get("micro_batch_size", 4) * 2 * train.get("nproc_per_node", 2))
    return from_dict({"results_dir": str(tmp_path / "results"), "train": train})


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


def test_counts_and_sharding(tiny_estimates):
    from pisft.model.policy import build_policy

    base, world1 = tiny_estimates["base"], tiny_estimates["world1"]
    total = sum(p.numel() for p in build_policy("tiny", seed=0, device="meta").parameters())
    assert base["params_total"] == total
    assert 0 < base["params_trained"] < total  # the expert's lm_head and the VLM's last MLP get no gradient
    assert base["world_size"] == 2 and base["bytes"]["params"] == 4 * total // 2
    assert base["bytes"]["optimizer"] == 8 * base["params_trained"] // 2
    for key in ("params", "grads", "optimizer"):
        assert world1["bytes"][key] == pytest.approx(2 * base["bytes"][key], abs=2)
    assert world1["bytes"]["activations"] == base["bytes"]["activations"]  # not sharded
    assert base["bytes"]["total"] == sum(v for k, v in base["bytes"].items() if k != "total")
    assert base["sequence"] == {"prefix_tokens": 2 * 16 + 48, "suffix_tokens": 10}


def test_activations_follow_micro_batch_checkpointing_and_precision(tiny_estimates):
    act = {k: v["bytes"]["activations"] for k, v in tiny_estimates.items()}
    assert 1.6 < act["batch16"] / act["base"] < 2.2
    assert act["ckpt"] < 0.8 * act["base"]
    assert act["bf16"] < act["base"]
    assert tiny_estimates["bf16"]["bytes"]["gathered"] < tiny_estimates["base"]["bytes"]["gathered"]


def test_estimate_uses_the_fetched_model_config(tmp_path):
    from pisft.model import fetch

    cfg = _cfg(tmp_path, micro_batch_size=4)
    before = estimate_memory(cfg)
    fetch.run(cfg)
    after = estimate_memory(cfg)
    assert after["model"].endswith("base_model") and before["model"] == "preset tiny"
    assert after["params_total"] == before["params_total"]


def test_cli_json(tmp_path, capsys):
    from pisft import cli

    config = tmp_path / "c.yaml"
    config.write_text(f"results_dir: {tmp_path / 'results'}\n")
    assert cli.main(["estimate", "--config", str(config), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params_total"] > 1_000_000 and out["gib"]["total"] > 0
    assert cli.main(["estimate", "--config", str(config)]) == 0
    assert "activations (peak)" in capsys.readouterr().out


@pytest.mark.integration
def test_estimate_matches_a_measured_cpu_peak(tmp_path):
    """One real step of the tiny model on CPU: its peak RSS above the pre-step RSS is within
    15% of the estimated activation peak (parameters and optimizer state are exact counts)."""
    from pisft.model.measure import measure_in_subprocess

    for checkpointing in (False, True):
        measured = measure_in_subprocess("tiny", micro_batch=32, checkpointing=checkpointing)
        est = estimate_memory(_cfg(tmp_path, micro_batch_size=32, activation_checkpointing=checkpointing),
                              world_size=1)
        ratio = est["bytes"]["activations"] / measured["step_peak_bytes"]
        assert 0.85 < ratio < 1.15, (checkpointing, est["bytes"]["activations"], measured)
        assert measured["params_bytes"] == est["bytes"]["params"]
        assert measured["optimizer_bytes"] == est["bytes"]["optimizer"]


def test_pi05_estimate_on_the_meta_device(tmp_path):
    cfg = from_dict({"results_dir": str(tmp_path / "none"),
                     "model": {"preset": "pi05", "source": "/data/pi05_base"},
                     "train": {"nproc_per_node": 8, "micro_batch_size": 4, "global_batch_size": 32,
                               "precision": "bf16"}})
    est = estimate_memory(cfg)
    assert 3.3e9 <= est["params_total"] <= 3.8e9
    assert est["sequence"] == {"prefix_tokens": 2 * 256 + 200, "suffix_tokens": 50}
    # sharded state over 8 devices: (4 + 4 + 8) bytes per trained parameter / 8, about 6.2 GiB
    assert 5 < est["gib"]["params"] + est["gib"]["grads"] + est["gib"]["optimizer"] < 7
    assert est["gib"]["activations"] > 5
