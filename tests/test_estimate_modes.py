"""The memory estimate knows the trainable mode (train.trainable): frozen parameters get no
gradient, no optimizer state and no EMA copy; the frozen prefix keeps no activations for backward;
the largest micro batch per mode brackets the capacity."""

from __future__ import annotations

import pytest

from pisft.config import from_dict
from pisft.introspect import estimate as E
from pisft.introspect import micro_batch_fits as F
from pisft.model.policy import build_policy
from pisft.train import trainable


def _cfg(tmp_path, **train):
    train = {"micro_batch_size": 2, "global_batch_size": 8, "nproc_per_node": 2, "fsdp_min_unit_params": 0,
             "precision": "bf16", "activation_checkpointing": True, **train}
    return from_dict({"results_dir": str(tmp_path / "results"), "train": train})


@pytest.mark.integration  # a few memory simulations of the tiny model
def test_the_estimate_counts_only_what_the_mode_trains(tmp_path):
    est = {m: E.estimate_memory(_cfg(tmp_path, trainable=m)) for m in ("all", "expert", "lora")}
    for mode in ("expert", "lora"):
        policy = build_policy("tiny", seed=0, device="meta")
        spec = trainable.lora_spec("openpi") if mode == "lora" else None
        trainable.apply_mode(policy, mode, spec)
        from pisft.model.pi05.construction import detach_expert_head
        detach_expert_head(policy)
        trained = trainable.count_parameters(policy)["trainable"]
        assert est[mode]["trainable"] == mode
        # AdamW's two fp32 moments of the trained parameters, sharded over 2 devices
        assert est[mode]["state_bytes"]["optimizer"] <= 8 * trained / 2 * 1.01
        assert est[mode]["state_bytes"]["optimizer"] < est["all"]["state_bytes"]["optimizer"]
        assert est[mode]["state_bytes"]["grads"] < est["all"]["state_bytes"]["grads"]
    # frozen parameters held in bf16 (except what LeRobot keeps in fp32): fewer parameter bytes
    assert est["expert"]["state_bytes"]["params"] < est["all"]["state_bytes"]["params"]
    assert "param shards (fp32, frozen bf16)" in E.format_report(est["expert"])  # the report says so
    assert "parameter shards (fp32)" in E.format_report(est["all"])
    # the frozen prefix keeps nothing for backward
    assert est["expert"]["bytes"]["activations"] < est["all"]["bytes"]["activations"]
    assert est["expert"]["bytes"]["ema"] == 0 and not est["expert"]["ema"]


@pytest.mark.integration
def test_an_ema_is_one_fp32_copy_of_the_trained_shards():
    def make():
        policy = build_policy("tiny", seed=0, device="meta")
        trainable.apply_mode(policy, "expert")
        return policy

    off = E.simulate_step(make, world_size=2, micro_batch=1, precision="bf16", checkpointing=True)
    on = E.simulate_step(make, world_size=2, micro_batch=1, precision="bf16", checkpointing=True, ema=True)
    assert off["bytes"]["ema"] == 0
    assert on["bytes"]["ema"] == on["state_bytes"]["grads"]  # fp32, the same shards as the gradients
    assert on["bytes"]["total"] == off["bytes"]["total"] + on["bytes"]["ema"]


@pytest.mark.integration
def test_the_largest_micro_batch_is_bracketed_by_simulated_steps(tmp_path):
    cfg = _cfg(tmp_path)
    one = F._fit_total(F.json.dumps(F.config_mod_dict(cfg)), "tiny", "expert", True, 1, 2)
    eight = F._fit_total(F.json.dumps(F.config_mod_dict(cfg)), "tiny", "expert", True, 8, 2)
    capacity = int((one + (eight - one) * 2.5 / 7) / (1 - cfg.smoke.min_memory_headroom)) + 1  # about 3.5
    fits = E.largest_micro_batches(cfg, modes=("expert",), preset="tiny", devices={"small": ("cuda", capacity)})
    cell = fits["modes"]["expert"]["checkpointing"]["small"]
    best = cell["micro_batch"]
    assert cell["exact"] and 1 <= best < 8
    raw = F.json.dumps(F.config_mod_dict(cfg))
    assert F._fit_total(raw, "tiny", "expert", True, best, 2) <= cell["limit_bytes"]
    assert F._fit_total(raw, "tiny", "expert", True, best + 1, 2) > cell["limit_bytes"]
    text = E.format_fits(fits)
    assert "expert" in text and "small" in text
