"""Closed-loop LIBERO rollout loop, against a stand-in simulator with LIBERO's interface."""

from __future__ import annotations

import base64
import functools
import io
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from pisft.policy import replicas
from pisft import rollout
from pisft import config as C
from pisft.errors import PisftError
from pisft.evaluate import closed_loop
from pisft.rollout import libero_sim
from pisft.rollout.workers import InlineWorker

RES = libero_sim.RENDER_RESOLUTION


class StandInEnv:
    """LIBERO's OffScreenRenderEnv interface: the end effector is a point that must reach a goal.

    The agent-view image is a gradient whose top-left pixel is dark and bottom-right bright,
    so a request built without LIBERO's 180° rotation shows. `explode_at` makes `step` raise;
    `die_at` ends the (worker) process the way a crash in native simulator code does.

    Stateful as LIBERO is: `seed` seeds the environment's generator (LIBERO's seeds numpy's),
    and every `reset` draws the scene's placement from it, so without a seed before each reset
    an episode depends on the resets its environment ran before. The draw moves the initial
    position along x by up to `placement_noise` (0: drawn, without effect).
    """

    def __init__(self, goal, seed, explode_at=None, die_at=None, placement_noise=0.0):
        self.goal = np.asarray(goal, dtype=float)
        self.seeds = [seed]
        self.rng = np.random.default_rng(seed)
        self.placement_noise = placement_noise
        self.placement = np.zeros(3)
        self.explode_at = explode_at
        self.die_at = die_at
        self.actions: list[list[float]] = []
        self.init_states: list = []
        self.closed = False
        self.pos = np.zeros(3)

    def _obs(self):
        ramp = np.linspace(0, 255, RES).astype(np.uint8)
        img = np.repeat(np.add.outer(ramp // 2, ramp // 2)[:, :, None], 3, axis=2).astype(np.uint8)
        # the wrist image shows the position, so the video's frames differ
        wrist = np.full((RES, RES, 3), int(np.clip(100 * self.pos[0], 0, 255)), np.uint8)
        return {"agentview_image": img, "robot0_eye_in_hand_image": wrist,
                "robot0_eef_pos": self.pos.copy(),
                "robot0_eef_quat": np.array([0.0, 0.0, math.sin(0.25), math.cos(0.25)]),
                "robot0_gripper_qpos": np.array([0.04, -0.04])}

    def seed(self, seed):
        self.seeds.append(seed)
        self.rng = np.random.default_rng(seed)

    def reset(self):
        self.placement = np.array([self.placement_noise * self.rng.uniform(-1, 1), 0.0, 0.0])  # along x
        self.pos = self.placement.copy()
        return self._obs()

    def set_init_state(self, state):
        self.init_states.append(state)
        self.pos = np.asarray(state, dtype=float)[:3] + self.placement
        return self._obs()

    def step(self, action):
        assert isinstance(action, list) and len(action) == 7
        self.actions.append(action)
        if self.explode_at is not None and len(self.actions) >= self.explode_at:
            raise RuntimeError("physics blew up")
        if self.die_at is not None and len(self.actions) >= self.die_at:
            os._exit(3)
        self.pos = self.pos + 0.05 * np.asarray(action[:3])
        done = bool(np.linalg.norm(self.pos - self.goal) < 0.03)
        return self._obs(), float(done), done, {}

    def close(self):
        self.closed = True


class StandInTask:
    def __init__(self, language, goal, explode_at=None, die_at=None):
        self.language, self.goal, self.explode_at, self.die_at = language, goal, explode_at, die_at


class StandInSuite:
    def __init__(self, tasks, n_init):
        self.tasks = tasks
        self.n_tasks = len(tasks)
        self.n_init = n_init

    def get_task(self, i):
        return self.tasks[i]

    def get_task_init_states(self, i):
        # initial state k puts the effector at (0.01 k, 0, 0)
        return [np.array([0.01 * k, 0.0, 0.0, 9.0]) for k in range(self.n_init)]


class StandInSimulator:
    """A picklable factory builds one per worker process: `functools.partial(StandInSimulator, tasks)`."""

    def __init__(self, tasks, n_init=50, placement_noise=0.0):
        self.tasks = tasks
        self.n_init = n_init
        self.placement_noise = placement_noise
        self.envs: list[StandInEnv] = []

    def describe(self):
        return {"package": "stand-in (tests/test_eval_closed_loop.py)", "version": None}

    def suite(self, name):
        return StandInSuite(self.tasks, self.n_init)

    def make_env(self, task, *, resolution, seed):
        assert resolution == RES
        env = StandInEnv(task.goal, seed, task.explode_at, task.die_at, self.placement_noise)
        self.envs.append(env)
        return env


class GoalSeekingPolicy:
    """Reads the goal from the prompt ("reach x y z") and the position from the state; a noise
    term drawn from the seed of each call shows whether seeds reach the right chunks."""

    def __init__(self, horizon=8, noise=0.0):
        self.horizon = horizon
        self.noise = noise
        self.requests: list[dict] = []
        self.seeds: list = []

    def reset(self, seed=None):
        self.seeds.append(seed)

    def infer(self, obs):
        self.requests.append(obs)
        goal = np.array([float(x) for x in obs["prompt"].split()[1:4]])
        pos = obs["observation/state"][:3]
        step = np.clip((goal - pos) / 0.05, -1, 1)
        jitter = self.noise * np.random.default_rng(self.seeds[-1]).uniform(-1, 1, 3)
        action = np.concatenate([step + jitter, np.zeros(3), [1.0]])
        return {"actions": np.tile(action, (self.horizon, 1))}


def ci(entry):
    return [entry["success_rate_ci_low"], entry["success_rate_ci_high"]]


def settings(**kw):
    base = dict(suites=("libero_spatial",), trials_per_task=3, replan_steps=5, num_wait_steps=10,
                seed=7, resize_size=224)
    base.update(kw)
    return rollout.Settings(**base)


def run_inline(sim, policy, s, out_dir=None, num_envs=1):
    """The stage's episode loop with the environments in this process (to inspect them)."""
    specs, languages = rollout.plan_episodes(sim, s, out_dir)
    workers = [InlineWorker(sim) for _ in range(num_envs)]
    try:
        return rollout.run_episodes(specs, policy, s, workers=workers, languages=languages)
    finally:
        for w in workers:
            w.close()


def test_episode_follows_openpi_loop():
    sim = StandInSimulator([StandInTask("reach 0.5 0 0", [0.5, 0, 0])])
    policy = GoalSeekingPolicy()
    results = run_inline(sim, policy, settings(trials_per_task=2))
    env, = sim.envs  # one environment per task, reused for its trials
    # seeded at creation and again before each episode's reset (same seed: independent of history)
    assert env.seeds == [7, 7, 7] and env.closed  # closed when the run ends
    # trial k starts from initial state k
    assert [s[0] for s in env.init_states] == [0.0, 0.01]
    # 10 dummy actions (still, gripper open) before the first policy step of each episode
    assert env.actions[:10] == [libero_sim.DUMMY_ACTION] * 10
    r0 = results[0]
    assert r0.success and r0.error is None
    # from 0 to 0.5 at 0.05 per step: 10 steps; replanning every 5 steps: 2 policy calls
    assert r0.steps == 10 and r0.policy_calls == 2 and r0.sim_steps == 20
    assert len(env.actions) == 10 + 10 + 10 + results[1].steps
    assert results[1].steps == 10  # from 0.01: 9.8 steps of 0.05 -> 10 (last within tolerance)
    # each chunk gets its own noise seed, fixed by the episode and the call number
    ep0 = rollout.episode_seed(7, "libero_spatial", 0, 0)
    ep1 = rollout.episode_seed(7, "libero_spatial", 0, 1)
    assert policy.seeds == [rollout.chunk_seed(ep0, 0), rollout.chunk_seed(ep0, 1),
                            rollout.chunk_seed(ep1, 0), rollout.chunk_seed(ep1, 1)]
    assert len(set(policy.seeds)) == 4


def test_request_matches_openpi_libero_client():
    sim = StandInSimulator([StandInTask("reach 0.5 0 0", [0.5, 0, 0])])
    policy = GoalSeekingPolicy()
    run_inline(sim, policy, settings(trials_per_task=1))
    req = policy.requests[0]
    assert set(req) == {"observation/image", "observation/wrist_image", "observation/state", "prompt"}
    img = req["observation/image"]
    assert img.shape == (224, 224, 3) and img.dtype == np.uint8
    # rotated 180°: the bright corner of the render is now top-left
    assert img[0, 0, 0] > 200 and img[-1, -1, 0] < 50
    state = req["observation/state"]
    assert state.shape == (8,)
    # quaternion (0, 0, sin .25, cos .25) is a rotation of 0.5 rad about z
    np.testing.assert_allclose(state[3:6], [0.0, 0.0, 0.5], atol=1e-9)
    np.testing.assert_allclose(state[6:], [0.04, -0.04])
    assert req["prompt"] == "reach 0.5 0 0"


def test_failures_time_out_at_the_step_limit_and_crashes_are_not_trials():
    sim = StandInSimulator([
        StandInTask("reach 0.5 0 0", [0.5, 0, 0]),
        StandInTask("reach 99 0 0", [99.0, 0, 0]),        # unreachable in 220 steps
        StandInTask("reach 0.5 0 0", [0.5, 0, 0]),
    ])
    policy = GoalSeekingPolicy()
    results = run_inline(sim, policy, settings(trials_per_task=2))
    by_task = {}
    for r in results:
        by_task.setdefault(r.task_id, []).append(r)
    assert [(r.task_id, r.trial) for r in results] == [(t, k) for t in range(3) for k in range(2)]
    assert all(r.success for r in by_task[0]) and all(r.success for r in by_task[2])
    assert [r.steps for r in by_task[1]] == [220, 220] and not any(r.success for r in by_task[1])
    assert by_task[1][0].policy_calls == 44  # 220 / 5
    assert len(sim.envs) == 3 and all(e.closed for e in sim.envs)  # one per task
    metrics = closed_loop.summarize(results)
    s = metrics["suites"]["libero_spatial"]
    assert (s["successes"], s["trials"], s["errors"]) == (4, 6, 0) and "retried" not in s  # the timing record's
    assert s["per_task"]["1"]["success_rate"] == 0.0 and s["per_task"]["1"]["task"] == "reach 99 0 0"
    assert s["per_task"]["1"]["episode_steps"]["mean"] == 220
    # tasks 0 and 2 share an instruction (as LIBERO-90's scenes do) and are counted apart
    assert (s["per_task"]["0"]["successes"], s["per_task"]["2"]["successes"]) == (2, 2)
    assert metrics["success_rate"] == pytest.approx(4 / 6)
    # 95% Wilson interval of 4/6: (0.3000, 0.9032)
    np.testing.assert_allclose(ci(s), [0.3000, 0.9032], atol=1e-4)
    np.testing.assert_allclose(ci(s["per_task"]["1"]), [0.0, 0.6576], atol=1e-4)
    np.testing.assert_allclose(ci(s["per_task"]["0"]), [0.3424, 1.0], atol=1e-4)
    # an episode that crashes on every attempt is no trial: the run stops naming it (issue 22)
    sim = StandInSimulator([StandInTask("reach 0.5 0 0", [0.5, 0, 0], explode_at=13)])
    with pytest.raises(rollout.EpisodeErrors, match=r"episode 0 .* crashed after \d+ steps: RuntimeError: "
                                                        r"physics blew up"):
        run_inline(sim, GoalSeekingPolicy(), settings(trials_per_task=2))
    with pytest.raises(PisftError, match="ran to their end"):
        closed_loop.summarize([rollout.EpisodeResult("libero_spatial", 0, "t", 0, False, 3, 1, 0.1,
                                                         error="RuntimeError: boom")])


def test_max_steps_and_task_ids_select_the_short_check():
    sim = StandInSimulator([StandInTask(f"reach {g} 0 0", [g, 0, 0]) for g in (0.5, 99.0, 0.2)])
    results = run_inline(sim, GoalSeekingPolicy(), settings(trials_per_task=1, max_steps=7, task_ids=(2, 1)))
    assert [(r.task_id, r.steps, r.success) for r in results] == [(2, 4, True), (1, 7, False)]
    assert results[1].policy_calls == 2  # 5 + 2 steps
    with pytest.raises(PisftError, match="eval.task_ids: libero_spatial has tasks 0..2"):
        rollout.plan_episodes(sim, settings(task_ids=(3,)), None)


def test_short_chunks_and_too_few_initial_states_are_clear_errors():
    sim = StandInSimulator([StandInTask("reach 0.5 0 0", [0.5, 0, 0])], n_init=2)
    with pytest.raises(PisftError, match="trials_per_task"):
        rollout.plan_episodes(sim, settings(trials_per_task=3), None)
    with pytest.raises(rollout.EpisodeErrors, match="replan_steps"):
        run_inline(sim, GoalSeekingPolicy(horizon=3), settings(trials_per_task=2))


def make_cfg(tmp_path, **eval_keys):
    return C.from_dict({"results_dir": str(tmp_path / "results"),
                        "eval": {"closed_loop": True, "trials_per_task": 2, "num_envs": 1,
                                 "libero_suites": ["libero_spatial", "libero_10"], **eval_keys}})


TWO_TASKS = [StandInTask("reach 0.5 0 0", [0.5, 0, 0]), StandInTask("reach 99 0 0", [99.0, 0, 0])]


def test_stage_writes_success_per_task_and_suite(tmp_path):
    cfg = make_cfg(tmp_path, videos=False)
    metrics = closed_loop.run(cfg, simulator=functools.partial(StandInSimulator, TWO_TASKS),
                              policy=GoalSeekingPolicy(), inline=True)
    out = tmp_path / "results" / "closed_loop"
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk["success_rate"] == metrics["success_rate"] == 0.5
    # never claims the real simulator
    assert on_disk["simulator"] == {"package": "stand-in (tests/test_eval_closed_loop.py)", "version": None}
    assert set(on_disk["suites"]) == {"libero_spatial", "libero_10"}
    task = on_disk["suites"]["libero_10"]["per_task"]["1"]
    assert task["trials"] == 2 and task["episode_steps"]["max"] == 520  # libero_10 allows 520 steps
    np.testing.assert_allclose(ci(on_disk), [0.2152, 0.7848], atol=1e-4)  # 4 / 8
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 8 and not any((out / "videos").iterdir())
    assert "timing" not in on_disk and "wall_time_s" not in on_disk and "num_envs" not in on_disk["settings"]
    t = json.loads((tmp_path / "results/logs/closed_loop.timing.json").read_text())  # how the run went
    assert t["num_envs"] == 1 and t["simulator_steps"] == sum(e["sim_steps"] for e in episodes)
    assert t["policy_calls"] == sum(e["policy_calls"] for e in episodes)
    assert t["simulator_steps_per_s"] > 0 and t["policy_ms_per_chunk"] > 0
    # the policy side: one environment, so one request per forward, on the one replica given
    assert t["policy_requests"] == t["policy_forwards"] == t["policy_calls"]
    assert (t["mean_policy_batch"], t["max_policy_batch"], t["policy_devices"]) == (1.0, 1, ["given"])
    report = (out / "report.md").read_text()
    assert "| libero_10 | 0.500 | [0.15, 0.85] | 2 / 4 | 265.0 |" in report
    assert "1.0 per forward on average over 1 replica(s): given" in report
    assert "stand-in" in report
    assert json.loads((out / "pisft_config.json").read_text())["eval"]["closed_loop"] is True


def test_a_video_of_the_first_episode_of_each_task_decodes(tmp_path):
    from pisft.rollout.video import probe

    cfg = make_cfg(tmp_path, libero_suites=["libero_10"], max_steps=24)
    metrics = closed_loop.run(cfg, simulator=functools.partial(StandInSimulator, TWO_TASKS),
                              policy=GoalSeekingPolicy(), inline=True)
    out = tmp_path / "results" / "closed_loop"
    assert sorted(p.name for p in (out / "videos").iterdir()) == [
        "libero_10_task00.html", "libero_10_task00.mp4", "libero_10_task01.html", "libero_10_task01.mp4"]
    # the page for `snakemake --report` carries the video itself
    page = (out / "videos/libero_10_task01.html").read_text()
    assert base64.b64encode((out / "videos/libero_10_task01.mp4").read_bytes()).decode() in page
    assert "failure after 24 steps" in page and "stand-in" in page
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert [e["video"] for e in episodes] == ["videos/libero_10_task00.mp4", None,
                                              "videos/libero_10_task01.mp4", None]
    # one frame after the wait steps, one per policy step; agent view | wrist, 256x256 each
    assert probe(out / "videos/libero_10_task00.mp4") == {"frames": 11, "width": 512, "height": 256, "codec": "h264"}
    assert probe(out / "videos/libero_10_task01.mp4")["frames"] == 25 == episodes[2]["video_frames"]
    assert metrics["suites"]["libero_10"]["per_task"]["1"]["video"] == "videos/libero_10_task01.mp4"
    report = (out / "report.md").read_text()
    assert '<video src="videos/libero_10_task01.mp4"' in report
    assert "[libero_10_task00.mp4](videos/libero_10_task00.mp4)" in report


def deterministic_part(metrics):
    """metrics.json without what names the run's folder and its settings (eval.policy_batch)."""
    return {k: v for k, v in metrics.items() if k not in ("settings", "model_dir")}


def test_the_stand_in_is_stateful_as_libero():
    """What makes the check below mean something: each reset draws from the environment's
    generator, so an episode depends on the resets before it unless the seed is set again."""
    sim = StandInSimulator([StandInTask("reach 0.5 0 0", [0.5, 0, 0])], placement_noise=0.02)
    env = sim.make_env(sim.suite("libero_spatial").get_task(0), resolution=RES, seed=7)
    first, second = env.reset()["robot0_eef_pos"], env.reset()["robot0_eef_pos"]
    assert not np.allclose(first, second) and np.abs(first).max() <= 0.02
    env.seed(7)
    np.testing.assert_array_equal(env.reset()["robot0_eef_pos"], first)
    np.testing.assert_array_equal(env.set_init_state([0.03, 0, 0, 9])["robot0_eef_pos"], first + [0.03, 0, 0])


def requests_by_chunk(policy) -> dict[int, tuple]:
    """The policy's requests keyed by their chunk's noise seed (unique per episode and call):
    the state and both images each chunk was computed from, whichever worker sent it."""
    return {seed: (tuple(req["observation/state"]), req["observation/image"].tobytes(),
                   req["observation/wrist_image"].tobytes())
            for seed, req in zip(policy.seeds, policy.requests, strict=True)}


@pytest.mark.integration  # ~15 s: rollouts in worker processes
def test_results_do_not_depend_on_the_number_of_environment_processes(tmp_path):
    """Worker processes (spawned), 1 asking one request at a time and 2 batching their requests:
    same episodes, same order, same metrics, same videos, the same states and images behind every
    chunk. The stand-in environments carry state across resets as LIBERO's do (`StandInEnv`):
    with 2 workers a task's episodes run in environments that have seen other resets than with 1."""
    tasks = [StandInTask(f"reach {g} 0 0", [g, 0, 0]) for g in (0.3, 0.45, 0.2)]
    runs, requests = {}, {}
    for n, batch in ((1, 1), (2, 2)):  # one at a time; both waiting environments in one forward
        cfg = make_cfg(tmp_path / f"n{n}", libero_suites=["libero_spatial"], num_envs=n, max_steps=30,
                       trials_per_task=3, policy_batch=batch)
        policy = GoalSeekingPolicy(noise=0.9)
        metrics = closed_loop.run(cfg, simulator=functools.partial(StandInSimulator, tasks, placement_noise=0.02),
                                  policy=policy)
        out = tmp_path / f"n{n}" / "results" / "closed_loop"
        episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
        timing = json.loads((tmp_path / f"n{n}/results/logs/closed_loop.timing.json").read_text())
        assert timing["num_envs"] == n
        runs[n] = (deterministic_part(metrics),
                   [(e["task_id"], e["trial"], e["success"], e["steps"], e["policy_calls"], e["sim_steps"])
                    for e in episodes],
                   (out / "videos/libero_spatial_task01.mp4").read_bytes())
        requests[n] = requests_by_chunk(policy)
    assert runs[1] == runs[2]
    assert requests[1] == requests[2] and len(requests[1]) == timing["policy_calls"]
    # the noise matters (some episodes succeed, some do not), so equality is not vacuous
    outcomes = {e[2] for e in runs[1][1]}
    assert outcomes == {True, False}
    # and so does the placement drawn at reset: trial k starts off initial state k (x = 0.01 k)
    firsts = {(t, k): requests[1][rollout.chunk_seed(rollout.episode_seed(7, "libero_spatial", t, k), 0)]
              for t in range(3) for k in range(3)}
    assert all(abs(state[0][0] - 0.01 * k) > 1e-6 for (_, k), state in firsts.items())


@pytest.mark.integration  # ~20 s: a worker process dies on every attempt and is replaced each time
def test_a_worker_that_dies_on_every_attempt_fails_the_stage(tmp_path):
    tasks = [StandInTask("reach 0.5 0 0", [0.5, 0, 0], die_at=15), StandInTask("reach 0.3 0 0", [0.3, 0, 0])]
    cfg = make_cfg(tmp_path, libero_suites=["libero_spatial"], num_envs=1)
    with pytest.raises(rollout.EpisodeErrors, match=r"episode 0 .* crashed after 0 steps: worker "
                                                        r"closed_loop-env0 died \(exit code 3\)"):
        closed_loop.run(cfg, simulator=functools.partial(StandInSimulator, tasks), policy=GoalSeekingPolicy())
    assert not (tmp_path / "results/closed_loop").exists()  # no success rate, no output


def test_stage_is_off_by_default(tmp_path):
    # off (the code default): an explicit "not run" output that carries no numbers (DVC keeps the stage)
    cfg = C.from_dict({"results_dir": str(tmp_path / "results")})
    assert closed_loop.run(cfg, simulator=lambda: pytest.fail("no simulator when off"))["closed_loop"] is False
    off = json.loads((tmp_path / "results/closed_loop/metrics.json").read_text())
    assert off == {"closed_loop": False, "note": closed_loop.OFF_NOTE} and "success_rate" not in off
    assert (tmp_path / "results/closed_loop/videos").is_dir()
    from pisft.evaluate import offline

    assert offline.closed_loop_results(cfg) is None  # off: not reported
    with pytest.raises(PisftError, match="was not run .* rerun the `closed_loop` stage"):
        offline.closed_loop_results(make_cfg(tmp_path))  # on: the "not run" output is refused


def test_stage_without_libero_installed_says_how_to_install_it(tmp_path, monkeypatch):
    """No `libero` package: None in sys.modules is how Python marks a module that cannot be
    imported (`importlib.util.find_spec` returns None, `import libero` fails), so LiberoSimulator's
    own lookup is what finds it missing, with hf-libero installed here or not."""
    for name in [m for m in sys.modules if m == "libero" or m.startswith("libero.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "libero", None)
    monkeypatch.setenv("LIBERO_CONFIG_PATH", str(tmp_path / "libero-config"))
    monkeypatch.setenv("MUJOCO_GL", "osmesa")
    with pytest.raises(libero_sim.SimulatorUnavailable) as exc:
        closed_loop.run(make_cfg(tmp_path))
    msg = str(exc.value)
    assert msg.startswith("The LIBERO simulator is not installed in this environment. `make setup` installs it")
    assert "hf-libero 0.1.4" in msg and "(no 'libero' package to import)" in msg
    assert "failed to import" not in msg
    assert not (tmp_path / "results" / "closed_loop").exists()
    assert not (tmp_path / "libero-config").exists()  # nothing to write LIBERO's paths for
    assert os.environ["MUJOCO_GL"] == "osmesa"  # a user's choice of back end is kept


@pytest.mark.parametrize("backend", ["osmesa", "egl"])
def test_stage_with_libero_installed_but_failing_to_import_names_the_back_end(fake_libero, tmp_path,
                                                                              monkeypatch, backend):
    """An installed `libero` whose import fails (as LIBERO's does when its OpenGL back end cannot
    start): the hint is about that back end and the paths file, never "not installed"."""
    (fake_libero / "libero/libero/envs/__init__.py").write_text(
        f"raise ImportError('Unable to load {backend} library: cannot open shared object file')\n")
    monkeypatch.setenv("MUJOCO_GL", backend)
    # the back end's libraries are taken as present (their check: test_libero_sim_setup.py)
    monkeypatch.setattr(libero_sim, "rendering_problem", lambda backend: None)
    with pytest.raises(libero_sim.SimulatorUnavailable) as exc:
        closed_loop.run(make_cfg(tmp_path))
    msg = str(exc.value)
    assert msg.startswith(f"LIBERO is installed ({fake_libero / 'libero'}) but failed to import "
                          f"(ImportError: Unable to load {backend} library")
    assert libero_sim.import_failure_hint(backend) in msg
    if backend == "osmesa":
        assert "MUJOCO_GL=osmesa needs OSMesa (libosmesa6)" in msg and "osmesa needs EGL" not in msg
    else:
        assert "MUJOCO_GL=egl needs EGL" in msg and "MUJOCO_GL=osmesa renders on the CPU" in msg
    assert libero_sim.APT_LINE in msg and "not installed" not in msg
    assert str(tmp_path / "libero-config" / "config.yaml") in msg  # the paths file, in this test's folder
    assert (tmp_path / "libero-config" / "config.yaml").is_file()  # written there, not in the home folder
    assert not (tmp_path / "results" / "closed_loop").exists()
    assert os.environ["MUJOCO_GL"] == backend


# A stand-in `libero` package with the real one's module layout and first-run behaviour
# (it asks on stdin for its paths when ~/.libero/config.yaml is missing), so LiberoSimulator
# itself is exercised: config file, suite lookup, bddl path, env seed.
FAKE_LIBERO = {
    "libero/__init__.py": "",
    "libero/libero/__init__.py": """
import os, yaml
config_file = os.path.join(os.environ.get("LIBERO_CONFIG_PATH", os.path.expanduser("~/.libero")), "config.yaml")
if not os.path.exists(config_file):
    input("Do you want to specify a custom path for the dataset folder? (Y/N): ")
def get_libero_path(key):
    with open(config_file) as f:
        return yaml.safe_load(f)[key]
""",
    "libero/libero/benchmark/__init__.py": """
from collections import namedtuple
import numpy as np
Task = namedtuple("Task", "name language problem problem_folder bddl_file init_states_file")
class libero_spatial:
    n_tasks = 2
    def get_task(self, i):
        return Task(f"t{i}", f"reach {0.5 * (i + 1)} 0 0", "Libero", "libero_spatial", f"t{i}.bddl", f"t{i}.init")
    def get_task_init_states(self, i):
        return np.zeros((50, 4))
def get_benchmark_dict():
    return {"libero_spatial": libero_spatial}
""",
    "libero/libero/envs/__init__.py": """
import numpy as np
CREATED = []
class OffScreenRenderEnv:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.goal = 0.5 if kwargs["bddl_file_name"].endswith("t0.bddl") else 1.0
        CREATED.append(self)
    def seed(self, seed):
        self.seeded = seed
    def _obs(self):
        img = np.zeros((self.kwargs["camera_heights"], self.kwargs["camera_widths"], 3), np.uint8)
        return {"agentview_image": img, "robot0_eye_in_hand_image": img,
                "robot0_eef_pos": np.array([self.x, 0.0, 0.0]), "robot0_eef_quat": np.array([0.0, 0.0, 0.0, 1.0]),
                "robot0_gripper_qpos": np.zeros(2)}
    def reset(self):
        self.x = 0.0
        return self._obs()
    def set_init_state(self, state):
        self.x = 0.0
        return self._obs()
    def step(self, action):
        self.x += 0.05 * action[0]
        done = abs(self.x - self.goal) < 0.03
        return self._obs(), float(done), done, {}
    def close(self):
        pass
""",
}


@pytest.fixture
def fake_libero(tmp_path, monkeypatch):
    pkg = tmp_path / "site"
    for rel, text in FAKE_LIBERO.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    for name in [m for m in sys.modules if m == "libero" or m.startswith("libero.")]:
        monkeypatch.delitem(sys.modules, name)  # a `libero` imported earlier (hf-libero) comes back after
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv("LIBERO_CONFIG_PATH", str(tmp_path / "libero-config"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # a job has no one to answer
    yield pkg
    for name in [m for m in sys.modules if m == "libero" or m.startswith("libero.")]:
        del sys.modules[name]


def test_libero_simulator_against_the_package_layout(fake_libero, tmp_path, monkeypatch):
    monkeypatch.delenv("MUJOCO_GL", raising=False)
    sim = libero_sim.LiberoSimulator()
    assert os.environ["MUJOCO_GL"] == "egl"
    written = yaml.safe_load((tmp_path / "libero-config" / "config.yaml").read_text())
    assert written["bddl_files"] == str(fake_libero / "libero" / "libero" / "bddl_files")
    assert written["init_states"] == str(fake_libero / "libero" / "libero" / "init_files")
    results = run_inline(sim, GoalSeekingPolicy(), settings(trials_per_task=2))
    assert [r.success for r in results] == [True] * 4 and [r.steps for r in results] == [10, 10, 20, 20]
    # a `libero` that is not the hf-libero distribution is never reported as hf-libero
    info = rollout.simulator_info(sim)
    assert info["package"] == "libero (not from the hf-libero distribution)" and info["version"] is None
    from libero.libero.envs import CREATED

    assert [Path(e.kwargs["bddl_file_name"]).relative_to(written["bddl_files"]).as_posix() for e in CREATED] == \
        ["libero_spatial/t0.bddl", "libero_spatial/t1.bddl"]
    assert all(e.seeded == 7 and e.kwargs["camera_heights"] == 256 for e in CREATED)
    with pytest.raises(PisftError, match="no suite 'libero_goal'"):
        sim.suite("libero_goal")


def test_an_existing_libero_config_is_kept(fake_libero, tmp_path):
    cfg_dir = tmp_path / "libero-config"
    cfg_dir.mkdir()
    (cfg_dir / "config.yaml").write_text("bddl_files: /mine\n")
    assert libero_sim.ensure_libero_config() is None
    assert (cfg_dir / "config.yaml").read_text() == "bddl_files: /mine\n"


def test_a_crash_of_the_stage_leaves_no_output(tmp_path):
    class Broken(StandInSimulator):
        def suite(self, name):
            raise RuntimeError("simulator died")

    with pytest.raises(RuntimeError):
        closed_loop.run(make_cfg(tmp_path), simulator=functools.partial(Broken, []),
                        policy=GoalSeekingPolicy(), inline=True)
    assert not (tmp_path / "results" / "closed_loop").exists()


def test_quaternion_to_axis_angle():
    np.testing.assert_allclose(libero_sim.quat_to_axis_angle([0, 0, 0, 1]), [0, 0, 0])
    half = math.pi / 4  # 90° about x
    np.testing.assert_allclose(libero_sim.quat_to_axis_angle([math.sin(half), 0, 0, math.cos(half)]),
                               [math.pi / 2, 0, 0], atol=1e-12)


def test_resize_with_pad_keeps_aspect():
    img = np.full((100, 200, 3), 255, np.uint8)
    out = libero_sim.resize_with_pad(img, 224, 224)
    assert out.shape == (224, 224, 3)
    assert out[0, 112].sum() == 0 and out[112, 112].min() == 255  # padded top, image in middle


def test_the_policy_takes_one_thread_unless_pisft_num_threads_says(monkeypatch):
    from pisft import device as device_mod

    monkeypatch.delenv(device_mod.THREADS_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # what Snakemake exports: not the policy's count
    assert replicas.policy_threads() == 1
    monkeypatch.setenv(device_mod.THREADS_ENV, "3")
    assert replicas.policy_threads() == 3


@pytest.mark.integration  # ~15 s: rollouts in worker processes
def test_stage_rolls_out_the_exported_model_in_process(tmp_path, monkeypatch):
    """The default policy: results/train/model through LiberoPolicy (the code `serve` runs)."""
    from test_serve_openpi_client import write_tiny_model

    from pisft import device as device_mod

    monkeypatch.delenv(device_mod.THREADS_ENV, raising=False)  # the default: the one thread asserted below

    cfg = make_cfg(tmp_path, libero_suites=["libero_spatial"], trials_per_task=1, max_steps=15)  # 3 chunks
    model = write_tiny_model(tmp_path / "export")
    (tmp_path / "results" / "train").mkdir(parents=True)
    model.rename(tmp_path / "results" / "train" / "model")
    sim = StandInSimulator([StandInTask("reach 99 0 0", [99.0, 0, 0])])
    import torch

    from pisft.policy.libero import LiberoPolicy

    seen_threads = []
    predict_many = LiberoPolicy.predict_many

    def counting(self, *args, **kwargs):
        seen_threads.append(torch.get_num_threads())
        return predict_many(self, *args, **kwargs)

    monkeypatch.setattr(LiberoPolicy, "predict_many", counting)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        metrics = closed_loop.run(cfg, simulator=lambda: sim, inline=True)
        # one policy thread beside the simulating workers, whatever the driver exported, and the
        # caller's count given back after (a test worker's later tests run with their own)
        assert seen_threads and set(seen_threads) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    episode = json.loads((tmp_path / "results" / "closed_loop" / "episodes.jsonl").read_text())
    assert episode["error"] is None and episode["steps"] == 15 and episode["policy_calls"] == 3
    assert metrics["success_rate"] == 0.0
    actions = np.array(sim.envs[0].actions[10:])
    assert actions.shape == (15, 7) and np.isfinite(actions).all()
    # each chunk's first 5 actions were executed: consecutive chunks differ (new noise, new obs)
    assert not np.allclose(actions[:5], actions[5:10])


def test_the_evaluation_report_shows_closed_loop_results_with_intervals_and_videos(tmp_path):
    from pisft.evaluate import report

    cfg = make_cfg(tmp_path, libero_suites=["libero_10"], task_ids=[1], trials_per_task=1, max_steps=12)
    metrics = closed_loop.run(cfg, simulator=functools.partial(StandInSimulator, TWO_TASKS),
                              policy=GoalSeekingPolicy(), inline=True)
    text = "\n".join(report.closed_loop_section(json.loads(json.dumps(metrics))))
    assert "Simulator: stand-in (tests/test_eval_closed_loop.py)" in text
    assert "step limit 12 (eval.max_steps)" in text
    assert "| libero_10 | 1: reach 99 0 0 | 0 / 1 | 0 | [0.00, 0.79] | 12 | 0 | " \
           "[libero_10_task01.mp4](../closed_loop/videos/libero_10_task01.mp4) |" in text
    assert "Episodes are cut at 12 steps" in text  # the expectation note travels with the numbers


def test_the_embedded_default_is_a_short_real_simulator_check_that_says_what_to_expect():
    cfg = C.load(Path(__file__).parents[1] / "config/config.yaml")
    e = cfg.eval
    assert e.closed_loop and list(e.libero_suites) == ["libero_10"] and list(e.task_ids) == [0, 1]
    assert (e.trials_per_task, e.max_steps) == (1, 60)
    note = closed_loop.expectation(cfg, rollout.Settings.from_config(cfg))
    assert "Expect a success rate of about 0" in note and "not what the model can do" in note
    assert "cut at 60 steps" in note and "libero_10 (520)" in note
    # a real model on real data with openpi's limits gets no such note
    real = C.from_dict({"model": {"source": "/models/pi05_base"}, "data": {"recap_dir": "/data/recap"},
                        "eval": {"closed_loop": True}})
    assert closed_loop.expectation(real, rollout.Settings.from_config(real)) is None


def test_num_envs_defaults_to_the_available_cores_and_bad_keys_are_refused():
    cfg = C.from_dict({"eval": {"closed_loop": True}})
    # one per core as far as memory holds (issue 22): on a host with the memory, one per core
    assert rollout.Settings.from_config(cfg).num_envs == rollout.auto_num_envs()[0]
    assert rollout.Settings.from_config(C.from_dict({"eval": {"num_envs": 3}})).num_envs == 3
    for bad, message in (({"num_envs": -1}, "eval.num_envs: must be 0"),
                         ({"max_steps": -5}, "eval.max_steps: must be 0"),
                         ({"task_ids": [10]}, r"eval.task_ids: \[10\]: task ids must be distinct and in 0..9"),
                         ({"task_ids": [3, 3]}, "must be distinct"),
                         ({"libero_suites": ["libero_90"], "task_ids": [89]}, None)):
        if message is None:
            C.from_dict({"eval": bad})  # libero_90 has 90 tasks
        else:
            with pytest.raises(C.ConfigError, match=message):
                C.from_dict({"eval": bad})


def test_stage_guides_a_conditioned_model_with_eval_cfg_scale_and_records_it(tmp_path, tmp_path_factory, capsys):
    """eval.cfg_scale reaches the policy the stage builds (the exported model, in-process): a
    model trained on advantage prompts is guided (its executed actions move with the scale) and
    metrics.json and report.md record the scale; a plain model runs unguided and says so once."""
    import torch

    from model_fixtures import tiny_model_dir
    from test_serve_openpi_client import SERVE_STATS
    from pisft.data import prompts
    from pisft.model.norm_stats import STATS_FILE, save_stats

    def stage(name: str, *, conditioned: bool, scale: float):
        root = tmp_path / name
        cfg = make_cfg(root, libero_suites=["libero_spatial"], trials_per_task=1, max_steps=5,
                       videos=False, cfg_scale=scale)  # one chunk after the wait steps
        (root / "results" / "train").mkdir(parents=True)
        model = tiny_model_dir(tmp_path_factory, root / "results" / "train" / "model")  # a copy
        save_stats(SERVE_STATS, model / STATS_FILE)
        if conditioned:
            prompts.PromptConditioning("demo").write(model / prompts.CONDITIONING_FILE)
        sim = StandInSimulator([StandInTask("reach 99 0 0", [99.0, 0, 0])])
        capsys.readouterr()
        closed_loop.run(cfg, simulator=lambda: sim, inline=True)
        out = root / "results" / "closed_loop"
        return (json.loads((out / "metrics.json").read_text()), (out / "report.md").read_text(),
                np.array(sim.envs[0].actions[10:]), capsys.readouterr().out)

    threads = torch.get_num_threads()
    try:
        guided, report, guided_actions, _ = stage("guided", conditioned=True, scale=2.0)
        _, _, positive_actions, _ = stage("positive", conditioned=True, scale=1.0)
        plain, _, _, log = stage("plain", conditioned=False, scale=2.0)
    finally:
        torch.set_num_threads(threads)
    assert guided["cfg_scale"] == 2.0 and guided["guidance"]["guided"]
    assert "Guidance: classifier-free guidance, scale 2" in report
    assert guided_actions.shape == positive_actions.shape == (5, 7)
    assert not np.allclose(guided_actions, positive_actions, atol=1e-4)
    assert plain["cfg_scale"] == 1.0 and plain["guidance"]["cfg_scale_requested"] == 2.0
    assert log.count("cfg_scale 2 ignored") == 1 and "cfg_scale 2 ignored" in plain["guidance"]["note"]


def test_workers_spread_over_tasks_so_each_environment_is_built_once():
    """2 workers, 2 tasks x 2 trials: each worker keeps one task (2 environment builds, not 4)."""
    from pisft.rollout import run_episodes

    class Worker:
        def __init__(self):
            self.tasks, self.reply = [], None

        def send(self, kind, payload=None):
            if kind == "start":
                self.tasks.append(payload.task_id)
                self.reply = ("done", EpisodeOutcome(True, 1, 1, 0.0, 0.0, 0.0))

        def recv(self):
            reply, self.reply = self.reply, None
            return reply

        def has_reply(self):
            return self.reply is not None

    from pisft.rollout.workers import EpisodeOutcome, EpisodeSpec

    specs = [EpisodeSpec(index=i, suite="libero_10", task_id=t, trial=n, max_steps=1, num_wait_steps=0,
                         env_seed=0, resize_size=224)
             for i, (t, n) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)])]
    workers = [Worker(), Worker()]
    settings = rollout.Settings.from_config(C.from_dict({"eval": {"closed_loop": True}}))
    results = run_episodes(specs, policy=None, settings=settings, workers=workers,
                           languages={("libero_10", 0): "a", ("libero_10", 1): "b"})
    assert [r.task_id for r in results] == [0, 0, 1, 1]
    assert sorted(w.tasks for w in workers) == [[0, 0], [1, 1]]


def test_an_environment_process_never_imports_torch():
    """A LIBERO environment process (`rollout.workers.ProcessWorker`, spawned: it imports
    `pisft.rollout.workers` with its package, and the stage's `python -m pisft` as its main module)
    steps the simulator and never needs torch; importing it would cost each of them 2-4 CPU s
    (pisft.policy.rtc). Checked in a fresh interpreter, as a spawned child starts."""
    import subprocess

    script = ("import sys, pisft.cli, pisft.rollout, pisft.rollout.workers, pisft.rollout.libero_sim; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lerobot', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", f"an environment process imports: {out.stdout[:300]}"
