"""Feeding the loop: the rank's micro-batches as a DataLoader, with per-sample random draws.

Each item gets the random draws of the objective (e.g. flow-matching noise and time) from
`sample_rng(seed, ref)`, i.e. from (seed, step, position in the global batch): the same numbers
whatever the world size, micro batch or number of data workers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from pisft import device
from pisft.train.sampler import SampleRef, StepSampler, sample_rng

RAND_KEY = "_pisft_rand"
Draw = Callable[[np.random.Generator], dict[str, np.ndarray]]
Prompt = Callable[[str, np.random.Generator], str]
Augment = Callable[[dict[str, Any], np.random.Generator], dict[str, Any]]


class StepDataset(Dataset):
    """Wraps the train set: item(ref) = train_set[ref.index] + its random draws."""

    def __init__(self, base: Dataset, seed: int, draw: Draw | None,
                 prompt: Prompt | None = None, augment: Augment | None = None) -> None:
        self.base = base
        self.seed = seed
        self.draw = draw
        self.prompt = prompt
        self.augment = augment  # data.augment (pisft.data.augment), from a stream of its own

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
                for_frame = getattr(self.prompt, "for_frame", None)  # labels by episode and frame
                item["task"] = for_frame(item, rng) if for_frame else self.prompt(item["task"], rng)
        if self.augment is not None:
            from pisft.data.augment import augment_rng

            item = self.augment(item, augment_rng(self.seed, ref.step, ref.position))
        return item


class _RankBatches:
    def __init__(self, sampler: StepSampler, rank: int, start: int, end: int) -> None:
        self.sampler, self.rank, self.start, self.end = sampler, rank, start, end

    def __iter__(self) -> Iterator[list[SampleRef]]:
        return self.sampler.rank_batches(self.rank, self.start, self.end)

    def __len__(self) -> int:
        return (self.end - self.start) * self.sampler.layout.accum


AUTO_WORKERS = -1  # train.num_workers: choose from the cores (default_workers)
MAX_AUTO_WORKERS = 8


def default_workers(kind: str, nproc_per_node: int, cores: int | None = None) -> int:
    """Data-loader worker processes per training process when train.num_workers is -1.

    On an accelerator the training process only launches work: each gets its share of the
    node's cores minus one (its own), at least 1 and at most MAX_AUTO_WORKERS. On the CPU the
    training processes' threads already use every core; one worker per process still takes
    decoding, collation and preprocessing off the training thread's critical path (it runs
    while the step waits on a collective or runs single-threaded Python) without adding more
    processes competing for the cores than there are batches to prepare.
    """
    cores = device.usable_cores() if cores is None else cores
    if not device.row(kind).accelerator:
        return 1
    share = max(1, cores // max(1, nproc_per_node))
    return max(1, min(MAX_AUTO_WORKERS, share - 1))


def resolve_workers(num_workers: int, kind: str, nproc_per_node: int) -> int:
    if num_workers == AUTO_WORKERS:
        return default_workers(kind, nproc_per_node)
    if num_workers < 0:
        raise ValueError(f"train.num_workers must be -1 (from the cores) or >= 0, got {num_workers}")
    return num_workers


def make_loader(train_set: Dataset, sampler: StepSampler, *, rank: int, start_step: int,
                end_step: int, seed: int, draw: Draw | None, num_workers: int,
                prompt: Prompt | None = None,
                collate: Callable[[list[dict]], dict] | None = None,
                pin_memory: bool = False, prefetch_factor: int = 4,
                augment: Augment | None = None) -> DataLoader:
    """The rank's micro-batches, in order, from start_step to end_step.

    With `num_workers` > 0 each worker reads, decodes, collates and (through `collate`, e.g.
    PolicyTask.collate) preprocesses whole micro-batches; `prefetch_factor` batches per worker
    are prepared ahead, and the DataLoader hands them out in sampler order whatever worker
    finished first, so the order (and every sample's random draws, from (seed, step,
    position)) does not depend on the number of workers. `pin_memory` (on an accelerator)
    puts the batches in page-locked memory, from which the non-blocking host->device copies
    are asynchronous. `augment` (data.augment) changes each sample's images with parameters
    drawn from (seed, step, position) too: training only.
    """
    if num_workers > 0:
        # The tokenizer runs in the workers (forked): its own thread pool off, no fork warning.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if prefetch_factor < 1:
        raise ValueError(f"train.prefetch_factor must be >= 1, got {prefetch_factor}")
    return DataLoader(
        StepDataset(train_set, seed, draw, prompt, augment),
        batch_sampler=_RankBatches(sampler, rank, start_step, end_step),
        num_workers=num_workers,
        collate_fn=collate or default_collate,
        pin_memory=pin_memory,
        persistent_workers=False,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )


def split_rand(batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    rand = batch.pop(RAND_KEY, {})
    return batch, rand
