"""`bench --only data_loader`: the training loader's samples per core second, at a small size.

Structure and consistency only: no verdict rests on this host's speed."""

from __future__ import annotations

import importlib

import pytest

from pisft import config as config_mod
from pisft.bench import data_loader_bench
from pisft.bench import run as bench_run


def test_data_loader_is_a_bench_part():
    module, func = bench_run.COMPONENT_BENCHES["data_loader"].split(":")
    assert getattr(importlib.import_module(module), func) is data_loader_bench.run
    assert "data_loader" in bench_run.part_names()


@pytest.mark.integration  # ~15 s: demo data, its conversion, LeRobot's reader and processors
def test_data_loader_bench_figures_are_consistent(tmp_path):
    cfg = config_mod.load(config_mod.DEFAULT_CONFIG)
    # tiny model config (64 px input) on 96 px images: the host resize has work to do
    out = data_loader_bench.run(cfg, tmp_path, episodes_per_task=1, length=6, image_size=96,
                                preset="tiny", micro_batch=2, warmup_batches=1, timed_batches=3,
                                rounds=2, split_batches=2, decode_images=6, augment_batches=2)
    assert out["image_size"] == 96 and out["cameras"] == 2
    assert out["dataset"]["frames"] == 60 and out["dataset"]["image_size"] == 96
    assert (tmp_path / "dataset" / "meta" / "info.json").is_file()  # a real converted dataset
    assert out["model_input_resolution"] == [64, 64]
    assert out["preset"] == "tiny" and out["chunk_size"] == 10 and out["prompt_tokens"] == 48

    # the rate is the samples timed over the CPU seconds they took
    assert out["samples_timed"] == 2 * 3 * 2  # rounds x batches x micro batch
    assert out["cpu_s"] > 0 and out["wall_s"] > 0
    assert out["samples_per_core_s"] == pytest.approx(out["samples_timed"] / out["cpu_s"], rel=0.01)
    assert out["ms_per_sample"] == pytest.approx(1e3 / out["samples_per_core_s"], rel=0.01)
    assert out["samples_per_wall_s"] == pytest.approx(out["samples_timed"] / out["wall_s"], rel=0.01)
    assert len(out["samples_per_core_s_by_round"]) == 2
    assert all(r > 0 for r in out["samples_per_core_s_by_round"])

    split = out["split_ms_per_sample"]
    assert split["samples"] == 2 * 2
    assert split["read_and_decode"] > 0 and split["collate_and_preprocess"] > 0
    assert split["of_which_png_decode"] == pytest.approx(2 * out["decode"]["decode_ms_per_image"], abs=2e-3)
    assert split["of_which_row_read_chunk_draws"] >= 0
    resize = out["host_resize"]
    assert resize["needed"] and resize["to"] == [64, 64] and resize["ms_per_sample"] > 0
    assert 0 < resize["samples_per_core_s_if_loader_resized"] < out["samples_per_core_s"] * 1.01

    assert out["goal_samples_per_core_s"] == 20 and out["goal_samples_per_card_s"] == 13
    assert out["meets_goal"] == (out["samples_per_core_s"] >= 20)
    est = out["training_consumption_estimate"]
    # the analytic training FLOPs of the tiny model at the prompt's tokens, and the peak table's 910B
    # row (the 910B3 figure): what the estimate divides, exactly
    from pisft.model.policy import build_policy
    from pisft.model.pi05.flops import pi05_training_flops_per_sample
    from pisft.train.metrics import peak_flops_for

    assert est["training_flops_per_sample"] == pi05_training_flops_per_sample(
        build_policy("tiny", seed=0, device="meta"), lang_tokens=out["prompt_tokens"])
    assert (est["peak_flops"], est["peak_flops_source"]) == peak_flops_for(data_loader_bench.CARD, "npu")
    assert est["samples_per_card_s"] == pytest.approx(
        est["peak_flops"] * est["mfu_assumed"] / est["training_flops_per_sample"], rel=0.01)
    assert all(isinstance(a, str) for a in est["assumptions"]) and est["assumptions"]
    assert out["cores_per_card_at_goal"] == pytest.approx(13 / out["samples_per_core_s"], abs=0.01)
    aug = out["augment"]  # data.augment: openpi beside the plain loader, the same samples
    assert aug["kind"] == "openpi" and aug["samples"] == 2 * 2 * 2  # rounds x augment_batches x micro
    assert aug["ms_per_sample_with"] > 0 and aug["ms_per_sample_without"] > 0
    assert aug["cost_ms_per_sample"] == pytest.approx(aug["ms_per_sample_with"] - aug["ms_per_sample_without"],
                                                      abs=2e-3)
    assert aug["cameras_cropped_and_rotated"] == 1


def test_data_loader_bench_refuses_empty_timing(tmp_path):
    cfg = config_mod.load(config_mod.DEFAULT_CONFIG)
    with pytest.raises(ValueError, match="timed_batches"):
        data_loader_bench.run(cfg, tmp_path, timed_batches=0)
