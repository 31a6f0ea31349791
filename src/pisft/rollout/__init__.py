"""pisft.rollout: the rollout engine under the closed-loop evaluation and the RECAP collection.

- `settings`: one settings object for what is rolled out and how (`Settings.for_evaluation`,
  `Settings.for_collection`), the number of environment processes;
- `plan`: the episodes in a fixed order, their environment and noise seeds;
- `workers` (and `libero_sim`, the simulator; `recording`, `video`): one environment per worker
  process, building the policy's requests, recording steps and encoding videos;
- `perturb` (and `paraphrases`): what an episode's perturbation (`eval.perturbations`) does to its
  scene, prompt and observations, a pure function of (seed, episode, strength);
- `scheduler`: episodes through the workers, requests through the policy's batching rule
  (`pisft.policy.batching`), an episode that errs run again on a fresh worker.

The stages on it: `pisft.evaluate.closed_loop` and `pisft.recap.collect`.
"""

from pisft.rollout.plan import VIDEO_DIR, chunk_seed, episode_seed, plan_episodes, video_name
from pisft.rollout.scheduler import (
    EPISODE_ATTEMPTS,
    CrashedEpisode,
    EpisodeErrors,
    EpisodeResult,
    Scheduler,
    check_chunk,
    env_count,
    mujoco_note,
    progress,
    roll_out,
    run_episodes,
    simulator_info,
    timing,
)
from pisft.rollout.settings import ENV_MEMORY_BYTES, Settings, auto_num_envs, resolve_num_envs

__all__ = ["ENV_MEMORY_BYTES", "EPISODE_ATTEMPTS", "VIDEO_DIR", "CrashedEpisode", "EpisodeErrors", "EpisodeResult",
           "Scheduler", "Settings", "auto_num_envs", "check_chunk", "chunk_seed", "env_count", "episode_seed",
           "mujoco_note", "plan_episodes", "progress", "resolve_num_envs", "roll_out", "run_episodes",
           "simulator_info", "timing", "video_name"]
