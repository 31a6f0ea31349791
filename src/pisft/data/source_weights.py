"""Each source's share of the training samples: RLinf's weighted mixture of datasets.

RLinf trains on several datasets (`data.train_data_paths`, each with a `weight`, default 1.0)
through `ReCapMixtureDataset` (`rlinf/data/datasets/recap/common.py`, RLinf commit
a3816b596478dcd8a5c69a6ec1468c9519f77b5b; used by `fsdp_cfg_worker.py` for the CFG policy with
`data.balance_dataset_weights`, default true as in `examples/offline_rl/config/cfg_rl_openpi.yaml`,
and by `fsdp_value_sft_worker.py` for the value model with `data.balance_weights`):

- an empty dataset is skipped;
- a dataset's sampling weight is `weight × len(dataset)` with balancing on, `weight` with it
  off, normalised to sum to 1;
- each sample draws its dataset with those probabilities (`rng.choice(..., p=...)`), then a
  frame uniformly in it (`rng.integers(0, len(dataset))`) (`__init__` and `_sample_step`,
  lines 60-147 of that file).

Where pisft differs: the shares are computed in float64 (RLinf holds the weights in float32: the
same shares to about 1e-7); a weight <= 0 is refused by the config check, so RLinf's fallback to
uniform weights for a non-positive sum never applies; RLinf's epoch length (`__len__`, from the
weight-1 datasets) has no counterpart, pisft's runs count optimizer steps (`train.steps`).

pisft's pool is one converted dataset, so convert_recap records each output episode's source
and each source's weight (`SAMPLING_FILE`, with `data.balance_source_weights`); the training
stages read it, and `pisft.train.sampler.StepSampler` draws the global batch of every step by
this rule from (seed, step), the same on any number of processes. `len(dataset)` is the
source's frames in the split the stage trains on. When the probabilities are the frames' own
shares (one source, or balancing on and every weight equal: the default) every frame is equally
likely, and the sampler keeps its seeded permutations (each frame once per epoch, as before).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pisft.errors import DataError
from pisft.stages import CONVERT_RECAP

SAMPLING_FILE = "meta/source_sampling.json"
RULE = ("RLinf ReCapMixtureDataset (rlinf/data/datasets/recap/common.py): P(source) proportional to "
        "weight x training frames (balance_source_weights true) or to weight (false), empty sources "
        "skipped; then a frame uniformly within the source")


def shares(weights: list[float], frames: list[int], balance: bool) -> list[float]:
    """Each source's probability: RLinf's `_dataset_sampling_weights` (an empty source: 0). The
    weights are taken relative to the largest first, so no product overflows (a weight of 1e308
    times a source's frames made every share NaN); a source with frames whose share still comes
    out 0 (weights 1e300 apart) is refused rather than silently never drawn."""
    top = max((w for w, n in zip(weights, frames, strict=True) if n > 0), default=0.0)
    if top <= 0:
        raise DataError("the pool's sources have no training frames; check data.recap_dir and the split")
    raw = [(w / top) * (n if balance else 1) if n > 0 else 0.0 for w, n in zip(weights, frames, strict=True)]
    total = sum(raw)
    out = [r / total for r in raw]
    lost = [i for i, (share, n) in enumerate(zip(out, frames, strict=True)) if n > 0 and share == 0]
    if lost:
        raise DataError(f"data.recap_dir: source(s) {lost} would never be drawn (their weight is "
                        f"{min(weights[i] for i in lost):g} against {top:g}: a share below what a float holds); "
                        "give weights within a sensible ratio of each other, or leave those sources out")
    return out


def uniform_over_frames(weights: list[float], frames: list[int], balance: bool) -> bool:
    """Whether the rule gives every frame the same probability (its shares are the frames')."""
    used = [w for w, n in zip(weights, frames, strict=True) if n > 0]
    return len(used) <= 1 or (balance and len(set(used)) == 1)


@dataclass(frozen=True)
class SourceSampling:
    """What convert_recap records: each output episode's source, each source's weight."""

    balance: bool
    weights: tuple[float, ...]
    episode_source: tuple[int, ...]  # by output episode index

    def write(self, root: Path) -> None:
        (root / SAMPLING_FILE).write_text(json.dumps(
            {"balance_source_weights": self.balance, "weights": list(self.weights),
             "episode_source": list(self.episode_source), "rule": RULE}, indent=1) + "\n")

    @classmethod
    def read(cls, dataset_dir: str | Path) -> SourceSampling | None:
        """The record, or None for a dataset converted before sources had weights (one weight)."""
        path = Path(dataset_dir) / SAMPLING_FILE
        if not path.is_file():
            return None
        from pisft import records

        fields = {"balance_source_weights": bool, "weights": (list, float), "episode_source": (list, int)}
        d = records.read(path, fields, writer=CONVERT_RECAP.name, required=tuple(fields))
        return cls(d["balance_source_weights"], tuple(float(w) for w in d["weights"]), tuple(d["episode_source"]))

    def source_of_rows(self, episode_index: np.ndarray) -> np.ndarray:
        """The source of every row of a split (rows given by their output episode index)."""
        table = np.asarray(self.episode_source, dtype=np.int64)
        episodes = np.asarray(episode_index, dtype=np.int64)
        if len(episodes) and (episodes.min() < 0 or episodes.max() >= len(table)):
            raise DataError(f"{SAMPLING_FILE}: lists {len(table)} episodes, the split has episode "
                            f"{int(episodes.max())}; convert the dataset again (convert_recap)")
        return table[episodes]


def report(sampling: SourceSampling, frames: dict[str, list[int]]) -> dict:
    """The conversion report's `sampling` section: per split the training stages may read,
    each source's frames and expected share of the samples."""
    w, b = list(sampling.weights), sampling.balance
    return {"balance_source_weights": b, "rule": RULE, "weights": w,
            "frames": frames,
            "share": {name: shares(w, n, b) if sum(n) else None for name, n in frames.items()},
            "draw": {name: ("permutation (every frame equally likely)" if uniform_over_frames(w, n, b)
                            else "weighted by source") for name, n in frames.items()}}
