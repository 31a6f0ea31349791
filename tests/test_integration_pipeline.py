"""The whole pipeline on the embedded default, through Snakemake and through DVC."""

import json

import pytest
import yaml

from conftest import planned, run

pytestmark = pytest.mark.integration


def test_snakemake_runs_the_whole_dag_and_it_learns(default_pipeline):
    results = default_pipeline / "results"
    manifest = json.loads((results / "base_model/MANIFEST.json").read_text())
    assert "model.safetensors" in manifest["files"]
    assert (results / "dataset/meta/info.json").is_file()
    smoke = json.loads((results / "smoke/report.json").read_text())
    assert smoke["passed"] is True
    lines = (results / "train/metrics.jsonl").read_text().splitlines()
    cfg = yaml.safe_load((default_pipeline / "config/config.yaml").read_text())
    assert len(lines) == cfg["train"]["steps"]
    assert (results / "train/model/model.safetensors").is_file()
    # 2 CPU processes: every parameter sharded, in the root unit alone (train.fsdp_min_unit_params)
    sharding = json.loads((results / "train/train_summary.json").read_text())["sharding_rank0"]
    assert sharding["all_params_sharded"] is True and sharding["units_by_group"] == {}
    assert sharding["params_local_fraction"] == pytest.approx(0.5, abs=0.02)
    metrics = json.loads((results / "eval/metrics.json").read_text())
    base, tuned = metrics["base"]["action_mse"], metrics["finetuned"]["action_mse"]
    assert tuned <= 0.5 * base, f"fine-tuned {tuned} vs base {base}: the model did not learn"
    assert (results / "eval/loss.png").stat().st_size > 0
    assert "fine-tuned" in (results / "eval/report.md").read_text().lower()
    for stage in ("fetch_base", "demo_recap", "convert_recap", "smoke_1card", "train_8card", "evaluate"):
        assert (results / "logs" / f"{stage}.log").stat().st_size > 0
        assert (results / "benchmarks" / f"{stage}.tsv").is_file()
    for out in ("base_model", "demo_recap", "dataset", "train/model", "eval"):
        resolved = json.loads((results / out / "pisft_config.json").read_text())
        assert resolved["train"]["steps"] == cfg["train"]["steps"]


def test_the_trained_model_carries_lerobots_processor_files_readable_by_everyone(default_pipeline):
    """LeRobot's make_pre_post_processors loads results/train/model (issue 47), from any working directory
    (issue 56: the tokenizer is its step's state in the model folder): the files are in its manifest and,
    as every other file of the export, readable by others."""
    import os
    import stat

    from lerobot.policies.factory import make_pre_post_processors

    from pisft import integrity
    from pisft.model.policy import read_config

    model = default_pipeline / "results/train/model"
    listed = json.loads((model / "MANIFEST.json").read_text())["files"]
    assert {"policy_preprocessor.json", "policy_postprocessor.json"} <= set(listed)
    integrity.verify_read(model, what="test")
    mask = os.umask(0)
    os.umask(mask)
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in model.rglob("*") if p.is_file()
            and stat.S_IMODE(p.stat().st_mode) != 0o666 & ~mask} == {}
    pre, post = make_pre_post_processors(read_config(model / "config.json")[0], pretrained_path=str(model))
    assert [type(s).__name__ for s in pre.steps][-3:-1] == ["Pi05PrepareStateTokenizerProcessorStep",
                                                             "ModelTokenizerStep"]


def test_the_embedded_default_checks_the_closed_loop_in_the_real_simulator(default_pipeline):
    """make run's short closed-loop check (issue 13): the real hf-libero, its videos, in the report."""
    results = default_pipeline / "results"
    closed = json.loads((results / "closed_loop/metrics.json").read_text())
    assert closed["simulator"]["package"] == "hf-libero", closed["simulator"]
    assert closed["episodes"] == 2 and closed["errors"] == 0
    for task in closed["suites"]["libero_10"]["per_task"].values():
        assert task["episode_steps"]["max"] <= 60 and (results / "closed_loop" / task["video"]).stat().st_size > 0
    report = (results / "eval/report.md").read_text()
    assert "## Closed-loop LIBERO success" in report and "Simulator: hf-libero" in report
    assert "Expect a success rate of about 0" in report and "../closed_loop/videos/libero_10_task00.mp4" in report


def test_the_embedded_default_runs_one_recap_iteration(default_pipeline):
    """Iteration 1: policy 0 rolled out in the real simulator, the pool converted, the value model
    trained, the frames labelled, the policy retrained on the labels and evaluated on iteration
    0's episodes; the summary lists both iterations."""
    results = default_pipeline / "results"
    it = results / "recap" / "iter_1"
    cfg = yaml.safe_load((default_pipeline / "config/config.yaml").read_text())
    per_task = cfg["recap"]["episodes_per_task"]
    episodes = len(cfg["recap"]["task_ids"]) * per_task
    collection = json.loads((it / "rollouts/collection.json").read_text())
    assert len(collection["episodes"]) == episodes and all(e["error"] is None for e in collection["episodes"])
    # after the evaluation's state 0
    assert {e["initial_state"] for e in collection["episodes"]} == set(range(1, per_task + 1))
    report = json.loads((it / "dataset/conversion_report.json").read_text())
    assert [s["type"] for s in report["sources"]] == ["sft", "rollout"]
    assert report["sources"][1]["frames"] == collection["frames"]
    value = json.loads((it / "value/metrics.json").read_text())
    assert value["steps"] == cfg["recap"]["value_steps"] and value["loss_last"] < value["loss_first"]
    labels = json.loads((it / "advantages/summary.json").read_text())
    assert 0 < labels["positive_fraction"] < 1
    cond = json.loads((it / "train/model/prompt_conditioning.json").read_text())
    assert cond["advantage_tag"] == "recap_iter1" and cond["eval_prompt"] == "positive"
    closed = [json.loads((d / "closed_loop/metrics.json").read_text()) for d in (results, it)]
    assert closed[0]["episodes"] == closed[1]["episodes"] == 2
    summary = json.loads((results / "recap/metrics.json").read_text())
    assert [i["k"] for i in summary["iterations"]] == [0, 1]
    assert summary["iterations"][1]["rollouts"]["episodes"] == episodes
    assert "../recap/report.md" in (results / "eval/report.md").read_text()
    for rule in ("collect_rollouts_1", "convert_recap_1", "smoke_value_1", "train_value_1", "advantages_1",
                 "train_8card_1", "closed_loop_1", "recap_summary"):
        assert (results / "benchmarks" / f"{rule}.tsv").is_file(), rule


def test_a_new_labelling_reruns_the_advantages_and_what_follows_only(default_pipeline, tmp_path):
    """recap.positive_quantile: Snakemake plans the advantages and what follows; DVC (`dvc exp run
    -S`) reruns the advantages, then finds what follows stale; never the collection or the value
    model. A second iteration reuses the first's outputs."""
    import shutil

    import re

    work = shutil.copytree(default_pipeline, tmp_path / "w", symlinks=True)
    config_file = work / "config/config.yaml"
    original = config_file.read_text()

    def with_recap(**values):
        cfg = yaml.safe_load(original)
        cfg["recap"].update(values)
        config_file.write_text(yaml.safe_dump(cfg, sort_keys=False))

    after_labels = {"advantages_1", "train_8card_1", "closed_loop_1", "recap_summary"}
    with_recap(positive_quantile=0.4)
    assert planned(work) == after_labels
    with_recap(iterations=2)
    assert planned(work) == {f"{s}_2" for s in ("collect_rollouts", "convert_recap", "smoke_value", "train_value",
                                                "advantages", "train_8card", "closed_loop")} | {"recap_summary"}
    config_file.write_text(original)
    # DVC runs the labelling alone (training and the simulator again would add minutes and show
    # nothing new: Snakemake's plan above holds the rest), then names what follows as stale
    out = run(["dvc", "exp", "run", "-S", "config/config.yaml:recap.positive_quantile=0.4", "advantages_1"], work)
    assert set(re.findall(r"Running stage '(\w+)'", out.stdout)) == {"advantages_1"}
    stale = set(json.loads(run(["dvc", "status", "--json"], work).stdout))
    assert "train_8card_1" in stale and stale <= after_labels - {"advantages_1"}, stale


def test_second_snakemake_call_does_no_work(default_pipeline):
    out = run(["snakemake", "--cores", "2"], default_pipeline)
    assert "Nothing to be done" in out.stdout + out.stderr


def test_snakemake_report_builds_html_with_the_plots(default_pipeline):
    run(["snakemake", "--report", "report.html"], default_pipeline)
    html = (default_pipeline / "report.html").read_text(errors="replace")
    assert "loss.png" in html and "per_task.png" in html
    # the rollout videos, one page each (snakemake --report plays no bare MP4)
    assert "libero_10_task00.html" in html and "libero_10_task01.html" in html
