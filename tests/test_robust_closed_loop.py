"""Issue 22, items 1-2: a crash is not a failed episode; actions are finite or refused.

An episode that ends in an error (the simulator raises, its worker is killed, the policy fails
or answers NaN) is run again on a fresh worker; one that errs on every attempt fails the stage
naming it, and a success rate is only computed over episodes that ran to their end.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
from pathlib import Path
from xml.etree.ElementTree import ParseError

import numpy as np
import pytest
from test_eval_closed_loop import (
    GoalSeekingPolicy,
    StandInEnv,
    StandInSimulator,
    StandInTask,
    make_cfg,
    run_inline,
    settings,
)

from pisft import rollout
from pisft.errors import PisftError
from pisft.evaluate import closed_loop
from pisft.rollout import libero_sim

TASKS = [StandInTask("reach 0.5 0 0", [0.5, 0, 0]), StandInTask("reach 0.3 0 0", [0.3, 0, 0])]


class OnceFaultyEnv(StandInEnv):
    """Fails once per marker file: at its `at`-th step it raises, or (`kill`) the process sends
    itself SIGKILL, as the OS's out-of-memory killer ends a worker."""

    def __init__(self, goal, seed, *, fault: str, marker: Path, at: int):
        super().__init__(goal, seed)
        self.fault, self.marker, self.at = fault, marker, at

    def step(self, action):
        if len(self.actions) + 1 >= self.at and not self.marker.exists():
            self.marker.touch()
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("transient physics failure")
        return super().step(action)


class OnceFaultySimulator(StandInSimulator):
    """Task `faulty`'s first environment fails once (one marker file for the whole run, shared by
    every worker process); every later attempt runs normally."""

    def __init__(self, tasks, marker: str, fault: str, faulty: int = 0, at: int = 15):
        super().__init__(tasks)
        self.marker, self.fault, self.faulty, self.at = Path(marker), fault, faulty, at

    def make_env(self, task, *, resolution, seed):
        if task is not self.tasks[self.faulty]:
            return super().make_env(task, resolution=resolution, seed=seed)
        env = OnceFaultyEnv(task.goal, seed, fault=self.fault, marker=self.marker, at=self.at)
        self.envs.append(env)
        return env


class DamagedAssetSimulator(StandInSimulator):
    """Every environment fails to load its scene, as LIBERO does with a damaged asset file."""

    def make_env(self, task, *, resolution, seed):
        raise ParseError("not well-formed (invalid token): line 1, column 2")


class NaNPolicy(GoalSeekingPolicy):
    def infer(self, obs):
        out = super().infer(obs)
        out["actions"] = out["actions"].copy()
        out["actions"][1, 2] = np.nan
        out["actions"][3, 0] = np.inf
        return out


def outcomes(results):
    return [(r.suite, r.task_id, r.trial, r.success, r.steps, r.policy_calls) for r in results]


def test_an_episode_that_errs_once_is_run_again_and_gives_the_result_of_a_clean_run(tmp_path):
    clean = run_inline(StandInSimulator(TASKS), GoalSeekingPolicy(noise=0.5), settings(trials_per_task=2))
    cfg = make_cfg(tmp_path, libero_suites=["libero_spatial"], num_envs=1, trials_per_task=2)
    factory = functools.partial(OnceFaultySimulator, TASKS, str(tmp_path / "faulted"), "raise")
    metrics = closed_loop.run(cfg, simulator=factory, policy=GoalSeekingPolicy(noise=0.5), inline=True)
    assert (tmp_path / "faulted").exists()  # the fault did happen
    rows = [json.loads(line) for line in (tmp_path / "results/closed_loop/episodes.jsonl").read_text().splitlines()]
    assert [(r["suite"], r["task_id"], r["trial"], r["success"], r["steps"], r["policy_calls"]) for r in rows] \
        == outcomes(clean)
    assert all(r["error"] is None and "retried_errors" not in r for r in rows)  # the same lines as a clean run's
    timing = json.loads((tmp_path / "results/logs/closed_loop.timing.json").read_text())  # how the run went
    assert timing["episodes"][0]["retried_errors"] == ["RuntimeError: transient physics failure"]
    assert not any(e["retried_errors"] for e in timing["episodes"][1:])
    assert timing["retried"] == 1 and metrics["errors"] == 0 and metrics["episodes"] == 4 and "retried" not in metrics
    assert "1 of them ended in an error first" in (tmp_path / "results/closed_loop/report.md").read_text()


def test_a_damaged_asset_in_every_episode_fails_the_stage_without_a_success_rate(tmp_path, capsys):
    cfg = make_cfg(tmp_path, libero_suites=["libero_spatial"], num_envs=1, trials_per_task=2)
    with pytest.raises(rollout.EpisodeErrors) as exc:
        closed_loop.run(cfg, simulator=functools.partial(DamagedAssetSimulator, TASKS[:1]),
                        policy=GoalSeekingPolicy(), inline=True)
    msg = str(exc.value)
    assert msg.startswith("closed_loop: episode 0 (libero_spatial task 0 \"reach 0.5 0 0\", initial state 0")
    assert "ParseError: not well-formed" in msg and "ran 3 times, on a fresh environment worker" in msg
    assert "no success rate was computed" in msg and "1 episodes not yet started then were not run" in msg
    assert [len(e) for e in [exc.value.crashed[0].errors]] == [3]
    assert not (tmp_path / "results/closed_loop").exists()
    assert "success rate" not in capsys.readouterr().out


@pytest.mark.integration  # spawned workers, one killed and replaced: ~15-30 s on 2 cores
def test_a_worker_killed_by_the_os_is_replaced_and_its_episode_run_again(tmp_path):
    clean = run_inline(StandInSimulator(TASKS), GoalSeekingPolicy(noise=0.5), settings(trials_per_task=2))
    cfg = make_cfg(tmp_path, libero_suites=["libero_spatial"], num_envs=2, trials_per_task=2)
    factory = functools.partial(OnceFaultySimulator, TASKS, str(tmp_path / "killed"), "kill", 1)
    metrics = closed_loop.run(cfg, simulator=factory, policy=GoalSeekingPolicy(noise=0.5))
    assert (tmp_path / "killed").exists()  # a worker did receive SIGKILL
    rows = [json.loads(line) for line in (tmp_path / "results/closed_loop/episodes.jsonl").read_text().splitlines()]
    assert [(r["suite"], r["task_id"], r["trial"], r["success"], r["steps"], r["policy_calls"]) for r in rows] \
        == outcomes(clean)
    timing = json.loads((tmp_path / "results/logs/closed_loop.timing.json").read_text())
    retried = [e["retried_errors"] for e in timing["episodes"] if e["retried_errors"]]
    assert len(retried) == 1 and "died (exit code -9)" in retried[0][0]
    assert timing["retried"] == 1 and metrics["errors"] == 0
    # the killed attempt's video was never finished: the retry's is complete and decodes
    videos = sorted(p.name for p in (tmp_path / "results/closed_loop/videos").glob("*.mp4"))
    assert videos == ["libero_spatial_task00.mp4", "libero_spatial_task01.mp4"]


def test_non_finite_actions_never_reach_the_simulator_and_fail_the_episode():
    sim = StandInSimulator(TASKS[:1])
    with pytest.raises(rollout.EpisodeErrors, match=r"crashed after 0 steps: PisftError: the policy returned "
                                                        r"non-finite actions \(2 of the 35 values"):
        run_inline(sim, NaNPolicy(), settings(trials_per_task=1))
    executed = [a for env in sim.envs for a in env.actions]  # the wait steps of each of the 3 attempts
    assert executed == [libero_sim.DUMMY_ACTION] * 30


def test_collection_retries_an_episode_and_writes_the_dataset_of_a_clean_run(tmp_path):
    from test_recap_collect import TASKS as COLLECT_TASKS
    from test_recap_collect import make_cfg as collect_cfg

    from pisft.recap import collect

    def hashes(root: Path) -> dict[str, str]:
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*")) if p.is_file() and p.suffix in (".parquet", ".jsonl")}

    a, b = tmp_path / "a", tmp_path / "b"
    clean = collect.run(collect_cfg(a), simulator=functools.partial(StandInSimulator, COLLECT_TASKS),
                        policy=GoalSeekingPolicy(), inline=True)
    factory = functools.partial(OnceFaultySimulator, COLLECT_TASKS, str(tmp_path / "faulted"), "raise", 0, 13)
    retried = collect.run(collect_cfg(b), simulator=factory, policy=GoalSeekingPolicy(), inline=True)
    assert (tmp_path / "faulted").exists()
    out_a, out_b = a / "results/recap/iter_1/rollouts", b / "results/recap/iter_1/rollouts"
    assert hashes(out_a) == hashes(out_b) and hashes(out_a)
    assert not (out_b / collect.RECORDINGS).exists()
    timing = json.loads((b / "results/recap/iter_1/logs/collect_rollouts.timing.json").read_text())
    assert [e["retried_errors"] for e in timing["episodes"]][0] == ["RuntimeError: transient physics failure"]
    assert retried["episodes"] == clean["episodes"]  # the retry is in the timing record only


def _assets(tmp_path: Path) -> Path:
    assets = tmp_path / "assets"
    files = {"scenes/floor.xml": b"<mujoco><geom/></mujoco>", "textures/wood.png": b"\x89PNG....."}
    lines = []
    for rel, data in files.items():
        (assets / rel).parent.mkdir(parents=True, exist_ok=True)
        (assets / rel).write_bytes(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {rel}")
    (assets / libero_sim.INSTALLED_MANIFEST).write_text("\n".join(lines) + "\n")
    return tmp_path


def test_the_asset_check_compares_content_not_only_presence(tmp_path, monkeypatch):
    monkeypatch.setattr(libero_sim, "_is_hf_libero", lambda root: True)
    monkeypatch.delenv(libero_sim.ASSETS_VERIFIED_ENV, raising=False)
    bench = _assets(tmp_path)
    assert libero_sim.assets_problem(bench) is None
    assert os.environ[libero_sim.ASSETS_VERIFIED_ENV]  # what the spawned workers inherit
    with open(bench / "assets/scenes/floor.xml", "r+b") as f:  # real bytes flipped, same size
        f.seek(3)
        f.write(b"\x00\xff")
    problem = libero_sim.assets_problem(bench)
    assert problem is not None and "1 of LIBERO's 2 scene asset files" in problem and "damaged" in problem
    assert "scenes/floor.xml" in problem and "libero_sim_setup.py assets" in problem
    # a worker that inherited the parent's check of an intact tree skips the reading...
    monkeypatch.delenv(libero_sim.ASSETS_VERIFIED_ENV)
    bench2 = _assets(tmp_path / "two")
    assert libero_sim.assets_problem(bench2) is None
    calls = []
    monkeypatch.setattr(libero_sim, "sha256_file", lambda p: calls.append(p) or "0")
    assert libero_sim.assets_problem(bench2) is None and calls == []
    # ...and reads again once a file changed since
    (bench2 / "assets/textures/wood.png").write_bytes(b"\x89PNG.....!")
    assert "damaged" in libero_sim.assets_problem(bench2) and calls


def test_summarize_refuses_results_that_did_not_run_to_their_end():
    r = rollout.EpisodeResult("libero_spatial", 0, "t", 0, False, 3, 1, 0.1, error="WorkerDied: killed")
    with pytest.raises(PisftError, match=r"1 episode\(s\) ended in an error .* WorkerDied: killed"):
        closed_loop.summarize([r])


class MujocoEnv(StandInEnv):
    """Steps a real MuJoCo model with the action (scaled past MuJoCo's bound of 1e10) as its
    control, so MuJoCo itself warns and writes MUJOCO_LOG.TXT into the working folder."""

    def step(self, action):
        import mujoco

        if not hasattr(self, "_mj"):
            m = mujoco.MjModel.from_xml_string(
                '<mujoco><worldbody><body><joint name="j" type="slide"/><geom size=".1"/></body>'
                '</worldbody><actuator><motor joint="j"/></actuator></mujoco>')
            self._mj = (m, mujoco.MjData(m))
        m, d = self._mj
        d.ctrl[:] = 1e11 * (1.0 + abs(action[0]))
        mujoco.mj_step(m, d)
        return super().step(action)


class MujocoSimulator(StandInSimulator):
    def make_env(self, task, *, resolution, seed):
        env = MujocoEnv(task.goal, seed)
        self.envs.append(env)
        return env


@pytest.mark.integration  # a spawned worker process: ~5-15 s on 2 cores
def test_mujocos_log_goes_to_the_stages_log_folder_not_the_project_root(tmp_path, monkeypatch, capfd):
    from pisft.logs import tee_output

    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    cfg = make_cfg(tmp_path, libero_suites=["libero_spatial"], num_envs=1, trials_per_task=1)
    with tee_output(tmp_path / "results/logs/closed_loop.log"):
        closed_loop.run(cfg, simulator=functools.partial(MujocoSimulator, TASKS[:1]), policy=GoalSeekingPolicy())
    assert list(project.iterdir()) == []  # nothing in the working folder of the stage
    log = tmp_path / "results/logs/closed_loop.mujoco/MUJOCO_LOG.TXT"
    assert "Nan, Inf or huge value in CTRL" in log.read_text()
    assert f"MuJoCo logged warnings (an unstable simulation) to {log}" in capfd.readouterr().out
    assert (tmp_path / "results/closed_loop/videos/libero_spatial_task00.mp4").is_file()  # absolute paths
