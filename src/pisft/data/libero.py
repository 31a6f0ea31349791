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
# The two input namings: RECAP/openpi (`image`, ...) and `libero_v2` (LeRobot-style names).
NAMINGS: dict[str, dict[str, str]] = {
    "recap": {"image": "image", "wrist_image": "wrist_image", "state": "state", "actions": "actions"},
    "libero_v2": {
        "image": "observation.images.image",
        "wrist_image": "observation.images.wrist_image",
        "state": "observation.state",
        "actions": "action",
    },
}
ROLLOUT_COLUMNS = ("is_success", "done", "intervene_flag")
INDEX_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")

REPO_ID = "pisft/libero_recap"
ADVANTAGE_SUFFIX = {True: "Advantage: positive", False: "Advantage: negative"}


def advantage_prompt(task: str, positive: bool) -> str:
    """RECAP's advantage-conditioned prompt: the task followed by the advantage label."""
    return f"{task}\n{ADVANTAGE_SUFFIX[bool(positive)]}"
