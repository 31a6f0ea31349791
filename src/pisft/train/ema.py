"""An exponential moving average (EMA) of the trained weights (`train.ema_decay`), as openpi keeps one.

openpi (Physical-Intelligence/openpi @ 15a9616, `scripts/train.py`): `init_train_state` sets
`ema_params = params` (the loaded weights, before any step), and `train_step` updates it after
every optimizer step, from the first one, with no warmup and no bias correction:
    ema <- decay * ema + (1 - decay) * new_params
`TrainConfig.ema_decay` defaults to 0.99 and `pi05_libero` sets 0.999 (`src/openpi/training/
config.py`); its checkpoints hand the EMA out as the model's params (`training/checkpoints.py`,
`_split_params`). Here the same, with three choices of pisft's:
- the average covers the parameters that train (`requires_grad`), whatever `train.trainable`
  freezes: a frozen parameter never changes, so its average would be itself;
- it is kept in fp32 and sharded like the parameters: with FSDP2 each rank holds a fp32 copy of
  its own shard of every trained parameter (a DTensor with the parameter's placements, so DCP
  reshards it when a run resumes on another world size), updated shard by shard with no
  collective;
- a step skipped for a non-finite gradient (the loop leaves the parameters untouched) leaves the
  average untouched too, decided on the device (the update's weight is 0), with no host sync.
"""

from __future__ import annotations

import torch
from torch import nn

from pisft.tensors import local_shard


class WeightsEMA:
    """fp32 EMA of a model's trainable parameters (names as `model.named_parameters()`)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = float(decay)
        self._params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        # The starting average is the weights training starts from (openpi: ema_params = params).
        self.shadow = {n: p.detach().to(torch.float32, copy=True) for n, p in self._params.items()}

    @torch.no_grad()
    def update(self, applied: torch.Tensor | None = None) -> None:
        """ema <- decay * ema + (1 - decay) * param, after an optimizer step; `applied` (a device
        bool tensor) False leaves the average as it is (the step was skipped)."""
        weight: float | torch.Tensor = 1.0 - self.decay
        for name, p in self._params.items():
            e, w = local_shard(self.shadow[name]), local_shard(p)
            if applied is not None:
                weight = (1.0 - self.decay) * applied.to(device=e.device, dtype=torch.float32)
            e.lerp_(w.to(torch.float32), weight)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average as DCP saves and loads it (in place): {parameter name: fp32 tensor}."""
        return dict(self.shadow)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Write the average into the model's trainable parameters (for the export: the exported
        model is the average, as openpi's checkpoints are)."""
        params = dict(model.named_parameters())
        for name, e in self.shadow.items():
            p = params[name]
            local_shard(p).copy_(local_shard(e).to(p.dtype))

    def numel_local(self) -> int:
        return sum(local_shard(e).numel() for e in self.shadow.values())


def ema_record(ema: WeightsEMA | None) -> dict:
    """What `pisft_model.json` says of the exported weights (`weights`)."""
    if ema is None:
        return {"kind": "last_step"}
    return {"kind": "ema", "ema_decay": ema.decay}


def make_ema(model: nn.Module, decay: float | None) -> WeightsEMA | None:
    """The run's EMA (`train.ema_decay`), or None when it is off (0 or null)."""
    return WeightsEMA(model, decay) if decay else None
