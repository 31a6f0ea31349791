"""The estimate's simulated step: one steady-state training step of rank 0 of W on fake tensors,
and its peak memory by category (`simulate_step`; pisft.introspect.estimate says how and what each
category holds).

With it: the policy to simulate built in a trainable mode (`with_mode`), whether the training
keeps an EMA (`ema_enabled`), a process group of W fake ranks (`fake_world`), a policy's tensors
made fake (`to_fake`) and pisft's FSDP units of a policy (`fsdp_plan`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pisft.config import PisftConfig
from pisft.introspect.step_memory import StepMemory
from pisft.tensors import local_bytes, local_numel, optimizer_state

GIB = 1 << 30
CATEGORIES = ("params", "optimizer", "grads", "gathered", "activations", "ema")


def to_fake(policy, fake_mode) -> None:
    """Replace every parameter and buffer (meta) by a fake CPU tensor; ties are kept."""
    params: dict[int, torch.nn.Parameter] = {}
    for module in policy.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in params:
                with fake_mode:
                    params[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="cpu"),
                                                       requires_grad=p.requires_grad)
            module._parameters[name] = params[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                with fake_mode:
                    module._buffers[name] = torch.empty_like(b, device="cpu")
    policy.config.device = "cpu"


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[Any]:
    """A default process group of `world_size` fake ranks (this process is rank 0) and its mesh."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the memory simulation needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def simulate_step(make_policy: Callable[[], Any], *, world_size: int, micro_batch: int,
                  precision: str, checkpointing: bool, min_unit_params: int = 0,
                  ema: bool = False) -> dict[str, Any]:
    """One steady-state training step of rank 0 of `world_size`, on fake tensors: peak bytes.

    `make_policy()` returns a PI05Policy on the meta device. Returns the per-category bytes at
    the peak (`bytes`), the peak above the pre-step memory (`step_peak_bytes`, comparable to
    `pisft.introspect.measure`), the model state, the FSDP plan and where the peak happened.
    `min_unit_params`: the FSDP units' floor (`pisft.train.fsdp.merge_small_units`; 0: layer units).
    `ema`: an exponential moving average of the trained parameters is kept (train.ema_decay): one
    fp32 copy of each trained parameter's shard, held throughout (category `ema`).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pisft.model.registry import spec_of

    policy = make_policy()
    spec_of(policy).prepare_for_training(policy, checkpointing=checkpointing)
    plan = fsdp_plan(policy, min_unit_params)
    sequence = {"prefix_tokens": spec_of(policy).prefix_tokens(policy), "suffix_tokens": int(policy.config.chunk_size)}
    params_total = sum(p.numel() for p in policy.parameters())
    params_bf16 = sum(p.numel() for p in policy.parameters() if p.dtype == torch.bfloat16)  # hold_frozen_in's
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    to_fake(policy, fake)
    with fake_world(world_size) as mesh, fake:
        step = _tracked_step(policy, mesh, micro_batch, precision, min_unit_params)
    tracker = step.pop("tracker")
    step_peak, live, phase = tracker.peak(held=step["opt_ids"])
    at_peak = _at_peak(tracker, live, step)
    at_peak["ema"] = step["ema_bytes"] if ema else 0
    return {
        "params_total": params_total,
        "params_bf16": params_bf16,
        "params_trained": step["params_trained"],
        "bytes": at_peak | {"total": sum(at_peak.values())},
        "step_peak_bytes": step_peak,
        "state_bytes": {"params": step["params_bytes"], "grads": step["grads_bytes"],
                        "optimizer": step["opt_bytes"], "ema": at_peak["ema"]},
        "peak_phase": phase,
        "fsdp": plan,
        "sequence": sequence,
    }


def _tracked_step(policy, mesh, micro_batch: int, precision: str,
                  min_unit_params: int = 0) -> dict[str, Any]:
    """Shard, then forward, backward, clip, AdamW and zero_grad under a StepMemory tracker.

    Returns the tracker and what the attribution needs: the allocation ids of the parameters,
    the gradients and the optimizer state, and their bytes.
    """
    from pisft.train import fsdp, optim
    from pisft.model.registry import spec_of
    from pisft.train.policy_task import PolicyTask
    from pisft.introspect.synthetic import synthetic_batch

    cpu = torch.device("cpu")
    fsdp.shard(policy, mesh, precision, min_params=min_unit_params)
    # Fused AdamW: the kernel the training takes on CUDA, NPU and CPU (no foreach temporaries).
    optimizer = optim.build_optimizer(policy.parameters(), lr=1e-4, weight_decay=1e-10, fused=True)
    task = PolicyTask(policy, None, cpu, precision)
    batch, rand = synthetic_batch(policy, micro_batch, cpu, seed=0)
    policy.train()
    trainable = [p for p in policy.parameters() if p.requires_grad]
    out: dict[str, Any] = {"params_bytes": local_bytes(policy.parameters()),
                           "ema_bytes": sum(local_numel(p) for p in trainable) * 4}
    tracker = StepMemory()
    out["param_ids"] = tracker.register_existing(policy.parameters())
    with spec_of(policy).fused_attention(), tracker:
        tracker.phase = "forward"
        loss = task.loss(policy, batch, rand)
        tracker.phase = "backward"
        loss.backward()
        grads = [p.grad for p in trainable if p.grad is not None]
        out["grad_ids"] = {tracker.alloc_id(g) for g in grads} - {None}
        out["grads_bytes"] = local_bytes(grads)
        out["params_trained"] = sum(p.numel() for p in trainable if p.grad is not None)
        del grads, loss
        tracker.phase = "clip + optimizer"
        torch.nn.utils.clip_grad_norm_(trainable, 1.0, error_if_nonfinite=False)
        # The first step creates AdamW's moments; in every later step they exist throughout.
        # They are counted as held from the start (steady state), their creation left out.
        optimizer.step()
        state = optimizer_state(optimizer)
        out["opt_ids"] = {tracker.alloc_id(v) for v in state} - {None}
        out["opt_bytes"] = local_bytes(state)
        del state
        optimizer.zero_grad(set_to_none=True)
    return out | {"tracker": tracker}


def _at_peak(tracker: StepMemory, live: dict, step: dict[str, Any]) -> dict[str, int]:
    """The bytes live at the peak, by category (CATEGORIES)."""
    at_peak = dict.fromkeys(CATEGORIES, 0)
    at_peak["params"], at_peak["optimizer"] = step["params_bytes"], step["opt_bytes"]
    for alloc, nbytes in live.items():
        if alloc in step["param_ids"]:
            at_peak["params"] += nbytes
        elif alloc in step["grad_ids"]:
            at_peak["grads"] += nbytes
        elif alloc in tracker.in_fsdp or alloc in tracker.resized:
            at_peak["gathered"] += nbytes
        else:
            at_peak["activations"] += nbytes
    return at_peak


def fsdp_plan(policy, min_unit_params: int = 0) -> dict[str, int]:
    """Units of pisft's FSDP plan: how many, the root's and the largest unit's parameters."""
    from pisft.train.fsdp import choose_units

    units = choose_units(policy, min_unit_params)

    def unit_params(u) -> list:
        modules = getattr(u, "modules", None) or (u.module,)
        return [p for m in modules for p in m.parameters()]

    sizes = [sum(p.numel() for p in unit_params(u)) for u in units]
    in_units = {id(p) for u in units for p in unit_params(u)}
    root = sum(p.numel() for p in policy.parameters() if id(p) not in in_units)
    kept = sum(s for u, s in zip(units, sizes) if not getattr(u, "reshard_after_forward", True))
    return {"units": len(units), "params_root_unit": root, "params_largest_unit": max(sizes, default=0),
            "params_kept_unsharded_until_backward": kept}


def with_mode(make: Callable[[], Any], mode: str, spec: Any, precision: str, seed: int = 0) -> Callable[[], Any]:
    """`make` with the trainable mode applied as the training applies it
    (`pisft.train.trainable.apply_training_layout`)."""
    from pisft.train import trainable

    def build():
        policy = make()
        trainable.apply_training_layout(policy, mode, spec, precision=precision, seed=seed)
        return policy
    return build


def ema_enabled(cfg: PisftConfig) -> bool:
    """Whether the training keeps an EMA of the trained parameters (train.ema_decay, when the
    config has that key and sets it)."""
    return bool(getattr(cfg.train, "ema_decay", None))

