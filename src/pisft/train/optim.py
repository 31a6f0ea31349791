"""AdamW and the warmup + cosine learning-rate schedule (openpi's pi05 recipe shape).

lr(k) for optimizer step k (0-based):
  k <  warmup:  lr * (k + 1) / (warmup + 1)                       (linear warmup)
  k >= warmup:  decay_lr + (lr - decay_lr) * (1 + cos(pi * p)) / 2,  p = (k - warmup) / (steps - warmup)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

ADAM_BETAS = (0.9, 0.95)  # openpi
ADAM_EPS = 1e-8


def lr_at(step: int, *, lr: float, warmup_steps: int, decay_lr: float, steps: int) -> float:
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    span = max(1, steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return decay_lr + (lr - decay_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[torch.nn.Parameter] | Iterable[dict], *, lr: float,
                    weight_decay: float, fused: bool) -> torch.optim.AdamW:
    """AdamW over the trainable parameters: one group, or parameter groups (dicts with `params`
    and their own `lr`, as torch takes them; the schedule scales every group's lr alike)."""
    items = list(params)
    if items and isinstance(items[0], dict):
        groups: list = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in items]
        groups = [g for g in groups if g["params"]]  # a group frozen whole (train.trainable) drops out
    else:
        groups = [p for p in items if p.requires_grad]
    kwargs = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                             weight_decay=weight_decay, **kwargs)


def build_scheduler(optimizer: torch.optim.Optimizer, *, lr: float, warmup_steps: int,
                    decay_lr: float, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        return lr_at(step, lr=lr, warmup_steps=warmup_steps, decay_lr=decay_lr, steps=steps) / lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
