"""LIBERO / RECAP names shared by the demo writer, the converter and the dataset loader."""

from __future__ import annotations

# The ten LIBERO-10 (LIBERO-Long) task instructions, in the suite's order.
LIBERO_10_TASKS: tuple[str, ...] = (
    "put both the alphabet soup and the tomato sauce in the basket",
    "put both the cream cheese box and the butter in the basket",
    "turn on the stove and put the moka pot on it",
    "put the black bowl in the bottom drawer of the cabinet and close it",
    "put the white mug on the left plate and put the yellow and white mug on the right plate",
    "pick up the book and place it in the back compartment of the caddy",
    "put the white mug on the plate and put the chocolate pudding to the right of the plate",
    "put both the alphabet soup and the cream cheese box in the basket",
    "put both moka pots on the stove",
    "put the yellow and white mug in the microwave and close it",
)

FPS = 10
STATE_DIM = 8
ACTION_DIM = 7

# Canonical (RECAP) input names -> pi0.5 output names.
CAMERAS = ("image", "wrist_image")
OUTPUT_NAMES = {
    "image": "observation.images.base_0_rgb",
    "wrist_image": "observation.images.left_wrist_0_rgb",
    "state": "observation.state",
    "actions": "action",
}
# Column names of the LIBERO inputs, canonical name -> dataset column, as the tools that write
# LIBERO LeRobot datasets name them (detected from meta/info.json; `data.columns` overrides):
#
# - `recap`: `image`, `wrist_image`, `state`, `actions`.
#   openpi: examples/libero/convert_libero_data_to_lerobot.py (the `physical-intelligence/libero`
#   dataset) and its LIBERO data config (`RepackTransform` from `image`, `wrist_image`, `state`,
#   `actions`); RLinf: rlinf/data/storage/lerobot/writer.py (`LeRobotDatasetWriter.create`, the
#   features its LIBERO rollout collector rlinf/envs/wrappers/collect_episode.py writes),
#   rlinf/models/embodiment/openpi/dataconfig/libero_dataconfig.py and
#   rlinf/data/datasets/recap/value_dataset.py (`_REPACK_KEYS["libero"]`).
# - `libero_v2`: `observation.images.image`, `observation.images.wrist_image`,
#   `observation.state`, `action`. RLinf: rlinf/data/datasets/recap/value_dataset.py
#   (`_REPACK_KEYS["libero_v2"]`).
# - `lerobot`: `observation.images.image` (agent view), `observation.images.image2` (wrist),
#   `observation.state`, `action`. LeRobot 0.6.1: lerobot/envs/configs.py (`LiberoEnv.features_map`:
#   agentview_image -> observation.images.image, robot0_eye_in_hand_image -> observation.images.image2)
#   and lerobot/envs/libero.py (camera_name_mapping `image`, `image2`); what `lerobot-eval`
#   records from its LIBERO environment.
# - `observation_flat`: `observation.image`, `observation.wrist_image`, `observation.state` and
#   `action` (or `actions`). RLinf: examples/offline_rl/advantage_labeling/recap/process/
#   compute_advantages.py (`KEY_MAPPINGS["libero"]`, which names no action column: both spellings
#   are accepted).
#
# Each entry lists the accepted column names of a canonical key (`pisft.config.COLUMN_KEYS`, the keys
# of `data.columns`); a naming matches when every canonical key has exactly one of its names among
# the features.
NAMINGS: dict[str, dict[str, tuple[str, ...]]] = {
    "recap": {"image": ("image",), "wrist_image": ("wrist_image",), "state": ("state",),
              "actions": ("actions",)},
    "libero_v2": {"image": ("observation.images.image",), "wrist_image": ("observation.images.wrist_image",),
                  "state": ("observation.state",), "actions": ("action",)},
    "lerobot": {"image": ("observation.images.image",), "wrist_image": ("observation.images.image2",),
                "state": ("observation.state",), "actions": ("action",)},
    "observation_flat": {"image": ("observation.image",), "wrist_image": ("observation.wrist_image",),
                         "state": ("observation.state",), "actions": ("action", "actions")},
}


def naming_columns(naming: str) -> dict[str, str]:
    """The column names a writer uses for `naming` (the first accepted name of each key)."""
    return {canon: names[0] for canon, names in NAMINGS[naming].items()}


ROLLOUT_COLUMNS = ("is_success", "done", "intervene_flag")
# Per-frame success as the tools record it: RECAP/RLinf's `is_success` (RLinf's collector sets it
# on every frame of a successful episode), LeRobot's `next.success` (lerobot/scripts/lerobot_eval.py,
# true from the step the environment reports success). An episode is successful when the column
# is true on any of its frames; `is_success` wins when a dataset has both.
SUCCESS_COLUMNS = ("is_success", "next.success")
INDEX_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")

REPO_ID = "pisft/libero_recap"
# RECAP's advantage-conditioned prompt, as RLinf builds it (rlinf/data/datasets/recap/cfg_model.py,
# `TokenizePromptWithGuidance`; openpi_cfg_action_model.py `obs_processor`): f"{task}\nAdvantage: positive".
ADVANTAGE_SEPARATOR = "\n"
ADVANTAGE_SUFFIX = {True: "Advantage: positive", False: "Advantage: negative"}


def advantage_prompt(task: str, positive: bool) -> str:
    """RECAP's advantage-conditioned prompt: the task followed by the advantage label."""
    return f"{task}{ADVANTAGE_SEPARATOR}{ADVANTAGE_SUFFIX[bool(positive)]}"


def strip_advantage(prompt: str) -> str:
    """The task of a prompt, without an advantage label if it carries one."""
    for suffix in ADVANTAGE_SUFFIX.values():
        tail = ADVANTAGE_SEPARATOR + suffix
        if prompt.endswith(tail):
            return prompt[: -len(tail)]
    return prompt


def has_advantage(prompt: str) -> bool:
    return strip_advantage(prompt) != prompt
