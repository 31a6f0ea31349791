"""Parameter count and per-device memory of a training step, before any compute is spent.

`python -m pisft estimate [--config FILE] [--json]`, and `estimate_memory(cfg)` for the smoke
stage. Nothing is allocated: the model is built on the meta device.

Per device, for FSDP2 full sharding over W = world size devices (pisft.train.fsdp):
  params      fp32 parameters (the optimizer's master copy in bf16 mode too), sharded: 4 B x P / W
  grads       fp32 gradients of the parameters that receive one, sharded: 4 B x P_trained / W
  optimizer   AdamW exp_avg + exp_avg_sq (fp32), sharded: 8 B x P_trained / W
  gathered    unsharded compute copies (2 B in bf16, 4 B in fp32): the root unit's parameters
              for the whole step (FSDP2 does not reshard the root after forward) plus two of the
              largest units (the one computing and the one prefetched), plus the largest
              unsharded gradient awaiting its reduce-scatter (compute copy + fp32 reduce copy)
  activations the peak of live activations and temporaries in one forward+backward at the
              micro batch, measured by running the step on the meta device (with LeRobot's
              gradient checkpointing when train.activation_checkpointing is set)
Gradient accumulation adds no activation memory (one micro batch at a time).
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pisft.config import PisftConfig
from pisft.model import policy as policy_mod

GIB = 1 << 30
ADAM_STATES = 2


class LiveMemory(TorchDispatchMode):
    """Tracks the bytes of every tensor storage created while active: current and peak."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (allocation id, +bytes | -bytes)
        self.live: dict[int, tuple[int, int]] = {}  # storage key -> (allocation id, bytes)
        self._next = 0

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.events.append((entry[0], -entry[1]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.live:
                    self._next += 1
                    self.live[key] = (self._next, storage.nbytes())
                    self.events.append((self._next, storage.nbytes()))
                    weakref.finalize(storage, self._free, key)
        return out

    def allocation_id(self, t: torch.Tensor) -> int | None:
        entry = self.live.get(t.untyped_storage()._cdata)
        return entry[0] if entry else None

    def peak(self, exclude: set[int] = frozenset()) -> int:
        current = peak = 0
        for alloc, delta in self.events:
            if alloc in exclude:
                continue
            current += delta
            peak = max(peak, current)
        return peak


def _dummy_inputs(config, micro_batch: int, device: str):
    res = config.image_resolution[0]
    n_cams = len([k for k in config.input_features if k.startswith("observation.images.")])
    with torch.device(device):
        images = [torch.zeros(micro_batch, 3, res, res) for _ in range(n_cams)]
        img_masks = [torch.ones(micro_batch, dtype=torch.bool) for _ in range(n_cams)]
        tokens = torch.zeros(micro_batch, config.tokenizer_max_length, dtype=torch.long)
        token_mask = torch.ones(micro_batch, config.tokenizer_max_length, dtype=torch.bool)
        actions = torch.zeros(micro_batch, config.chunk_size, config.max_action_dim)
        noise = torch.zeros_like(actions)
        time = torch.full((micro_batch,), 0.5)
    return images, img_masks, tokens, token_mask, actions, noise, time


def step_activations(policy, micro_batch: int, *, checkpointing: bool, device: str = "meta") -> dict[str, Any]:
    """Run one forward+backward of the policy's core; peak activation bytes and trained params.

    Runs on `policy`'s device (meta: nothing allocated). Prompts are padded to
    tokenizer_max_length by the processor, so the sequence lengths here are the real ones.
    """
    core = policy.model
    core.train()
    if checkpointing:
        core.gradient_checkpointing_enable()
    inputs = _dummy_inputs(policy.config, micro_batch, device)
    tracker = LiveMemory()
    with tracker:
        loss = core.forward(*inputs).mean()
        loss.backward()
    grads = {tracker.allocation_id(p.grad) for p in policy.parameters() if p.grad is not None}
    trained = [p for p in policy.parameters() if p.grad is not None]
    result = {
        "activations_bytes": tracker.peak(exclude={g for g in grads if g is not None}),
        "params_trained": sum(p.numel() for p in trained),
        "trained_ids": {id(p) for p in trained},
    }
    for p in policy.parameters():
        p.grad = None
    if checkpointing:
        core.gradient_checkpointing_disable()
    return result


def _estimate_policy(cfg: PisftConfig):
    """The policy to estimate, on the meta device: the fetched base model's config if present."""
    base = cfg.results("base_model")
    dtype = "bfloat16" if cfg.train.precision == "bf16" else "float32"
    if (base / policy_mod.CONFIG_FILE).is_file():
        config, _ = policy_mod.read_config(base / policy_mod.CONFIG_FILE)
        info = policy_mod.read_model_info(base)
        return policy_mod.policy_from_config(config, info, device="meta", dtype=dtype), str(base)
    return policy_mod.build_policy(cfg.model.preset, seed=0, device="meta", dtype=dtype), f"preset {cfg.model.preset}"


def _unit_sizes(policy, trained_ids: set[int]) -> tuple[int, int, int]:
    """(root-unit params, of those the ones that get gradients, largest unit) under pisft's FSDP plan."""
    from pisft.train.fsdp import choose_units

    units = choose_units(policy)
    in_units = {id(p) for u in units for p in u.module.parameters()}
    root = [p for p in policy.parameters() if id(p) not in in_units]
    largest = max((sum(p.numel() for p in u.module.parameters()) for u in units), default=0)
    return (sum(p.numel() for p in root), sum(p.numel() for p in root if id(p) in trained_ids), largest)


def estimate_memory(cfg: PisftConfig, *, world_size: int | None = None) -> dict[str, Any]:
    """Parameter counts and per-device memory (bytes and GiB) of one training step.

    `world_size`: override the configured one (the 1-device smoke run passes 1).
    """
    world = world_size or cfg.world_size
    micro = cfg.train.micro_batch_size
    bf16 = cfg.train.precision == "bf16"
    compute_bytes = 2 if bf16 else 4

    policy, model_from = _estimate_policy(cfg)
    params_total = sum(p.numel() for p in policy.parameters())
    act = step_activations(policy, micro, checkpointing=cfg.train.activation_checkpointing)
    params_trained = act["params_trained"]
    root_params, root_trained, largest_unit = _unit_sizes(policy, act["trained_ids"])

    params_b = 4 * params_total / world
    grads_b = 4 * params_trained / world
    optim_b = 4 * ADAM_STATES * params_trained / world
    largest_grad = max(largest_unit, root_trained)
    gathered_b = (compute_bytes * (root_params + 2 * largest_unit)
                  + (compute_bytes + 4 if bf16 else 4) * largest_grad)
    act_b = act["activations_bytes"]
    parts = {"params": params_b, "grads": grads_b, "optimizer": optim_b,
             "gathered": gathered_b, "activations": act_b}
    total = sum(parts.values())
    return {
        "model": model_from,
        "preset": cfg.model.preset,
        "params_total": params_total,
        "params_trained": params_trained,
        "params_untrained": params_total - params_trained,
        "params_root_unit": root_params,
        "params_largest_unit": largest_unit,
        "world_size": world,
        "micro_batch_size": micro,
        "precision": cfg.train.precision,
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "sequence": {"prefix_tokens": _prefix_tokens(policy), "suffix_tokens": policy.config.chunk_size},
        "bytes": {k: int(v) for k, v in parts.items()} | {"total": int(total)},
        "gib": {k: round(v / GIB, 3) for k, v in parts.items()} | {"total": round(total / GIB, 3)},
        "total_bytes": int(total),
    }


def _prefix_tokens(policy) -> int:
    cfg = policy.config
    vision = policy.model.paligemma_with_expert.paligemma.config.vision_config
    per_image = (cfg.image_resolution[0] // vision.patch_size) ** 2
    n_cams = len([k for k in cfg.input_features if k.startswith("observation.images.")])
    return n_cams * per_image + cfg.tokenizer_max_length


def format_report(est: dict[str, Any]) -> str:
    lines = [
        f"model            {est['model']}",
        f"parameters       {est['params_total'] / 1e6:,.1f} M total, {est['params_trained'] / 1e6:,.1f} M "
        f"receive gradients ({est['params_untrained'] / 1e6:,.1f} M never do in pi0.5's loss)",
        f"step             world size {est['world_size']} (FSDP2 full sharding), micro batch "
        f"{est['micro_batch_size']}, {est['precision']}, activation checkpointing "
        f"{'on' if est['activation_checkpointing'] else 'off'}; sequence "
        f"{est['sequence']['prefix_tokens']} prefix + {est['sequence']['suffix_tokens']} action tokens",
        "per-device memory (GiB)",
    ]
    labels = {"params": "parameters (fp32, sharded)", "grads": "gradients (fp32, sharded)",
              "optimizer": "AdamW state (fp32, sharded)", "gathered": "unsharded compute copies",
              "activations": "activations (peak)", "total": "total"}
    for key, label in labels.items():
        lines.append(f"  {label:<30} {est['gib'][key]:>10.3f}")
    return "\n".join(lines)


def main(cfg: PisftConfig, as_json: bool = False) -> int:
    est = estimate_memory(cfg)
    print(json.dumps(est, indent=2, sort_keys=True) if as_json else format_report(est))
    return 0
