"""Shared helpers for the model tests (tests/test_model_*.py)."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
import torch

from pisft.bench import closed_loop_bench

CAMERAS = ("observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb")


def fake_stats() -> dict[str, dict[str, np.ndarray]]:
    return closed_loop_bench.tiny_stats()


def fake_batch(batch_size: int = 4, chunk: int = 10, seed: int = 0) -> dict:
    """A collated batch as pisft.data.dataset yields it (two 64x64 cameras, state 8, chunk x 7)."""
    g = torch.Generator().manual_seed(seed)
    batch = {key: torch.rand(batch_size, 3, 64, 64, generator=g) for key in CAMERAS}
    batch["observation.state"] = torch.randn(batch_size, 8, generator=g)
    batch["action"] = torch.randn(batch_size, chunk, 7, generator=g) * 0.5
    batch["action_is_pad"] = torch.zeros(batch_size, chunk, dtype=torch.bool)
    batch["task"] = ["put both moka pots on the stove", "turn on the stove and put the moka pot on it",
                     "pick up the book and place it in the back compartment of the caddy",
                     "put the black bowl in the bottom drawer of the cabinet and close it\nAdvantage: positive",
                     ][:batch_size] * (batch_size // 4 + 1)
    batch["task"] = batch["task"][:batch_size]
    return batch


@functools.lru_cache(maxsize=None)
def _tiny_model_dir_cached(root: str, trained_like: bool = False) -> str:
    name = "tiny_model_trained_like" if trained_like else "tiny_model"
    return str(closed_loop_bench.write_tiny_model(Path(root, name), trained_like=trained_like))


def tiny_model_dir(tmp_path_factory, dest: Path | None = None) -> Path:
    """A saved tiny model (seed 0, with stats); copied to `dest` if given (safe to modify)."""
    base = Path(_tiny_model_dir_cached(str(tmp_path_factory.getbasetemp() / "model_cache")))
    if dest is None:
        return base
    shutil.copytree(base, dest)
    return dest


def trained_like_model_dir(tmp_path_factory) -> Path:
    """The tiny model with its zero-initialised parameters filled, as training leaves them
    (`closed_loop_bench.fill_zero_parameters`): its actions follow the rows of a forward, as a
    trained model's do (the random tiny model's never show it); built once per session."""
    return Path(_tiny_model_dir_cached(str(tmp_path_factory.getbasetemp() / "model_cache"), True))
