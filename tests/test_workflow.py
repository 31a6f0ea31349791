"""The DAG's single source of truth: Snakemake rules; dvc.yaml is generated from them."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pisft.workflow import dvc_yaml
from pisft.workflow.snakemake_rules import load_rules
from pisft.workflow.stages import STAGE_KEYS, code_deps

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["fetch_base", "demo_recap", "convert_recap", "smoke_1card", "train_8card", "evaluate"]


def workflow_copy(tmp_path: Path) -> Path:
    """The workflow, config and profiles in a scratch folder (no results)."""
    from pisft.workflow import scratch

    return scratch.copy_project(ROOT, tmp_path / "wf")  # with src/pisft: the stages depend on it


def snakemake(*args, cwd=ROOT, check=True):
    exe = Path(sys.executable).with_name("snakemake")
    return subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True, check=check)


def test_committed_dvc_yaml_is_not_stale(monkeypatch):
    monkeypatch.chdir(ROOT)
    rules = load_rules()
    assert [r.name for r in rules] == STAGES
    assert (ROOT / "dvc.yaml").read_text() == dvc_yaml.render(rules), (
        "dvc.yaml is stale: run `python -m pisft dvc-yaml` and commit it"
    )


def test_dvc_stages_mirror_the_rules(monkeypatch):
    monkeypatch.chdir(ROOT)
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for rule in load_rules():
        stage = stages[rule.name]
        assert stage["cmd"].startswith("python -m pisft ")
        assert f"--config {rule.config_file}" in stage["cmd"]
        assert stage.get("deps", []) == [*rule.inputs, *rule.code]
        # code is a dependency: the stage's package folders, the shared modules, the lock
        assert rule.code == code_deps(rule.name, "auto") and all((ROOT / c).exists() for c in rule.code)
        assert stage["params"] == [{"config/config.yaml": list(STAGE_KEYS[rule.name])}]
    # checkpoints are no DVC output: never deleted, and a fresh clone without them is not "changed"
    assert not any("checkpoints" in json.dumps(out) for out in stages["train_8card"]["outs"])
    assert stages["evaluate"]["metrics"] == ["results/eval/metrics.json"]
    assert "results/base_model" in stages["fetch_base"]["outs"]  # tiny: small, cached


def test_weights_from_a_local_source_are_not_cached_a_second_time(tmp_path, monkeypatch):
    work = workflow_copy(tmp_path)
    cfg = yaml.safe_load((work / "config/config.yaml").read_text())
    cfg["model"]["source"] = str(tmp_path / "pi05_base")
    (work / "config/config.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(work)
    stages = yaml.safe_load(dvc_yaml.render(load_rules()))["stages"]
    assert stages["fetch_base"]["outs"] == [{"results/base_model": {"cache": False}}]


def test_stale_check_fails_when_a_rule_changes(tmp_path):
    work = workflow_copy(tmp_path)
    shutil.copy(ROOT / "dvc.yaml", work / "dvc.yaml")
    smk = work / "workflow/rules/evaluate.smk"
    smk.write_text(smk.read_text().replace("--log {log}", "--log {log} --set eval.batch_size=4"))
    run = subprocess.run([sys.executable, "-m", "pisft", "dvc-yaml", "--check"], cwd=work,
                         capture_output=True, text=True)
    assert run.returncode == 1 and "dvc.yaml is stale" in run.stderr
    subprocess.run([sys.executable, "-m", "pisft", "dvc-yaml"], cwd=work, check=True, capture_output=True)
    assert "eval.batch_size=4" in (work / "dvc.yaml").read_text()


def test_dry_run_lists_the_whole_dag(tmp_path):
    # In a scratch copy: the project root may hold a finished run (make run), with nothing to do.
    out = snakemake("-n", "--cores", "2", "--quiet", "rules", cwd=workflow_copy(tmp_path)).stdout
    for stage in STAGES:
        assert stage in out


def test_bad_config_stops_snakemake_before_any_job(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  micro_batch: 3\n")
    run = snakemake("-n", "--cores", "1", "--configfile", str(bad), check=False)
    assert run.returncode != 0
    assert "unknown key 'train.micro_batch'" in run.stderr + run.stdout
    assert "train.micro_batch_size" in run.stderr + run.stdout


def test_configfile_override_is_passed_to_stages_as_one_file(tmp_path):
    work = workflow_copy(tmp_path)
    override = work / "more.yaml"
    override.write_text("train:\n  steps: 3\n")
    out = snakemake("-n", "--cores", "1", "--configfile", "config/config.yaml", str(override),
                    "-p", cwd=work).stdout
    assert "--config results/config/effective.yaml" in out
    effective = yaml.safe_load((work / "results/config/effective.yaml").read_text())
    assert effective["train"]["steps"] == 3


@pytest.mark.integration  # ~50 s on 2 cores: two dry runs, one resolving the closed-loop stage
def test_closed_loop_stage_joins_the_dag_only_when_enabled(tmp_path):
    work = workflow_copy(tmp_path)
    assert "rule closed_loop:" not in snakemake("-n", "--cores", "1", cwd=work).stdout
    on = work / "on.yaml"
    on.write_text("eval:\n  closed_loop: true\n  libero_suites: [libero_10]\n")
    out = snakemake("-n", "--cores", "1", "--configfile", "config/config.yaml", str(on), cwd=work).stdout
    assert "rule closed_loop:" in out
    assert "results/closed_loop/metrics.json" in out


def test_workflow_files_are_snakefmt_formatted():
    exe = Path(sys.executable).with_name("snakefmt")
    check = subprocess.run([str(exe), "--check", "workflow"], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_lock_file_pins_every_project_dependency():
    import tomllib

    lock = {
        line.split("==")[0].lower().replace("_", "-")
        for line in (ROOT / "workflow/envs/cpu-cuda.lock.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split("[")[0].split("==")[0].lower().replace("_", "-") for d in deps}
    assert names <= lock, f"in pyproject.toml but not in the lock: {sorted(names - lock)}"


def test_slurm_profile_asks_for_a_whole_node_of_accelerators(tmp_path):
    work = workflow_copy(tmp_path)
    npu = work / "npu.yaml"
    npu.write_text("device: npu\ntrain:\n  nproc_per_node: 8\n  micro_batch_size: 2\n  global_batch_size: 16\n")
    out = snakemake("train_8card", "--profile", "profiles/slurm", "-n", "--configfile",
                    "config/config.yaml", str(npu), cwd=work).stdout
    train = out[out.index("rule train_8card:"):]
    resources = next(line for line in train.splitlines() if "resources:" in line)
    assert "gres=npu:8" in resources and "accelerators=8" in resources and "nodes=1" in resources
