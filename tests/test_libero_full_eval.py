"""config/profiles/libero-full-eval.yaml is openpi's LIBERO evaluation protocol, alone and over a
device profile: 4 suites × 10 tasks × 50 trials = 2000 episodes at openpi's step limits."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
from test_eval_closed_loop import StandInSimulator, StandInTask

from pisft import rollout
from pisft import config as C
from pisft.rollout import libero_sim
from pisft.workflow import profile as profile_mod

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "config/profiles/libero-full-eval.yaml"

# openpi's protocol, Physical-Intelligence/openpi examples/libero/main.py at commit
# 15a9616a00943ada6c20a0f158e3adb39df2ccac (unchanged since 231a1cf7caddaae1d0ed1b4956a55de332feb27e):
# Args.resize_size, replan_steps, num_steps_wait, num_trials_per_task, seed, and max_steps per suite.
OPENPI_SUITE_MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520}
OPENPI = {"resize_size": 224, "replan_steps": 5, "num_wait_steps": 10, "trials_per_task": 50, "seed": 7}
TASKS_PER_SUITE = 10  # LIBERO's four suites have 10 tasks each; openpi runs range(task_suite.n_tasks)


@pytest.fixture(scope="module")
def applied(tmp_path_factory) -> dict[str, C.PisftConfig]:
    """The profile switched into a copy of config/config.yaml as `python -m pisft profile` does,
    alone and after a device profile, and each result loaded as the stages load it."""
    out = {}
    for name, before in (("alone", []), ("over ascend-8card", ["ascend-8card.yaml"])):
        tmp = tmp_path_factory.mktemp("full_eval")
        shutil.copy(ROOT / "config/config.yaml", tmp / "config.yaml")
        for profile in [*(ROOT / "config/profiles" / b for b in before), PROFILE]:
            profile_mod.switch(profile, tmp / "config.yaml", tmp / "dvc.yaml")
        out[name] = C.load(tmp / "config.yaml")
    return out


def test_the_suite_limits_are_openpis():
    assert {s: libero_sim.SUITE_MAX_STEPS[s] for s in OPENPI_SUITE_MAX_STEPS} == OPENPI_SUITE_MAX_STEPS


@pytest.mark.parametrize("case", ["alone", "over ascend-8card"])
def test_the_profile_sets_openpis_protocol(applied, case):
    e = applied[case].eval
    assert e.closed_loop is True
    assert e.libero_suites == list(OPENPI_SUITE_MAX_STEPS) and e.task_ids == []
    assert (e.resize_size, e.replan_steps, e.num_wait_steps, e.trials_per_task, e.closed_loop_seed) == (
        OPENPI["resize_size"], OPENPI["replan_steps"], OPENPI["num_wait_steps"], OPENPI["trials_per_task"],
        OPENPI["seed"])
    assert e.max_steps == 0  # openpi's limit of each suite
    assert e.num_envs == 0  # sized to the host
    assert applied[case].recap.iterations == 0  # every initial state is the evaluation's


def test_the_device_profile_keeps_its_keys_under_the_full_evaluation(applied):
    cfg = applied["over ascend-8card"]
    assert (cfg.device, cfg.train.nproc_per_node, cfg.model.source) == ("npu", 8, "/data/pi05_base")


def test_the_resolved_settings_plan_2000_episodes_at_openpis_limits(applied, tmp_path):
    settings = rollout.Settings.from_config(applied["alone"])
    tasks = [StandInTask(f"reach {t} 0 0", (0.0, 0.0, 0.0)) for t in range(TASKS_PER_SUITE)]
    specs, languages = rollout.plan_episodes(StandInSimulator(tasks, n_init=50), settings, tmp_path)
    assert len(specs) == 4 * TASKS_PER_SUITE * OPENPI["trials_per_task"] == 2000
    assert len(languages) == 4 * TASKS_PER_SUITE
    assert Counter(s.suite for s in specs) == {s: 500 for s in OPENPI_SUITE_MAX_STEPS}
    for spec in specs:
        assert spec.max_steps == OPENPI_SUITE_MAX_STEPS[spec.suite]
        assert (spec.num_wait_steps, spec.env_seed, spec.resize_size) == (
            OPENPI["num_wait_steps"], OPENPI["seed"], OPENPI["resize_size"])
        assert spec.init_state == spec.trial  # episode i from the task's initial state i
    assert Counter((s.suite, s.task_id) for s in specs) == {
        (s, t): OPENPI["trials_per_task"] for s in OPENPI_SUITE_MAX_STEPS for t in range(TASKS_PER_SUITE)}
    assert sum(s.video is not None for s in specs) == 4 * TASKS_PER_SUITE  # one per task
    assert settings.replan_steps == OPENPI["replan_steps"] and settings.num_envs >= 1


def test_the_libero_90_profile_plans_its_90_tasks_at_openpis_limit_400(tmp_path):
    """config/profiles/libero-90-eval.yaml: LIBERO-90 in openpi's loop, 90 tasks x 50 trials at the limit
    openpi's examples/libero/main.py gives libero_90 (400, at the commit cited above)."""
    shutil.copy(ROOT / "config/config.yaml", tmp_path / "config.yaml")
    profile_mod.switch(ROOT / "config/profiles/libero-90-eval.yaml", tmp_path / "config.yaml", tmp_path / "dvc.yaml")
    cfg = C.load(tmp_path / "config.yaml")
    assert (cfg.eval.libero_suites, cfg.eval.task_ids, cfg.eval.max_steps, cfg.recap.iterations) == (
        ["libero_90"], [], 0, 0)
    settings = rollout.Settings.from_config(cfg)
    tasks = [StandInTask(f"reach {t} 0 0", (0.0, 0.0, 0.0)) for t in range(90)]
    specs, _ = rollout.plan_episodes(StandInSimulator(tasks, n_init=50), settings, tmp_path)
    assert len(specs) == 90 * OPENPI["trials_per_task"] == 4500
    assert {s.max_steps for s in specs} == {400} == {libero_sim.SUITE_MAX_STEPS["libero_90"]}
    assert {(s.num_wait_steps, s.env_seed, s.resize_size) for s in specs} == {
        (OPENPI["num_wait_steps"], OPENPI["seed"], OPENPI["resize_size"])}
    assert sum(s.video is not None for s in specs) == 90
