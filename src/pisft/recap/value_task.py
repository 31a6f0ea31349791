"""The value model as a task of the optimizer-step loop (`pisft.train.loop.Task`).

Like `pisft.train.policy_task.PolicyTask` for the policy: the data loader's workers collate and
tokenise (`collate`), the training process moves the batch to the device (`prepare`) and the
loss is the mean two-hot cross-entropy (`value_model.categorical_loss`), under bf16 autocast
when train.precision is bf16. The objective draws nothing at random (`draw` is None).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pisft.recap.value_data import PromptCollate
from pisft.recap.value_model import TARGET_KEY, categorical_loss


class ValueTask:
    draw = None  # no per-sample random draws

    def __init__(self, collate: PromptCollate, device: torch.device, precision: str = "fp32") -> None:
        self.collate = collate
        self.device = device
        self.autocast = precision == "bf16"

    def prepare(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()}

    def logits(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return model(batch)  # through __call__: FSDP hooks run

    def loss(self, model: nn.Module, batch: dict[str, Any], rand: dict[str, torch.Tensor]) -> torch.Tensor:
        del rand
        return categorical_loss(self.logits(model, batch), batch[TARGET_KEY]).mean()

    def flops_per_sample(self, batch: dict[str, Any]) -> float | None:  # noqa: ARG002 - the Task protocol
        return None  # no FLOP count for the value model: MFU is not reported
