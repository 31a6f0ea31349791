"""The DAG's single source of truth: Snakemake rules; dvc.yaml is generated from them."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pisft import config as pisft_config
from pisft import layout
from pisft.workflow import dvc_yaml
from pisft.workflow.drivers import WRAPPER
from pisft.workflow.snakemake_rules import load_workflow
from pisft import stages as stage_table
from pisft.code_graph import code_deps

ROOT = Path(__file__).resolve().parents[1]
STAGES = list(stage_table.STAGES)  # the one table of stages; the rules must follow it, in its order


def workflow_copy(tmp_path: Path) -> Path:
    """The workflow, config and profiles in a scratch folder (no results)."""
    from pisft.workflow import scratch

    return scratch.copy_project(ROOT, tmp_path / "wf")  # with src/pisft: the stages depend on it


def snakemake(*args, cwd=ROOT, check=True):
    exe = Path(sys.executable).with_name("snakemake")
    return subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True, check=check)


def test_committed_dvc_yaml_is_not_stale(monkeypatch):
    monkeypatch.chdir(ROOT)
    workflow = load_workflow()
    assert [r.name for r in workflow.rules] == stage_table.rule_names(workflow.config["recap"]["iterations"])
    assert (ROOT / "dvc.yaml").read_text() == dvc_yaml.render(workflow.rules, workflow.config), (
        "dvc.yaml is stale: run `python -m pisft dvc-yaml` and commit it"
    )


def test_dvc_stages_mirror_the_rules(monkeypatch):
    monkeypatch.chdir(ROOT)
    doc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    assert doc["vars"] == ["config/config.yaml"]  # paths are templates over the run config
    stages = doc["stages"]
    workflow = load_workflow()
    # config_check first: the shape's keys as params, its file a dependency of every stage
    assert list(stages)[0] == dvc_yaml.CHECK_STAGE and set(stages) == {dvc_yaml.CHECK_STAGE,
                                                                        *(r.name for r in workflow.rules)}
    check = "${results_dir}/" + dvc_yaml.CHECK_FILE
    assert stages[dvc_yaml.CHECK_STAGE] == {
        "cmd": f"{WRAPPER} {dvc_yaml.CHECK_STAGE} -- config/config.yaml",
        "params": [{"config/config.yaml": list(dvc_yaml.SHAPE_KEYS)}], "outs": [{check: {"persist": True}}]}
    for rule in workflow.rules:
        stage = stages[rule.name]
        # the rule's command, through the driver wrapper (shape check, Snakemake's records)
        assert stage["cmd"] == f"{WRAPPER} {rule.name} -- " + rule.cmd.replace("results/", "${results_dir}/")
        assert f"--config {rule.config_file}" in stage["cmd"]
        inputs = [i.replace("results/", "${results_dir}/") for i in rule.inputs]
        assert stage.get("deps", []) == [*inputs, check, *rule.code]
        # code is a dependency: the stage's package folders, the shared modules, the lock
        name, k = stage_table.stage_of(rule.name)
        assert rule.code == code_deps(name, "auto") and all((ROOT / c).exists() for c in rule.code)
        assert stage["params"] == [{"config/config.yaml": list(stage_table.STAGES[name].keys_at(k))}]
    # checkpoints are no DVC output: never deleted, and a fresh clone without them is not "changed"
    assert not any("checkpoints" in json.dumps(out) for out in stages["train_8card"]["outs"])
    assert stages["evaluate"]["metrics"] == ["${results_dir}/eval/metrics.json"]
    assert "${results_dir}/base_model" in stages["fetch_base"]["outs"]  # tiny: small, cached
    assert "${results_dir}/eval/per_step.csv" in stages["evaluate"]["outs"]  # drawn by top-level plots
    assert {next(iter(p)) for p in doc["plots"]} == {o.name for o in stage_table.EVALUATE.outputs
                                                     if isinstance(o.plot, stage_table.Table)}
    # what DVC reads: the templates filled in from config/config.yaml are the rules' paths
    resolved = yaml.safe_load(dvc_yaml.resolve((ROOT / "dvc.yaml").read_text(), workflow.config))
    assert resolved["stages"]["convert_recap"]["deps"][0] == workflow.config["data"]["recap_dir"]
    assert "data.recap_dir=${results_dir}/demo_recap" in dvc_yaml.shape_of((ROOT / "dvc.yaml").read_text())


def test_the_value_stages_declare_the_model_they_load(tmp_path, monkeypatch):
    """For recap.value_init base and previous, two iterations: the model smoke_value_k,
    train_value_k and advantages_k load (`pisft.layout.value_init_model`, what `require_value_inputs` hands to the
    model loader) is the one model among the rule's inputs and the DVC stage's deps, and the key
    is among the params that rerun them."""
    from pisft.stages import rule_name

    work = workflow_copy(tmp_path)
    monkeypatch.chdir(work)
    config_file = work / "config" / "config.yaml"
    original = yaml.safe_load(config_file.read_text())
    want = {"base": {1: "results/base_model", 2: "results/base_model"},
            "previous": {1: "results/train/model", 2: "results/recap/iter_1/train/model"}}
    for value_init, loads in want.items():
        config = {**original, "recap": {**original["recap"], "iterations": 2, "value_init": value_init}}
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        workflow = load_workflow(work / "workflow" / "Snakefile", work)
        cfg = pisft_config.from_dict(workflow.config)
        rules = {r.name: r for r in workflow.rules}
        dvc = yaml.safe_load(dvc_yaml.resolve(dvc_yaml.render(workflow.rules, workflow.config), workflow.config))
        models = {"results/base_model", *(str(layout.policy(cfg, j)) for j in range(3))}
        for k in (1, 2):
            assert str(layout.value_init_model(cfg.at_iteration(k))) == loads[k]
            # advantages_k reads the value model's frozen part from that model (value_model.load)
            for stage in ("smoke_value", "train_value", "advantages"):
                name = rule_name(stage, k)
                assert [i for i in rules[name].inputs if i in models] == [loads[k]], (value_init, name)
                stage_deps = dvc["stages"][name]["deps"]
                assert [d for d in stage_deps if d in models] == [loads[k]], (value_init, name)
                if stage != "advantages":  # it reruns with train_value_k, which reads the key
                    assert "recap.value_init" in rules[name].tracked_keys
                    assert "recap.value_init" in dvc["stages"][name]["params"][0]["config/config.yaml"]
        assert f"recap.value_init={value_init}" in dvc_yaml.shape(cfg)


def test_dvc_only_settings_are_no_snakemake_params(monkeypatch):
    """Plot axes, caching: read by dvc-yaml only, so editing them reruns nothing under Snakemake."""
    monkeypatch.chdir(ROOT)
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings, StorageSettings

    validations = []
    real = pisft_config.from_dict
    monkeypatch.setattr(pisft_config, "from_dict", lambda *a, **k: validations.append(1) or real(*a, **k))
    with SnakemakeApi(OutputSettings(quiet=None)) as api:
        wf = api.workflow(resource_settings=ResourceSettings(cores=1), config_settings=ConfigSettings(),
                          storage_settings=StorageSettings(), snakefile=Path("workflow/Snakefile"))._workflow
        for rule in wf.rules:
            assert set(dict(rule.params.items())) <= {"code", "config", "tracked"}, rule.name
    assert len(validations) == 1, "the config is validated once per parse, not once per rule"
    # and dvc_yaml.py, where they live, is no code any stage depends on
    assert not any("dvc_yaml" in c or c == "src/pisft/workflow" for s in STAGES for c in code_deps(s, "auto"))


def test_weights_from_a_local_source_are_not_cached_a_second_time(tmp_path, monkeypatch):
    work = workflow_copy(tmp_path)
    cfg = yaml.safe_load((work / "config/config.yaml").read_text())
    cfg["model"]["source"] = str(tmp_path / "pi05_base")
    (work / "config/config.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(work)
    workflow = load_workflow()
    text = dvc_yaml.render(workflow.rules, workflow.config)
    stages = yaml.safe_load(text)["stages"]
    assert stages["fetch_base"]["outs"] == [{"${results_dir}/base_model": {"cache": False}}]
    assert "model.source=local" in dvc_yaml.shape_of(text)


def test_stale_check_fails_when_a_rule_changes(tmp_path):
    work = workflow_copy(tmp_path)
    shutil.copy(ROOT / "dvc.yaml", work / "dvc.yaml")
    smk = work / "workflow/rules/common.smk"  # the helper every rule is made by
    assert 'f"{LOGS}/{rule_id}.log"' in smk.read_text()
    smk.write_text(smk.read_text().replace('f"{LOGS}/{rule_id}.log"', 'f"{LOGS}/{rule_id}_renamed.log"'))
    run = subprocess.run([sys.executable, "-m", "pisft", "dvc-yaml", "--check"], cwd=work,
                         capture_output=True, text=True)
    assert run.returncode == 1 and "dvc.yaml is stale" in run.stderr
    subprocess.run([sys.executable, "-m", "pisft", "dvc-yaml"], cwd=work, check=True, capture_output=True)
    assert "logs/evaluate_renamed.log" in (work / "dvc.yaml").read_text()


def test_dry_run_lists_every_stage_and_writes_nothing(tmp_path):
    # In a scratch copy: the project root may hold a finished run (make run), with nothing to do.
    work = workflow_copy(tmp_path)
    out = snakemake("-n", "--cores", "2", "--quiet", "rules", cwd=work).stdout
    for stage in STAGES:
        assert stage in out
    # `rule all` asks for every stage's outputs, so a missing intermediate is rebuilt
    out = snakemake("-n", "--cores", "2", cwd=work).stdout
    all_inputs = out[out.index("rule all:"):].splitlines()[1]
    for path in ("results/base_model", "results/demo_recap", "results/dataset", "results/smoke/report.json",
                 "results/train/model", "results/eval/metrics.json", "results/recap/iter_1/rollouts",
                 "results/recap/iter_1/value", "results/recap/iter_1/advantages", "results/recap/iter_1/train/model",
                 "results/recap/iter_1/closed_loop/metrics.json", "results/recap/metrics.json"):
        assert path in all_inputs
    assert not (work / "results").exists() and not (work / "dvc.lock").exists()


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
    # written when a run starts (onstart), never by a dry run or --lint
    assert not (work / "results").exists()
    snakemake("--lint", "--configfile", "config/config.yaml", str(override), cwd=work, check=False)
    assert not (work / "results").exists()
    support = __import__("pisft.workflow.snakemake_support", fromlist=["x"])
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    config["train"]["steps"] = 3
    cfg = pisft_config.from_dict(config)
    (tmp_path / "r").mkdir()
    cfg.results_dir = str(tmp_path / "r")
    support.write_effective_config(cfg, config)
    effective = yaml.safe_load((tmp_path / "r/config/effective.yaml").read_text())
    assert effective["train"]["steps"] == 3


@pytest.mark.integration  # ~25 s on 2 cores: both drivers' dry runs for two profiles
def test_profile_switches_both_drivers(tmp_path, monkeypatch):
    """One command: config/config.yaml runs the profile, dvc.yaml follows; a refused one writes nothing."""
    work = workflow_copy(tmp_path)
    shutil.copy(ROOT / "dvc.yaml", work / "dvc.yaml")
    pisft = [sys.executable, "-m", "pisft", "profile"]
    bad = work / "bad.yaml"
    bad.write_text("train:\n  global_batch_size: 7\n")
    before = (work / "config/config.yaml").read_text()
    refused = subprocess.run([*pisft, str(bad)], cwd=work, capture_output=True, text=True)
    assert refused.returncode == 2 and "global_batch_size" in refused.stderr
    assert (work / "config/config.yaml").read_text() == before
    subprocess.run([*pisft, "config/profiles/ascend-8card.yaml"], cwd=work, check=True, capture_output=True)
    text = (work / "config/config.yaml").read_text()
    assert "# " in text  # the file's comments are kept
    cfg = pisft_config.load(work / "config/config.yaml")
    assert (cfg.device, cfg.train.nproc_per_node, cfg.model.source) == ("npu", 8, "/data/pi05_base")
    # Snakemake reads the same file: its dry run passes it to the stages as is (the profile's
    # data folder does not exist here, so only up to fetch_base)
    out = snakemake("-n", "--cores", "1", "-p", "fetch_base", cwd=work).stdout
    assert "pisft fetch_base --config config/config.yaml" in out
    # DVC: dvc.yaml regenerated for the shape (local model, Ascend lock), paths from the config
    monkeypatch.chdir(work)
    dvc_text = (work / "dvc.yaml").read_text()
    assert "model.source=local" in dvc_yaml.shape_of(dvc_text) and "ascend-aarch64" in dvc_text
    resolved = yaml.safe_load(dvc_yaml.resolve(dvc_text, yaml.safe_load(text)))["stages"]
    assert "/data/pi05_base" in resolved["fetch_base"]["deps"]
    assert resolved["convert_recap"]["deps"][0] == "/data/libero_10_recap"
    check = subprocess.run([sys.executable, "-m", "pisft", "dvc-yaml", "--check"], cwd=work,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.mark.integration  # ~50 s on 2 cores: two dry runs, one resolving the closed-loop stage
def test_closed_loop_stage_joins_the_dag_only_when_enabled(tmp_path):
    work = workflow_copy(tmp_path)
    out = snakemake("-n", "--cores", "1", cwd=work).stdout
    assert "rule closed_loop:" in out and "results/closed_loop/metrics.json" in out
    off = work / "off.yaml"
    off.write_text("eval:\n  closed_loop: false\n")  # the RECAP loop still on: refused, it needs the simulator
    refused = snakemake("-n", "--cores", "1", "--configfile", "config/config.yaml", str(off), cwd=work, check=False)
    assert refused.returncode != 0 and "needs eval.closed_loop: true" in refused.stdout + refused.stderr
    off.write_text("eval:\n  closed_loop: false\nrecap:\n  iterations: 0\n")
    out = snakemake("-n", "--cores", "1", "--configfile", "config/config.yaml", str(off), cwd=work).stdout
    assert "rule closed_loop:" not in out and "collect_rollouts" not in out


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
    assert "gres=npu:8" in resources and "accelerators=8" in resources and "nodes=" not in resources  # one node
    # train.nnodes 2: both nodes' accelerators (gres is per node), a task per node; the profile keeps them
    npu.write_text(npu.read_text().replace("train:\n", "train:\n  nnodes: 2\n").replace(
        "global_batch_size: 16", "global_batch_size: 32"))
    out = snakemake("train_8card", "--profile", "profiles/slurm", "-n", "--configfile",
                    "config/config.yaml", str(npu), cwd=work).stdout
    train = out[out.index("rule train_8card:"):]
    resources = next(line for line in train.splitlines() if "resources:" in line)
    assert all(f in resources for f in ("gres=npu:8", "nodes=2", "tasks=2", "mpi=srun")), resources


def test_non_training_stages_take_their_threads_from_one_place(monkeypatch):
    """Snakemake exports OMP_NUM_THREADS=<rule threads>, DVC nothing: the stage sets its own."""
    import torch

    from pisft.workflow.drivers import pin_threads

    before = torch.get_num_threads()
    try:
        for exported in ("1", "7", None):  # what a driver may have exported
            if exported is None:
                monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
            else:
                monkeypatch.setenv("OMP_NUM_THREADS", exported)
            monkeypatch.setenv("PISFT_NUM_THREADS", "2")
            assert pin_threads() == 2 and torch.get_num_threads() == 2
            assert os.environ["OMP_NUM_THREADS"] == "2"
    finally:
        torch.set_num_threads(before)


def test_a_source_reached_through_results_dotdot_or_a_link_is_read_where_it_leads(tmp_path):
    """Snakemake sees an outside data source's every file (a changed file reruns convert_recap) and a
    folder under results_dir (a stage's output) as the folder; a path that only spells results/
    (`results/../data`) is outside, a link into results_dir inside: where they lead."""
    from pisft import config as pisft_config
    from pisft.workflow.snakemake_support import source_inputs

    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "sub" / "episode.parquet").write_bytes(b"x")
    (tmp_path / "results" / "demo_recap").mkdir(parents=True)
    (tmp_path / "demo_link").symlink_to(tmp_path / "results" / "demo_recap")
    dotdot, link = tmp_path / "results" / ".." / "data", tmp_path / "demo_link"
    cfg = pisft_config.from_dict({"results_dir": str(tmp_path / "results"),
                                  "data": {"recap_dir": [str(dotdot), str(link)]}})
    assert source_inputs(cfg) == [(dotdot / "sub" / "episode.parquet").as_posix(), str(link)]


def test_a_source_inside_results_dir_that_no_rule_writes_is_read_file_by_file(tmp_path):
    """Issue 56: a source placed inside results/ was given to Snakemake as its folder, as the demo's
    is, so a file changed deep inside it went unseen (and the run's dvc commit recorded it)."""
    from pisft import config as pisft_config
    from pisft.workflow.snakemake_support import source_inputs

    mine = tmp_path / "results" / "mine"
    (mine / "data").mkdir(parents=True)
    (mine / "data" / "episode.parquet").write_bytes(b"x")
    (mine / "meta").mkdir()
    (mine / "meta" / "info.json").write_text("{}")
    demo = tmp_path / "results" / "demo_recap"  # written by demo_recap: the folder
    demo.mkdir()
    (demo / "data.parquet").write_bytes(b"x")
    cfg = pisft_config.from_dict({"results_dir": str(tmp_path / "results"),
                                  "data": {"recap_dir": [str(mine), str(demo)]}})
    assert source_inputs(cfg) == [(mine / "data" / "episode.parquet").as_posix(),
                                  (mine / "meta" / "info.json").as_posix(), str(demo)]


def test_training_over_several_nodes_asks_slurm_for_them_with_one_task_each(tmp_path):
    """train.nnodes 2, no endpoint: the training rules ask for 2 nodes, a task each, and `mpi` (the
    command starts its own tasks); the smoke gate, one node, and the by-hand rendezvous ask for none."""
    from pisft.workflow.snakemake_support import node_resources

    def cfg(*sets):
        return pisft_config.load(ROOT / "config/config.yaml", [f"results_dir={tmp_path}", *sets])

    two = cfg("train.nnodes=2")
    training = [s for s in stage_table.STAGES.values() if s.training and not s.one_process]
    assert stage_table.TRAIN_8CARD in training
    for stage in training:
        assert node_resources(two, stage) == {"nodes": 2, "tasks": 2, "mpi": "srun"}, stage.name
    assert node_resources(two, stage_table.SMOKE_1CARD) == {}
    assert node_resources(cfg(), stage_table.TRAIN_8CARD) == {}
    assert node_resources(cfg("train.nnodes=2", "train.rdzv_endpoint=10.0.0.1:29500"), stage_table.TRAIN_8CARD) == {}


def test_eval_shards_scatters_the_rollout_stages_in_both_drivers(tmp_path, monkeypatch):
    """eval.shards 3 with one RECAP iteration: each closed loop and the collection is 3 shard rules
    (the stage's inputs and keys, its shard folder, `--shard i/3`) and the stage's own rule merging
    their folders into its usual outputs (`--merge-shards 3`); dvc.yaml has the same stages, its
    shape says eval.shards=3. Every other rule is the one-job workflow's."""
    from pisft.stages import CLOSED_LOOP, COLLECT_ROLLOUTS, STAGES

    work = workflow_copy(tmp_path)
    monkeypatch.chdir(work)
    config_file = work / "config" / "config.yaml"
    original = yaml.safe_load(config_file.read_text())
    shaped = {}
    for shards in (1, 3):
        config = {**original, "recap": {**original["recap"], "iterations": 1},
                  "eval": {**original["eval"], "shards": shards}}
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        workflow = load_workflow(work / "workflow" / "Snakefile", work)
        shaped[shards] = ({r.name: r for r in workflow.rules}, dvc_yaml.render(workflow.rules, workflow.config))
    one, three = shaped[1][0], shaped[3][0]
    scattered = {(CLOSED_LOOP, 0), (CLOSED_LOOP, 1), (COLLECT_ROLLOUTS, 1)}
    assert set(three) == set(one) | {row.shard_rule(k, i, 3) for row, k in scattered for i in (1, 2, 3)}
    assert [s.name for s in STAGES.values() if s.shards_key] == ["collect_rollouts", "closed_loop"]
    for row, k in scattered:
        merge, alone = three[row.rule(k)], one[row.rule(k)]
        folders = [f"results{'/recap/iter_1' if k else ''}/shards/{row.name}/shard_{i}_of_3" for i in (1, 2, 3)]
        assert merge.outputs == alone.outputs and merge.tracked_keys == alone.tracked_keys
        assert [p for p in merge.inputs if p not in alone.inputs] == folders
        assert " --merge-shards 3 --config " in merge.cmd
        for i, folder in enumerate(folders, start=1):
            shard = three[row.shard_rule(k, i, 3)]
            assert list(shard.outputs.values()) == [folder] and shard.directories == {folder}
            assert shard.inputs == alone.inputs and shard.tracked_keys == alone.tracked_keys
            assert shard.cmd == alone.cmd.replace(" --config ", f" --shard {i}/3 --config ").replace(
                f"/{row.rule(k)}.log", f"/{row.shard_rule(k, i, 3)}.log")
    for name in set(one) - {row.rule(k) for row, k in scattered}:
        assert vars(three[name]) == vars(one[name]), name
    dvc = yaml.safe_load(shaped[3][1])
    assert set(dvc["stages"]) == {dvc_yaml.CHECK_STAGE, *three}
    assert dvc["stages"]["closed_loop__shard_2_of_3"]["outs"] == ["${results_dir}/shards/closed_loop/shard_2_of_3"]
    collect_deps = dvc["stages"]["collect_rollouts_1"]["deps"]
    assert "${results_dir}/recap/iter_1/shards/collect_rollouts/shard_3_of_3" in collect_deps
    assert dvc["stages"]["closed_loop"]["metrics"] == yaml.safe_load(shaped[1][1])["stages"]["closed_loop"]["metrics"]
    assert dvc_yaml.shape_of(shaped[3][1]).endswith(" eval.shards=3")
    assert "eval.shards" not in dvc_yaml.shape_of(shaped[1][1])
