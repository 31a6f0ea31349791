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


def test_second_snakemake_call_does_no_work(default_pipeline):
    out = run(["snakemake", "--cores", "2"], default_pipeline)
    assert "Nothing to be done" in out.stdout + out.stderr


def test_snakemake_report_builds_html_with_the_plots(default_pipeline):
    run(["snakemake", "--report", "report.html"], default_pipeline)
    html = (default_pipeline / "report.html").read_text(errors="replace")
    assert "loss.png" in html and "per_task.png" in html
