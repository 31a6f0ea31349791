"""Parameter count and per-device peak memory of a training step, before any compute is spent.

`python -m pisft estimate [--config FILE] [--json]`, and `estimate_memory(cfg)` for the smoke
stage. Nothing is allocated and nothing is computed: the step runs on fake tensors.

How: the estimate runs pisft's own training step for one device of the configured world size W,
with every tensor a `FakeTensor` (shapes, dtypes and aliasing, no data) and a fake process group
of W ranks (collectives return at once), and follows the bytes of every tensor storage that the
step creates, resizes and frees. The step is the training's, not a model of it:

- the policy with the training structure (`pi05.construction.prepare_for_training`): activation
  checkpointing per joint decoder layer only, the unused action-expert `lm_head` removed;
- FSDP2 sharding through `pisft.train.fsdp.shard` (its units, its mixed-precision policy, its
  reshard-after-forward choices and prefetch), on the W-rank fake group: sharded fp32 master
  parameters, bf16 all-gathered compute copies, fp32 gradient reduce-scatter;
- the loss through `pisft.train.policy_task.PolicyTask` (`torch.autocast` in bf16, so autocast's
  bf16 casts and its fp32 intermediates are there), inside `fused_joint_attention`;
- backward (with the recompute of each checkpointed layer), gradient clipping, fused AdamW,
  `zero_grad(set_to_none=True)`; counted in steady state (AdamW's moments, which the first step
  creates, are held from the start).

Per device, at the moment of the step's peak (bytes; their sum is the peak):
  params       the parameter shards (1/W of every parameter; exact): fp32, the frozen ones
               bf16 under train.precision=bf16
  optimizer    AdamW's exp_avg + exp_avg_sq shards of the trained parameters (exact)
  grads        the fp32 gradient shards already reduce-scattered at the peak
  gathered     FSDP's unsharded compute copies (each unit between its all-gather and its reshard:
               the root and the vision units for the whole forward+backward, a decoder pair and
               the one prefetched), its all-gather and reduce-scatter buffers
  activations  everything else the step holds: saved activations (each checkpointed layer's
               inputs, the vision tower's activations), one layer's recompute, autocast's casts
               and fp32 intermediates, backward temporaries and the unsharded bf16 gradients
               waiting for their reduce-scatter, the input batch
  ema          with train.ema_decay set: the fp32 moving average of the trained parameters' shards

The trainable mode (`train.trainable`, pisft.train.trainable) is applied to the simulated policy
as the training applies it (`apply_mode`, then `hold_frozen_in`: frozen parameters in bf16 under
train.precision=bf16): frozen parameters have no gradient, no optimizer state and no EMA copy,
and with the whole VLM frozen (`expert`) the prefix runs without grad, its activations freed
layer by layer (pisft.model.pi05 8.). `largest_micro_batches` (printed by `pisft estimate` for
pi0.5) finds, per mode and checkpointing on/off, the largest micro batch whose estimate fits a
device's memory less the smoke gate's headroom.
`state_bytes` gives the whole model state (params, all gradient shards, optimizer).

What the estimate is not: a device's reserved memory (the caching allocator holds more than the
tensors), collective-library buffers, kernel workspaces and the runtime context. docs/memory.md
says what each adds and how npu-smi's figure relates to this one. The simulated tensors are CPU
tensors, so ops run CPU's kernel choices (attention: the CPU flash kernel; on CUDA/NPU the fused
kernels save the same output + log-sum-exp) and CPU autocast's op lists; the differences are
listed in docs/memory.md. Checked against a measured CPU step within 15% at two sizes
(tests/test_train_estimate.py, `python -m pisft.introspect.measure`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pisft import layout
from pisft.config import PisftConfig
from pisft.introspect import estimate_cache
from pisft.model import policy as policy_mod
from pisft.tensors import local_bytes, local_numel, local_shard, optimizer_state

GIB = 1 << 30
CATEGORIES = ("params", "optimizer", "grads", "gathered", "activations", "ema")
# A storage created from inside these torch files is an FSDP collective buffer (all-gather
# input/output, reduce-scatter input/output): torch/distributed/fsdp/_fully_shard/.
_FSDP_FILES = ("_fsdp_collectives.py",)


class StepMemory(TorchDispatchMode):
    """Follows the bytes of tensor storages: created (op outputs), resized, freed.

    Storages that exist before the mode is entered are the baseline. Each allocation gets an id
    and every change is an event (allocation id, delta bytes, phase); `peak()` replays them.
    `UntypedStorage.resize_` is not an operator (FSDP2 frees and re-allocates its unsharded
    parameters with it), so it is wrapped while the mode is active.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current: dict[int, tuple[int, int]] = {}  # storage key -> (allocation id, bytes)
        self.events: list[tuple[int, int, str]] = []  # (allocation id, delta bytes, phase)
        self.phase = "step"
        self.in_fsdp: set[int] = set()  # allocation ids created by FSDP's collective code
        self.resized: set[int] = set()  # allocation ids whose storage FSDP resized
        self._next = 0
        self._orig_resize = torch.UntypedStorage.resize_

    # -- bookkeeping ---------------------------------------------------------------------------
    def _record(self, alloc: int, delta: int) -> None:
        if delta:
            self.events.append((alloc, delta, self.phase))

    def _free(self, key: int, alloc: int) -> None:
        entry = self.current.get(key)
        if entry is not None and entry[0] == alloc:
            del self.current[key]
            self._record(alloc, -entry[1])

    def _new(self, storage: torch.UntypedStorage, nbytes: int | None = None) -> int:
        self._next += 1
        alloc = self._next
        key = storage._cdata
        self.current[key] = (alloc, storage.nbytes() if nbytes is None else nbytes)
        weakref.finalize(storage, self._free, key, alloc)
        return alloc

    def register_existing(self, tensors) -> set[int]:
        """Storages that exist already (in the baseline, not events); their allocation ids."""
        out = set()
        for t in tensors:
            storage = local_shard(t).untyped_storage()
            key = storage._cdata
            if key not in self.current:
                self._new(storage)
            out.add(self.current[key][0])
        return out

    def alloc_id(self, t: torch.Tensor) -> int | None:
        entry = self.current.get(local_shard(t).untyped_storage()._cdata)
        return entry[0] if entry else None

    def peak(self, held: set[int] = frozenset()) -> tuple[int, dict[int, int], str | None]:
        """(peak bytes above the baseline, {allocation id: bytes} live then, phase), counting the
        allocations in `held` as held before the step (their events are left out)."""
        level = best = 0
        best_index, phase = -1, None
        for i, (alloc, delta, ph) in enumerate(self.events):
            if alloc in held:
                continue
            level += delta
            if level > best:
                best, best_index, phase = level, i, ph
        live: dict[int, int] = {}
        for alloc, delta, _ in self.events[: best_index + 1]:
            if alloc not in held:
                live[alloc] = live.get(alloc, 0) + delta
        return best, {a: b for a, b in live.items() if b}, phase

    # -- interception --------------------------------------------------------------------------
    def __enter__(self):
        tracker, orig = self, self._orig_resize

        def resize_(storage, size):
            key = storage._cdata
            before = storage.nbytes()
            result = orig(storage, size)
            entry = tracker.current.get(key)
            if entry is None:  # a storage from before: its old size is in the baseline
                alloc = tracker._new(storage, before)
                entry = tracker.current[key]
            alloc, _ = entry
            tracker.current[key] = (alloc, storage.nbytes())
            tracker.resized.add(alloc)
            tracker._record(alloc, storage.nbytes() - before)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A DTensor's memory is its local tensor's (the wrapper's storage is not memory).
        inputs = {local_shard(t).untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = local_shard(t).untyped_storage()
            key = storage._cdata
            if key in self.current or key in inputs:  # a view, an in-place or out= result
                continue
            alloc = self._new(storage)
            if _called_from_fsdp_collectives():
                self.in_fsdp.add(alloc)
            self._record(alloc, self.current[key][1])
        return out


def _called_from_fsdp_collectives(depth: int = 12) -> bool:
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(_FSDP_FILES):
            return True
        frame = frame.f_back
    return False


# ------------------------------------------------------------------------------------------------
# The simulated step


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


# ------------------------------------------------------------------------------------------------
# The configured run


def _estimate_policy(cfg: PisftConfig) -> tuple[Callable[[], Any], str]:
    """A builder of the policy to estimate, on the meta device: the fetched base model's config
    if present and of the config's preset, else the preset (a base fetched for another preset, e.g.
    the embedded default's tiny one before `--set model.preset=pi05`, is not the model asked about:
    it is named on stderr and left aside)."""
    base = _base_of_preset(cfg)
    if base is not None:
        info = policy_mod.read_model_info(base)

        def make():
            config, _ = policy_mod.read_config(base / policy_mod.CONFIG_FILE)
            return policy_mod.policy_from_config(config, info, device="meta", dtype="float32")
        return make, str(base)
    return (lambda: policy_mod.build_policy(cfg.model.preset, seed=0, device="meta", dtype="float32"),
            f"preset {cfg.model.preset}")


def _base_of_preset(cfg: PisftConfig, *, quiet: bool = False) -> Any:
    """The fetched base model's folder when it holds a model of the config's preset, else None
    (named on stderr unless `quiet` when it holds another preset's)."""
    base = layout.base_model(cfg)
    if not (base / policy_mod.CONFIG_FILE).is_file():
        return None
    info = policy_mod.read_model_info(base)
    if info.get("preset") == cfg.model.preset:
        return base
    if not quiet:
        print(f"estimate: {base} holds a {info.get('preset')} model, the config asks for model.preset "
              f"{cfg.model.preset}: estimating the preset's model (fetch_base makes the config's base)",
              file=sys.stderr)
    return None


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


_ELSEWHERE: dict[tuple[str, int], dict[str, Any]] = {}


def _simulate_elsewhere(cfg: PisftConfig, world: int) -> dict[str, Any]:
    """The estimate from a fresh process (this one has a process group; the simulation needs its
    own). One process computes the asked world size, 1 and the configured one (what the smoke
    stage asks for); the answers are kept for this process, and in pisft.introspect.estimate_cache
    for later ones (read back with this run's model folder as `model`)."""
    from pisft import config as config_mod

    raw = json.dumps(config_mod.to_dict(cfg), sort_keys=True)
    base = _base_of_preset(cfg, quiet=True)
    model_files = [] if base is None else [base / policy_mod.CONFIG_FILE, base / policy_mod.MODEL_INFO_FILE]
    label = f"preset {cfg.model.preset}" if base is None else str(base)
    keys = {w: estimate_cache.key(json.loads(raw), w, model_files, label) for w in sorted({world, 1, cfg.world_size})}
    for w, cache_key in keys.items():  # kept by an earlier smoke run of the same step (estimate_cache)
        if (raw, w) not in _ELSEWHERE and (kept := estimate_cache.read(cache_key)) is not None:
            _ELSEWHERE[(raw, w)] = {**kept, "model": label}
    if (raw, world) not in _ELSEWHERE:
        worlds = list(keys)
        cmd = [sys.executable, "-m", "pisft.introspect.estimate", "--config-json", "-",
               "--world-sizes", ",".join(map(str, worlds))]
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
        out = subprocess.run(cmd, input=raw, capture_output=True, text=True, env=env, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"memory estimate in a subprocess failed: {out.stderr[-2000:]}")
        for w, est in zip(worlds, json.loads(out.stdout.strip().splitlines()[-1]), strict=True):
            _ELSEWHERE[(raw, w)] = est
            estimate_cache.write(keys[w], est)
    return _ELSEWHERE[(raw, world)]


def estimate_memory(cfg: PisftConfig, *, world_size: int | None = None) -> dict[str, Any]:
    """Parameter counts and per-device peak memory (bytes and GiB) of one training step.

    `world_size`: override the configured one (the 1-device smoke run passes 1).
    """
    import torch.distributed as dist

    world = world_size or cfg.world_size
    if dist.is_initialized():
        return _simulate_elsewhere(cfg, world)
    from pisft import device as devices
    from pisft.train.fsdp import min_unit_params

    from pisft.train import trainable

    t = cfg.train
    if "auto" in (t.micro_batch_size, t.activation_checkpointing):
        from pisft.errors import PisftError

        raise PisftError("train.micro_batch_size / train.activation_checkpointing: auto is decided by smoke_1card "
                         "on the device from measured peaks; estimate a given setting (--set "
                         "train.micro_batch_size=N --set train.activation_checkpointing=true|false)")
    make, model_from = _estimate_policy(cfg)
    make = with_mode(make, t.trainable, trainable.spec_for(cfg), t.precision, seed=t.seed)
    kind = devices.resolve_kind("auto") if cfg.device == "auto" else cfg.device
    smallest = min_unit_params(kind, t.fsdp_min_unit_params)
    sim = simulate_step(make, world_size=world, micro_batch=t.micro_batch_size, precision=t.precision,
                        checkpointing=t.activation_checkpointing, min_unit_params=smallest,
                        ema=ema_enabled(cfg))
    return {
        "model": model_from,
        "preset": cfg.model.preset,
        "trainable": t.trainable,
        "ema": ema_enabled(cfg),
        "params_total": sim["params_total"],
        "params_trained": sim["params_trained"],
        "params_untrained": sim["params_total"] - sim["params_trained"],
        "params_bf16": sim["params_bf16"],
        "params_root_unit": sim["fsdp"]["params_root_unit"],
        "params_largest_unit": sim["fsdp"]["params_largest_unit"],
        "fsdp_units": sim["fsdp"]["units"],
        "fsdp_min_unit_params": smallest,
        "world_size": world,
        "micro_batch_size": t.micro_batch_size,
        "precision": t.precision,
        "activation_checkpointing": t.activation_checkpointing,
        "sequence": sim["sequence"],
        "peak_phase": sim["peak_phase"],
        "bytes": {k: int(v) for k, v in sim["bytes"].items()},
        "gib": {k: round(v / GIB, 3) for k, v in sim["bytes"].items()},
        "state_bytes": {k: int(v) for k, v in sim["state_bytes"].items()},
        "step_peak_bytes": int(sim["step_peak_bytes"]),
        "total_bytes": int(sim["bytes"]["total"]),
    }


def _dummy_inputs(config, micro_batch: int, device: str):
    """Inputs of `PI05Pytorch.forward` (images, masks, tokens, actions, noise, time), zeros."""
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


def format_report(est: dict[str, Any]) -> str:
    lines = [
        f"model            {est['model']}",
        f"parameters       {est['params_total'] / 1e6:,.1f} M in the training model, "
        f"{est['params_trained'] / 1e6:,.1f} M receive gradients (train.trainable: {est.get('trainable', 'all')}; "
        f"{est['params_untrained'] / 1e6:,.1f} M are frozen or never reached by pi0.5's loss)",
        f"step             world size {est['world_size']} (FSDP2 full sharding, {est['fsdp_units']} units), "
        f"micro batch {est['micro_batch_size']}, {est['precision']}, activation checkpointing "
        f"{'per decoder layer' if est['activation_checkpointing'] else 'off'}; sequence "
        f"{est['sequence']['prefix_tokens']} prefix + {est['sequence']['suffix_tokens']} action tokens",
        f"per-device peak allocated memory (GiB), at its peak ({est['peak_phase']})",
    ]
    labels = {"params": "param shards (fp32, frozen bf16)" if est.get("params_bf16") else "parameter shards (fp32)",
              "optimizer": "AdamW moment shards (fp32)",
              "grads": "gradient shards (fp32)", "gathered": "FSDP unsharded copies + buffers",
              "activations": "activations + temporaries", "ema": "EMA of trained params (fp32)",
              "total": "total (peak allocated)"}
    for key, label in labels.items():
        if key not in est["gib"] or (key == "ema" and not est.get("ema")):  # ema: only with train.ema_decay
            continue
        lines.append(f"  {label:<32} {est['gib'][key]:>10.3f}")
    lines.append("A device shows more: caching-allocator reserve, HCCL/NCCL buffers, workspaces, "
                 "runtime context (docs/memory.md).")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# The largest micro batch per mode (printed by `pisft estimate` for pi0.5)

MIB = 1 << 20
# Nominal device memory: Ascend 910B (64 GB HBM; npu-smi reports 65536 MB) and an 80 GB GPU
# (A100/H100 80GB). The smoke gate's headroom (smoke.min_memory_headroom) and, on the NPU, HCCL's
# buffers are taken off before a micro batch counts as fitting (as `one_card_gate` does).
FIT_DEVICES = {"910B 64GB": ("npu", 65536 * MIB), "GPU 80GB": ("cuda", 81920 * MIB)}
FIT_PRESET = "pi05"
MAX_FIT_MICRO_BATCH = 1024  # no search above this (reported as ">= 1024")


def _fit_total(raw: str, preset: str, mode: str, checkpointing: bool, micro_batch: int, world: int) -> int:
    """The estimated per-device total of `preset` in `mode` (a worker of `largest_micro_batches`)."""
    from pisft import config as config_mod
    from pisft.train import trainable

    cfg = config_mod.from_dict(json.loads(raw))
    cfg.train.trainable = mode
    t = cfg.train
    make = with_mode(lambda: policy_mod.build_policy(preset, seed=0, device="meta", dtype="float32"),
                     mode, trainable.spec_for(cfg), t.precision, seed=t.seed)
    sim = simulate_step(make, world_size=world, micro_batch=micro_batch, precision=t.precision,
                        checkpointing=checkpointing, ema=ema_enabled(cfg))
    return int(sim["bytes"]["total"])


def config_mod_dict(cfg: PisftConfig) -> dict[str, Any]:
    from pisft import config as config_mod

    return config_mod.to_dict(cfg)


def _limit(kind: str, capacity: int, headroom: float) -> int:
    from pisft.device import hccl_buffer_bytes

    return int(capacity * (1 - headroom)) - hccl_buffer_bytes(kind, env={})


def _search(total_at: Callable[[int], int], known: dict[int, int], limit: int, tries: int = 4) -> tuple[int, bool]:
    """(largest micro batch whose total is <= limit, whether a neighbour above it was seen over the limit).

    The total is affine in the micro batch within one peak phase and convex over all of them (a
    maximum of affine terms): extrapolating the last two points overshoots, interpolating
    between a fitting and a failing point undershoots, so a few simulated steps bracket it."""
    for _ in range(tries):
        fit = [b for b, v in known.items() if v <= limit]
        over = [b for b, v in known.items() if v > limit]
        lo = max(fit, default=0)
        hi = min((b for b in over if b > lo), default=None)
        if lo == 0 or (hi is not None and hi == lo + 1) or lo >= MAX_FIT_MICRO_BATCH:
            break
        if hi is None:
            a, b = sorted(known)[-2:]
            slope = max((known[b] - known[a]) / (b - a), 1.0)
            guess = lo + int((limit - known[lo]) // slope)
            guess = max(guess, lo + 1)
        else:
            slope = (known[hi] - known[lo]) / (hi - lo)
            guess = lo + int((limit - known[lo]) // slope)
            guess = min(max(guess, lo + 1), hi - 1)
        guess = min(guess, MAX_FIT_MICRO_BATCH)
        if guess in known:
            break
        known[guess] = total_at(guess)
    fit = [b for b, v in known.items() if v <= limit]
    lo = max(fit, default=0)
    exact = lo == 0 or (lo + 1) in known or lo >= MAX_FIT_MICRO_BATCH
    return lo, exact


def largest_micro_batches(cfg: PisftConfig, *, world_size: int | None = None,
                          modes: tuple[str, ...] | None = None, preset: str = FIT_PRESET,
                          devices: dict[str, tuple[str, int]] | None = None) -> dict[str, Any]:
    """For `preset` (pi0.5) at `world_size` (default: the configured one): per mode and
    checkpointing on/off, the largest micro batch whose estimated per-device peak fits each of
    `devices` (`FIT_DEVICES`: name -> (kind, bytes)) less the smoke gate's headroom. Two worker
    processes simulate the steps."""
    import concurrent.futures
    import multiprocessing

    from pisft.train.trainable import MODES

    world = world_size or cfg.world_size
    raw = json.dumps(config_mod_dict(cfg), sort_keys=True)
    headroom = cfg.smoke.min_memory_headroom
    devices = devices or FIT_DEVICES
    out: dict[str, Any] = {"preset": preset, "world_size": world, "precision": cfg.train.precision,
                           "headroom": headroom, "ema": ema_enabled(cfg),
                           "devices": {n: c for n, (_, c) in devices.items()},
                           "device_kinds": {n: k for n, (k, _) in devices.items()}, "modes": {}}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=ctx) as pool:
        def totals(jobs):
            futures = {key: pool.submit(_fit_total, raw, preset, key[0], key[1], key[2], world) for key in jobs}
            return {key: f.result() for key, f in futures.items()}

        cases = [(m, ck) for m in (modes or MODES) for ck in (True, False)]
        known = {case: {} for case in cases}
        for (m, ck, b), v in totals([(m, ck, b) for m, ck in cases for b in (1, 8)]).items():
            known[(m, ck)][b] = v
        for case in cases:
            row = {}
            for name, (kind, capacity) in devices.items():
                limit = _limit(kind, capacity, headroom)
                best, exact = _search(lambda b, c=case: totals([(c[0], c[1], b)])[(c[0], c[1], b)],
                                      known[case], limit)
                row[name] = {"micro_batch": best, "exact": exact, "limit_bytes": limit,
                             "total_gib_at_1": round(known[case][1] / GIB, 2),
                             "total_gib_at_best": round(known[case][best] / GIB, 2) if best else None}
            out["modes"].setdefault(case[0], {})["checkpointing" if case[1] else "no_checkpointing"] = row
    return out


def format_fits(fits: dict[str, Any]) -> str:
    from pisft import device as devices

    names = list(fits["devices"])
    buffers = any(devices.row(k).collective_buffer_bytes for k in fits["device_kinds"].values())
    lines = [f"largest micro batch per device, {fits['preset']} at world size {fits['world_size']} "
             f"({fits['precision']}; fits = estimate <= capacity less {fits['headroom']:.0%} headroom"
             f"{' and HCCL buffers on the NPU' if buffers else ''}"
             f"{'; EMA counted' if fits['ema'] else ''}):",
             f"  {'train.trainable':<16}{'checkpointing':<15}" + "".join(f"{n:>14}" for n in names)]
    for mode, rows in fits["modes"].items():
        for key, label in (("checkpointing", "on"), ("no_checkpointing", "off")):
            cells = []
            for n in names:
                cell = rows[key][n]
                b = cell["micro_batch"]
                text = "none" if b == 0 else (f">={b}" if b >= MAX_FIT_MICRO_BATCH else str(b))
                cells.append(f"{text + ('' if cell['exact'] else '?'):>14}")
            lines.append(f"  {mode:<16}{label:<15}" + "".join(cells))
    lines.append("  (?: the search stopped before bracketing it; none: micro batch 1 does not fit)")
    return "\n".join(lines)


def main(cfg: PisftConfig, as_json: bool = False, fits: bool | None = None,
         world_size: int | None = None) -> int:
    """`pisft estimate`: the configured step; and for pi0.5 (by default when model.preset is pi05,
    or with --fits) the largest micro batch of each mode on a 910B and an 80 GB GPU."""
    est = estimate_memory(cfg, world_size=world_size)
    show_fits = cfg.model.preset == FIT_PRESET if fits is None else fits
    table = largest_micro_batches(cfg, world_size=world_size) if show_fits else None
    if as_json:
        print(json.dumps(est | ({"largest_micro_batches": table} if table else {}), indent=2, sort_keys=True))
    else:
        print(format_report(est))
        if table:
            print(format_fits(table))
    return 0


def _subprocess_main(argv: list[str]) -> int:
    import argparse

    from pisft import config as config_mod

    parser = argparse.ArgumentParser(prog="python -m pisft.introspect.estimate",
                                     description="estimate_memory for a config given as JSON (internal)")
    parser.add_argument("--config-json", required=True, help="'-': the config as JSON on stdin")
    parser.add_argument("--world-sizes", required=True, help="comma-separated")
    args = parser.parse_args(argv)
    cfg = config_mod.from_dict(json.loads(sys.stdin.read()))
    worlds = [int(w) for w in args.world_sizes.split(",")]
    print(json.dumps([estimate_memory(cfg, world_size=w) for w in worlds]))
    return 0


if __name__ == "__main__":
    raise SystemExit(_subprocess_main(sys.argv[1:]))
