"""Map an openpi LIBERO observation to the model's input batch, checking it on the way.

openpi's LIBERO client (`examples/libero/main.py`) sends, per request:
    observation/image        agent-view camera, (H, W, 3) uint8 (rotated 180°, resized with pad)
    observation/wrist_image  wrist camera, (H, W, 3) uint8
    observation/state        (8,) eef position (3), axis-angle (3), gripper joint positions (2)
    prompt                   the task instruction
These become the pi0.5 LIBERO features `observation.images.base_0_rgb`,
`observation.images.left_wrist_0_rgb`, `observation.state` and `task`. The model's own feature
names are accepted as well. Images may be uint8 in [0, 255] or float in [0, 1], HWC or CHW,
of any size within `Limits` (the model resizes with padding to its own resolution).

Checks come in two passes so that a hostile request costs next to nothing: `check` looks only
at keys, shapes, dtypes, sizes and the prompt's length (no pixel is touched); `to_batch` runs
it first and only then converts pixels. Refused (docs/serving.md): an image with a side
under `MIN_IMAGE_SIDE` or over `Limits.max_image_side`, an image so elongated that the model's
resize-with-pad would shrink one side to nothing (LeRobot's `resize_with_pad_torch` then
fails), and a prompt over `Limits.max_prompt_chars` characters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pisft.errors import PisftError

if TYPE_CHECKING:  # torch is imported when first needed: `serve` binds its port before that
    import torch

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

# A side this short is no camera image (most likely a CHW/HWC mix-up such as (3, 224, 3)).
MIN_IMAGE_SIDE = 16


@dataclass(frozen=True)
class Limits:
    """What one request may hold; `python -m pisft serve` sets them from its options."""

    max_image_side: int = 2048  # pixels, either side (openpi's clients send 224)
    max_prompt_chars: int = 2048  # characters of the task instruction

    def to_dict(self) -> dict:
        return asdict(self)


class ObservationError(PisftError):
    """A request whose observation is missing a key or has a wrong shape, type or size."""


def _find(obs: Mapping[str, Any], feature: str) -> tuple[str, Any]:
    alias = OPENPI_LIBERO_KEYS.get(feature)
    for key in (alias, feature):
        if key is not None and key in obs:
            return key, obs[key]
    names = f"'{alias}' (or '{feature}')" if alias else f"'{feature}'"
    raise ObservationError(f"observation has no {names}; got keys {sorted(map(str, obs))}")


def _image_hw(key: str, arr: np.ndarray) -> tuple[int, int]:
    """(height, width) of an HWC or CHW image array; only its shape is looked at."""
    if arr.ndim != 3 or 3 not in (arr.shape[0], arr.shape[-1]):
        raise ObservationError(f"'{key}': expected an image of shape (H, W, 3) or (3, H, W), "
                               f"got shape {arr.shape}")
    if arr.dtype != np.uint8 and arr.dtype.kind != "f":
        raise ObservationError(f"'{key}': expected uint8 or float pixels, got dtype {arr.dtype}")
    # HWC (what openpi sends) first: a shape like (3, W, 3) is read as HWC
    return (arr.shape[0], arr.shape[1]) if arr.shape[-1] == 3 else (arr.shape[1], arr.shape[2])


def check_image(key: str, value: Any, limits: Limits,
                resolution: tuple[int, int] | None = None) -> np.ndarray:
    """The image as an array, after checking its shape, dtype and size (no pixel is read).

    `resolution`: the model's (height, width); images it could not resize with padding
    (one side would shrink to zero pixels) are refused.
    """
    arr = np.asarray(value)
    h, w = _image_hw(key, arr)
    if min(h, w) < MIN_IMAGE_SIDE:
        raise ObservationError(
            f"'{key}': an image of {h}×{w} pixels (shape {arr.shape}) is too small: each side must "
            f"be at least {MIN_IMAGE_SIDE} pixels. Send the camera image as (H, W, 3) uint8, as "
            f"openpi's LIBERO client does (224×224)")
    if max(h, w) > limits.max_image_side:
        raise ObservationError(
            f"'{key}': an image of {h}×{w} pixels (shape {arr.shape}) is too large: the limit is "
            f"{limits.max_image_side} pixels a side (serve --max-image-side). Resize on the client, "
            f"as openpi's clients do (openpi_client.image_tools.resize_with_pad(img, 224, 224))")
    if resolution is not None:
        th, tw = resolution
        ratio = max(w / tw, h / th)  # the model's resize-with-pad (LeRobot resize_with_pad_torch)
        rh, rw = int(h / ratio), int(w / ratio)
        if min(rh, rw) < 1:
            raise ObservationError(
                f"'{key}': an image of {h}×{w} pixels (shape {arr.shape}) is too elongated for the "
                f"model's {th}×{tw} input: resized with padding it would be {rh}×{rw} pixels. Send "
                f"images whose longer side is at most {max(th, tw)} times the shorter (a camera image, e.g. 224×224)")
    return arr


def image_to_tensor(key: str, value: Any, limits: Limits | None = None,
                    resolution: tuple[int, int] | None = None) -> torch.Tensor:
    """(H, W, 3) or (3, H, W), uint8 or float in [0, 1] -> float32 (3, H, W) in [0, 1]."""
    arr = check_image(key, value, limits or Limits(), resolution)
    if arr.dtype == np.uint8:
        img = arr.astype(np.float32) / 255.0
    else:
        img = arr.astype(np.float32)
        if not np.isfinite(img).all() or img.min() < 0.0 or img.max() > 1.0:
            raise ObservationError(f"'{key}': a float image must have values in [0, 1]")
    if arr.shape[-1] == 3:
        img = img.transpose(2, 0, 1)
    import torch

    return torch.from_numpy(np.ascontiguousarray(img))


def check_state(key: str, value: Any, state_dim: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "fiu" or arr.shape != (state_dim,):
        raise ObservationError(f"'{key}': expected {state_dim} numbers (shape ({state_dim},)), "
                               f"got shape {arr.shape} of dtype {arr.dtype}")
    return arr


def state_to_tensor(key: str, value: Any, state_dim: int) -> torch.Tensor:
    arr = check_state(key, value, state_dim).astype(np.float32)
    if not np.isfinite(arr).all():
        raise ObservationError(f"'{key}': state has NaN or infinite values")
    import torch

    return torch.from_numpy(arr)


def prompt_of(obs: Mapping[str, Any], limits: Limits | None = None) -> str:
    limits = limits or Limits()
    for key in (PROMPT_KEY, "task"):
        if key in obs:
            value = obs[key]
            if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "SU":
                value = value.item()
            if isinstance(value, (str, bytes)) and len(value) > limits.max_prompt_chars:
                # before decoding or any other work: the length on the wire is enough to refuse
                raise ObservationError(
                    f"'{key}': the task instruction has {len(value)} "
                    f"{'characters' if isinstance(value, str) else 'bytes'}; the limit is "
                    f"{limits.max_prompt_chars} (serve --max-prompt-chars). Send the task "
                    f"instruction alone, as openpi's LIBERO client does")
            if isinstance(value, bytes):
                value = value.decode("utf-8", errors="replace")
            if not isinstance(value, str) or not value.strip():
                raise ObservationError(f"'{key}': expected a non-empty task instruction string")
            return value
    raise ObservationError(f"observation has no '{PROMPT_KEY}' (the task instruction); "
                           f"got keys {sorted(map(str, obs))}")


def to_batch(obs: Any, *, image_features: list[str], state_dim: int,
             limits: Limits | None = None,
             image_resolution: tuple[int, int] | None = None) -> dict[str, Any]:
    """One observation -> a batch of one, in the dataset's layout (what the preprocessor takes).

    Every key, shape, size and the prompt's length are checked before any pixel is converted.
    """
    limits = limits or Limits()
    if not isinstance(obs, Mapping):
        raise ObservationError(f"an observation must be a map of keys to values, got {type(obs).__name__}")
    images = {}
    for feature in image_features:
        key, value = _find(obs, feature)
        images[feature] = (key, check_image(key, value, limits, image_resolution))
    state_key, state = _find(obs, STATE)
    check_state(state_key, state, state_dim)
    task = prompt_of(obs, limits)
    batch: dict[str, Any] = {feature: image_to_tensor(key, arr, limits, image_resolution)[None]
                             for feature, (key, arr) in images.items()}
    batch[STATE] = state_to_tensor(state_key, state, state_dim)[None]
    batch["task"] = [task]
    return batch
