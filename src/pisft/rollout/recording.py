"""Record the executed steps of a rollout episode, as RLinf's collector keeps them, in a worker.

One frame per executed policy step (the wait steps are not recorded): the observation the
step was taken from and the action executed from it, as RLinf's LIBERO collector pairs them
(`rlinf/envs/wrappers/collect_episode.py`, `_buffer_to_lerobot_ep`: observation i, starting
with the one after reset, with action i). The observation is kept as RLinf's LIBERO
environment hands it to the collector (`rlinf/envs/libero/libero_env.py`,
`_extract_image_and_state`; `rlinf/envs/libero/utils.py`, `get_libero_image`): both cameras at
render resolution, rotated 180° (the orientation of openpi's LIBERO training data,
`examples/libero/main.py`), and the 8-dim state (end-effector position, axis-angle, gripper
joints).

The recorder writes as it goes, so a 520-step episode never sits in a worker's memory: each
camera's frames are appended as raw uint8 to a file of its own under the episode's folder, and
`steps.npz` (state, actions, outcome, image shapes) is written when the episode ends; an
episode that ends in an error leaves no `steps.npz`. `read` maps the frames back.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

CAMERAS = ("image", "wrist_image")  # RLinf's names: agent view, wrist camera
STEPS_FILE = "steps.npz"


class EpisodeRecorder:
    """`folder`: the episode's, made here inside its parent, which the stage made: a parent gone
    (the temporary output of a killed stage, removed by its rerun) is not made again."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(exist_ok=True)
        self._files = {cam: open(self.folder / f"{cam}.u8", "wb") for cam in CAMERAS}  # noqa: SIM115
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._state: list[np.ndarray] = []
        self._actions: list[np.ndarray] = []

    @property
    def steps(self) -> int:
        return len(self._actions)

    def add(self, image: np.ndarray, wrist_image: np.ndarray, state: np.ndarray, action: np.ndarray) -> None:
        """One executed step: the observation it was taken from and the action executed."""
        for cam, img in zip(CAMERAS, (image, wrist_image), strict=True):
            img = np.ascontiguousarray(img, dtype=np.uint8)
            shape = self._shapes.setdefault(cam, img.shape)
            if img.shape != shape:
                raise ValueError(f"{cam}: frame of shape {img.shape} after frames of {shape}")
            self._files[cam].write(img.tobytes())
        self._state.append(np.asarray(state, dtype=np.float32).reshape(-1))
        self._actions.append(np.asarray(action, dtype=np.float32).reshape(-1))

    def _close_files(self) -> None:
        for fh in self._files.values():
            fh.close()

    def close(self, success: bool) -> int:
        """End the episode with its outcome; returns the number of frames recorded."""
        self._close_files()
        n = self.steps
        tmp = self.folder / f".{STEPS_FILE}"
        with open(tmp, "wb") as fh:
            np.savez(fh, state=np.asarray(self._state, dtype=np.float32).reshape(n, -1),
                     actions=np.asarray(self._actions, dtype=np.float32).reshape(n, -1),
                     success=np.asarray(bool(success)),
                     **{f"{cam}_shape": np.asarray(self._shapes.get(cam, (0, 0, 3))) for cam in CAMERAS})
        tmp.rename(self.folder / STEPS_FILE)
        return n

    def discard(self) -> None:
        """The episode failed to run: nothing of it is kept."""
        self._close_files()
        shutil.rmtree(self.folder, ignore_errors=True)


def read(folder: str | Path) -> dict[str, np.ndarray]:
    """A finished recording: `state` (T, 8) and `actions` (T, 7) float32, `success` (bool),
    and each camera as (T, H, W, 3) uint8 (memory-mapped from its file)."""
    folder = Path(folder)
    with np.load(folder / STEPS_FILE) as z:
        out = {"state": z["state"], "actions": z["actions"], "success": bool(z["success"])}
        shapes = {cam: tuple(int(x) for x in z[f"{cam}_shape"]) for cam in CAMERAS}
    n = len(out["actions"])
    for cam in CAMERAS:
        path = folder / f"{cam}.u8"
        if n == 0:
            out[cam] = np.zeros((0, *shapes[cam]), dtype=np.uint8)
            continue
        expected = n * int(np.prod(shapes[cam]))
        if path.stat().st_size != expected:
            raise ValueError(f"{path}: {path.stat().st_size} bytes, {n} frames of {shapes[cam]} need {expected}")
        out[cam] = np.memmap(path, dtype=np.uint8, mode="r", shape=(n, *shapes[cam]))
    return out
