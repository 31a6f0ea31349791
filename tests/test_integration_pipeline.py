"""The whole pipeline on the embedded default, through Snakemake and through DVC."""

import json

import pytest
import yaml

from conftest import run

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


def test_second_snakemake_call_does_no_work(default_pipeline):
    out = run(["snakemake", "--cores", "2"], default_pipeline)
    assert "Nothing to be done" in out.stdout + out.stderr


def test_snakemake_report_builds_html_with_the_plots(default_pipeline):
    run(["snakemake", "--report", "report.html"], default_pipeline)
    html = (default_pipeline / "report.html").read_text(errors="replace")
    assert "loss.png" in html and "per_task.png" in html
    # the rollout videos, one page each (snakemake --report plays no bare MP4)
    assert "libero_10_task00.html" in html and "libero_10_task01.html" in html
