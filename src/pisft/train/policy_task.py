"""The pi0.5 training task: preprocessing, the flow-matching loss, its per-sample random draws.

LeRobot's `PI05Policy.forward` draws the flow-matching noise and time from the process RNG
(`self.model.sample_noise`, `self.model.sample_time`), so the loss of a sample would depend on
which process and micro-step it lands in. Here the draws are made per sample from
(seed, step, position in the global batch) by the data pipeline, with the same distributions
(standard normal noise; time ~ Beta(alpha, beta) * scale + offset from the policy config), and
handed to the model for the duration of one forward call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from pisft.model.lerobot_internals import set_non_blocking_transfers, sync_free_forward
from pisft.train.flops import pi05_training_flops_per_sample

TOKENS_KEY = "observation.language.tokens"


@contextlib.contextmanager
def injected_flow_samples(core: nn.Module, noise: torch.Tensor, time: torch.Tensor) -> Iterator[None]:
    """Make `core.sample_noise` / `core.sample_time` return the given per-sample draws."""

    def sample_noise(shape, device):
        if tuple(shape) != tuple(noise.shape):
            raise RuntimeError(f"flow-matching noise shape {tuple(shape)} expected, drawn "
                               f"{tuple(noise.shape)}: LeRobot's pi0.5 changed underneath?")
        return noise.to(device=device, dtype=torch.float32)

    def sample_time(bsize, device):
        if bsize != time.shape[0]:
            raise RuntimeError(f"flow-matching time for batch {bsize} expected, drawn {time.shape[0]}")
        return time.to(device=device, dtype=torch.float32)

    core.sample_noise = sample_noise
    core.sample_time = sample_time
    try:
        yield
    finally:
        del core.sample_noise
        del core.sample_time


class PolicyTask:
    def __init__(self, policy: nn.Module, preprocessor: Any, device: torch.device,
                 precision: str = "fp32") -> None:
        cfg = policy.config
        self.autocast = precision == "bf16"
        self.policy = policy
        self.core = policy.model
        self.pre = preprocessor
        self.device = device
        self.chunk = int(cfg.chunk_size)
        self.action_dim = int(cfg.max_action_dim)
        self.alpha = float(cfg.time_sampling_beta_alpha)
        self.beta = float(cfg.time_sampling_beta_beta)
        self.scale = float(cfg.time_sampling_scale)
        self.offset = float(cfg.time_sampling_offset)
        self._flops: dict[int, float] = {}
        self.image_keys = frozenset(cfg.image_features)
        set_non_blocking_transfers(preprocessor)

    def draw(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        noise = rng.standard_normal((self.chunk, self.action_dim), dtype=np.float32)
        time = np.float32(rng.beta(self.alpha, self.beta) * self.scale + self.offset)
        return {"noise": noise, "time": np.asarray(time, dtype=np.float32)}

    def prepare(self, batch: dict[str, Any]) -> dict[str, Any]:
        # Images (the bulk of the bytes; pinned by the data loader on an accelerator) go to the
        # device first, asynchronously; LeRobot's pipeline then normalises state/action and
        # builds the prompt on the host (the prompt reads the state) and moves the rest.
        batch = {k: v.to(self.device, non_blocking=True) if k in self.image_keys else v
                 for k, v in batch.items()}
        batch = self.pre(batch)
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()}

    def loss(self, model: nn.Module, batch: dict[str, Any], rand: dict[str, torch.Tensor]) -> torch.Tensor:
        with injected_flow_samples(self.core, rand["noise"], rand["time"]), \
                sync_free_forward(self.policy), \
                torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = model(batch)  # through __call__: FSDP hooks run; no .item() inside
        return loss.float()

    def flops_per_sample(self, batch: dict[str, Any]) -> float | None:
        tokens = batch.get(TOKENS_KEY)
        if tokens is None:
            return None
        n = int(tokens.shape[1])
        if n not in self._flops:
            self._flops[n] = pi05_training_flops_per_sample(self.policy, lang_tokens=n)
        return self._flops[n]
