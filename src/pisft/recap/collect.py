"""`collect_rollouts`: roll policy k-1 out in LIBERO and keep what RLinf's collector keeps.

Iteration k >= 1 of the RECAP loop starts here. The rollouts are the closed-loop evaluation's
(both run on the rollout engine, `pisft.rollout`: the same worker processes, episode plan, noise
seeds, policy object and openpi settings), with three differences:

- the policy is iteration k-1's (`layout.policy(cfg, k - 1)`), prompted as its
  `prompt_conditioning.json` says (`LiberoPolicy`, `pisft.data.prompts.for_model`) and guided
  with `eval.cfg_scale` as the evaluation guides it (`pisft.model.guidance`);
- episode i of a task starts from LIBERO initial state `eval.trials_per_task + i` (the
  evaluation uses states 0 .. eval.trials_per_task-1), and the environment seed and the policy
  noise seeds come from `recap.collect_seed` (the evaluation's from `eval.closed_loop_seed`), so
  collection and evaluation never share a start or a draw;
- every executed step after the wait steps is recorded in the worker
  (`pisft.rollout.recording`).

The output is what RLinf's LIBERO collection leaves before any labelling: a LeRobot dataset
written as RLinf's `LeRobotDatasetWriter` (`rlinf/data/storage/lerobot/writer.py`) writes the
frames of `CollectEpisode` (`rlinf/envs/wrappers/collect_episode.py`, `_buffer_to_lerobot_ep`):
one frame per executed step (the observation it was taken from, the action executed), `image`
and `wrist_image` (256×256, rotated 180° as RLinf's LIBERO environment and openpi's LIBERO data
have them), `state` (8), `actions` (7), `done` (the last frame), `is_success` (the episode's
outcome on every frame), `intervene_flag` (false), `segment_id` (0), LeRobot's index columns,
and the task text in `meta/tasks.jsonl`. RLinf's writer runs LeRobot at the commit RLinf pins
(`requirements/install.sh`, LEROBOT_COMMIT 0cf8648, the v2.1 dataset format), so this is LeRobot
v2.1 with PNG images in parquet, written by `pisft.data.recap_layout` (the demo's writer too).
`convert_recap` reads it as it reads RLinf's own collection.

An episode that crashes (the simulator, a worker process, the policy) is not a failed trial:
as in the evaluation (`pisft.rollout.scheduler`) it runs again from its start on a fresh
worker, up to `pisft.rollout.EPISODE_ATTEMPTS` in all (the recording of an attempt that erred is
discarded, and a retry records from scratch), and one that errs on every attempt stops the
stage, naming it and its errors, with nothing written.

Output `results/recap/iter_<k>/rollouts/` (atomic): the dataset, `collection.json` (suite,
tasks, every episode's task, initial state, seeds, frames, outcome; the policy and the rows of its
forwards; the settings) and `pisft_config.json`: the same bytes for the same config, model and
policy thread count, whatever the load, `eval.num_envs` or a kill and rerun (every forward has
`eval.policy_batch` rows, `pisft.policy.fixed_shape`), so DVC sees the same dataset. How the run
went (times, environment processes, batches, episodes run again) is its timing record,
`results/recap/iter_<k>/logs/collect_rollouts.timing.json`.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pisft import config as config_mod
from pisft import device as device_mod
from pisft import layout, rollout
from pisft import logs as logs_mod
from pisft.data.libero import FPS
from pisft.data.recap_layout import RecapEpisode, write_recap_dataset
from pisft.errors import PisftError
from pisft.integrity import stage_output, verify_read
from pisft.io import write_json_atomic
from pisft.policy.replicas import PolicyPool, open_policy_pool, policy_record
from pisft.rollout import libero_sim
from pisft.rollout import plan as rollout_plan
from pisft.rollout import recording as episode_recording
from pisft.rollout.workers import EpisodeSpec
from pisft.stages import COLLECT_ROLLOUTS

STAGE = COLLECT_ROLLOUTS.name  # its settings, logs, progress lines (the stage table's row)

log = logging.getLogger("pisft.collect_rollouts")

RECORDINGS = ".recordings"  # the workers' step recordings, inside the output until written
DATASET_VERSION = "v2.1"  # LeRobot at RLinf's pinned commit (see the module docstring)
ROBOT_TYPE = "panda"  # CollectEpisode's default robot_type (and fps 10: pisft.data.libero.FPS)


class CollectionError(PisftError):
    """An episode crashed: the collection is not a result."""


def settings_for(cfg: config_mod.PisftConfig, stage: str | None = None) -> rollout.Settings:
    """The rollout settings of the collection (`rollout.Settings.for_collection`)."""
    return rollout.Settings.for_collection(cfg, stage=stage)


def _crash_message(exc: rollout.EpisodeErrors, out: Path) -> str:
    return (f"collect_rollouts: {exc.describe()}. A crash is not a failed trial, so nothing was written to "
            f"{out}. {exc.attempts_note()} Fix the cause (the simulator install, the policy) and rerun the stage")


def _dataset_episodes(specs: list[EpisodeSpec], results: list[rollout.EpisodeResult],
                      task_index: dict[str, int]):
    """The recorded episodes in plan order, as the dataset writer takes them."""
    for spec, r in zip(specs, results, strict=True):
        assert spec.record is not None
        rec = episode_recording.read(spec.record)
        n = len(rec["actions"])
        if n != r.steps or n == 0 or rec["success"] != r.success:
            raise PisftError(f"collect_rollouts: episode {spec.index}: the worker recorded {n} steps "
                             f"(success {rec['success']}) but executed {r.steps} (success {r.success})")
        done = np.zeros(n, dtype=bool)
        done[-1] = True
        yield RecapEpisode(
            episode_index=spec.index, task_index=task_index[r.task], state=rec["state"], actions=rec["actions"],
            images={cam: rec[cam] for cam in episode_recording.CAMERAS},
            is_success=np.full(n, r.success, dtype=bool), done=done,
            intervene_flag=np.zeros(n, dtype=bool), segment_id=np.zeros(n, dtype=np.uint8))


def collection_record(cfg: config_mod.PisftConfig, settings: rollout.Settings, specs: list[EpisodeSpec],
                      results: list[rollout.EpisodeResult], tasks: list[str], model_dir: Path) -> dict:
    """collection.json: what was rolled out, from where, with which seeds; its outcomes."""
    suite = settings.suites[0]
    by_task: dict[int, dict] = {}
    episodes = []
    for spec, r in zip(specs, results, strict=True):
        policy_seed = rollout.episode_seed(settings.seed, spec.suite, spec.task_id, spec.initial_state)
        episodes.append({
            "episode_index": spec.index, "task_id": spec.task_id, "task": r.task,
            "task_index": tasks.index(r.task), "initial_state": spec.initial_state, "env_seed": spec.env_seed,
            "policy_seed": policy_seed, "policy_calls": r.policy_calls, "frames": r.steps,
            "success": r.success, "error": r.error})
        entry = by_task.setdefault(spec.task_id, {"task_id": spec.task_id, "task": r.task,
                                                  "task_index": tasks.index(r.task), "episodes": 0,
                                                  "successes": 0})
        entry["episodes"] += 1
        entry["successes"] += int(r.success)
    e = cfg.eval
    return {
        "iteration": cfg.iteration,
        "policy_dir": str(model_dir),
        "suite": suite,
        "tasks": list(by_task.values()),
        "episodes_per_task": settings.trials_per_task,
        "max_steps": settings.steps_for(suite),
        "num_wait_steps": settings.num_wait_steps,
        "replan_steps": settings.replan_steps,
        "resize_size": settings.resize_size,
        "seeds": {
            "collect_seed": settings.seed,
            "env_seed": "recap.collect_seed, set before every episode's reset (as the evaluation sets its own)",
            "policy_seed": "closed_loop.episode_seed(recap.collect_seed, suite, task_id, initial_state)",
            "chunk_seed": "closed_loop.chunk_seed(policy_seed, k) for the episode's k-th chunk",
        },
        "evaluation": {"initial_states": [0, e.trials_per_task - 1], "env_seed": e.closed_loop_seed,
                       "note": "the evaluation's initial states (inclusive range) and seed; collection uses "
                               "neither"},
        "episodes": episodes,
        "frames": sum(r.steps for r in results),
        "successes": sum(r.success for r in results),
        "dataset": {"format": f"LeRobot {DATASET_VERSION}, RLinf's LeRobotDatasetWriter layout (collection, "
                              "unlabelled)", "codebase_version": DATASET_VERSION, "fps": FPS,
                    "robot_type": ROBOT_TYPE},
    }


def _prepare(cfg: config_mod.PisftConfig, simulator, policy: Any, *, needs_policy: bool = True):
    """(iteration, settings, policy k-1's folder, the simulator factory, a simulator, its record)."""
    k = cfg.iteration
    if k < 1:
        raise PisftError(f"collect_rollouts runs at a RECAP iteration k >= 1 (it rolls out policy k-1); "
                         f"got iteration {k}: pass --iteration K")
    settings = settings_for(cfg, stage=STAGE)
    model_dir = layout.policy(cfg, k - 1)
    if needs_policy and policy is None and not (model_dir / "config.json").is_file():
        raise PisftError(f"{model_dir}: policy {k - 1} (the model iteration {k - 1} exported) is missing; "
                         f"run iteration {k - 1}'s training first")
    factory = simulator if simulator is not None else libero_sim.LiberoSimulator
    sim = factory()  # SimulatorUnavailable with the install line when LIBERO is not installed
    return k, settings, model_dir, factory, sim, rollout.simulator_info(sim)


def run(cfg: config_mod.PisftConfig, *, simulator=None, policy: Any = None, inline: bool = False,
        shard: tuple[int, int] | None = None) -> dict:
    """The collect_rollouts stage at iteration `cfg.iteration` (>= 1). `simulator`: a picklable
    factory (default `libero_sim.LiberoSimulator`); `policy`: instead of policy k-1 (tests);
    `inline`: the environments in this process (tests). `shard` (i, n): only shard i of n's
    episodes, recorded into its shard folder (`pisft.rollout.plan`, "Scattered rollouts"); `merge` writes
    the dataset."""
    if shard is not None:
        return _run_shard(cfg, *shard, simulator=simulator, policy=policy, inline=inline)
    k, settings, model_dir, factory, sim, sim_info = _prepare(cfg, simulator, policy)
    final = layout.iteration(cfg).rollouts
    with stage_output(final, cfg) as out:  # convert_recap checks the rollouts against its manifest
        specs, languages = rollout.plan_episodes(sim, settings, None, record_dir=out / RECORDINGS)
        with open_policy_pool(cfg, policy, model_dir=model_dir, trained_on=layout.iteration(cfg, k - 1).dataset,
                              seed=settings.seed, rows=settings.forward_rows(len(specs)),
                              wait_ms=settings.policy_batch_wait_ms, stage=STAGE) as pool:
            collection, run_timing = _collect(cfg, k, settings, pool, out, specs, languages, factory=factory,
                                              sim=sim, sim_info=sim_info, inline=inline, model_dir=model_dir)
    write_json_atomic(layout.iteration(cfg).timing(STAGE), run_timing)
    print(f"collect_rollouts: {len(specs)} episodes, {collection['frames']} frames, "
          f"{collection['successes']} successes in {run_timing['wall_time_s']:.1f} s -> {final}", flush=True)
    return collection


def _collect(cfg: config_mod.PisftConfig, k: int, settings: rollout.Settings, pool: PolicyPool, out: Path,
             specs: list[EpisodeSpec], languages: dict, *, factory, sim, sim_info: dict, inline: bool,
             model_dir: Path) -> tuple[dict, dict]:
    """The rollouts into `out` (the same bytes for the same config, model and thread count); (the
    collection record, the run's timing record)."""
    final = layout.iteration(cfg).rollouts
    num_envs = rollout.env_count(settings, specs, stage=STAGE)
    print(f"collect_rollouts: iteration {k}, policy {model_dir}: {len(specs)} episodes in "
          f"{sim_info.get('package')} {sim_info.get('version') or ''}, {num_envs} environment "
          f"{'(inline)' if inline else 'processes'}", flush=True)
    record = rollout.progress(  # plan_episodes: episode i of a task starts from first_init_state + i
        STAGE, len(specs),
        lambda r: f"{r.suite} task {r.task_id} initial state {settings.first_init_state + r.trial}", logger=log)

    mujoco_logs = logs_mod.mujoco_log_dir(STAGE, layout.iteration(cfg).logs)
    (out / RECORDINGS).mkdir()  # the workers record into it
    try:
        results, wall = rollout.roll_out(specs, pool, settings, factory=factory, simulator=sim,
                                         num_envs=num_envs, inline=inline, languages=languages,
                                         on_episode=record, name=STAGE, log_dir=mujoco_logs)
    except rollout.EpisodeErrors as exc:
        raise CollectionError(_crash_message(exc, final)) from None
    finally:
        rollout.mujoco_note(mujoco_logs, STAGE)
    collection = write_outputs(cfg, settings, out, specs, results, sim_info=sim_info, policy=policy_record(pool),
                               model_dir=model_dir)
    shutil.rmtree(out / RECORDINGS)
    return collection, rollout.timing(results, wall, num_envs, pool, settings)


def write_outputs(cfg: config_mod.PisftConfig, settings: rollout.Settings, out: Path, specs: list[EpisodeSpec],
                  results: list[rollout.EpisodeResult], *, sim_info: dict, policy: dict, model_dir: Path) -> dict:
    """The dataset from the episodes' recordings (`spec.record`) and collection.json, in `out`: the
    one-job run and the merge of its shards (`merge`) both write through here, the same bytes."""
    tasks = list(dict.fromkeys(r.task for r in results))  # LeRobot's task_index: order of first appearance
    write_recap_dataset(out, _dataset_episodes(specs, results, {t: i for i, t in enumerate(tasks)}), tasks,
                        version=DATASET_VERSION, naming="recap", fps=FPS, robot_type=ROBOT_TYPE,
                        workers=device_mod.usable_cores())
    collection = collection_record(cfg, settings, specs, results, tasks, model_dir)
    collection["simulator"] = sim_info
    collection.update(policy)
    collection["settings"] = settings.record()
    write_json_atomic(out / "collection.json", collection)
    return collection


SHARD_RECORDINGS = "recordings"  # in a shard's folder: its episodes' step recordings, which the merge reads


def _run_shard(cfg: config_mod.PisftConfig, i: int, n: int, *, simulator, policy: Any, inline: bool) -> dict:
    """Shard i of n (`pisft.rollout.plan`, "Scattered rollouts"): its block of the plan, with the whole
    plan's forward rows, recorded into `layout.Iteration.shard`; its timing record beside the logs."""
    k, settings, model_dir, factory, sim, sim_info = _prepare(cfg, simulator, policy)
    label = f"{STAGE} {rollout_plan.shard_name(i, n)}"
    with stage_output(layout.iteration(cfg).shard(STAGE, i, n)) as out:
        specs, languages = rollout.plan_episodes(sim, settings, None, record_dir=out / SHARD_RECORDINGS)
        picked = rollout_plan.pick_shard(specs, i, n)
        num_envs = rollout.env_count(settings, picked, stage=STAGE)
        print(f"{label}: iteration {k}, policy {model_dir}: episodes {picked[0].index}..{picked[-1].index} of "
              f"{len(specs)}, {num_envs} environment {'(inline)' if inline else 'processes'}", flush=True)
        mujoco_logs = logs_mod.mujoco_log_dir(STAGE, layout.iteration(cfg).logs)
        (out / SHARD_RECORDINGS).mkdir()
        with open_policy_pool(cfg, policy, model_dir=model_dir, trained_on=layout.iteration(cfg, k - 1).dataset,
                              seed=settings.seed, rows=settings.forward_rows(len(specs)),
                              wait_ms=settings.policy_batch_wait_ms, stage=STAGE) as pool:
            try:
                results, wall = rollout.roll_out(
                    picked, pool, settings, factory=factory, simulator=sim, num_envs=num_envs, inline=inline,
                    languages=languages, name=STAGE, log_dir=mujoco_logs,
                    on_episode=rollout.progress(label, len(picked), lambda r: f"{r.suite} task {r.task_id} "
                                                f"initial state {settings.first_init_state + r.trial}", logger=log))
            except rollout.EpisodeErrors as exc:
                raise CollectionError(_crash_message(exc, layout.iteration(cfg).shard(STAGE, i, n))) from None
            finally:
                rollout.mujoco_note(mujoco_logs, STAGE)
            run_timing = rollout.timing(results, wall, num_envs, pool, settings)
            rollout_plan.save_shard(out, stage=STAGE, i=i, n=n, total=len(specs), results={"episodes": results},
                                indices={"episodes": [s.index for s in picked]},
                                record={"settings": settings.record(), "policy": policy_record(pool),
                                        "simulator": sim_info})
    write_json_atomic(layout.iteration(cfg).timing(f"{STAGE}.{rollout_plan.shard_name(i, n)}"), run_timing)
    print(f"{label}: {len(picked)} episodes in {run_timing['wall_time_s']:.1f} s -> "
          f"{layout.iteration(cfg).shard(STAGE, i, n)}", flush=True)
    return run_timing


def merge(cfg: config_mod.PisftConfig, n: int, *, simulator=None) -> dict:
    """The collection from its n shards (`run(shard=...)`): the episodes planned again, each one's
    result and recording taken from its shard by its index, then written as the one-job run writes
    them (`write_outputs`): the same dataset and collection.json. The timing record sums the shards'."""
    k, settings, model_dir, _factory, sim, sim_info = _prepare(cfg, simulator, None, needs_policy=False)
    folders = [layout.iteration(cfg).shard(STAGE, i, n) for i in range(1, n + 1)]
    for folder in folders:
        if folder.is_dir():
            verify_read(folder, what=f"merging {STAGE}'s shards", required=True)
    specs, _languages = rollout.plan_episodes(sim, settings, None)
    passes, record = rollout_plan.load_shards(folders, stage=STAGE, total=len(specs), passes={"episodes": len(specs)},
                                               result=rollout.EpisodeResult)
    if record["settings"] != json.loads(json.dumps(settings.record())) or record["simulator"] != sim_info:
        raise PisftError(f"{STAGE}: the shards ran with other settings or another simulator than the config now "
                         "gives; run every shard again")
    recorded = [replace(spec, record=str(folders[i - 1] / SHARD_RECORDINGS / Path(f"episode_{spec.index:06d}")))
                for i in range(1, n + 1) for spec in rollout_plan.pick_shard(specs, i, n)]
    final = layout.iteration(cfg).rollouts
    with stage_output(final, cfg) as out:
        collection = write_outputs(cfg, settings, out, recorded, passes["episodes"], sim_info=sim_info,
                                   policy=record["policy"], model_dir=model_dir)
    timings = [json.loads(layout.iteration(cfg).timing(f"{STAGE}.{rollout_plan.shard_name(i, n)}").read_text())
               for i in range(1, n + 1)]
    write_json_atomic(layout.iteration(cfg).timing(STAGE),
                      rollout_plan.merged_timing(timings, passes["episodes"], settings, rollout.timing))
    print(f"collect_rollouts: merged {n} shards: {len(specs)} episodes, {collection['frames']} frames, "
          f"{collection['successes']} successes -> {final}", flush=True)
    return collection
