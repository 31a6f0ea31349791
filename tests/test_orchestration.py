"""Day-to-day behaviour of both drivers: reruns after a change or a failure, locks, DVC."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import BIN, appended_comment, reverted, run, tool_env, wait_for
from pisft.workflow.console import finished_stages, started_stages
from pisft.train.checkpoint import list_checkpoints
from test_terminal import RULE_DUMP, _snakemake_logs

pytestmark = pytest.mark.integration

JOB = re.compile(r"^(?:local)?rule (\w+):", re.M)


def clone_run(src: Path, dest: Path) -> Path:
    """A copy of a finished run (results + Snakemake metadata), timestamps preserved."""
    shutil.copytree(src, dest, symlinks=True)
    return dest


@pytest.fixture(scope="module")
def finished(default_pipeline, tmp_path_factory) -> Path:
    """One copy of the finished run for the planning cases, its plan empty. Each case edits it
    under `reverted` (the bytes and times put back), so the copy and the baseline plan are made
    once; an edit left behind would show as extra jobs in the next case's plan."""
    work = clone_run(default_pipeline, tmp_path_factory.mktemp("orchestration") / "w")
    assert planned_jobs(work) == set()
    return work


def set_key(work: Path, dotted: str, value) -> None:
    path = work / "config/config.yaml"
    cfg = yaml.safe_load(path.read_text())
    node = cfg
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def planned_jobs(work: Path, *targets: str) -> set[str]:
    out = run(["snakemake", "-n", "--cores", "2", *targets], work).stdout
    return set(JOB.findall(out)) - {"all"}


# The embedded default's RECAP iteration: it starts from policy 0 and ends in the summary, so
# whatever reruns policy 0 (or the collection's settings) reruns all of it.
LOOP = {"collect_rollouts_1", "convert_recap_1", "smoke_value_1", "train_value_1", "advantages_1",
        "train_8card_1", "closed_loop_1", "recap_summary"}


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("train.steps", 12, {"train_8card", "closed_loop", "evaluate"} | LOOP),
        ("eval.batch_size", 4, {"evaluate"}),
        ("eval.trials_per_task", 2, {"closed_loop", "evaluate"} | LOOP),
        ("data.success_only", True, {"convert_recap", "smoke_1card", "train_8card", "closed_loop", "evaluate"} | LOOP),
        ("model.init_seed", 1, {"fetch_base", "smoke_1card", "train_8card", "closed_loop", "evaluate"} | LOOP),
        ("recap.positive_quantile", 0.4, {"advantages_1", "train_8card_1", "closed_loop_1", "recap_summary"}),
        # the value model from policy 0 instead of the base model: the value stages and what follows
        ("recap.value_init", "previous", {"smoke_value_1", "train_value_1", "advantages_1", "train_8card_1",
                                          "closed_loop_1", "recap_summary"}),
    ],
)
def test_snakemake_reruns_exactly_what_reads_a_changed_key(finished, key, value, expected):
    with reverted(finished / "config/config.yaml"):
        set_key(finished, key, value)
        assert planned_jobs(finished) == expected


def _checkpoint_steps(work: Path) -> list[int]:
    """The steps of training's checkpoints in every run folder, as the trainer lists them."""
    return sorted(f.step for run in (work / "results/checkpoints/train").glob("run-*") for f in list_checkpoints(run))


def metric_steps(work: Path) -> list[int]:
    """The step of every line of the exported metrics, in file order."""
    lines = (work / "results/train/metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def _training_workers(root_pid: int) -> list[psutil.Process]:
    try:
        procs = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p for p in procs if "pisft.train" in " ".join(p.cmdline())]


def test_a_failed_then_a_killed_training_reruns_alone_and_resumes(default_pipeline, tmp_path):
    """Two faults in one training's life, each at a checkpoint, never at a time: a rank killed
    (the stage fails, Snakemake says so and keeps what follows stale), then, in the rerun that
    resumes, a power cut of the driver (SIGKILL to Snakemake's process group); the documented
    recovery (`--unlock`, `--rerun-incomplete`) resumes again and ends with one trainer's steps."""
    work = clone_run(default_pipeline, tmp_path / "w")
    shutil.rmtree(work / "results/checkpoints/train")
    set_key(work, "eval.closed_loop", False)  # the simulator's minutes add nothing here
    set_key(work, "recap.iterations", 0)  # (the RECAP loop runs in the simulator)
    set_key(work, "train.steps", 40)  # retrain: only train_8card and evaluate are due
    set_key(work, "train.save_every", 10)  # each fault after a checkpoint, 20 or more steps before the end
    upstream = {p: p.stat().st_mtime for p in (work / "results/dataset").rglob("*") if p.is_file()}

    # 1. a rank killed after the first checkpoint: the stage fails
    proc = subprocess.Popen([str(BIN / "snakemake"), "--cores", "2", "train_8card"], cwd=work,
                            env=tool_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: _checkpoint_steps(work), 600, "a first checkpoint")
    workers = wait_for(lambda: _training_workers(proc.pid), 60, "training workers")
    workers[-1].send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    # the terminal: the launcher's word on the killed rank, then the stage's failure and its log's tail
    assert "train_8card failed (torchrun exit code" in out, out[-3000:]
    assert re.search(r"^\[[\d:]+\] train_8card: FAILED after ", out, re.M), out[-3000:]
    # ... as the terminal shows any failed stage (docs/workflow.md, "What the terminal shows"): its
    # start, no end, its log's last lines; the rule's details in Snakemake's own log, not here
    assert started_stages(out) == ["train_8card"] and not finished_stages(out), out[-3000:]
    log = (work / "results/logs/train_8card.log").read_text().splitlines()
    tail = re.findall(r"^  \| (.*)$", out, re.M)
    assert log and tail == log[-len(tail):] and len(tail) == min(len(log), 20), (tail, log[-20:])
    assert not RULE_DUMP.search(out), RULE_DUMP.search(out)
    details = _snakemake_logs(work)[-1].read_text()  # this run's: the newest
    assert "Error in rule train_8card:" in details and re.search(r"^\s+input: src/pisft/", details, re.M)
    assert not (work / "results/train/model").exists(), "a failed stage must leave no finished-looking output"
    assert not (work / "results/eval/metrics.json").exists(), "the stale evaluation must be gone"
    first = _checkpoint_steps(work)[-1]
    assert first < 40, "checkpoints survive the failure"
    # The Snakemake 9 trap does not bite: the whole DAG still knows training must rerun.
    assert planned_jobs(work) == {"train_8card", "evaluate"}

    # 2. the rerun resumes; after its own next checkpoint Snakemake's whole process group gets SIGKILL,
    #    no clean-up at all. torchrun's workers are in sessions of their own, outside that group: they
    #    must die anyway.
    proc = subprocess.Popen([str(BIN / "snakemake"), "--cores", "2", "train_8card"], cwd=work,
                            env=tool_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_for(lambda: _checkpoint_steps(work)[-1] > first, 600, "the rerun's next checkpoint")
    workers = wait_for(lambda: [w for w in _training_workers(proc.pid)
                                 if "torch.distributed.run" not in w.cmdline()], 60, "training workers")
    assert all(os.getpgid(w.pid) != proc.pid for w in workers)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    wait_for(lambda: not [w for w in workers if w.is_running()
                           and w.status() != psutil.STATUS_ZOMBIE], 60, "orphaned workers to die")
    assert (work / ".snakemake/incomplete").is_dir() and any((work / ".snakemake/incomplete").iterdir())
    assert not (work / "results/train/model").exists(), "outputs are atomic: nothing half-written"
    log = (work / "results/logs/train_8card.log").read_text()
    assert re.search(rf"resum\w* from .*step_{first:06d}", log, re.I), log[-2000:]

    # 3. the documented recovery, as typed in docs/troubleshooting.md: it resumes from the latest
    #    checkpoint, reruns training alone, and ends with one trainer's unique, increasing steps
    run(["snakemake", "--unlock"], work)
    rerun = run(["snakemake", "--cores", "2", "--rerun-incomplete", "train_8card"], work)
    log = (work / "results/logs/train_8card.log").read_text()
    resumed = re.search(r"resum\w* from .*step_(\d+)", log, re.I)
    assert resumed and int(resumed.group(1)) > first, log[-2000:]
    assert "convert_recap" not in started_stages(rerun.stdout + rerun.stderr)
    assert upstream == {p: p.stat().st_mtime for p in upstream}, "upstream outputs untouched"
    assert metric_steps(work) == list(range(1, 41))
    assert planned_jobs(work) == {"evaluate"}


@pytest.mark.parametrize(
    "edited, expected",
    [
        # a stage's code is the files it runs (its imports): the offline report reruns evaluate alone,
        # never a collection or a training (issue 34)
        ("src/pisft/evaluate/report.py", {"evaluate"}),
        ("src/pisft/train/loop.py", {"smoke_1card", "train_8card", "closed_loop", "evaluate"} | LOOP),
        ("src/pisft/config/schema.py", {"fetch_base", "demo_recap", "convert_recap", "smoke_1card", "train_8card",
                                 "closed_loop", "evaluate"} | LOOP),
        # the advantages stage and what reads its labels: the retraining, its closed loop, the summary
        ("src/pisft/recap/advantages.py", {"advantages_1", "train_8card_1", "closed_loop_1", "recap_summary"}),
        # DVC-only settings (plot axes, caching) live in dvc_yaml.py, which no stage runs
        ("src/pisft/workflow/dvc_yaml.py", set()),
    ],
)
def test_snakemake_reruns_what_runs_edited_code(finished, edited, expected):
    with appended_comment(finished / edited):
        assert planned_jobs(finished) == expected


def test_a_missing_intermediate_is_rebuilt_with_what_follows(finished, tmp_path):
    """`rule all` asks for every stage's outputs (the Snakemake idiom), so a removed model is
    retrained and everything after it rerun, though the evaluation is still there."""
    model, aside = finished / "results/train/model", tmp_path / "model"
    model.rename(aside)  # a rename keeps the folder's times for its return
    try:
        assert (finished / "results/eval/metrics.json").is_file()
        assert planned_jobs(finished) == {"train_8card", "closed_loop", "evaluate"} | LOOP
    finally:
        aside.rename(model)
