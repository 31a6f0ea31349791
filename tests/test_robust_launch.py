"""Issue 47, items 2-4: a training stage stopped by something the user must fix says so in one
line, without torchrun's traceback or a resume advice that a rerun cannot honour: a damaged
converted dataset (naming the file and the stage and command that rewrite it), a full disk, and a
smoke report made for another step (train.trainable switched after the smoke run). Each through
the real launcher and torchrun, on real outputs of the stages before it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_robust_disk import fill, small_fs
from test_robust_read import zero_middle

from pisft import config as config_mod
from pisft import integrity
from pisft.cli import resolve
from pisft.stages import STAGES

ROOT = Path(__file__).resolve().parents[1]
# One process, one micro batch per step, expert mode: the smoke report of the fixture is made
# for this step; a training that differs in a step key must not trust it.
STEP = ["train.nproc_per_node=1", "train.micro_batch_size=2", "train.global_batch_size=2",
        "train.trainable=expert", "train.steps=2", "train.save_every=1", "train.num_workers=0",
        "smoke.steps=2", "recap.iterations=0", "data.demo_episodes_per_task=1", "data.demo_episode_length=12"]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def pisft(results: Path, *args: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    sets = [f"results_dir={results}", f"data.recap_dir={results}/demo_recap", *STEP, *extra]
    cmd = [sys.executable, "-m", "pisft", *args, "--config", str(ROOT / "config/config.yaml"),
           *[x for s in sets for x in ("--set", s)]]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env(), timeout=600)


@pytest.fixture(scope="module")
def smoked(tmp_path_factory) -> Path:
    """results/ after demo_recap, fetch_base and convert_recap (their stage functions, run here as
    `python -m pisft` runs them) and a passing smoke_1card (expert mode) through the launcher."""
    results = tmp_path_factory.mktemp("launch") / "results"
    cfg = config_mod.load(ROOT / "config/config.yaml",
                          [f"results_dir={results}", f"data.recap_dir={results}/demo_recap", *STEP])
    for stage in ("demo_recap", "fetch_base", "convert_recap"):
        with integrity.writing_as(stage, f"python -m pisft {stage}"):
            resolve(STAGES[stage].run)(cfg)
    out = pisft(results, "launch", "smoke_1card")
    assert out.returncode == 0, out.stderr[-3000:]
    return results


def copy_of(smoked: Path, dest: Path) -> Path:
    shutil.copytree(smoked, dest, symlinks=True)
    return dest


def error_lines(text: str) -> list[str]:
    """The lines that report an error: pisft's, a worker's, an exception's."""
    return [line for line in text.splitlines()
            if line.lstrip().startswith("error") or "error (rank" in line or "Error" in line]


def the_one_error_line(out: subprocess.CompletedProcess) -> str:
    """A run stopped by an error the user can act on: exit 2, one error line, no traceback."""
    assert out.returncode == 2, out.stderr[-3000:]
    errors = error_lines(out.stdout + out.stderr)
    assert len(errors) == 1, errors
    assert "Traceback" not in out.stdout + out.stderr
    return errors[0]


@pytest.mark.integration
def test_training_launched_by_hand_after_switching_the_mode_is_refused(smoked):
    """The smoke report measured expert mode (the VLM frozen); training all of it needs several
    times the memory: the launcher refuses before torchrun starts, naming the key."""
    downstream = smoked / "eval" / "report.md"  # an evaluation of an earlier training: kept by a refusal
    downstream.parent.mkdir(parents=True)
    downstream.write_text("earlier evaluation\n")
    out = pisft(smoked, "launch", "train_8card", extra=("train.trainable=all",))
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: train_8card: the smoke report ") and "\n" not in last
    assert "train.trainable: smoke 'expert', now 'all'" in last and "rerun smoke_1card" in last
    assert "[launch]" not in out.stderr  # refused before any process started
    assert not (smoked / "checkpoints" / "train").exists()
    assert downstream.read_text() == "earlier evaluation\n"  # nothing removed for a refused launch
    shutil.rmtree(downstream.parent)


@pytest.mark.integration
def test_a_damaged_dataset_stops_training_with_one_line_naming_the_stage_that_rewrites_it(smoked, tmp_path):
    results = copy_of(smoked, tmp_path / "results")
    parquet = sorted((results / "dataset" / "data").rglob("*.parquet"))[0]
    zero_middle(parquet)  # 64 KiB of zeros, the size unchanged
    out = pisft(results, "launch", "train_8card")
    line = the_one_error_line(out)
    assert line.startswith("error: train_8card: reading the dataset "), line
    assert f"{parquet}: sha256 differs" in line and "is not what convert_recap wrote" in line
    assert "snakemake --cores all --forcerun convert_recap" in line and "dvc repro --force convert_recap" in line
    assert "resume" not in out.stderr.lower()  # a rerun fails the same way: no such advice


@pytest.mark.integration
def test_a_full_disk_under_training_is_one_line(smoked, tmp_path):
    with small_fs(tmp_path / "fs", 48) as fs:
        results = copy_of(smoked, fs / "results")
        shutil.rmtree(results / "demo_recap")  # the dataset is converted: room for the test
        (results / "demo_recap").mkdir()
        fill(fs, 4 << 20)  # a checkpoint of the tiny model (weights and AdamW moments) is larger
        line = the_one_error_line(pisft(results, "launch", "train_8card"))
        assert line.startswith("error: train_8card: checkpoint of step 1 will not fit: "), line
        assert "no space left on the device (" in line and "kept: no complete checkpoint" in line
        assert "resume with python -m pisft launch train_8card" in line
        assert not list((results / "checkpoints").rglob("step_000001"))
        # nothing free at all: refused before torchrun starts (its workers could not write a log)
        fill(fs, 0)
        out = pisft(results, "launch", "train_8card")
        assert out.returncode == 2, out.stderr[-3000:]
        assert out.stderr.strip().splitlines()[-1].startswith("error: train_8card's logs will not fit: ")
        assert "[launch]" not in out.stderr and "Traceback" not in out.stderr
