"""Map an openpi LIBERO observation to the model's input batch, checking it on the way.

openpi's LIBERO client (`examples/libero/main.py`) sends, per request:
    observation/image        agent-view camera, (H, W, 3) uint8 (rotated 180°, resized with pad)
    observation/wrist_image  wrist camera, (H, W, 3) uint8
    observation/state        (8,) eef position (3), axis-angle (3), gripper joint positions (2)
    prompt                   the task instruction
These become the pi0.5 LIBERO features `observation.images.base_0_rgb`,
`observation.images.left_wrist_0_rgb`, `observation.state` and `task`. The model's own feature
names are accepted as well. Images may be uint8 in [0, 255] or float in [0, 1], HWC or CHW;
any size (the model resizes with padding to its own resolution).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from pisft.errors import PisftError

BASE_IMAGE = "observation.images.base_0_rgb"
WRIST_IMAGE = "observation.images.left_wrist_0_rgb"
STATE = "observation.state"

# model feature -> the openpi LIBERO key for it
OPENPI_LIBERO_KEYS = {
    BASE_IMAGE: "observation/image",
    WRIST_IMAGE: "observation/wrist_image",
    STATE: "observation/state",
}
PROMPT_KEY = "prompt"


class ObservationError(PisftError):
    """A request whose observation is missing a key or has a wrong shape or type."""


def _find(obs: Mapping[str, Any], feature: str) -> tuple[str, Any]:
    alias = OPENPI_LIBERO_KEYS.get(feature)
    for key in (alias, feature):
        if key is not None and key in obs:
            return key, obs[key]
    names = f"'{alias}' (or '{feature}')" if alias else f"'{feature}'"
    raise ObservationError(f"observation has no {names}; got keys {sorted(map(str, obs))}")


def image_to_tensor(key: str, value: Any) -> torch.Tensor:
    """(H, W, 3) or (3, H, W), uint8 or float in [0, 1] -> float32 (3, H, W) in [0, 1]."""
    arr = np.asarray(value)
    if arr.ndim != 3 or 3 not in (arr.shape[0], arr.shape[-1]):
        raise ObservationError(f"'{key}': expected an image of shape (H, W, 3) or (3, H, W), "
                               f"got shape {arr.shape}")
    if arr.dtype == np.uint8:
        img = arr.astype(np.float32) / 255.0
    elif arr.dtype.kind == "f":
        img = arr.astype(np.float32)
        if not np.isfinite(img).all() or img.min() < 0.0 or img.max() > 1.0:
            raise ObservationError(f"'{key}': a float image must have values in [0, 1]")
    else:
        raise ObservationError(f"'{key}': expected uint8 or float pixels, got dtype {arr.dtype}")
    if arr.shape[-1] == 3:  # HWC (what openpi sends); a shape like (3, W, 3) is read as HWC too
        img = img.transpose(2, 0, 1)
    if min(img.shape[1:]) < 1:
        raise ObservationError(f"'{key}': empty image of shape {arr.shape}")
    return torch.from_numpy(np.ascontiguousarray(img))


def state_to_tensor(key: str, value: Any, state_dim: int) -> torch.Tensor:
    arr = np.asarray(value)
    if arr.dtype.kind not in "fiu" or arr.shape != (state_dim,):
        raise ObservationError(f"'{key}': expected {state_dim} numbers (shape ({state_dim},)), "
                               f"got shape {arr.shape} of dtype {arr.dtype}")
    arr = arr.astype(np.float32)
    if not np.isfinite(arr).all():
        raise ObservationError(f"'{key}': state has NaN or infinite values")
    return torch.from_numpy(arr)


def prompt_of(obs: Mapping[str, Any]) -> str:
    for key in (PROMPT_KEY, "task"):
        if key in obs:
            value = obs[key]
            if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "SU":
                value = value.item()
            if isinstance(value, bytes):
                value = value.decode("utf-8", errors="replace")
            if not isinstance(value, str) or not value.strip():
                raise ObservationError(f"'{key}': expected a non-empty task instruction string")
            return value
    raise ObservationError(f"observation has no '{PROMPT_KEY}' (the task instruction); "
                           f"got keys {sorted(map(str, obs))}")


def to_batch(obs: Any, *, image_features: list[str], state_dim: int) -> dict[str, Any]:
    """One observation -> a batch of one, in the dataset's layout (what the preprocessor takes)."""
    if not isinstance(obs, Mapping):
        raise ObservationError(f"an observation must be a map of keys to values, got {type(obs).__name__}")
    batch: dict[str, Any] = {}
    for feature in image_features:
        key, value = _find(obs, feature)
        batch[feature] = image_to_tensor(key, value)[None]
    key, value = _find(obs, STATE)
    batch[STATE] = state_to_tensor(key, value, state_dim)[None]
    batch["task"] = [prompt_of(obs)]
    return batch
