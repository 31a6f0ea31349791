"""Issue 22, item 6: config lists that would repeat work (or name none) are refused by validate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pisft import rollout
from pisft import config as C
from pisft.errors import PisftError

ROOT = Path(__file__).resolve().parents[1]


def write_config(tmp_path: Path, **eval_keys) -> Path:
    raw = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    raw["eval"].update(eval_keys)
    raw["results_dir"] = str(tmp_path / "results")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pisft", "validate", str(path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


@pytest.mark.parametrize(("suites", "message"), [
    (["libero_10", "libero_goal", "libero_10"], r"eval.libero_suites: \['libero_10'\] listed more than once; "
                                                r"each suite once"),
    ([], r"eval.libero_suites: an empty list names no suite to roll out; give one or more of libero_spatial"),
])
def test_repeated_and_empty_suite_lists_are_refused(tmp_path, suites, message):
    with pytest.raises(C.ConfigError, match=message):
        C.load(write_config(tmp_path, libero_suites=suites, closed_loop=True))
    out = validate(write_config(tmp_path, libero_suites=suites, closed_loop=True))
    assert out.returncode != 0 and "libero_suites" in out.stderr + out.stdout
    assert "OK" not in out.stdout


def test_the_shipped_config_and_distinct_suites_pass(tmp_path):
    cfg = C.load(write_config(tmp_path, libero_suites=["libero_10", "libero_goal"]))
    assert list(cfg.eval.libero_suites) == ["libero_10", "libero_goal"]
    out = validate(ROOT / "config/config.yaml")
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr


def test_the_episode_plan_refuses_them_too():
    for suites in ((), ("libero_10", "libero_10")):
        s = rollout.Settings(suites=suites, trials_per_task=1, replan_steps=5, num_wait_steps=0, seed=7,
                                 resize_size=224)
        with pytest.raises(PisftError, match="distinct suites"):
            rollout.plan_episodes(None, s, None)
