"""Issue 47, item 6: the two drivers and the data they read.

- Changed input data: a data source whose files changed, or were added, is seen by Snakemake (its
  files are the rule's inputs) and by DVC (the folder is a dep); a source dvc.yaml does not name
  stops DVC before any stage.
- A dvc.yaml that does not match the config (data.recap_dir as a list under the committed one):
  refused in one line before DVC removes anything, dvc.yaml regenerated; Snakemake unharmed.
- One run writes results/ at a time: `dvc repro` beside a running Snakemake, and Snakemake beside
  a running `dvc repro`, are refused before they remove or write anything, and leave both
  drivers' records as they were.
Real Snakemake and DVC on a scratch copy of the project (the SFT stages up to convert_recap);
a run is held where it is with SIGSTOP, the fault as a slow or busy stage makes it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import BIN, copy_project, run, tool_env, wait_for

from pisft import config as pisft_config
from pisft.workflow import dvc_yaml

SMALL = {"data": {"demo_episodes_per_task": 1, "demo_episode_length": 12},
         "eval": {"closed_loop": False}, "recap": {"iterations": 0}}


def test_every_key_of_the_shape_changes_it_and_every_source_is_in_it():
    """config_check runs when one of dvc_yaml.SHAPE_KEYS changes: each of them changes the shape."""
    base = {"eval": {"closed_loop": True, "trials_per_task": 1}}
    changed = {"device": "npu", "model.source": "/models/mine", "model.tokenizer": "/models/tok",
               "eval.closed_loop": False, "recap.iterations": 1, "recap.init": "base", "recap.value_init": "previous",
               "data.recap_dir": ["results/demo_recap", {"path": "/data/more", "type": "rollout"}]}
    assert set(changed) == set(dvc_yaml.SHAPE_KEYS)
    before = dvc_yaml.shape(pisft_config.from_dict(base))
    for key, value in changed.items():
        raw = yaml.safe_load(yaml.safe_dump(base))
        *section, leaf = key.split(".")
        (raw.setdefault(section[0], {}) if section else raw)[leaf] = value
        assert dvc_yaml.shape(pisft_config.from_dict(raw)) != before, key
    three = pisft_config.from_dict({"data": {"recap_dir": ["/a", "/b", {"path": "/c"}]}})
    assert "data.recap_dir=/a,/b,/c" in dvc_yaml.shape(three)
    assert before.endswith("data.recap_dir=${results_dir}/demo_recap")


def state(work: Path) -> dict:
    """Both drivers' records and the outputs: what a refused run must leave as it was."""
    out = {"dvc.lock": (work / "dvc.lock").read_bytes()}
    meta = work / ".snakemake" / "metadata"
    out["snakemake metadata"] = sorted((p.name, p.read_bytes()) for p in meta.iterdir()) if meta.is_dir() else []
    for folder in ("demo_recap", "dataset"):
        root = work / "results" / folder
        out[folder] = sorted((p.relative_to(root).as_posix(), p.stat().st_mtime_ns, p.stat().st_size)
                             for p in root.rglob("*")) if root.is_dir() else None
    check = work / "results" / dvc_yaml.CHECK_FILE  # config_check's file, every DVC stage's dep
    out[dvc_yaml.CHECK_FILE] = check.read_text() if check.is_file() else None
    return out


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A scratch copy with the small SFT config switched in, converted once by `dvc repro`."""
    work = copy_project(tmp_path_factory.mktemp("drivers") / "w", git=True)
    small = work.parent / "small.yaml"
    small.write_text(yaml.safe_dump(SMALL))
    run([str(BIN / "python"), "-m", "pisft", "profile", str(small)], work)
    run(["git", "commit", "-qam", "small"], work)
    run(["dvc", "repro", "convert_recap"], work)
    run(["git", "add", "dvc.lock"], work)
    run(["git", "commit", "-qm", "lock"], work)
    return work


def set_sources(work: Path, sources) -> None:
    path = work / "config" / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["data"]["recap_dir"] = sources
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def planned(work: Path, target: str = "convert_recap") -> set[str]:
    out = run(["snakemake", "-n", "--cores", "1", target], work).stdout
    return set(re.findall(r"^rule (\w+):", out, re.M)) - {"all"}


def reasons(work: Path, target: str = "convert_recap") -> dict[str, str]:
    """The jobs `snakemake -n` plans and why (its `reason:` line)."""
    out = run(["snakemake", "-n", "--cores", "1", target], work).stdout
    return dict(re.findall(r"^rule (\w+):\n(?:    .*\n)*?    reason: (.*)$", out, re.M))


@pytest.mark.integration
def test_a_list_of_sources_under_the_old_dvc_yaml_stops_before_any_stage(project, tmp_path):
    """The committed dvc.yaml names one data folder; data.recap_dir becomes a list of two. Before:
    every stage died with `TypeError: unhashable type: 'list'` and nothing said what to do."""
    work = Path(shutil.copytree(project, tmp_path / "w", symlinks=True))
    other = Path(shutil.copytree(work / "results/demo_recap", tmp_path / "more",
                                 ignore=shutil.ignore_patterns(".snakemake_timestamp", "MANIFEST.json",
                                                               "pisft_config.json")))
    set_sources(work, ["results/demo_recap", {"path": str(other), "type": "sft"}])
    before = state(work)
    refused = run(["dvc", "repro", "convert_recap"], work, check=False)
    assert refused.returncode != 0
    lines = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, refused.stderr[-3000:]
    assert f"data.recap_dir ${{results_dir}}/demo_recap -> ${{results_dir}}/demo_recap,{other}" in lines[0]
    assert "python -m pisft dvc-yaml" in lines[0] and "nothing ran and no output was removed" in lines[0]
    assert "Running stage 'convert_recap'" not in refused.stdout  # config_check stopped it first
    assert state(work) == before
    assert str(other) in dvc_yaml.shape_of((work / "dvc.yaml").read_text())  # regenerated for the list
    status = json.loads(run(["dvc", "status", "--json", "convert_recap"], work).stdout)
    assert "convert_recap" in status and set(status) <= {dvc_yaml.CHECK_STAGE, "convert_recap"}, status
    # Snakemake reads the list as it is (no TypeError), the new source's files among the inputs
    assert planned(work) == {"convert_recap"}
    again = run(["dvc", "repro", "convert_recap"], work)
    assert "Running stage 'convert_recap'" in again.stdout
    lock = yaml.safe_load((work / "dvc.lock").read_text())["stages"]["convert_recap"]
    assert str(other) in [d["path"] for d in lock["deps"]]


@pytest.mark.integration
def test_changed_source_data_is_seen_by_both_drivers_and_an_unnamed_source_is_refused(project, tmp_path):
    """Sources outside results/ and inside it (issue 56: one placed inside results/ that no stage
    writes was given to Snakemake as its folder, taken for a stage's output by where it lay)."""
    work = Path(shutil.copytree(project, tmp_path / "w", symlinks=True))
    plain = shutil.ignore_patterns(".snakemake_timestamp", "MANIFEST.json", "pisft_config.json")
    other = Path(shutil.copytree(work / "results/demo_recap", tmp_path / "more", ignore=plain))
    mine = Path(shutil.copytree(work / "results/demo_recap", work / "results/mine", ignore=plain))
    set_sources(work, ["results/demo_recap", str(other), "results/mine"])
    run(["python", "-m", "pisft", "dvc-yaml"], work)
    run(["dvc", "repro", "convert_recap"], work)
    assert planned(work) == set() and "up to date" in run(["dvc", "status", "convert_recap"], work).stdout.lower()
    # a file deep inside the outside source changes (an episode's actions scaled): both drivers see
    # it (Snakemake compared the folder's own time stamp, which a file deep inside does not move)
    scaled = sorted((other / "data").rglob("*.parquet"))[0]
    original = work / "results/demo_recap" / scaled.relative_to(other)
    scale_actions(scaled)
    assert reasons(work) == {"convert_recap": f"Updated input files: {scaled}"}
    changed = run(["dvc", "status", "convert_recap"], work).stdout
    assert str(other) in changed and "modified" in changed
    shutil.copy2(original, scaled)  # put back, bytes and time stamp: nothing to do again
    assert reasons(work) == {} and "up to date" in run(["dvc", "status", "convert_recap"], work).stdout.lower()
    # the same inside results/: before, "Nothing to be done", and the Snakemake run's dvc commit then
    # recorded the changed source as converted, so DVC missed it too
    scaled = sorted((mine / "data").rglob("*.parquet"))[0]
    scale_actions(scaled)
    assert reasons(work) == {"convert_recap": f"Updated input files: {scaled.relative_to(work)}"}
    changed = run(["dvc", "status", "convert_recap"], work).stdout
    assert "results/mine" in changed and "modified" in changed
    dataset = work / "results" / "dataset" / "MANIFEST.json"
    before = dataset.read_bytes()
    run(["snakemake", "convert_recap", "--cores", "1"], work)  # converts it; its dvc commit records that
    assert dataset.read_bytes() != before
    assert planned(work) == set() and "up to date" in run(["dvc", "status", "convert_recap"], work).stdout.lower()
    # a file added to the outside one, even one with an old time stamp (a copy that kept it)
    added = other / "meta" / "notes.txt"
    added.write_text("added\n")
    os.utime(added, (0, 0))
    assert reasons(work) == {"convert_recap": "Set of input files has changed since last execution"}
    assert "modified" in run(["dvc", "status", "convert_recap"], work).stdout
    # a fourth source the regenerated dvc.yaml does not name: refused before any stage
    third = Path(shutil.copytree(other, tmp_path / "third"))
    set_sources(work, ["results/demo_recap", str(other), "results/mine", str(third)])
    refused = run(["dvc", "repro", "convert_recap"], work, check=False)
    assert refused.returncode != 0, refused.stderr[-2000:]
    assert (f"${{results_dir}}/mine -> ${{results_dir}}/demo_recap,{other},${{results_dir}}/mine,{third}"
            in refused.stderr), refused.stderr[-2000:]


def scale_actions(path: Path, factor: float = 2.0) -> None:
    """An episode's actions multiplied by `factor`, written back in place (a hand edit of the data)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    name = next(n for n in table.column_names if "action" in n)
    column = table.column(name)
    scaled = pa.array([list(np.asarray(v, dtype=np.float32) * factor) for v in column.to_pylist()], type=column.type)
    pq.write_table(table.set_column(table.column_names.index(name), name, scaled), path)


def _stage_process(parent: int, stage: str) -> psutil.Process | None:
    """The `python -m pisft <stage>` process under the driver `parent`, once it runs."""
    try:
        for child in psutil.Process(parent).children(recursive=True):
            cmd = child.cmdline()
            if "pisft" in cmd and stage in cmd and "pisft.workflow.drivers" not in cmd:
                return child
    except psutil.NoSuchProcess:
        return None
    return None


def _held(cmd: list[str], work: Path, stage: str):
    """Start a driver and stop its stage process where it is (SIGSTOP) once it runs."""
    proc = subprocess.Popen(cmd, cwd=work, env=tool_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    child = wait_for(lambda: _stage_process(proc.pid, stage), 600, f"{cmd[0]}'s {stage} to start")
    child.send_signal(signal.SIGSTOP)
    return proc, child


@pytest.mark.integration
def test_one_run_writes_results_at_a_time_and_a_refused_one_changes_nothing(project, tmp_path):
    work = Path(shutil.copytree(project, tmp_path / "w", symlinks=True))
    # Snakemake is converting (held): a dvc repro beside it stops at once, before removing anything
    snakemake, stage = _held([str(BIN / "snakemake"), "convert_recap", "--cores", "1", "--forcerun",
                              "convert_recap"], work, "convert_recap")
    try:
        before = state(work)
        refused = run(["dvc", "repro", "-f", "convert_recap"], work, check=False)
        assert refused.returncode != 0 and "Unable to acquire lock" in refused.stderr, refused.stderr[-2000:]
        assert "Running stage" not in refused.stdout
        assert state(work) == before
    finally:
        stage.send_signal(signal.SIGCONT)
    out, _ = snakemake.communicate(timeout=600)
    assert snakemake.returncode == 0, out[-3000:]
    # dvc repro is converting (held): Snakemake beside it stops before its first job
    dvc, stage = _held([str(BIN / "dvc"), "repro", "-f", "convert_recap"], work, "convert_recap")
    try:
        time.sleep(0.5)
        before = state(work)
        refused = run(["snakemake", "convert_recap", "--cores", "1", "--forcerun", "convert_recap"], work, check=False)
        assert refused.returncode != 0
        line = next(x for x in refused.stderr.splitlines() if x.startswith("error: "))
        assert line.startswith(f"error: a DVC run is working on this checkout (pid {dvc.pid}: ")
        assert "one run writes results/ at a time; nothing was run or removed" in line
        assert state(work) == before
        assert not list((work / ".snakemake" / "locks").glob("*"))  # Snakemake's own lock let go
    finally:
        stage.send_signal(signal.SIGCONT)
    out, _ = dvc.communicate(timeout=600)
    assert dvc.returncode == 0, out[-3000:]
    assert os.path.isdir(work / "results" / "dataset")
