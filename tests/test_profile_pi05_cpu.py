"""config/profiles/pi05-cpu.yaml (the real-size DAG on this CPU) switches in and validates; the
run itself (about 45 minutes) is `make run-pi05-cpu`, not a test."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from conftest import BIN, copy_project, run
from pisft import config as C
from pisft.model import sources
from pisft.workflow import profile as profile_mod

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "config/profiles/pi05-cpu.yaml"


def test_the_real_size_profile_applies_and_validates(tmp_path):
    shutil.copy(ROOT / "config/config.yaml", tmp_path / "config.yaml")
    profile_mod.switch(PROFILE, tmp_path / "config.yaml", tmp_path / "dvc.yaml")
    cfg = C.load(tmp_path / "config.yaml")
    assert cfg.model.preset == "pi05" and sources.parse_source(cfg.model.source).kind == "random"
    assert cfg.device == "cpu" and cfg.train.precision == "bf16"
    assert cfg.train.trainable == "expert" and cfg.recap.value_trainable == "head"
    assert (cfg.world_size, cfg.train.micro_batch_size) == (2, 1)
    assert cfg.train.activation_checkpointing and cfg.recap.iterations == 1
    assert cfg.train.steps <= 5 and cfg.recap.policy_steps <= 5 and cfg.recap.value_steps <= 5
    # a rate random real-size weights survive (the smoke gate's loss rose 2.30 -> 36.0 at the
    # default's 1e-3, -> 7.83 at 5e-5, fell to 2.19 at 1e-6); RLinf's value-model rates
    assert cfg.train.lr == 1e-6 and cfg.recap.value_lr == 5e-5 and cfg.recap.value_head_lr == 1e-4
    assert (tmp_path / "dvc.yaml").is_file()


@pytest.mark.integration
def test_a_random_base_is_no_folder_dvc_depends_on_and_snakemake_records_it_in_dvc(tmp_path):
    """model.source: random is a name, like tiny: dvc.yaml's fetch_base does not depend on a path
    'random' (DVC's commit after a Snakemake run refused it: "dependency 'random' does not
    exist"), so the real-size profile's Snakemake run ends with its stages recorded in dvc.lock."""
    work = copy_project(tmp_path / "w", git=True)
    override = tmp_path / "random.yaml"
    override.write_text(yaml.safe_dump({"model": {"source": "random", "init_seed": 3}}))
    run([str(BIN / "python"), "-m", "pisft", "profile", str(override)], work)
    deps = yaml.safe_load((work / "dvc.yaml").read_text())["stages"]["fetch_base"]["deps"]
    assert "${model.source}" not in deps and "random" not in deps
    out = run(["snakemake", "--cores", "2", "fetch_base"], work)
    assert "dvc.lock: recorded config_check, fetch_base" in out.stderr, out.stderr[-3000:]  # the config_check row too
    assert "up to date" in run(["dvc", "status", "fetch_base"], work).stdout.lower()
