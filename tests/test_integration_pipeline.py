"""The whole pipeline on the embedded default, through Snakemake and through DVC."""

import json

import pytest
import yaml

from conftest import copy_project, run

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
    assert "finetuned" in (results / "eval/report.md").read_text().lower()
    for stage in ("fetch_base", "demo_recap", "convert_recap", "smoke_1card", "train_8card", "evaluate"):
        assert (results / "logs" / f"{stage}.log").is_file()
        resolved = next((results).rglob("pisft_config.json"), None)
        assert resolved is not None


def test_second_snakemake_call_does_no_work(default_pipeline):
    out = run(["snakemake", "--cores", "2"], default_pipeline)
    assert "Nothing to be done" in out.stdout + out.stderr


def test_dvc_repro_runs_the_dag_then_is_up_to_date(tmp_path):
    work = copy_project(tmp_path / "dvc", git=True)
    cfg_path = work / "config/config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["train"]["steps"] = 6
    cfg["train"]["save_every"] = 3
    cfg["smoke"]["steps"] = 2
    cfg["data"]["demo_episodes_per_task"] = 2
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run(["dvc", "repro"], work)
    assert (work / "results/eval/metrics.json").is_file()
    assert len((work / "results/train/metrics.jsonl").read_text().splitlines()) == 6
    again = run(["dvc", "repro"], work)
    assert "up to date" in again.stdout.lower()
    status = run(["dvc", "status"], work)
    assert "up to date" in status.stdout.lower()
