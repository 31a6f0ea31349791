"""A stage's code dependencies are the rooms it runs (issue 34, item 6): an edit to one file of a
package reruns the stages whose code reaches it, under both drivers, and never a collection or a
training for an edit to a report."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pisft import code_graph
from pisft import stages as stage_table
from pisft.workflow.scratch import copy_project
from pisft.workflow.snakemake_rules import load_rules

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# One file of each room a stage runs, and the rules an edit to it must rerun (and none other)
# under the default config (closed loop on, one RECAP iteration).
EDITS = {
    "src/pisft/evaluate/report.py": {"evaluate"},
    "src/pisft/introspect/estimate.py": {"smoke_1card", "smoke_value_1"},
    "src/pisft/gates/value_smoke.py": {"smoke_value_1"},
    "src/pisft/recap/summary.py": {"recap_summary"},
    "src/pisft/data/demo.py": {"demo_recap"},
}
TRAININGS = {"train_8card", "train_8card_1", "train_value_1", "collect_rollouts_1"}


def _run(cmd: list[str], cwd: Path) -> str:
    env = {**os.environ, "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")])}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def _downstream(rules, direct: set[str]) -> set[str]:
    """The rules that must rerun after `direct`: they and every rule reading their outputs."""
    out = set(direct)
    for r in rules:  # rules are in DAG order
        if any(o in r.inputs for done in rules if done.name in out for o in done.outputs.values()):
            out.add(r.name)
    return out


def _snakemake_plan(project: Path) -> set[str]:
    text = _run([str(BIN / "snakemake"), "-n", "--rerun-triggers", "mtime", "--quiet", "rules"], project)
    return set(re.findall(r"^(\w+)\s+\d+$", text, re.M)) - {"all", "total"}


def _dvc_changed(project: Path) -> set[str]:
    text = _run([str(BIN / "dvc"), "status"], project)
    return set(re.findall(r"^(\w+):\s*$", text, re.M))


def test_each_stage_depends_on_the_files_its_entry_point_imports():
    """Computed from the imports (deterministic): a report is the evaluation's, not the collection's."""
    deps = {name: code_graph.code_deps(name, "cpu") for name in stage_table.STAGES}
    assert deps == {name: code_graph.code_deps(name, "cpu") for name in stage_table.STAGES}
    for name, files in deps.items():
        row = stage_table.STAGES[name]
        for function in filter(None, (row.run, row.before_group)):  # what the row names runs
            assert "src/" + function.partition(":")[0].replace(".", "/") + ".py" in files, (name, function)
        assert files == sorted(files[:-1]) + [files[-1]] and files[-1].endswith(".lock.txt")
        assert all((ROOT / f).is_file() for f in files), name
    assert "src/pisft/evaluate/report.py" in deps["evaluate"]
    for name in ("collect_rollouts", "train_8card", "train_value", "smoke_1card", "advantages"):
        assert "src/pisft/evaluate/report.py" not in deps[name], name
    assert "src/pisft/introspect/estimate.py" in deps["smoke_1card"]  # its report carries the estimate
    assert "src/pisft/train/launch.py" in deps["train_8card"]  # started by the launcher
    # a row's before_group is code the stage runs, as its run is
    import dataclasses

    elsewhere = dataclasses.replace(stage_table.STAGES["smoke_1card"], before_group="pisft.recap.summary:run")
    assert "src/pisft/recap/summary.py" not in deps["smoke_1card"]
    with pytest.MonkeyPatch.context() as patched:
        patched.setitem(code_graph.STAGES, "smoke_1card", elsewhere)
        assert "src/pisft/recap/summary.py" in code_graph.code_deps("smoke_1card", "cpu")
    assert "src/pisft/workflow/dvc_yaml.py" not in {f for fs in deps.values() for f in fs}


@pytest.mark.integration
def test_an_edit_reruns_the_stages_that_run_the_file_under_both_drivers(tmp_path):
    """Every output made up (no stage runs), recorded in dvc.lock, older than nothing it reads;
    then one file of each room edited in turn: Snakemake's dry-run plan and `dvc status`."""
    project = copy_project(ROOT, tmp_path / "project", git=True)
    rules = load_rules(project / "workflow" / "Snakefile", project)
    for r in rules:
        for out in r.outputs.values():
            path = project / out
            if out in r.directories:
                path.mkdir(parents=True, exist_ok=True)
                (path / "made_up").write_text(r.name)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(r.name)
    from pisft.workflow import dvc_yaml

    (project / "results" / dvc_yaml.CHECK_FILE).write_text(dvc_yaml.CHECK_TEXT)  # config_check's (DVC only)
    _run([str(BIN / "dvc"), "commit", "--force", "--quiet"], project)  # rewrites the outputs: then the times
    t0 = time.time() - 100_000
    for folder in ("src", "workflow", "config"):
        for f in (project / folder).rglob("*"):
            os.utime(f, (t0, t0))
    for i, r in enumerate(rules):  # in DAG order: each output newer than what it reads
        t = t0 + 100 * (i + 1)
        for out in r.outputs.values():
            path = project / out
            inside = list(path.rglob("*")) if path.is_dir() else []
            if path.is_dir():
                (path / ".snakemake_timestamp").touch()
                inside.append(path / ".snakemake_timestamp")
            for f in [*inside, path]:
                os.utime(f, (t, t))
    assert _snakemake_plan(project) == set()
    assert _dvc_changed(project) == set()

    for i, (edited, direct) in enumerate(EDITS.items()):
        path = project / edited
        before = path.read_text()
        path.write_text(before + "# an edit\n")
        os.utime(path, (t0 + 10_000 + i, t0 + 10_000 + i))
        try:
            assert _dvc_changed(project) == direct, edited
            plan = _snakemake_plan(project)
            assert plan == _downstream(rules, direct), edited
            if edited.endswith("report.py") or edited.endswith("summary.py"):
                assert not plan & TRAININGS, (edited, plan)
        finally:
            path.write_text(before)
            os.utime(path, (t0, t0))


def test_the_kept_import_graph_is_the_parsed_one_and_an_edit_is_a_miss(tmp_path, monkeypatch):
    """pisft.code_graph.stored_graph: a second process reads the graph the first parsed (the same
    code dependencies), the package's content keys it (an edited file is parsed again, never
    answered from the kept graph), and "off" parses every time."""
    src = tmp_path / "src"
    import shutil

    shutil.copytree(ROOT / "src" / "pisft", src / "pisft", ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "graphs"
    monkeypatch.setenv(code_graph.CACHE_ENV, str(cache))
    parsed = {form: {name: code_graph._parsed_imports(name, src, form == "top") for name in code_graph._files(src)}
              for form in ("all", "top")}
    assert code_graph.stored_graph(src) == parsed and len(list(cache.iterdir())) == 1
    code_graph.stored_graph.cache_clear()  # as a new process: read from the kept file
    (kept,) = cache.iterdir()
    assert code_graph.stored_graph(src) == parsed and list(cache.iterdir()) == [kept]
    # an import added to one module: another digest, parsed again, and the new edge is there
    report = src / "pisft" / "evaluate" / "report.py"
    report.write_text(report.read_text() + "\n\ndef _late():\n    import pisft.recap.summary  # noqa\n")
    code_graph.stored_graph.cache_clear()
    code_graph._files.cache_clear()
    code_graph._tree.cache_clear()
    assert "pisft.recap.summary" in code_graph.stored_graph(src)["all"]["pisft.evaluate.report"]
    assert "pisft.recap.summary" not in parsed["all"]["pisft.evaluate.report"]
    assert len(list(cache.iterdir())) == 2
    monkeypatch.setenv(code_graph.CACHE_ENV, "off")
    code_graph.stored_graph.cache_clear()
    assert code_graph.stored_graph(src)["all"]["pisft.evaluate.report"] == \
        code_graph._parsed_imports("pisft.evaluate.report", src, False)
    assert len(list(cache.iterdir())) == 2
