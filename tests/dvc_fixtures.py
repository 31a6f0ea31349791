"""The DVC run of the small SFT settings, once per session: tests/test_dvc.py drives DVC on it,
tests/test_slurm.py compares the same DAG run through Slurm with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from conftest import BIN, copy_project, run

RAN = re.compile(r"Running stage '(\w+)'")
SMALL = {
    ("data", "demo_episodes_per_task"): 2,
    ("smoke", "steps"): 2,
    ("train", "steps"): 6,
    ("train", "save_every"): 3,
    ("eval", "bootstrap_samples"): 50,
    # every 8th held-out frame: the offline evaluation's chunks are most of `evaluate`'s time after its
    # imports, and these tests check what runs and reruns, not the error bars
    ("eval", "frame_stride"): 8,
    ("eval", "closed_loop"): False,  # the simulator costs minutes; tests/test_eval_closed_loop.py runs it
    ("recap", "iterations"): 0,  # the loop runs in the simulator: tests/test_integration_pipeline.py drives it
}
STAGES = {"fetch_base", "demo_recap", "convert_recap", "smoke_1card", "train_8card", "evaluate"}
CHECK = "config_check"  # DVC only, before every stage (pisft.workflow.dvc_yaml.CHECK_STAGE)


@pytest.fixture(scope="session")
def dvc_run(tmp_path_factory) -> Path:
    """The small SFT DAG run by `dvc repro` (tests/test_dvc.py; tests/test_slurm.py compares the
    Slurm run with it)."""
    work = copy_project(tmp_path_factory.mktemp("dvc") / "w", git=True)
    # The documented switch: the settings go into config/config.yaml, dvc.yaml follows its shape
    small = work.parent / "small.yaml"
    small.write_text(yaml.safe_dump({s: {k: v for (s2, k), v in SMALL.items() if s2 == s}
                                     for s in {s for s, _ in SMALL}}))
    run([str(BIN / "python"), "-m", "pisft", "profile", str(small)], work)
    assert set(yaml.safe_load((work / "dvc.yaml").read_text())["stages"]) == {CHECK, *STAGES}
    run(["git", "commit", "-qam", "small config"], work)
    first = run(["dvc", "repro"], work)
    assert RAN.findall(first.stdout)[0] == CHECK and set(RAN.findall(first.stdout)) == {CHECK, *STAGES}
    run(["git", "add", "dvc.lock"], work)
    run(["git", "commit", "-qm", "lock"], work)
    return work
