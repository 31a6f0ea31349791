"""recap_summary: every iteration's closed-loop success (Wilson intervals), rollouts, value fit
and labels, in one metrics.json and report, read from what the stages wrote."""

from __future__ import annotations

import json

import pytest

from pisft import layout
from pisft.config import from_dict
from pisft.errors import PisftError
from pisft.evaluate.closed_loop import summarize
from pisft.rollout import EpisodeResult
from pisft.evaluate.intervals import wilson_interval
from pisft.recap import summary


def _closed_loop(path, outcomes):
    results = [EpisodeResult("libero_10", task, f"task {task}", trial, ok, 10, 2, 0.1)
               for task, per_task in outcomes.items() for trial, ok in enumerate(per_task)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"closed_loop": True, **summarize(results)}))


def _iteration_outputs(cfg, k):
    at = cfg.at_iteration(k)
    (layout.results(at, "rollouts")).mkdir(parents=True)
    layout.results(at, "rollouts", "collection.json").write_text(json.dumps(
        {"episodes": [{"task_id": 0, "frames": 30, "success": True}, {"task_id": 1, "frames": 60, "success": False}]}))
    layout.results(at, "value").mkdir(parents=True)
    layout.results(at, "value", "metrics.json").write_text(json.dumps(
        {"spearman_heldout": 0.61, "bin_accuracy_heldout": 0.2, "loss_first": 5.3, "loss_last": 3.1, "steps": 50}))
    layout.results(at, "advantages").mkdir(parents=True)
    layout.results(at, "advantages", "summary.json").write_text(json.dumps(  # as pisft.recap.advantages writes it
        {"positive_fraction": 0.31, "frames": 90, "positive": 28, "scope": "global", "lookahead": 10,
         "per_task": {"0": {"positive_fraction": 0.4}, "1": {"positive_fraction": 0.2}},
         "per_source_type": {"sft": {"positive_fraction": 1.0}, "rollout": {"positive_fraction": 0.3}}}))


def test_the_summary_lists_every_iteration_with_wilson_intervals(tmp_path):
    cfg = from_dict({"results_dir": str(tmp_path / "results"), "recap": {"iterations": 2},
                     "eval": {"closed_loop": True, "task_ids": [0, 1], "trials_per_task": 2}})
    _closed_loop(layout.results(cfg, "closed_loop", "metrics.json"), {0: [True, False], 1: [False, False]})
    for k, outcomes in ((1, {0: [True, True], 1: [False, False]}), (2, {0: [True, True], 1: [True, False]})):
        _iteration_outputs(cfg, k)
        _closed_loop(layout.results(cfg.at_iteration(k), "closed_loop", "metrics.json"), outcomes)
    summary.run(cfg)
    out = json.loads(layout.results(cfg, "recap", "metrics.json").read_text())
    its = out["iterations"]
    assert [it["k"] for it in its] == [0, 1, 2]
    assert [it["closed_loop"]["success_rate"] for it in its] == [0.25, 0.5, 0.75]
    ci = wilson_interval(3, 4)
    assert (its[2]["closed_loop"]["ci_low"], its[2]["closed_loop"]["ci_high"]) == (ci.low, ci.high)
    assert its[2]["closed_loop"]["per_task"]["libero_10/1"]["success_rate"] == 0.5
    assert "rollouts" not in its[0]
    assert its[1]["rollouts"] == {"episodes": 2, "frames": 90, "successes": 1}
    assert its[1]["value"]["spearman_heldout"] == 0.61
    assert its[1]["advantages"]["positive_fraction"] == 0.31
    assert its[1]["advantages"]["positive_fraction_per_source"] == {"sft": 1.0, "rollout": 0.3}
    report = layout.results(cfg, "recap", "report.md").read_text()
    assert "![success per iteration](success.png)" in report and "| 2 | 75.0% |" in report
    assert "not that RECAP improves a policy" in report
    assert layout.results(cfg, "recap", "success.png").stat().st_size > 0
    # the iterations' own folders beside the summary are untouched
    assert layout.results(cfg.at_iteration(1), "value", "metrics.json").is_file()


def test_a_missing_iteration_output_names_the_stage_to_run(tmp_path):
    cfg = from_dict({"results_dir": str(tmp_path / "results"), "eval": {"closed_loop": True, "trials_per_task": 1},
                     "recap": {"iterations": 1}})
    _closed_loop(layout.results(cfg, "closed_loop", "metrics.json"), {0: [True]})
    _iteration_outputs(cfg, 1)
    with pytest.raises(PisftError, match="closed_loop.*run the `closed_loop_1` stage first"):
        summary.run(cfg)
    assert not layout.results(cfg, "recap", "metrics.json").exists()
