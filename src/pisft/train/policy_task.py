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
from torch.utils.data import default_collate

from pisft.model.registry import spec_of
from pisft.train.batches import RAND_KEY

TOKENS_KEY = "observation.language.tokens"
PREPARED_KEY = "_pisft_host_prepared"  # set by host_prepare: only the device copies are left


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


class HostCollate:
    """collate_fn of the training data loader: default_collate, then the preprocessor without
    its device step; the per-sample random draws pass through untouched."""

    def __init__(self, host_pipeline: Any) -> None:
        self.host_pipeline = host_pipeline

    def host_prepare(self, batch: dict[str, Any]) -> dict[str, Any]:
        out = dict(self.host_pipeline(batch))
        out[PREPARED_KEY] = True
        return out

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        batch = default_collate(items)
        rand = batch.pop(RAND_KEY, None)
        batch = self.host_prepare(batch)
        if rand is not None:
            batch[RAND_KEY] = rand
        return batch


class PolicyTask:
    def __init__(self, policy: nn.Module, preprocessor: Any, device: torch.device,
                 precision: str = "fp32") -> None:
        cfg = policy.config
        self.autocast = precision == "bf16"
        self.policy = policy
        self.spec = spec_of(policy)
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
        self._collate: HostCollate | None = None
        self._device_step: Any = None  # the preprocessor's last step alone (LeRobot's device copies)
        self.image_keys = frozenset(cfg.image_features)
        # The frozen-prefix forward (pisft.model.pi05 8.): None = whenever the whole VLM is frozen;
        # False forces the joint forward (the benchmark's before/after comparison).
        self.frozen_prefix: bool | None = None
        self.spec.non_blocking_transfers(preprocessor)

    def draw(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        noise = rng.standard_normal((self.chunk, self.action_dim), dtype=np.float32)
        time = np.float32(rng.beta(self.alpha, self.beta) * self.scale + self.offset)
        return {"noise": noise, "time": np.asarray(time, dtype=np.float32)}

    def host_prepare(self, batch: dict[str, Any]) -> dict[str, Any]:
        """LeRobot's preprocessing of a collated batch on the host, up to (not including) its
        device step: normalised state/action, the prompt tokens (which read the state).

        The data loader runs it in its worker processes (`collate`), so the training process
        only moves the prepared tensors to the device (`prepare`)."""
        return self.collate.host_prepare(batch)

    @property
    def collate(self) -> HostCollate:
        """The data loader's collate_fn: stack the samples, then `host_prepare` (in a worker).
        It holds the preprocessor only (not the policy), so a worker gets a small object."""
        if self._collate is None:
            steps = getattr(self.pre, "steps", None)
            if not steps or type(steps[-1]).__name__ != "DeviceProcessorStep":
                raise TypeError("the preprocessor does not end with LeRobot's DeviceProcessorStep; "
                                "LeRobot's pi0.5 pipeline changed underneath?")
            self._collate = HostCollate(self.pre[:-1])
        return self._collate

    def prepare(self, batch: dict[str, Any]) -> dict[str, Any]:
        if batch.pop(PREPARED_KEY, False):  # preprocessed by the data loader: the device step only
            if self._device_step is None:
                self._device_step = self.pre[-1:]
            return self._device_step(batch)
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
                self.spec.training_loss(self.policy, frozen_prefix=self.frozen_prefix), \
                torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = model(batch)  # through __call__: FSDP hooks run; no .item() inside
        return loss.float()

    def flops_per_sample(self, batch: dict[str, Any]) -> float | None:
        tokens = batch.get(TOKENS_KEY)
        if tokens is None:
            return None
        n = int(tokens.shape[1])
        if n not in self._flops:
            self._flops[n] = self.spec.training_flops_per_sample(self.policy, lang_tokens=n)
        return self._flops[n]
