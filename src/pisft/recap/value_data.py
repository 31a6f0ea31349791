"""What the value model reads: the pool's returns, the value targets, the frames and prompts.

- `read_returns(dataset_dir)`: `returns.parquet` of the converted pool (written by the RECAP
  loop's returns step, RLinf's `compute_returns`: episode_index, frame_index, return, reward),
  checked against the dataset: one row per frame of every episode, finite values;
- `ReturnRange`: the minimum and maximum return over every frame of the pool (both splits),
  the scale of the value target (`rlinf_recap.value_target`) and of the advantage's reward sum;
- `episode_source_types(dataset_dir)`: episode -> `sft` | `rollout` (conversion_report.json);
- `ValueFrames`: the frames of one split as the value model reads them (the cameras, the plain
  task text, the normalised return);
- `PromptCollate`: the data loader's collate_fn: stack, then tokenise the plain task text as
  LeRobot tokenises pi0.5's prompt (the model's tokenizer, its max length, right padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, default_collate

from pisft.config import SOURCE_TYPES
from pisft.data import rlinf_recap
from pisft.data.dataset import episode_tasks, load_split
from pisft.data.libero import strip_advantage
from pisft.errors import DataError
from pisft.layout import RETURNS_FILE
from pisft.recap.value_model import TARGET_KEY, TOKEN_MASK_KEY, TOKENS_KEY

RETURNS_COLUMNS = ("episode_index", "frame_index", "return", "reward")
ROW_KEY = "row"  # the frame's row in its split (to put predictions back in order)


@dataclass(frozen=True)
class ReturnRange:
    min: float
    max: float

    @classmethod
    def of(cls, returns: pd.DataFrame) -> ReturnRange:
        values = returns["return"].to_numpy(np.float64)
        return cls(float(values.min()), float(values.max()))

    def target(self, returns: np.ndarray) -> np.ndarray:
        """The value model's target for these returns (return / |min|, clipped to [-1, 0])."""
        return rlinf_recap.value_target(returns, self.min)


def _dataset_frames(dataset_dir: Path) -> pd.DataFrame:
    files = sorted((dataset_dir / "data").rglob("*.parquet"))
    if not files:
        raise DataError(f"{dataset_dir / 'data'}: no data files; {dataset_dir} is not a converted dataset")
    tables = [pq.read_table(f, columns=["episode_index", "frame_index"]).to_pandas() for f in files]
    return pd.concat(tables, ignore_index=True)


def read_returns(dataset_dir: str | Path) -> pd.DataFrame:
    """returns.parquet, sorted by (episode_index, frame_index), checked against the dataset."""
    from pisft.data.dataset import verify_dataset

    dataset_dir = Path(dataset_dir)
    verify_dataset(dataset_dir)
    path = dataset_dir / RETURNS_FILE
    redo = "(the RECAP loop's returns step writes it with the converted pool; run the stages before train_value)"
    if not path.is_file():
        raise DataError(f"{path}: not found {redo}")
    available = set(pq.ParquetFile(path).schema_arrow.names)
    missing = [c for c in RETURNS_COLUMNS if c not in available]
    if missing:
        raise DataError(f"{path}: lacks column(s) {missing}; it must have {list(RETURNS_COLUMNS)} {redo}")
    table = pq.read_table(path, columns=list(RETURNS_COLUMNS)).to_pandas()
    table = table.astype({"episode_index": np.int64, "frame_index": np.int64, "return": np.float64,
                          "reward": np.float64})
    bad = ~np.isfinite(table[["return", "reward"]].to_numpy()).all(axis=1)
    if bad.any():
        first = table[bad].iloc[0]
        raise DataError(f"{path}: {int(bad.sum())} row(s) with a non-finite return or reward (first: episode "
                        f"{int(first.episode_index)}, frame {int(first.frame_index)}) {redo}")
    keys = ["episode_index", "frame_index"]
    dup = table.duplicated(keys)
    if dup.any():
        first = table[dup].iloc[0]
        raise DataError(f"{path}: {int(dup.sum())} duplicated (episode, frame) row(s) (first: episode "
                        f"{int(first.episode_index)}, frame {int(first.frame_index)}) {redo}")
    frames = _dataset_frames(dataset_dir)
    both = frames.merge(table[keys], on=keys, how="outer", indicator=True)
    for side, what in (("left_only", f"frames of {dataset_dir} without a row in {path.name}"),
                       ("right_only", f"rows of {path.name} for frames {dataset_dir} does not have")):
        extra = both[both["_merge"] == side]
        if len(extra):
            first = extra.iloc[0]
            raise DataError(f"{path}: {len(extra)} {what} (first: episode {int(first.episode_index)}, frame "
                            f"{int(first.frame_index)}); it was computed for another dataset {redo}")
    return table.sort_values(keys, kind="stable").reset_index(drop=True)


def episode_source_types(dataset_dir: str | Path) -> dict[int, str]:
    """Episode index -> its source's type (`sft` | `rollout`), as conversion_report.json lists it."""
    import json

    path = Path(dataset_dir) / "conversion_report.json"
    if not path.is_file():
        raise DataError(f"{path}: not found; {dataset_dir} is not a converted dataset")
    out: dict[int, str] = {}
    for entry in json.loads(path.read_text())["episodes"]:
        kind = entry.get("source_type")
        if kind not in SOURCE_TYPES:
            raise DataError(f"{path}: episode {entry.get('episode_index')} has source_type {kind!r}, not one "
                            f"of {', '.join(SOURCE_TYPES)}; convert the pool again with this pisft "
                            "(data.recap_dir lists each source with its type)")
        out[int(entry["episode_index"])] = kind
    return out


class ValueFrames(Dataset):
    """The frames of one split: cameras (float CHW in [0, 1]), the plain task text, the target."""

    def __init__(self, dataset_dir: str | Path, split: str, returns: pd.DataFrame, scale: ReturnRange,
                 image_keys: tuple[str, ...]) -> None:
        chunks = load_split(dataset_dir, split, chunk_size=1)  # the split's frames, LeRobot's reader
        self.frames = chunks.frames
        self.image_keys = image_keys
        self.episode_index = chunks.episode_index
        self.frame_index = chunks.frame_index
        rows = pd.DataFrame({"episode_index": self.episode_index, "frame_index": self.frame_index})
        joined = rows.merge(returns, on=["episode_index", "frame_index"], how="left")
        self.returns = joined["return"].to_numpy(np.float64)
        self.rewards = joined["reward"].to_numpy(np.float64)
        self.target = scale.target(self.returns).astype(np.float32)
        tasks = episode_tasks(dataset_dir)
        self.task = [strip_advantage(tasks[int(e)]) for e in self.episode_index]

    def __len__(self) -> int:
        return len(self.episode_index)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        item = self.frames[idx]
        out = {k: item[k] for k in self.image_keys}
        out["task"] = self.task[idx]
        out[TARGET_KEY] = torch.tensor(self.target[idx])
        out[ROW_KEY] = torch.tensor(idx, dtype=torch.int64)
        return out


def clean_task(task: str) -> str:
    """The task text as pi0.5's prompt step cleans it (LeRobot `Pi05PrepareStateTokenizerProcessorStep`)."""
    return task.strip().replace("_", " ").replace("\n", " ")


class PromptCollate:
    """collate_fn: default_collate, then the prompt tokens (in the data loader's workers)."""

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length

    def tokens(self, tasks: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        # As LeRobot's TokenizerProcessorStep for pi0.5 (processor_pi05: max_length
        # tokenizer_max_length, padding "max_length", right padding, truncation).
        enc = self.tokenizer([clean_task(t) for t in tasks], max_length=self.max_length, truncation=True,
                             padding="max_length", padding_side="right", return_tensors="pt")
        return enc["input_ids"].long(), enc["attention_mask"].bool()

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        batch = default_collate(items)
        batch[TOKENS_KEY], batch[TOKEN_MASK_KEY] = self.tokens(batch["task"])
        return batch
