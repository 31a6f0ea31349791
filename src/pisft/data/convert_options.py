"""How one conversion runs (`convert_recap`): the data.* keys it reads (`CONVERSION_KEYS`) and its
`Options`."""

from __future__ import annotations

import dataclasses
from typing import Any

from pisft import device
from pisft.config import CONVERSION, INPUT, DataConfig, PisftConfig, keys_marked, roles_of
from pisft.data.prompts import PromptConditioning


# The data.* keys a conversion reads (`Options.data`); its report's "options" records them. Read off
# the keys' marks (pisft.config): the data keys a change of which reruns the conversion, less the
# input it converts (`data.recap_dir`).
CONVERSION_KEYS = tuple(key.removeprefix("data.") for key in keys_marked(CONVERSION)
                        if key.startswith("data.") and INPUT not in roles_of(key))


class Options:
    """How one conversion runs: the data.* settings it reads (`data`, a `DataConfig`, where those
    keys and their defaults are written, once) and its worker threads (`workers`; 0: every core
    this process may use). Keywords set data keys: `Options(image_size=16)` converts as
    `data.image_size: 16` does."""

    def __init__(self, data: DataConfig | None = None, *, workers: int = 0, **keys: Any) -> None:
        unknown = sorted(set(keys) - set(CONVERSION_KEYS))
        if unknown:
            raise TypeError(f"Options: {unknown} not among the data keys a conversion reads: "
                            f"{', '.join(CONVERSION_KEYS)}")
        self.data = dataclasses.replace(data or DataConfig(), **keys)
        self.workers = workers

    @classmethod
    def from_config(cls, cfg: PisftConfig) -> Options:
        d = cfg.data
        return cls(d, tasks=[str(t) for t in d.tasks], columns=dict(d.columns),
                   # at a RECAP iteration the pool's held-out episodes are the value model's only
                   # (recap.holdout_fraction): the policy trains on every episode of the pool
                   eval_fraction=cfg.recap.holdout_fraction if cfg.iteration else d.eval_fraction)

    def recorded(self) -> dict[str, Any]:
        """The settings the conversion ran with, as its report records them."""
        return {key: getattr(self.data, key) for key in CONVERSION_KEYS}

    @property
    def conditioning(self) -> PromptConditioning:
        return PromptConditioning(advantage_tag=self.data.advantage_tag,
                                  positive_only_conditional=self.data.positive_only_conditional,
                                  unconditional_prob=self.data.unconditional_prob)

    def n_workers(self) -> int:
        if self.workers > 0:
            return self.workers
        return device.usable_cores()
