"""Issue 22, item 5: a value means one thing to both drivers (Snakemake: YAML 1.1, DVC: YAML 1.2)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ruamel.yaml import YAML

from pisft import config as C
from pisft.workflow import profile as profile_mod

ROOT = Path(__file__).resolve().parents[1]


def config_with(tmp_path: Path, replace: str, by: str) -> Path:
    text = (ROOT / "config/config.yaml").read_text()
    assert replace in text
    path = tmp_path / "config.yaml"
    path.write_text(text.replace(replace, by, 1))
    return path


@pytest.mark.parametrize(("line", "one", "two"), [
    ("  steps: 010", "8 (int)", "10 (int)"),
    ("  steps: 0o10", "'0o10' (str)", "8 (int)"),
    ("  lr: 1e-3", "'1e-3' (str)", "0.001 (float)"),
    ("  lr: 1e3", "'1e3' (str)", "1000.0 (float)"),
])
def test_a_value_the_two_drivers_read_differently_is_refused_naming_the_key(tmp_path, line, one, two):
    key = line.split(":")[0].strip()
    old = {"steps": "  steps: 150", "lr": "  lr: 0.001"}[key]
    path = config_with(tmp_path, old, line)
    # what the two readers really make of it
    text = path.read_text()
    assert yaml.safe_load(text)["train"][key] != YAML(typ="safe", pure=True).load(text)["train"][key]
    with pytest.raises(C.ConfigError) as exc:
        C.load(path)
    msg = str(exc.value)
    assert f"train.{key}: Snakemake (YAML 1.1) reads {one}, DVC (YAML 1.2) reads {two}" in msg
    assert "Quote a value meant as text" in msg and "5.0e-5" in msg
    out = subprocess.run([sys.executable, "-m", "pisft", "validate", str(path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode != 0 and f"train.{key}: Snakemake" in out.stderr + out.stdout


def test_yes_no_on_off_and_sexagesimal_strings_are_refused_unquoted_and_taken_quoted(tmp_path):
    for value, quoted in (("yes", '"yes"'), ("off", '"off"'), ("12:30", '"12:30"')):
        path = config_with(tmp_path, "  preset: tiny", f"  preset: {value}")
        with pytest.raises(C.ConfigError, match=r"model.preset: Snakemake \(YAML 1.1\) reads"):
            C.read_yaml(path, missing="-")
        path = config_with(tmp_path, "  preset: tiny", f"  preset: {quoted}")
        assert C.read_yaml(path, missing="-")["model"]["preset"] == value


def test_a_repeated_key_is_refused(tmp_path):
    path = config_with(tmp_path, "  steps: 150", "  steps: 150\n  steps: 10")
    with pytest.raises(C.ConfigError, match=r"found the key 'steps' twice .* keep one"):
        C.load(path)


def test_the_profile_switch_writes_numbers_as_numbers_both_drivers_read_alike(tmp_path):
    shutil.copy(ROOT / "config/config.yaml", tmp_path / "config.yaml")
    prof = tmp_path / "p.yaml"
    prof.write_text("train:\n  lr: 1e-4\n  decay_lr: 1e-10\nmodel:\n  preset: tiny\n")
    profile_mod.switch(prof, tmp_path / "config.yaml", tmp_path / "dvc.yaml")
    text = (tmp_path / "config.yaml").read_text()
    one, two = yaml.safe_load(text), YAML(typ="safe", pure=True).load(text)
    assert one["train"]["lr"] == two["train"]["lr"] == 1e-4 and isinstance(one["train"]["lr"], float)
    assert one["train"]["decay_lr"] == two["train"]["decay_lr"] == 1e-10
    assert "'1e-4'" not in text and C.load(tmp_path / "config.yaml").train.lr == 1e-4
    # a profile with a repeated key writes nothing
    before = text
    prof.write_text("train:\n  lr: 1.0e-4\n  lr: 2.0e-4\n")
    with pytest.raises(C.ConfigError, match="found the key 'lr' twice"):
        profile_mod.switch(prof, tmp_path / "config.yaml", tmp_path / "dvc.yaml")
    assert (tmp_path / "config.yaml").read_text() == before
