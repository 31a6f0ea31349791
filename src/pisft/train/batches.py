"""Feeding the loop: the rank's micro-batches as a DataLoader, with per-sample random draws.

Each item gets the random draws of the objective (e.g. flow-matching noise and time) from
`sample_rng(seed, ref)`, i.e. from (seed, step, position in the global batch): the same numbers
whatever the world size, micro batch or number of data workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from pisft.train.sampler import SampleRef, StepSampler, sample_rng

RAND_KEY = "_pisft_rand"
Draw = Callable[[np.random.Generator], dict[str, np.ndarray]]
Prompt = Callable[[str, np.random.Generator], str]


class StepDataset(Dataset):
    """Wraps the train set: item(ref) = train_set[ref.index] + its random draws."""

    def __init__(self, base: Dataset, seed: int, draw: Draw | None,
                 prompt: Prompt | None = None) -> None:
        self.base = base
        self.seed = seed
        self.draw = draw
        self.prompt = prompt

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, ref: SampleRef) -> dict[str, Any]:
        item = dict(self.base[ref.index])
        if self.draw is not None or self.prompt is not None:
            rng = sample_rng(self.seed, ref)
            if self.draw is not None:
                item[RAND_KEY] = {k: torch.from_numpy(np.array(v, copy=True))
                                  for k, v in self.draw(rng).items()}
            if self.prompt is not None:  # after the objective's draws, which stay as they were
                item["task"] = self.prompt(item["task"], rng)
        return item


class _RankBatches:
    def __init__(self, sampler: StepSampler, rank: int, start: int, end: int) -> None:
        self.sampler, self.rank, self.start, self.end = sampler, rank, start, end

    def __iter__(self) -> Iterator[list[SampleRef]]:
        return self.sampler.rank_batches(self.rank, self.start, self.end)

    def __len__(self) -> int:
        return (self.end - self.start) * self.sampler.layout.accum


def make_loader(train_set: Dataset, sampler: StepSampler, *, rank: int, start_step: int,
                end_step: int, seed: int, draw: Draw | None, num_workers: int,
                prompt: Prompt | None = None,
                collate: Callable[[list[dict]], dict] | None = None,
                pin_memory: bool = False) -> DataLoader:
    return DataLoader(
        StepDataset(train_set, seed, draw, prompt),
        batch_sampler=_RankBatches(sampler, rank, start_step, end_step),
        num_workers=num_workers,
        collate_fn=collate or default_collate,
        pin_memory=pin_memory,
        persistent_workers=False,
        prefetch_factor=4 if num_workers > 0 else None,
    )


def split_rand(batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    rand = batch.pop(RAND_KEY, {})
    return batch, rand
