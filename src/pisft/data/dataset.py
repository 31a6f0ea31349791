"""Read the converted dataset (`results/dataset/`) for training and evaluation.

- `load_stats(dataset_dir)`: LeRobot stats (min/max/mean/std/count/q01/q10/q50/q90/q99 per
  feature) as numpy arrays, the `dataset_stats` LeRobot's normalisation processors take.
- `split_episodes(dataset_dir)`: `{"train": [...], "eval": [...]}` episode indices.
- `episode_tasks(dataset_dir)`: episode index -> task instruction (without any advantage suffix).
- `episode_success(dataset_dir)`: episode index -> success (True/False; None when the source
  recorded none), as the conversion report lists them.
- `load_split(dataset_dir, split, chunk_size=...)`: the split's episodes read through LeRobot's
  `LeRobotDataset`; items carry the action chunk (`action` (chunk_size, 7), `action_is_pad`),
  the cameras as float CHW in [0, 1], `observation.state` (8,) and `task` (the prompt): the
  items of a `LeRobotDataset` with `delta_timestamps` for the chunk, tensor for tensor
  (`ActionChunks`, which builds the chunk without decoding every frame's images).

Everything is read from disk; nothing is ever downloaded (a missing file is a DataError).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from pisft.data.libero import REPO_ID
from pisft.errors import DataError
from pisft.layout import SPLIT_FILE
from pisft.stages import CONVERT_RECAP

SPLITS = ("train", "eval")


def _require(dataset_dir: Path, rel: str) -> Path:
    path = Path(dataset_dir) / rel
    if not path.exists():
        raise DataError(f"{path}: missing; {dataset_dir} is not a converted dataset; run the convert_recap "
                        "stage (python -m pisft convert_recap --config FILE)")
    return path


def verify_dataset(dataset_dir: str | Path) -> None:
    """The converted dataset is the one convert_recap wrote (its MANIFEST.json; `pisft.integrity`)."""
    from pisft.integrity import verify_read

    _require(Path(dataset_dir), "meta/info.json")  # not a dataset at all: that message first
    verify_read(dataset_dir, what=f"reading the dataset {dataset_dir}", required=True, stage=CONVERT_RECAP.name)


def load_stats(dataset_dir: str | Path) -> dict[str, dict[str, np.ndarray]]:
    from lerobot.datasets.io_utils import load_stats as lerobot_load_stats

    _require(Path(dataset_dir), "meta/stats.json")
    verify_dataset(dataset_dir)
    stats = lerobot_load_stats(Path(dataset_dir))
    assert stats is not None
    return stats


def split_episodes(dataset_dir: str | Path) -> dict[str, list[int]]:
    from pisft import records

    path = _require(Path(dataset_dir), SPLIT_FILE)
    split = records.read(path, dict.fromkeys(SPLITS, (list, int)), writer=CONVERT_RECAP.name, required=SPLITS)
    return {name: list(split[name]) for name in SPLITS}


def _episodes(dataset_dir: str | Path) -> list[dict]:
    """conversion_report.json's episodes, each field of its type."""
    from pisft import records

    path = _require(Path(dataset_dir), "conversion_report.json")
    report = records.read(path, {"episodes": (list, dict)}, writer=CONVERT_RECAP.name, required=("episodes",))
    return [records.check(e, {"episode_index": int, "task": str, "success": (None, bool)}, path=f"{path} (episodes)",
                          writer=CONVERT_RECAP.name, required=("episode_index", "task")) for e in report["episodes"]]


def episode_tasks(dataset_dir: str | Path) -> dict[int, str]:
    return {e["episode_index"]: e["task"] for e in _episodes(dataset_dir)}


def episode_success(dataset_dir: str | Path) -> dict[int, bool | None]:
    return {e["episode_index"]: e.get("success") for e in _episodes(dataset_dir)}


def outcome_counts(dataset_dir: str | Path, episodes: list[int]) -> dict[str, int]:
    """How many of `episodes` are successes, failures, and of unknown outcome."""
    success = episode_success(dataset_dir)
    values = [success.get(int(e)) for e in episodes]
    return {"episodes": len(values), "successes": sum(v is True for v in values),
            "failures": sum(v is False for v in values), "unknown": sum(v is None for v in values)}


def fps(dataset_dir: str | Path) -> int:
    return int(json.loads(_require(Path(dataset_dir), "meta/info.json").read_text())["fps"])


ALL = "all"  # every episode of the dataset (train and eval)


def load_split(dataset_dir: str | Path, split: str, *, chunk_size: int):
    """A LeRobotDataset over the episodes of `split` ("train", "eval", or "all": both)."""
    if split not in (*SPLITS, ALL):
        raise ValueError(f"split must be one of {(*SPLITS, ALL)}, got {split!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    root = Path(dataset_dir)
    verify_dataset(root)
    for rel in ("meta/info.json", "meta/tasks.parquet", "meta/episodes", "data"):
        _require(root, rel)
    episodes = sorted(sum(split_episodes(root).values(), [])) if split == ALL else split_episodes(root)[split]
    if not episodes:
        raise DataError(f"{root / 'split.json'}: split '{split}' has no episodes; lower/raise data.eval_fraction "
                        "or add episodes")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local root never needs the hub
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    frames = LeRobotDataset(
        repo_id=REPO_ID,
        root=root,
        episodes=episodes,
        video_backend="pyav",  # images are stored as PNG; also skips torchcodec's noisy probe
    )
    return ActionChunks(frames, chunk_size)


class ActionChunks(Dataset):
    """The frames of a `LeRobotDataset`, each with the chunk of the next `chunk_size` actions.

    It gives what `LeRobotDataset(..., delta_timestamps={"action": [k / fps for k < chunk_size]})`
    gives (the test compares every tensor), without its cost: LeRobot 0.6.1 reads a chunk with
    `hf_dataset[key][rows]` on a dataset whose format transform converts whole rows, so every
    one of the chunk's frames has its PNG images decoded and thrown away (2 x chunk_size decodes
    per sample, 100 for pi0.5's 50-action chunk; `dataset_reader._query_hf_dataset`). Here the
    actions of the split are read once into memory (chunk_size x 7 floats per frame, small) and
    only the sample's own frame goes through LeRobot. The padding is LeRobot's
    (`dataset_reader._get_query_indices`): an index past the episode's end repeats its last
    action and is marked in `action_is_pad`.
    """

    def __init__(self, frames: Any, chunk_size: int) -> None:
        self.frames = frames
        self.chunk_size = chunk_size
        columns = frames.hf_dataset.with_format("numpy")
        self.actions = torch.from_numpy(np.ascontiguousarray(columns["action"], dtype=np.float32))
        self.index = np.asarray(columns["index"], dtype=np.int64)  # absolute frame index
        self.episode_index = np.asarray(columns["episode_index"], dtype=np.int64)
        self.frame_index = np.asarray(columns["frame_index"], dtype=np.int64)
        self._row_of = {int(a): r for r, a in enumerate(self.index)}
        self._bounds = {}
        for e in np.unique(self.episode_index).tolist():
            meta = frames.meta.episodes[e]
            self._bounds[e] = (int(meta["dataset_from_index"]), int(meta["dataset_to_index"]))
        for e, (start, end) in self._bounds.items():
            missing = [a for a in range(start, end) if a not in self._row_of]
            if missing:
                raise DataError(f"{frames.root}: episode {e} lacks frames {missing[:5]} of "
                                f"[{start}, {end}) in its data files; convert it again")

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        item = self.frames[idx]
        abs_idx = int(self.index[idx])
        start, end = self._bounds[int(self.episode_index[idx])]
        wanted = np.arange(abs_idx, abs_idx + self.chunk_size)
        rows = [self._row_of[int(a)] for a in np.clip(wanted, start, end - 1)]
        item["action"] = self.actions[rows]
        item["action_is_pad"] = torch.from_numpy((wanted < start) | (wanted >= end))
        return item
