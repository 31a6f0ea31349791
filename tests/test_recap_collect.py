"""collect_rollouts: policy k-1 rolled out with the closed-loop machinery, every executed step
recorded, written as RLinf's LIBERO collection (its LeRobotDatasetWriter layout, LeRobot v2.1)
and read back by LeRobot and by convert_recap."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from data_fixtures import convert
from test_eval_closed_loop import GoalSeekingPolicy, StandInSimulator, StandInTask

from pisft import rollout
from pisft import config as C
from pisft import layout
from pisft.data import demo
from pisft.data.images import decode_png
from pisft.errors import PisftError
from pisft.rollout import libero_sim
from pisft.recap import collect

# RLinf's LeRobotDatasetWriter features for LIBERO collection, in its order, then LeRobot's
RLINF_COLUMNS = ["state", "actions", "done", "is_success", "intervene_flag", "segment_id", "image", "wrist_image",
                 "timestamp", "frame_index", "episode_index", "index", "task_index"]
WAIT, EVAL_TRIALS, SEED = 10, 3, 1000
TASKS = [StandInTask("reach 0.3 0 0", [0.3, 0, 0]), StandInTask("reach 99 0 0", [99.0, 0, 0])]


def make_cfg(tmp_path: Path, **recap) -> C.PisftConfig:
    cfg = C.from_dict({
        "results_dir": str(tmp_path / "results"), "device": "cpu",
        "eval": {"closed_loop": True, "trials_per_task": EVAL_TRIALS, "num_envs": 1, "num_wait_steps": WAIT,
                 "replan_steps": 5, "closed_loop_seed": 7},
        "recap": {"iterations": 1, "suite": "libero_10", "task_ids": [0, 1], "episodes_per_task": 2,
                  "max_steps": 24, "collect_seed": SEED, **recap}})
    return cfg.at_iteration(1)


def episode_rows(root: Path) -> list[dict]:
    """Every frame of a v2.1 dataset, episode by episode (pyarrow, no LeRobot)."""
    return [row for f in sorted((root / "data").rglob("episode_*.parquet")) for row in pq.read_table(f).to_pylist()]


def executed_actions(env, episodes: int) -> list[np.ndarray]:
    """The stand-in environment's actions per episode, without the wait steps (env.actions
    holds every step of the episodes it ran, one after the other)."""
    out, rest = [], list(env.actions)
    for _ in range(episodes):
        assert rest[:WAIT] == [libero_sim.DUMMY_ACTION] * WAIT
        rest = rest[WAIT:]
        n = next((i for i, a in enumerate(rest) if a == libero_sim.DUMMY_ACTION), len(rest))
        out.append(np.asarray(rest[:n]))
        rest = rest[n:]
    assert not rest
    return out


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("collect")
    cfg = make_cfg(tmp)
    sim = StandInSimulator(TASKS)
    policy = GoalSeekingPolicy()
    collection = collect.run(cfg, simulator=lambda: sim, policy=policy, inline=True)
    return cfg, sim, policy, collection, tmp / "results/recap/iter_1/rollouts"


def test_frames_are_the_executed_steps(collected):
    _, sim, _, collection, out = collected
    assert out.is_dir() and not (out / collect.RECORDINGS).exists()
    env0, env1 = sim.envs  # one environment per task, reused for its two episodes
    executed = executed_actions(env0, 2) + executed_actions(env1, 2)
    rows = episode_rows(out)
    by_episode = [[r for r in rows if r["episode_index"] == i] for i in range(4)]
    assert [len(e) for e in by_episode] == [len(a) for a in executed] == [e["frames"] for e in collection["episodes"]]
    # task 0 is reached in a few steps (the episode ends there); task 1 runs to recap.max_steps
    assert [len(a) for a in executed][2:] == [24, 24] and all(len(a) < 24 for a in executed[:2])
    for rows_i, actions in zip(by_episode, executed, strict=True):
        np.testing.assert_array_equal(np.array([r["actions"] for r in rows_i]), actions.astype(np.float32))
        assert [r["frame_index"] for r in rows_i] == list(range(len(actions)))
    assert [r["index"] for r in rows] == list(range(len(rows)))
    assert collection["frames"] == len(rows)


def test_state_and_images_are_the_observation_each_step_was_taken_from(collected):
    _, _, policy, _, out = collected
    rows = [r for r in episode_rows(out) if r["episode_index"] == 2]  # task 1, its first episode
    state = np.array([r["state"] for r in rows])
    actions = np.array([r["actions"] for r in rows])
    assert state.shape == (24, 8)
    # the first frame is the observation after the wait steps, the one the first request was built from
    first_request = next(q for q in policy.requests if q["prompt"] == "reach 99 0 0")
    np.testing.assert_array_equal(state[0], first_request["observation/state"].astype(np.float32))
    # initial state 3 (the first after the evaluation's 0..2) puts the effector at x = 0.03
    np.testing.assert_allclose(state[0, :3], [0.03, 0, 0], atol=1e-7)
    # each next state is the stand-in's response to the recorded action: state t pairs with action t
    np.testing.assert_allclose(state[1:, :3], state[:-1, :3] + 0.05 * actions[:-1, :3], atol=1e-6)
    np.testing.assert_allclose(state[:, 3:6], np.tile([0, 0, 0.5], (24, 1)), atol=1e-6)  # openpi's axis-angle
    np.testing.assert_allclose(state[:, 6:], np.tile([0.04, -0.04], (24, 1)), atol=1e-7)
    # images: 256×256 as rendered, rotated 180° as openpi's LIBERO data (the bright corner top-left)
    image = decode_png(rows[0]["image"]["bytes"])
    assert image.shape == (256, 256, 3) and image[0, 0, 0] > 200 and image[-1, -1, 0] < 50
    ramp = np.linspace(0, 255, 256).astype(np.uint8)
    rendered = np.repeat(np.add.outer(ramp // 2, ramp // 2)[:, :, None], 3, axis=2)
    np.testing.assert_array_equal(image, rendered[::-1, ::-1])
    wrist = [decode_png(r["wrist_image"]["bytes"]) for r in rows]
    # the stand-in's wrist camera shows int(100 x): the state of the same frame (the next one is 5 more)
    shown = np.array([int(w[0, 0, 0]) for w in wrist])
    assert np.abs(shown - 100 * state[:, 0]).max() < 1.001 and len(set(shown.tolist())) > 5


def test_outcome_columns_are_rlinfs(collected):
    _, _, _, collection, out = collected
    rows = episode_rows(out)
    for i, e in enumerate(collection["episodes"]):
        ep = [r for r in rows if r["episode_index"] == i]
        assert [r["is_success"] for r in ep] == [e["success"]] * len(ep)  # the outcome on every frame
        assert [r["done"] for r in ep] == [False] * (len(ep) - 1) + [True]
        assert not any(r["intervene_flag"] for r in ep) and {r["segment_id"] for r in ep} == {0}
        assert {r["task_index"] for r in ep} == {e["task_index"]}
    assert [e["success"] for e in collection["episodes"]] == [True, True, False, False]


def test_layout_is_rlinfs_collection_and_the_demos(collected, tmp_path):
    _, _, _, _, out = collected
    info = json.loads((out / "meta/info.json").read_text())
    assert info["codebase_version"] == "v2.1" and info["fps"] == 10 and info["robot_type"] == "panda"
    assert list(info["features"]) == RLINF_COLUMNS  # unlabelled: no return/reward/prompt features
    assert info["features"]["image"] == {"dtype": "image", "shape": [256, 256, 3],
                                         "names": ["height", "width", "channel"]}
    assert info["total_episodes"] == 4 and info["total_frames"] == len(episode_rows(out))
    tasks = [json.loads(line) for line in (out / "meta/tasks.jsonl").read_text().splitlines()]
    assert tasks == [{"task_index": 0, "task": "reach 0.3 0 0"}, {"task_index": 1, "task": "reach 99 0 0"}]
    assert not list((out / "meta").glob("returns*")) and not list((out / "meta").glob("advantages*"))
    # the demo is written by the same writer: the same files and features (its images are smaller)
    demo_root = tmp_path / "demo"
    demo_root.mkdir()
    demo.build(demo_root, episodes_per_task=1, length=3, image_size=16, failure_fraction=0.0, seed=0, workers=1)
    demo_info = json.loads((demo_root / "meta/info.json").read_text())
    assert sorted(p.relative_to(demo_root).as_posix() for p in (demo_root / "meta").iterdir()) == \
        sorted(p.relative_to(out).as_posix() for p in (out / "meta").iterdir())
    for key, ft in info["features"].items():
        assert {**demo_info["features"][key], "shape": ft["shape"]} == ft, key


def test_initial_states_and_seeds_are_disjoint_from_the_evaluations_and_recorded(collected):
    cfg, sim, policy, collection, out = collected
    env0, env1 = sim.envs
    # episode i of a task starts from initial state eval.trials_per_task + i (state k: x = 0.01 k)
    assert [s[0] for s in env0.init_states] == [s[0] for s in env1.init_states] == [0.03, 0.04]
    assert env0.seeds == [SEED] * 3  # at creation and before each reset: recap.collect_seed, never eval's 7
    eps = collection["episodes"]
    assert [(e["task_id"], e["initial_state"], e["env_seed"]) for e in eps] == \
        [(0, 3, SEED), (0, 4, SEED), (1, 3, SEED), (1, 4, SEED)]
    assert collection["evaluation"]["initial_states"] == [0, EVAL_TRIALS - 1]
    assert not {e["initial_state"] for e in eps} & set(range(EVAL_TRIALS))
    # the chunks' noise seeds: from collect_seed and the episode, as collection.json says
    expected = [rollout.chunk_seed(e["policy_seed"], k) for e in eps for k in range(e["policy_calls"])]
    assert policy.seeds == expected
    assert eps[0]["policy_seed"] == rollout.episode_seed(SEED, "libero_10", 0, 3)
    evaluation = {rollout.episode_seed(7, "libero_10", t, k) for t in (0, 1) for k in range(EVAL_TRIALS)}
    assert not {e["policy_seed"] for e in eps} & evaluation
    assert collection["seeds"]["collect_seed"] == SEED and collection["policy_dir"] == str(layout.policy(cfg, 0))
    assert collection["suite"] == "libero_10" and collection["max_steps"] == 24
    assert [(t["task_id"], t["episodes"], t["successes"]) for t in collection["tasks"]] == [(0, 2, 2), (1, 2, 0)]
    assert all(e["error"] is None for e in eps)
    on_disk = json.loads((out / "collection.json").read_text())
    assert on_disk["episodes"] == eps and on_disk["simulator"]["package"].startswith("stand-in")
    assert json.loads((out / "pisft_config.json").read_text())["recap"]["collect_seed"] == SEED


def test_convert_recap_reads_it_as_rlinfs_collection(collected, tmp_path):
    _, _, _, collection, out = collected
    report = convert(out, tmp_path / "dataset", eval_fraction=0.5)
    assert report["source"]["codebase_version"] == "v2.1" and report["source"]["naming"] == "recap"
    assert report["source"]["success_column"] == "is_success" and report["source"]["side_features"] == {}
    assert report["source"]["image_shape"] == [256, 256, 3]
    assert report["in"] == {"episodes": 4, "frames": collection["frames"], "tasks": 2}
    assert report["out"]["frames"] == collection["frames"]
    outcomes = report["outcomes"]
    assert outcomes["train"]["successes"] + outcomes["eval"]["successes"] == 2
    assert outcomes["train"]["failures"] + outcomes["eval"]["failures"] == 2


def test_lerobot_reads_it(collected, tmp_path):
    """LeRobot 0.6.1 reads v2.1 through its own converter (offline, in place), then loads it."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from lerobot.scripts.convert_dataset_v21_to_v30 import convert_dataset

    _, _, _, collection, out = collected
    root = tmp_path / "lerobot"
    shutil.copytree(out, root)
    convert_dataset(repo_id="pisft/rollouts", root=root, push_to_hub=False)
    ds = LeRobotDataset(repo_id="pisft/rollouts", root=root)
    assert len(ds) == collection["frames"] and ds.num_episodes == 4
    rows = episode_rows(out)
    for i in (0, len(rows) - 1):
        item = ds[i]
        np.testing.assert_array_equal(item["state"].numpy(), np.float32(rows[i]["state"]))
        np.testing.assert_array_equal(item["actions"].numpy(), np.float32(rows[i]["actions"]))
        assert item["image"].shape == (3, 256, 256)
        assert item["task"] == ("reach 0.3 0 0" if rows[i]["task_index"] == 0 else "reach 99 0 0")
        assert bool(item["is_success"]) == rows[i]["is_success"]


def test_a_crashed_episode_fails_the_stage_naming_it(tmp_path):
    tasks = [TASKS[0], StandInTask("reach 0.5 0 0", [0.5, 0, 0], explode_at=WAIT + 3)]
    with pytest.raises(collect.CollectionError, match=r"episode 2 \(libero_10 task 1 \"reach 0.5 0 0\", initial "
                                                      r"state 3, environment seed 1000\) crashed after \d+ steps: "
                                                      r"RuntimeError: physics blew up\. A crash is not a failed trial"):
        collect.run(make_cfg(tmp_path), simulator=functools.partial(StandInSimulator, tasks),
                    policy=GoalSeekingPolicy(), inline=True)
    assert not (tmp_path / "results/recap/iter_1/rollouts").exists()
    assert list((tmp_path / "results/recap/iter_1").iterdir()) == []  # no half-written output either


def test_a_policy_that_fails_fails_the_stage(tmp_path):
    with pytest.raises(collect.CollectionError, match=r"episode 0 .* crashed after 0 steps: PisftError: the policy "
                                                      r"returned actions of shape \(3, 7\)"):
        collect.run(make_cfg(tmp_path), simulator=functools.partial(StandInSimulator, TASKS),
                    policy=GoalSeekingPolicy(horizon=3), inline=True)
    assert not (tmp_path / "results/recap/iter_1/rollouts").exists()


def test_a_worker_that_dies_fails_the_stage(tmp_path):  # one spawned worker: ~2 s
    tasks = [TASKS[0], StandInTask("reach 0.5 0 0", [0.5, 0, 0], die_at=WAIT + 2)]
    with pytest.raises(collect.CollectionError, match=r"episode 2 \(libero_10 task 1 .* crashed after 0 steps: "
                                                      r"worker collect_rollouts-env0 died \(exit code 3\)"):
        collect.run(make_cfg(tmp_path), simulator=functools.partial(StandInSimulator, tasks),
                    policy=GoalSeekingPolicy())
    assert not (tmp_path / "results/recap/iter_1/rollouts").exists()


def test_policy_k_minus_1_is_loaded_prompted_and_guided_as_the_evaluation_does(tmp_path, monkeypatch):
    """Without a policy given, collect loads iteration k-1's export (here a model trained with
    advantage prompts), prompts it "<task>\nAdvantage: positive", guides it with eval.cfg_scale;
    the dataset keeps the plain task."""
    import torch
    from test_serve_openpi_client import write_tiny_model

    from pisft.data import prompts
    from pisft.data.libero import advantage_prompt
    from pisft.policy import predictor as inference

    seen: list = []
    real = inference.ChunkPredictor.predict

    def spy(self, batch, noise, **blend):
        seen.append((str(self.model_dir), list(batch["task"]), blend.get("cfg_scale"),
                     blend.get("unconditioned_tasks")))
        return real(self, batch, noise, **blend)

    monkeypatch.setattr(inference.ChunkPredictor, "predict", spy)
    cfg = make_cfg(tmp_path, task_ids=[1], max_steps=5)
    cfg.eval.cfg_scale = 2.0
    cfg.eval.policy_batch = 1  # one row per forward: the spy sees each request once (no padding)
    model = write_tiny_model(tmp_path / "export")
    prompts.recap_conditioning(1, True, 0.1).write(model / prompts.CONDITIONING_FILE)
    layout.policy(cfg, 0).parent.mkdir(parents=True)
    model.rename(layout.policy(cfg, 0))
    sim = StandInSimulator(TASKS)
    threads = torch.get_num_threads()
    try:
        collection = collect.run(cfg, simulator=lambda: sim, inline=True)
    finally:
        torch.set_num_threads(threads)
    # two chunks (one per 5-step episode), each the positive prompt guided against the plain task
    assert seen == [(str(layout.policy(cfg, 0)), [advantage_prompt("reach 99 0 0", True)], 2.0, ["reach 99 0 0"])] * 2
    assert collection["guidance"]["guided"] and collection["cfg_scale"] == 2.0
    assert collection["prompt"]["eval_prompt"] == "positive"
    assert [e["frames"] for e in collection["episodes"]] == [5, 5]
    out = tmp_path / "results/recap/iter_1/rollouts"
    tasks = [json.loads(line)["task"] for line in (out / "meta/tasks.jsonl").read_text().splitlines()]
    assert tasks == ["reach 99 0 0"]
    actions = np.array([r["actions"] for r in episode_rows(out)], dtype=np.float32)
    np.testing.assert_array_equal(actions, np.asarray(executed_actions(sim.envs[0], 2)).reshape(10, 7)
                                  .astype(np.float32))


def test_wrong_iteration_missing_policy_and_too_few_initial_states(tmp_path):
    cfg = make_cfg(tmp_path)
    with pytest.raises(PisftError, match="iteration k >= 1 .* got iteration 0"):
        collect.run(cfg.at_iteration(0), simulator=functools.partial(StandInSimulator, TASKS),
                    policy=GoalSeekingPolicy(), inline=True)
    with pytest.raises(PisftError, match=r"results/train/model: policy 0 .* is missing; run iteration 0's training"):
        collect.run(cfg, simulator=functools.partial(StandInSimulator, TASKS), inline=True)
    # a suite with 4 initial states per task: the evaluation takes 0..2, collection would need 3 and 4
    with pytest.raises(PisftError, match="has 4 initial states; 2 episodes from initial state 3 on .* need 5"):
        collect.run(cfg, simulator=functools.partial(StandInSimulator, TASKS, n_init=4),
                    policy=GoalSeekingPolicy(), inline=True)


def _hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and (p.suffix == ".parquet" or p.suffix == ".jsonl")}


@pytest.mark.integration  # 8-14 s here: spawned environment processes
def test_the_dataset_does_not_depend_on_the_number_of_environment_processes(tmp_path):
    tasks = [StandInTask(f"reach {g} 0 0", [g, 0, 0]) for g in (0.3, 0.45)]
    out = {}
    for n in (1, 2):
        cfg = make_cfg(tmp_path / f"n{n}", max_steps=30)
        cfg.eval.num_envs = n
        # placements drawn at each reset, as LIBERO's: an episode depends on its environment's past unless reseeded
        collection = collect.run(cfg, simulator=functools.partial(StandInSimulator, tasks, placement_noise=0.02),
                                 policy=GoalSeekingPolicy(noise=0.9))
        timing = json.loads((tmp_path / f"n{n}/results/recap/iter_1/logs/collect_rollouts.timing.json").read_text())
        assert timing["num_envs"] == n and "timing" not in collection
        out[n] = (_hashes(tmp_path / f"n{n}/results/recap/iter_1/rollouts"), collection["episodes"])
    assert out[1] == out[2]
    assert {e["success"] for e in out[1][1]} == {True, False}  # the noise matters: equality is not vacuous
    assert len(out[1][0]) == 4 + 3  # 4 episode files; tasks, episodes, episodes_stats


@pytest.mark.integration  # ~60-150 s here: LIBERO's environment creation, two resets, 32 rendered steps
@pytest.mark.skipif(importlib.util.find_spec("libero") is None,
                    reason="the LIBERO simulator (hf-libero) is not installed in this environment; "
                           "`make setup` installs it (docs/libero.md, 'The LIBERO simulator')")
def test_collection_in_the_real_simulator(tmp_path):
    """Policy 0 (the tiny pi0.5, exported) rolled out in hf-libero: each recorded frame is the raw
    observation each executed step was taken from (cameras rotated 180°, openpi's state) and
    the action executed, from the initial states after the evaluation's."""
    import torch
    from test_eval_libero_real import RecordingEnv, RecordingSimulator, openpi_state
    from test_serve_openpi_client import write_tiny_model

    steps = 6

    class InitRecordingEnv(RecordingEnv):
        def set_init_state(self, state):
            self._log.append(("init", np.array(state)))
            return super().set_init_state(state)

    class InitRecordingSimulator(RecordingSimulator):
        def make_env(self, task, *, resolution, seed):
            env = super().make_env(task, resolution=resolution, seed=seed)
            return InitRecordingEnv(env._env, self.log)

    cfg = C.from_dict({
        "results_dir": str(tmp_path / "results"), "device": "cpu",
        "eval": {"closed_loop": True, "trials_per_task": 1, "num_envs": 1, "num_wait_steps": WAIT,
                 "replan_steps": 5, "closed_loop_seed": 7},
        "recap": {"iterations": 1, "suite": "libero_10", "task_ids": [0], "episodes_per_task": 2,
                  "max_steps": steps, "collect_seed": SEED}}).at_iteration(1)
    model = write_tiny_model(tmp_path / "export")
    layout.policy(cfg, 0).parent.mkdir(parents=True)
    model.rename(layout.policy(cfg, 0))
    log: list = []
    sims: list = []

    def simulator():
        sims.append(InitRecordingSimulator(log))
        return sims[-1]

    threads = torch.get_num_threads()
    try:
        collection = collect.run(cfg, simulator=simulator, inline=True)
    finally:
        torch.set_num_threads(threads)
    assert collection["simulator"]["package"] == "hf-libero"
    assert [(e["initial_state"], e["env_seed"], e["frames"], e["error"]) for e in collection["episodes"]] == \
        [(1, SEED, steps, None), (2, SEED, steps, None)]
    assert ("make_env", 256, SEED) in log and ("seed", 7) not in log
    stored = sims[0].suite("libero_10").get_task_init_states(0)
    inits = [e[1] for e in log if e[0] == "init"]
    assert len(inits) == 2 and all(np.array_equal(a, stored[k]) for a, k in zip(inits, (1, 2), strict=True))
    # the observation before each executed step (wait steps excluded), and the step's action
    pairs, last, n_steps = [], None, 0
    for entry in log:
        if entry[0] == "obs":
            last = entry[1]
        elif entry[0] == "init":
            n_steps = 0
        elif entry[0] == "step":
            n_steps += 1
            if n_steps > WAIT:
                pairs.append((last, np.asarray(entry[1])))
    out = tmp_path / "results/recap/iter_1/rollouts"
    rows = episode_rows(out)
    assert len(rows) == len(pairs) == 2 * steps
    for row, (obs, action) in zip(rows, pairs, strict=True):
        np.testing.assert_array_equal(decode_png(row["image"]["bytes"]), obs["agentview_image"][::-1, ::-1])
        np.testing.assert_array_equal(decode_png(row["wrist_image"]["bytes"]),
                                      obs["robot0_eye_in_hand_image"][::-1, ::-1])
        np.testing.assert_allclose(row["state"], openpi_state(obs), rtol=0, atol=1e-6)  # stored as float32
        np.testing.assert_array_equal(np.float32(row["actions"]), action.astype(np.float32))
    assert decode_png(rows[0]["image"]["bytes"]).shape == (256, 256, 3)
    assert not np.array_equal(rows[0]["state"], rows[steps]["state"])  # two initial states, two episodes
    report = convert(out, tmp_path / "dataset", eval_fraction=0.5)
    assert report["in"] == {"episodes": 2, "frames": 2 * steps, "tasks": 1}
    assert report["outcomes"]["train"]["failures"] + report["outcomes"]["eval"]["failures"] == 2
