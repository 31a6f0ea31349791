"""Which samples each optimizer step trains on: a function of (seed, step) only.

The train set is read as an endless stream of seeded permutations (epoch e uses the permutation
seeded by (seed, e)). The global batch of optimizer step k is the stream's positions
[k*G, (k+1)*G). That global batch is cut into `world_size × accum` micro-batches of equal size;
rank r at micro-step a takes micro-batch m = a*world_size + r. Whatever the number of
processes, the union over ranks and micro-steps of step k is the same G samples, so 1 process
and N processes train on the same data in the same order, and a run can resume at step k on a
different number of processes.

A pool of sources with weights (`data.recap_dir`, `pisft.data.source_weights`: RLinf's
ReCapMixtureDataset rule) whose shares differ from the frames' own is drawn instead from a
`SourceMixture`: every position of step k's global batch picks its source with the source's
probability, then a frame uniformly within the source's frames, both from a generator seeded
by (seed, step), so the global batch is again a function of (seed, step) alone. One source, or
equal weights with balancing on (every frame equally likely), keeps the permutations.

Each sample also carries its (step, position in the global batch): the per-sample random draws
of the objective (flow-matching noise and time) are derived from (seed, step, position) too,
never from a process's RNG, so they do not depend on the world size either.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pisft.config import accumulation_steps


@dataclass(frozen=True)
class SampleRef:
    index: int  # index into the train dataset
    step: int  # optimizer step that consumes it
    position: int  # position in that step's global batch, 0..G-1


@dataclass(frozen=True)
class StepLayout:
    global_batch: int
    micro_batch: int
    world_size: int

    def __post_init__(self) -> None:
        per = self.micro_batch * self.world_size
        if self.global_batch % per:
            raise ValueError(
                f"global batch {self.global_batch} not divisible by micro batch × world size = {per}"
            )

    @property
    def accum(self) -> int:
        return accumulation_steps(self.global_batch, self.micro_batch, self.world_size)

    def micro_index(self, rank: int, micro_step: int) -> int:
        return micro_step * self.world_size + rank


MIXTURE_TAG = 0x5A3F  # separates the mixture's draws from the permutations' and the samples'


@dataclass(frozen=True)
class SourceMixture:
    """The train set's rows grouped by source, and each source's probability (RLinf's rule)."""

    groups: tuple[np.ndarray, ...]  # per source, its rows of the train set (may be empty)
    probs: np.ndarray  # per source, the probability a sample comes from it (sums to 1)

    @classmethod
    def of(cls, source_of_row: np.ndarray, weights: list[float], balance: bool) -> SourceMixture | None:
        """The mixture of a train set whose row r comes from source `source_of_row[r]`; None when
        every frame is equally likely (one source, or equal weights balanced by frames)."""
        from pisft.data.source_weights import shares, uniform_over_frames

        rows = np.asarray(source_of_row, dtype=np.int64)
        groups = tuple(np.flatnonzero(rows == n) for n in range(len(weights)))
        frames = [len(g) for g in groups]
        if uniform_over_frames(list(weights), frames, balance):
            return None
        return cls(groups, np.asarray(shares(list(weights), frames, balance), dtype=np.float64))

    def draw(self, seed: int, step: int, size: int) -> list[int]:
        """The rows of one step's global batch: per position a source, then a frame in it."""
        rng = np.random.default_rng([seed, MIXTURE_TAG, step])
        source = rng.choice(len(self.probs), size=size, p=self.probs)
        lengths = np.array([len(g) for g in self.groups], dtype=np.int64)
        offset = rng.integers(0, np.maximum(lengths[source], 1))  # a chosen source has frames
        flat = np.concatenate(self.groups)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        return [int(i) for i in flat[starts[source] + offset]]

    def describe(self) -> str:
        return "; ".join(f"source {n}: {100 * p:.1f}% of the samples from {len(g)} frames"
                         for n, (g, p) in enumerate(zip(self.groups, self.probs, strict=True)))


class StepSampler:
    """Deterministic sample stream over `num_samples` items, keyed by (seed, step)."""

    def __init__(self, num_samples: int, seed: int, layout: StepLayout,
                 mixture: SourceMixture | None = None) -> None:
        if num_samples < 1:
            raise ValueError("the train set is empty")
        if mixture is not None and sum(len(g) for g in mixture.groups) != num_samples:
            raise ValueError(f"the source mixture covers {sum(len(g) for g in mixture.groups)} rows, "
                             f"the train set has {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self.layout = layout
        self.mixture = mixture
        self._perms: dict[int, np.ndarray] = {}
        self._drawn: tuple[int, list[int]] | None = None  # the last step the mixture drew

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            if len(self._perms) > 4:  # keep memory bounded for long runs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def global_batch(self, step: int) -> list[int]:
        g = self.layout.global_batch
        if self.mixture is not None:
            if self._drawn is None or self._drawn[0] != step:
                self._drawn = (step, self.mixture.draw(self.seed, step, g))
            return list(self._drawn[1])
        out = []
        for pos in range(step * g, (step + 1) * g):
            epoch, offset = divmod(pos, self.num_samples)
            out.append(int(self._perm(epoch)[offset]))
        return out

    def micro_batch(self, step: int, rank: int, micro_step: int) -> list[SampleRef]:
        lay = self.layout
        m = lay.micro_index(rank, micro_step)
        start = m * lay.micro_batch
        indices = self.global_batch(step)[start:start + lay.micro_batch]
        return [SampleRef(i, step, start + j) for j, i in enumerate(indices)]

    def rank_batches(self, rank: int, start_step: int, end_step: int) -> Iterator[list[SampleRef]]:
        """The micro-batches of one rank, step by step, from start_step (inclusive)."""
        for step in range(start_step, end_step):
            for a in range(self.layout.accum):
                yield self.micro_batch(step, rank, a)

    def epoch_of(self, step: int) -> float:
        return step * self.layout.global_batch / self.num_samples


def sample_rng(seed: int, ref: SampleRef) -> np.random.Generator:
    """The generator for the per-sample random draws of one sample of one step."""
    return np.random.default_rng([seed, 0x5EED, ref.step, ref.position])
