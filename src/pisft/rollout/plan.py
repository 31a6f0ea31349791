"""Episode planning and seeds: the run's episodes in a fixed order (suite, task, trial), each
with its environment seed and the seed of its policy noise, whatever worker runs it."""

from __future__ import annotations

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

