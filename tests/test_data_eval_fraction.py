"""data.eval_fraction 0: every episode trains, `evaluate` writes a "not run" result; at a RECAP
iteration the pool's held-out episodes are the value model's only (recap.holdout_fraction)."""

from __future__ import annotations

import json

import pytest

from pisft import config as config_mod
from pisft.data.convert import Options
from pisft.data.split import stratified_split
from pisft.evaluate import offline
from pisft.stages import EVALUATE, STAGES


def test_eval_fraction_zero_holds_nothing_out_and_is_valid():
    tasks = {i: f"task {i % 3}" for i in range(12)}
    assert stratified_split(tasks, 0.0, 0) == {"train": list(range(12)), "eval": []}
    assert len(stratified_split(tasks, 0.25, 0)["eval"]) == 3  # one of the four episodes of each task
    assert config_mod.from_dict({"data": {"eval_fraction": 0.0}}).data.eval_fraction == 0.0
    for key, bad in (("data", {"eval_fraction": 1.0}), ("recap", {"holdout_fraction": 1.0}),
                     ("recap", {"holdout_fraction": -0.1})):
        with pytest.raises(config_mod.ConfigError, match=f"{key}.{next(iter(bad))}"):
            config_mod.from_dict({key: bad})


def test_a_recap_pool_is_split_for_the_value_model_only():
    cfg = config_mod.from_dict({"data": {"eval_fraction": 0.3}, "recap": {"holdout_fraction": 0.1}})
    assert Options.from_config(cfg).data.eval_fraction == 0.3  # the SFT dataset: data.eval_fraction
    assert Options.from_config(cfg.at_iteration(0)).data.eval_fraction == 0.3
    cfg.recap.iterations = 1
    assert Options.from_config(cfg.at_iteration(1)).data.eval_fraction == 0.1  # the pool: the value model's
    assert config_mod.RecapConfig().holdout_fraction == 0.0  # by default the whole pool trains
    assert "recap.holdout_fraction" in STAGES["convert_recap"].keys_at(1)
    assert "recap.holdout_fraction" not in STAGES["convert_recap"].keys_at(0)


def test_evaluate_without_held_out_episodes_writes_every_output_as_not_run(tmp_path):
    cfg = config_mod.from_dict({"results_dir": str(tmp_path), "data": {"eval_fraction": 0.0}})
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "split.json").write_text(json.dumps({"train": [0, 1], "eval": []}))
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 1.0 / s, "lr": 1e-3}) + "\n" for s in (1, 2, 3)))
    metrics = offline.run(cfg)
    assert metrics == {"evaluated": False, "note": offline.NO_HELD_OUT}
    for rel in (out.path for out in EVALUATE.outputs):  # every output the workflow declares
        assert (tmp_path / rel).is_file() and (tmp_path / rel).stat().st_size > 0, rel
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["evaluated"] is False
    assert "not run" in (tmp_path / "eval" / "report.md").read_text()
    assert (tmp_path / "eval" / "per_step.csv").read_text().startswith("step,base_action_mse,")
    # eval_fraction > 0 with nothing held out still goes to the evaluation, which says the dataset
    # holds no episode out (too few episodes per task): never a silent "not run"
    assert offline._holds_episodes_out(
        config_mod.from_dict({"results_dir": str(tmp_path), "data": {"eval_fraction": 0.2}}))
