"""Episode planning and seeds: the run's episodes in a fixed order (suite, task, trial), each
with its environment seed and the seed of its policy noise, whatever worker runs it; and the
plan's shards.

**Scattered rollouts** (`eval.shards`): a rollout stage's episodes split over several jobs, then merged.

`closed_loop` and `collect_rollouts` plan their episodes in one fixed order (`plan_episodes`),
and an episode's result depends on nothing but its plan entry: its environment seed, its noise seeds
(from the run seed and the episode, `episode_seed`, `chunk_seed`) and the rows of every policy forward
(`eval.policy_batch`, at most one per episode of the whole plan: `Settings.forward_rows`), never on
which worker, process or node runs it, nor what ran before it. So shard i of N runs the contiguous
block of the plan `shard_range(total, i, N)` (blocks keep a task's episodes together, so a worker keeps
its environment), with the forward rows of the whole plan, and writes its episodes' results, videos
and recordings into its own folder (`layout.Iteration.shard`); the merge plans the same episodes
again, takes every result by its episode index, and writes the stage's usual outputs with the same
code as the one-job run: the same bytes (tests/test_rollout_shards.py). Each shard's timing record
goes beside the logs (`<stage>.shard_<i>_of_<N>.timing.json`), the merge's sums them.

A shard's folder is written whole or not at all (`pisft.integrity.stage_output`, with a manifest the
merge verifies), so a shard whose job was killed leaves nothing and is the only one a driver runs
again (Snakemake: one job per shard; docs/workflow.md, "Scattered evaluation and collection")."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pisft.errors import PisftError
from pisft.rollout import libero_sim
from pisft.rollout.settings import Settings
from pisft.rollout.workers import EpisodeSpec

VIDEO_DIR = "videos"


def episode_seed(seed: int, suite: str, task_id: int, init_state: int) -> int:
    """Seed of the policy's noise for one episode: fixed by the run seed and the episode (its
    task and initial state number, which is the trial number in the evaluation)."""
    words = [seed, task_id, init_state] + [ord(c) for c in suite]
    return int(np.random.SeedSequence(words).generate_state(1)[0])


def chunk_seed(episode: int, call: int) -> int:
    """Noise seed of an episode's call-th chunk: independent of what else runs meanwhile."""
    return int(np.random.SeedSequence([episode, call]).generate_state(1)[0])


def video_name(suite: str, task_id: int) -> str:
    return f"{VIDEO_DIR}/{suite}_task{task_id:02d}.mp4"


def plan_episodes(simulator: libero_sim.Simulator, settings: Settings, out_dir: Path | None,
                  record_dir: Path | None = None) -> tuple[list[EpisodeSpec], dict[tuple[str, int], str]]:
    """The run's episodes in order, and each task's instruction; checked before any rollout.
    `record_dir`: every episode records its executed steps in `record_dir/episode_<index>/`."""
    specs: list[EpisodeSpec] = []
    languages: dict[tuple[str, int], str] = {}
    # absolute: a worker process runs in the stage's log folder (MuJoCo's log, pisft.rollout.workers)
    out_dir = None if out_dir is None else Path(out_dir).absolute()
    record_dir = None if record_dir is None else Path(record_dir).absolute()
    if not settings.suites or len(set(settings.suites)) != len(settings.suites):
        raise PisftError(f"eval.libero_suites: {list(settings.suites)}: give one or more distinct suites "
                         "(a repeat runs the same episodes twice)")
    for suite_name in settings.suites:
        if suite_name not in libero_sim.SUITE_MAX_STEPS:
            raise PisftError(f"eval.libero_suites: unknown suite '{suite_name}'; one of "
                             f"{', '.join(libero_sim.SUITE_MAX_STEPS)}")
        suite = simulator.suite(suite_name)
        task_ids = settings.task_ids or tuple(range(suite.n_tasks))
        bad = [t for t in task_ids if not 0 <= t < suite.n_tasks]
        if bad:
            raise PisftError(f"eval.task_ids: {suite_name} has tasks 0..{suite.n_tasks - 1}, not {bad}; "
                             "pick ids in that range (or [] for every task)")
        for task_id in task_ids:
            languages[(suite_name, task_id)] = suite.get_task(task_id).language
            n_init = len(suite.get_task_init_states(task_id))
            if settings.first_init_state == 0 and n_init < settings.trials_per_task:
                raise PisftError(
                    f"{suite_name} task {task_id} has {n_init} initial states, fewer than "
                    f"eval.trials_per_task={settings.trials_per_task}; lower eval.trials_per_task")
            if n_init < settings.first_init_state + settings.trials_per_task:
                raise PisftError(
                    f"{suite_name} task {task_id} has {n_init} initial states; {settings.trials_per_task} "
                    f"episodes from initial state {settings.first_init_state} on (after the evaluation's "
                    f"eval.trials_per_task) need {settings.first_init_state + settings.trials_per_task}: "
                    "lower recap.episodes_per_task or eval.trials_per_task")
            for trial in range(settings.trials_per_task):
                video = None
                if settings.videos and trial == 0 and out_dir is not None:
                    video = str(out_dir / video_name(suite_name, task_id))
                index = len(specs)
                specs.append(EpisodeSpec(
                    index=index, suite=suite_name, task_id=task_id, trial=trial,
                    max_steps=settings.steps_for(suite_name), num_wait_steps=settings.num_wait_steps,
                    env_seed=settings.seed, resize_size=settings.resize_size, video=video,
                    init_state=settings.first_init_state + trial,
                    record=None if record_dir is None else str(record_dir / f"episode_{index:06d}")))
    return specs, languages



SHARD_RESULTS = "results.json"  # in a shard's folder: its episodes' results and what they were run with


def parse_shard(text: str) -> tuple[int, int]:
    """`--shard I/N` -> (I, N), 1 <= I <= N."""
    try:
        i, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise PisftError(f"--shard {text}: give the shard as I/N, e.g. 1/2 (shard 1 of 2)") from None
    if not 1 <= i <= n:
        raise PisftError(f"--shard {text}: the shard I of I/N is 1..N")
    return i, n


def shard_name(i: int, n: int) -> str:
    """A shard's folder and timing record name: `shard_1_of_2`."""
    return f"shard_{i}_of_{n}"


def shard_range(total: int, i: int, n: int) -> range:
    """The plan positions shard i (1..n) of n runs: contiguous blocks whose sizes differ by at most one
    (the first total % n shards one more). Refused when a shard would have no episode."""
    if n > total:
        raise PisftError(f"eval.shards is {n} but the stage plans {total} episode(s): every shard needs one; "
                         f"set eval.shards to at most {total}")
    return range((i - 1) * total // n, i * total // n)


def pick_shard(specs: list[EpisodeSpec], i: int, n: int) -> list[EpisodeSpec]:
    """Shard i of n's episodes of a plan (its specs in plan order, `spec.index` their position)."""
    return [specs[p] for p in shard_range(len(specs), i, n)]


def save_shard(folder: Path, *, stage: str, i: int, n: int, total: int, results: dict[str, list],
         indices: dict[str, list[int]], record: dict) -> None:
    """A shard's results.json: for each pass (`results`: "episodes", and the closed loop's plain-chunking
    pass "plain"), its results with their plan indices; `record`: what the merge checks is the same in
    every shard (the settings, the policy's record, the simulator)."""
    doc = {"stage": stage, "shard": i, "shards": n, "episodes": total, "record": record,
           "passes": {key: [{"index": index, **asdict(r)} for index, r in zip(indices[key], rs, strict=True)]
                      for key, rs in results.items()}}
    (folder / SHARD_RESULTS).write_text(json.dumps(doc, indent=1) + "\n")


def load_shards(folders: list[Path], *, stage: str, total: int, passes: dict[str, int],
                result: type) -> tuple[dict[str, list], dict]:
    """The shards' results (as `result`: the scheduler's EpisodeResult, which imports this module), each
    pass in plan order (`passes`: its number of episodes), and the record they share. Refused (naming the
    shard and what to do) when a shard is missing, was run for another number of shards or another plan,
    or when two disagree on the record."""
    n = len(folders)
    merged = {key: [None] * count for key, count in passes.items()}
    record = None
    for i, folder in enumerate(folders, start=1):
        path = folder / SHARD_RESULTS
        if not path.is_file():
            raise PisftError(f"{stage}: shard {i} of {n} has no {path}; run it first "
                             f"(python -m pisft {stage} --shard {i}/{n}, or the workflow's {stage} shard rule)")
        doc = json.loads(path.read_text())
        if (doc["stage"], doc["shard"], doc["shards"], doc["episodes"]) != (stage, i, n, total):
            raise PisftError(f"{path}: written as shard {doc['shard']} of {doc['shards']} of {doc['episodes']} "
                             f"episodes, not shard {i} of {n} of {total}: the config changed since; "
                             "run the shards again")
        if record is None:
            record = doc["record"]
        elif doc["record"] != record:
            raise PisftError(f"{path}: its settings, policy or simulator differ from shard 1's "
                             f"({folders[0] / SHARD_RESULTS}); run every shard again with the same config")
        for key, entries in doc["passes"].items():
            for entry in entries:
                index = entry.pop("index")
                if merged[key][index] is not None:
                    raise PisftError(f"{path}: episode {index} is also in another shard; run the shards again")
                merged[key][index] = result(**entry)
    missing = {key: [p for p, r in enumerate(rs) if r is None] for key, rs in merged.items()}
    if any(missing.values()):
        raise PisftError(f"{stage}: the shards miss episodes {missing}; run every shard again")
    return merged, record or {}


def merged_timing(shard_timings: list[dict], results: list, settings, timing) -> dict:
    """The merge's timing record: the pooled figures over every shard's episodes (`timing` of the
    scheduler: environment processes summed, wall time the longest shard's), each shard's record
    under `shards`."""
    out = timing(results, max(t["wall_time_s"] for t in shard_timings), sum(t["num_envs"] for t in shard_timings),
                 None, settings)
    out["shards"] = shard_timings
    return out
