"""DVC drives the same DAG: reruns, the link cache, remotes, metrics, plots and experiments."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import BIN, appended_comment, planned, reverted, run, tool_env
from dvc_fixtures import CHECK, RAN, SMALL, STAGES  # dvc_run: the session's DVC run (tests/dvc_fixtures.py)

from pisft.train.guard import LOCK_NAME

pytestmark = pytest.mark.integration

NOTHING = "Nothing to be done"


def set_keys(work: Path, values: dict) -> None:
    path = work / "config/config.yaml"
    cfg = yaml.safe_load(path.read_text())
    for (section, key), value in values.items():
        cfg[section][key] = value
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def clone_run(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


def push_and_clone(work: Path, tmp_path: Path) -> Path:
    """`dvc push` from `work` to a local remote, its lock and remote config committed, then a git
    clone of `work` with `dvc pull` run in it: the clone."""
    run(["dvc", "remote", "add", "-d", "local", str(tmp_path / "remote")], work)
    run(["dvc", "push"], work)
    run(["git", "add", "dvc.lock", ".dvc"], work)
    run(["git", "commit", "-qam", "lock and remote"], work)
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(work), str(clone)], tmp_path)
    run(["dvc", "pull"], clone)
    return clone


def test_dvc_repro_twice_does_no_work(dvc_run):
    assert (dvc_run / "results/eval/metrics.json").is_file()
    assert len((dvc_run / "results/train/metrics.jsonl").read_text().splitlines()) == 6
    again = run(["dvc", "repro"], dvc_run)
    assert not RAN.findall(again.stdout)
    assert "up to date" in run(["dvc", "status"], dvc_run).stdout.lower()


def test_snakemake_has_nothing_to_do_after_dvc_repro(dvc_run):
    """DVC ran every stage; Snakemake's records (benchmarks, metadata, timestamps) agree."""
    dry = run(["snakemake", "-n", "--cores", "2"], dvc_run)
    assert NOTHING in dry.stdout + dry.stderr, dry.stdout[-3000:]
    assert all((dvc_run / f"results/benchmarks/{s}.tsv").is_file() for s in STAGES)


def test_dvc_reruns_exactly_what_reads_a_changed_key(dvc_run, tmp_path):
    """`dvc status` names the readers of a changed key at each depth, without running them: an eval
    key is `evaluate`'s alone, a train key training's (evaluation follows its output), a data key the
    conversion's. A data key set by a DVC experiment, data.eval_fraction 0, reruns the conversion it
    names, and the experiment records it: every episode trains. Both drivers then find exactly what
    follows the new dataset stale, DVC's status and Snakemake's plan alike. Running those stages too
    would retrain and add nothing. The key changed again is then Snakemake's to see as well, from
    the record DVC's run left it. Held elsewhere: Snakemake accepting what DVC ran
    (test_snakemake_has_nothing_to_do_after_dvc_repro), `evaluate`'s "not run" outputs when nothing
    is held out (tests/test_data_eval_fraction.py). Which stage reads which key
    is the stage table's, checked whole in tests/test_stages.py."""
    work = clone_run(dvc_run, tmp_path / "w")
    for key, value, readers in ((("eval", "batch_size"), 3, {"evaluate"}),
                                (("train", "steps"), 7, {"train_8card"}),
                                (("data", "eval_fraction"), 0.0, {"convert_recap"})):
        with reverted(work / "config/config.yaml"):
            set_keys(work, {key: value})
            assert _changed_stages(work) == readers, key
    exp = run(["dvc", "exp", "run", "-S", "config/config.yaml:data.eval_fraction=0.0", "convert_recap"], work)
    assert set(RAN.findall(exp.stdout)) == {"convert_recap"}
    split = json.loads((work / "results/dataset/split.json").read_text())
    assert split["eval"] == [] and len(split["train"]) > 0
    shown = json.loads(run(["dvc", "exp", "show", "--json"], work).stdout)
    assert 0.0 in list(_values_at(shown, ("data", "eval_fraction"))), "the experiment records data.eval_fraction=0"
    after = {"smoke_1card", "train_8card", "evaluate"}
    assert _changed_stages(work) == after
    assert planned(work) == after
    # DVC's run recorded the job for Snakemake (pisft.workflow.drivers.record_for_snakemake): its
    # key changed again is seen by Snakemake too, which has no other record of what the job read
    set_keys(work, {("data", "eval_fraction"): 0.2})
    assert planned(work) == {"convert_recap"} | after


def test_fresh_clone_and_dvc_pull_does_not_make_snakemake_retrain(dvc_run, tmp_path):
    clone = push_and_clone(clone_run(dvc_run, tmp_path / "origin"), tmp_path)
    # The pulled clone is up to date for DVC itself (no checkpoints there: they are no output)
    status = run(["dvc", "status"], clone).stdout
    assert "up to date" in status.lower(), status
    weights = clone / "results/train/model/model.safetensors"
    # .dvc/config asks for reflink, hardlink, symlink, copy: on this filesystem (no reflinks)
    # the pulled weights are a hard link into the cache, not a second copy.
    assert weights.is_symlink() or weights.stat().st_nlink > 1, "weights were copied, not linked"
    # The documented step after `dvc pull`: mark the pulled outputs as up to date for Snakemake.
    run(["snakemake", "--touch", "--cores", "1"], clone)
    dry = run(["snakemake", "-n", "--cores", "2"], clone)
    assert "Nothing to be done" in dry.stdout + dry.stderr
    # --touch also recorded the params, so a changed key still reruns exactly its readers.
    set_keys(clone, {("train", "steps"): 7})
    assert planned(clone) == {"train_8card", "evaluate"}


def test_metrics_and_plots(dvc_run, tmp_path):
    work = clone_run(dvc_run, tmp_path / "w")
    metrics = json.loads(run(["dvc", "metrics", "show", "--json"], work).stdout)
    text = json.dumps(metrics)
    assert "results/eval/metrics.json" in text and "action_mse" in text
    _assert_every_plot_renders_its_data(work)
    # experiments: test_dvc_reruns_exactly_what_reads_a_changed_key runs one (`dvc exp run -S`)


def _assert_every_plot_renders_its_data(work: Path) -> None:
    """`dvc plots show` draws each plot dvc.yaml defines from the workspace's files: the images
    as they are, the CSV plots with every row of every column they name."""
    shown = json.loads(run(["dvc", "plots", "show", "--json"], work).stdout)
    assert not shown.get("errors"), shown.get("errors")
    data = shown["data"]
    results = yaml.safe_load((work / "config/config.yaml").read_text())["results_dir"]
    defined = yaml.safe_load((work / "dvc.yaml").read_text().replace("${results_dir}", results))
    images = [p for stage in defined["stages"].values() for p in stage.get("plots", [])]
    assert images, "dvc.yaml defines no image plots"
    for image in images:
        assert len(data.get(image, [])) == 1, f"{image}: no image rendered"
        (entry,) = data[image]
        assert entry["type"] == "image" and entry["revisions"] == ["workspace"]
        assert Path(work, entry["url"]).read_bytes() == (work / image).read_bytes(), image
    assert defined["plots"], "dvc.yaml defines no data plots"
    for definition in defined["plots"]:
        ((name, props),) = definition.items()
        ((csv_path, columns),) = props["y"].items()
        rows = list(csv.DictReader((work / csv_path).open()))
        assert len(data.get(name, [])) == 1, f"plot {name} ({csv_path}: {len(rows)} rows) renders nothing"
        (entry,) = data[name]
        drawn = {(v[props["x"]], v["field"], v["dvc_inferred_y_value"]) for v in entry["content"]["data"]["values"]}
        assert rows and drawn == {(r[props["x"]], c, r[c]) for r in rows for c in columns}, name


def _values_at(node, path):
    """Every value found under the key path anywhere in a nested JSON document."""
    if isinstance(node, dict):
        inner = node
        for key in path:
            if not isinstance(inner, dict) or key not in inner:
                break
            inner = inner[key]
        else:
            yield inner
        for value in node.values():
            yield from _values_at(value, path)
    elif isinstance(node, list):
        for value in node:
            yield from _values_at(value, path)


def _descends_from(pid: int, ancestors: set[int]) -> bool:
    while pid > 1:
        if pid in ancestors:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _trainer_holding(work: Path, drivers: set[int]) -> int | None:
    """The pid of the trainer (rank 0) under one of `drivers` that holds a run folder's lock under
    results/, if any: the holder writes it into the lock file right after taking the flock
    (pisft.train.guard)."""
    for lock in work.glob(f"results/**/{LOCK_NAME}"):
        try:
            text = lock.read_text().strip()
            pid = int(json.loads(text)["pid"]) if text else None
        except (OSError, ValueError, KeyError):
            continue  # being written: look again
        if pid is not None and _descends_from(pid, drivers):
            return pid
    return None


def test_a_dvc_repro_beside_a_training_snakemake_is_refused_and_snakemake_trains_dvcs_bytes(dvc_run, tmp_path):
    """Snakemake retrains, from no checkpoint, what `dvc repro` trained in the session's run
    (tests/dvc_fixtures.py), its trainer held with SIGSTOP while the other driver starts: `dvc
    repro` started beside it is refused at once (DVC's repository lock, which a Snakemake run
    holds), before it removes or writes anything; the one trainer writes every step once, and the
    weights are byte-identical through either driver (same threads; tests/test_slurm.py compares a
    Snakemake run through Slurm with the same run). Before the refusal: the wrapper saw Snakemake's
    lock and carried on, re-ran four stages under it, and Snakemake failed."""
    work = clone_run(dvc_run, tmp_path / "w")
    shutil.rmtree(work / "results/checkpoints")
    shutil.rmtree(work / "results/train")
    assert set(re.findall(r"^rule (\w+):", run(["snakemake", "-n", "--cores", "2", "train_8card"],
                                                 work).stdout, re.M)) == {"train_8card"}
    snakemake = subprocess.Popen([str(BIN / "snakemake"), "--cores", "2", "train_8card"], cwd=work, env=tool_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: dict[str, str] = {}
    reader = threading.Thread(target=lambda: out.__setitem__("s", snakemake.stdout.read()), daemon=True)
    reader.start()
    held = None
    try:
        deadline = time.monotonic() + 1200
        while held is None and time.monotonic() < deadline and snakemake.poll() is None:
            held = _trainer_holding(work, {snakemake.pid})
            time.sleep(0.05)
        assert held is not None, "Snakemake's trainer never took the run folder"
        os.kill(held, signal.SIGSTOP)
        lock_before = (work / "dvc.lock").read_bytes()
        evaluation = sorted((p.name, p.stat().st_mtime_ns) for p in (work / "results/eval").iterdir())
        refused = run(["dvc", "repro", "train_8card"], work, check=False)
        assert refused.returncode != 0 and "Unable to acquire lock" in refused.stderr, refused.stderr[-2000:]
        assert not RAN.findall(refused.stdout)
        assert (work / "dvc.lock").read_bytes() == lock_before
        assert sorted((p.name, p.stat().st_mtime_ns) for p in (work / "results/eval").iterdir()) == evaluation
    finally:
        if held is not None:
            os.kill(held, signal.SIGCONT)
    snakemake.wait(timeout=1800)
    reader.join(timeout=60)
    assert snakemake.returncode == 0, out.get("s", "")[-3000:]
    steps = [json.loads(line)["step"] for line in
             (work / "results/train/metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, SMALL[("train", "steps")] + 1)), "one trainer: every step once, in order"
    log = (work / "results/logs/train_8card.log").read_text()
    assert "resuming from" not in log, log[-3000:]  # trained from the start
    weights = "results/train/model/model.safetensors"
    assert (work / weights).read_bytes() == (dvc_run / weights).read_bytes()


@pytest.fixture(scope="module")
def dvc_finished(dvc_run, tmp_path_factory) -> Path:
    """One copy of the DVC run for the status cases, up to date; each edits it under `reverted`."""
    work = clone_run(dvc_run, tmp_path_factory.mktemp("dvc_status") / "w")
    assert _changed_stages(work) == set()
    return work


def _changed_stages(work: Path) -> set[str]:
    status = json.loads(run(["dvc", "status", "--json"], work).stdout or "{}")
    return {name.split(":")[-1] for name in status}


@pytest.mark.parametrize(
    "edited, expected",
    [
        ("src/pisft/evaluate/report.py", {"evaluate"}),
        ("src/pisft/train/loop.py", {"smoke_1card", "train_8card"}),  # evaluate follows their outputs
        ("workflow/envs/cpu-cuda.lock.txt",
         {"fetch_base", "demo_recap", "convert_recap", "smoke_1card", "train_8card", "evaluate"}),
    ],
)
def test_dvc_sees_edited_code(dvc_finished, edited, expected):
    with appended_comment(dvc_finished / edited):
        assert _changed_stages(dvc_finished) == expected


def test_a_new_data_folder_regenerates_dvc_yaml_before_any_stage(dvc_run, tmp_path):
    """The data sources are in dvc.yaml by their paths (a template cannot follow a list of them):
    the first `dvc repro` after data.recap_dir changed stops at config_check, before DVC removes
    any output, with dvc.yaml regenerated; the next follows the new folder."""
    work = clone_run(dvc_run, tmp_path / "w")
    other = tmp_path / "recap"
    shutil.copytree(work / "results/demo_recap", other)
    set_keys(work, {("data", "recap_dir"): str(other)})
    dataset = sorted(p.name for p in (work / "results/dataset").rglob("*"))
    refused = run(["dvc", "repro", "convert_recap"], work, check=False)
    assert refused.returncode != 0 and "dvc.yaml has been regenerated" in refused.stderr, refused.stderr[-2000:]
    assert set(RAN.findall(refused.stdout)) == {CHECK}
    assert sorted(p.name for p in (work / "results/dataset").rglob("*")) == dataset  # nothing removed
    run([str(BIN / "python"), "-m", "pisft", "dvc-yaml", "--check"], work)  # regenerated: current
    status = json.loads(run(["dvc", "status", "--json"], work).stdout)
    assert set(status) == {CHECK, "convert_recap"}, status
    assert str(other) in json.dumps(status["convert_recap"])  # the new folder is the dependency


def test_dvc_regenerates_dvc_yaml_when_the_model_becomes_a_local_folder(dvc_run, tmp_path):
    """A change of shape (tiny -> a local folder): the stage stops once, with dvc.yaml regenerated."""
    work = clone_run(dvc_run, tmp_path / "w")
    local = tmp_path / "pi05_local"
    shutil.copytree(work / "results/base_model", local, ignore=shutil.ignore_patterns(".snakemake_timestamp"))
    set_keys(work, {("model", "source"): str(local)})
    first = run(["dvc", "repro", "fetch_base"], work, check=False)
    assert first.returncode != 0
    assert "dvc.yaml has been regenerated" in first.stdout + first.stderr, first.stderr[-2000:]
    assert set(RAN.findall(first.stdout)) == {CHECK}  # before fetch_base: its output not removed
    assert (work / "results/base_model/model.safetensors").is_file()
    assert "model.source=local" in (work / "dvc.yaml").read_text().splitlines()[2]
    second = run(["dvc", "repro", "fetch_base"], work)
    assert set(RAN.findall(second.stdout)) == {CHECK, "fetch_base"}
    lock = yaml.safe_load((work / "dvc.lock").read_text())["stages"]["fetch_base"]
    assert str(local) in [d["path"] for d in lock["deps"]]  # the folder's content is tracked


def test_after_snakemake_dvc_is_up_to_date_and_a_pull_restores_every_output(default_pipeline, tmp_path):
    """Snakemake's run ends with `dvc commit`: dvc status is clean, push carries every output."""
    work = clone_run(default_pipeline, tmp_path / "origin")
    status = run(["dvc", "status"], work).stdout
    assert "up to date" in status.lower(), status
    clone = push_and_clone(work, tmp_path)
    status = run(["dvc", "status"], clone).stdout
    assert "up to date" in status.lower(), status
    lock = yaml.safe_load((clone / "dvc.lock").read_text())["stages"]
    from pisft.stages import rule_names

    assert set(lock) == {CHECK, *rule_names(1)}  # every stage Snakemake ran is recorded, the RECAP loop's too
    outs = [o["path"] for stage in lock.values() for o in stage.get("outs", [])]
    assert all((clone / path).exists() for path in outs), [p for p in outs if not (clone / p).exists()]
    run(["snakemake", "--touch", "--cores", "1"], clone)  # the documented step after a pull
    dry = run(["snakemake", "-n", "--cores", "2"], clone)
    assert NOTHING in dry.stdout + dry.stderr
