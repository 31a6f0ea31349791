"""`train_structure`: what one optimizer step of the real training path does, counted on the CPU.

`python -m pisft bench --only train_structure` (and `make bench`). Two processes (torchrun),
the tiny preset, activation checkpointing on, micro batch 4, gradient accumulation 2, a few
optimizer steps of the code the `train_8card` stage runs: `stage.build` (load, one checkpointing
level, FSDP2 units, AdamW), the attention context of `pisft.train.__main__.run_stage`, `loop.run` with the stage's
settings. The process group is `collective_audit.AuditedProcessGroup` over gloo in counting mode
(HCCL's dtype table checked, not enforced). The first optimizer step (lazy initialisation) is
left out of the per-step figures. Figures are rank 0's (`ranks_agree`: rank 1 counted the same).

- `fsdp_units`: FSDP2 parameter groups, the root's included (it is gathered every forward like
  any unit; a `fully_shard([m1, m2])` group counts once); `fsdp_units_excluding_root` without
  it. `fsdp_units_target` is the issue's bound
  (decoder layer pairs + vision layers + 4).
- `all_gather_per_micro_step`, `reduce_scatter_per_micro_step`: collectives of the all-gather
  family (allgather, _allgather_base, the coalesced forms) and of the reduce-scatter family per
  micro-step, whoever issued them (FSDP2, the loop, DTensor), over the measured steps.
- `float64_collectives`: collectives carrying float64 during the whole training loop.
  `hccl_violations`: collectives (whole process: build, loop) that torch_npu 2.11's HCCL refuses.
- `decoder_layer_forwards_per_micro_step`: forward calls of each decoder layer's q_proj (VLM and
  action-expert layers; forward hooks, so activation-checkpointing recomputes count) per
  micro-step: mean, min, max and per layer.
- `max_unsharded_param_fraction`: the peak, over the measured steps, of the fraction of all
  parameters whose FSDP2 parameter group is in the UNSHARDED state at the same moment
  (`FSDPParamGroup._to_unsharded` / `_to_sharded` / `_to_sharded_post_forward` transitions).
- `host_syncs_per_step`: calls that force a device->host synchronisation on an accelerator
  (`item`, `tolist`, `numpy`, `cpu`, `to(cpu)`, `__float__`/`__int__`/`__bool__`/`__index__`,
  printing) on a tensor that would live on the device, per optimizer step; logging steps
  (every `train.log_every`-th and the last) and the others separately, with call sites. On this
  CPU every tensor is a host tensor, so device residence is modelled by a torch-function mode:
  tensors from the data loader, from factories without the training device, and derived only
  from such tensors are host tensors; `.to(<training device>)` makes a device tensor; parameters,
  buffers, gradients and everything derived from them are device tensors. Calls inside
  `backward()` (autograd hooks) are not seen.
- `tensors_from_python_per_micro_step`: tensors built on the device from Python data
  (`torch.tensor(<list>, device=<device>)`, `torch.as_tensor`): each is a host->device copy from
  pageable memory, which blocks the host on an NPU (torch_npu's `copy_between_host_and_device_opapi`
  synchronises unless the copy is non-blocking). `float64_ops_per_micro_step`: operations whose
  result is a float64 device tensor. Both per micro-step of the steps without a metrics fetch,
  with call sites; both 0 for the training path (LeRobot's own pi0.5 forward makes 2 of the
  first and several of the second: `pisft.model.pi05` 5.). A logging step's fetch (every
  `train.log_every` steps) builds one int64 tensor of per-rank figures from Python numbers right
  before its own device->host transfer, which synchronises anyway: reported apart
  (`tensors_from_python.per_logging_step`, `logging_sites`).
- The layout measured is the ACCELERATOR's, whatever the host: `train.fsdp_min_unit_params` 0,
  the layer units an NPU or GPU trains with (`fsdp.min_unit_params`: floor 0 off the CPU). The
  CPU's own floor (16M parameters) would merge the tiny model into the root unit alone
  (`fsdp_units` 1, `max_unsharded_param_fraction` 1.0), which says nothing about an NPU run.
  `all_gather_bound`: 2 x fsdp_units (one gather in forward, at most one again for backward).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

BACKEND = "pisft_audit"
NPROC = 2
MICRO_BATCH = 4
ACCUM = 2
STEPS = 4
LOG_EVERY = 2
# The device kind whose FSDP layout is measured (its `fsdp.min_unit_params` floor), whatever the host.
LAYOUT_OF = "npu"
HOST_ATTR = "_pisft_host"  # set on tensors that live on the host in the modelled device run


# ---------------------------------------------------------------------------------- host syncs
_SYNC_METHODS = frozenset({"item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__",
                           "__index__", "__repr__", "__format__", "__str__", "__array__"})
_HOST_RESULT = frozenset({"cpu", "numpy"})  # their result is a host tensor
_FROM_PYTHON = frozenset({"tensor", "as_tensor"})  # factories that copy Python data
_SKIP_FRAMES = ("torch/overrides.py", "torch/_tensor.py", "pisft/bench/train_structure.py",
                "torch/utils/_device.py", "torch/_tensor_str.py")


def _tensors(obj: Any, out: list | None = None) -> list[torch.Tensor]:
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors(x, out)
    return out


def _is_host(t: torch.Tensor) -> bool:
    return bool(getattr(t, HOST_ATTR, False))


def _set_host(obj: Any, host: bool) -> None:
    for t in _tensors(obj):
        try:
            setattr(t, HOST_ATTR, host)
        except (AttributeError, RuntimeError):  # some tensor subclasses refuse attributes
            pass


def mark_host_state(obj: Any, depth: int = 8, _seen: set | None = None) -> int:
    """Flag every tensor reachable from obj's attributes (dicts, lists) as a host tensor, e.g.
    the preprocessor's normalisation statistics (its steps run before its device step)."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen or depth < 0:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        _set_host(obj, True)
        return 1
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        items = list(vars(obj).values())
    else:
        return 0
    return sum(mark_host_state(x, depth - 1, seen) for x in items)


def _target_device(args: tuple, kwargs: dict) -> Any:
    """The device argument of Tensor.to(...) (a str, torch.device or tensor), else None."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device, torch.Tensor)):
            return a
    return None


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None and any(s in frame.f_code.co_filename.replace(os.sep, "/")
                                    for s in _SKIP_FRAMES):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename.replace(os.sep, "/")
    for marker in ("site-packages/", "/src/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


class HostSyncCounter(TorchFunctionMode):
    """Counts device->host synchronisations in a modelled device run (see the module doc).

    Every tensor is on the CPU here; which of them would be on the device is tracked with a
    flag (HOST_ATTR) and with device objects: `t.device` of a device tensor returns the training
    device object, of a host tensor `self.host` (a distinct torch.device("cpu") object). A
    transfer target is the host when it is the string "cpu", `self.host` or a host tensor;
    any other device object stands for the training device (torch's internals pass on the
    device objects of the tensors they handle).
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device  # the training device object
        self.host = torch.device("cpu")
        self.step = -1
        self.paused = False
        self.by_step: dict[int, Counter] = defaultdict(Counter)  # step -> site -> calls
        self.from_python_by_step: dict[int, Counter] = defaultdict(Counter)  # step -> site -> tensors
        self.float64_by_step: dict[int, Counter] = defaultdict(Counter)  # step -> site -> ops

    def _on_host(self, target: Any) -> bool:
        if isinstance(target, torch.Tensor):
            return _is_host(target)
        if isinstance(target, str):
            from pisft import device as devices

            return devices.on_host(target)
        return target is self.host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if getattr(func, "__self__", None) is torch.Tensor.device and source is not None:
            return self.host if _is_host(source) else self.device
        name = getattr(func, "__name__", "")
        inputs = _tensors(args) + _tensors(kwargs)
        to_host = to_device = False
        if name == "to" and source is not None:
            target = _target_device(args, kwargs)
            if target is not None:
                to_host = self._on_host(target)
                to_device = not to_host
        sync = source is not None and not _is_host(source) and (name in _SYNC_METHODS or to_host)
        if sync and not self.paused:
            self.by_step[self.step][_site()] += 1
        result = func(*args, **kwargs)
        if name in _HOST_RESULT or to_host:
            _set_host(result, True)
        elif to_device:
            _set_host(result, False)
        elif inputs:
            if all(_is_host(t) for t in inputs):
                _set_host(result, True)
        else:  # a factory: on the device only when asked for a device other than the host
            target = kwargs.get("device")
            _set_host(result, target is None or self._on_host(target))
        if not self.paused:
            self._census(name, inputs, result)
        return result

    def _census(self, name: str, inputs: list[torch.Tensor], result: Any) -> None:
        """Tensors copied from Python data to the device; ops with a float64 device result."""
        on_device = [t for t in _tensors(result) if not _is_host(t)]
        if name in _FROM_PYTHON and not inputs and on_device:
            self.from_python_by_step[self.step][_site()] += 1
        if any(t.dtype == torch.float64 for t in on_device):
            self.float64_by_step[self.step][_site()] += 1


# ---------------------------------------------------------------------------------- FSDP state
def fsdp_groups(model: torch.nn.Module) -> tuple[list[Any], Any]:
    """(every FSDP2 parameter group of the model, the root's group)."""
    from torch.distributed.fsdp import FSDPModule

    groups: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                groups.setdefault(id(group), group)
    root = model._get_fsdp_state()._fsdp_param_group if isinstance(model, FSDPModule) else None
    return list(groups.values()), root


def group_numel(group: Any) -> int:
    return sum(p._orig_size.numel() for p in group.fsdp_params)


class UnshardTracker:
    """The parameters whose FSDP2 group is UNSHARDED, followed through the group transitions."""

    def __init__(self, groups: list[Any], total_params: int) -> None:
        self.numel = {id(g): group_numel(g) for g in groups}
        self.total = total_params
        self.unsharded: dict[int, int] = {}
        self.step = -1
        self.peak_by_step: dict[int, float] = defaultdict(float)
        self._patched: list[tuple[Any, str, Any]] = []

    def _update(self, group: Any) -> None:
        key = id(group)
        if group.is_unsharded:
            self.unsharded[key] = self.numel.get(key, group_numel(group))
        else:
            self.unsharded.pop(key, None)
        frac = sum(self.unsharded.values()) / self.total if self.total else 0.0
        self.peak_by_step[self.step] = max(self.peak_by_step[self.step], frac)

    @contextlib.contextmanager
    def installed(self):
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        tracker = self
        for name in ("_to_unsharded", "_to_sharded", "_to_sharded_post_forward"):
            original = getattr(FSDPParamGroup, name)

            def wrapped(group, *a, _original=original, **k):
                out = _original(group, *a, **k)
                tracker._update(group)
                return out

            self._patched.append((FSDPParamGroup, name, original))
            setattr(FSDPParamGroup, name, wrapped)
        try:
            yield self
        finally:
            for cls, name, original in reversed(self._patched):
                setattr(cls, name, original)
            self._patched.clear()


# ---------------------------------------------------------------------------------- the model
def decoder_q_projs(policy: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The query projection of every decoder layer (VLM and action expert; `q_proj`, or fused
    `qkv_proj`), by layer name."""
    # pi0.5's folder by design: this bench counts pi0.5's decoder layers and projections by name
    from pisft.model.pi05.fused import query_projection
    from pisft.model.pi05.parts import EXPERT_LAYERS, PALIGEMMA_WITH_EXPERT, VLM_LAYERS, VLM_MODEL, below

    layers = (f".{below(VLM_LAYERS, VLM_MODEL)}.",
              f".{below(EXPERT_LAYERS, PALIGEMMA_WITH_EXPERT)}.")
    out = {}
    for name, module in policy.named_modules():
        if name.endswith(".self_attn") and any(inside in name for inside in layers):
            out[name.removesuffix(".self_attn")] = query_projection(module)
    return out


def vision_q_projs(policy: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name.removesuffix(".self_attn.q_proj"): m for name, m in policy.named_modules()
            if name.endswith(".self_attn.q_proj") and ".vision_model.encoder.layers." in name}


def _attention_context():
    """The attention switch `pisft.train.__main__.run_stage` wraps training in (its name changed over time)."""
    # pi0.5's folder by design: the bench runs pi0.5 and reads the switch by each of its past names
    from pisft.model.pi05 import attention

    for name in ("fused_joint_attention", "sdpa_joint_attention"):
        if hasattr(attention, name):
            return name, getattr(attention, name)()
    return "none", contextlib.nullcontext()


# ---------------------------------------------------------------------------------- the worker
class _Batches:
    """The loop's batch iterator: marks step boundaries and host tensors; pauses counting."""

    def __init__(self, it, start_step: int, accum: int, on_step_start) -> None:
        self.it, self.accum, self.on_step_start = it, accum, on_step_start
        self.micro = 0
        self.start_step = start_step
        self.counter: HostSyncCounter | None = None

    def __iter__(self):
        return self

    def __next__(self):
        if self.micro % self.accum == 0:
            self.on_step_start(self.start_step + self.micro // self.accum)
        self.micro += 1
        if self.counter is not None:
            self.counter.paused = True
        try:
            batch = next(self.it)
        finally:
            if self.counter is not None:
                self.counter.paused = False
        _set_host(batch, True)
        return batch


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def worker(spec_path: str, out_dir: str) -> int:
    import torch.distributed as dist

    from pisft import config as config_mod
    from pisft import device as devices
    from pisft.introspect import collective_audit as ca
    from pisft.stages import TRAIN_8CARD
    from pisft.train import loop
    from pisft.train.batches import make_loader
    from pisft.train.run import loop_settings, lr_scheduler
    from pisft.train.job import Context, build, make_sampler

    spec = json.loads(Path(spec_path).read_text())
    cfg = config_mod.from_dict(spec["config"], "train_structure")
    ca.register(BACKEND, table=ca.HCCL_TABLE, enforce=False)
    dist.init_process_group(BACKEND)
    rank, world = dist.get_rank(), dist.get_world_size()
    info = devices.DeviceInfo(kind="cpu", backend=BACKEND, device=torch.device("cpu"), name="cpu")
    ctx = Context(cfg, TRAIN_8CARD.name, info, rank, world)
    t = cfg.train
    t0 = time.perf_counter()
    if rank == 0:  # inputs made once, by rank 0, while rank 1 waits
        build_inputs(cfg)
    dist.barrier()
    inputs_s = time.perf_counter() - t0
    attention_name, attention_ctx = _attention_context()
    with attention_ctx:
        built = build(ctx)
        policy = built.model
        groups, root = fsdp_groups(policy)
        total_params = sum(p.numel() for p in policy.parameters())
        unit_sizes = sorted(group_numel(g) for g in groups if g is not root)

        forwards: dict[str, Counter] = {"decoder": Counter(), "vision": Counter()}
        step_box = {"step": -1}
        hooks = []
        decoder_names = list(decoder_q_projs(policy))
        vision_names = list(vision_q_projs(policy))
        for kind, mods in (("decoder", decoder_q_projs(policy)),
                           ("vision", vision_q_projs(policy))):
            for name, mod in mods.items():
                def hook(_m, _i, _o, kind=kind, name=name):
                    forwards[kind][(step_box["step"], name)] += 1
                hooks.append(mod.register_forward_hook(hook))

        scheduler = lr_scheduler(cfg, built.optimizer)
        sampler = make_sampler(cfg, built.train_set, world)
        loader = make_loader(built.train_set, sampler, rank=rank, start_step=0, end_step=t.steps,
                             seed=t.seed, draw=built.task.draw, num_workers=0)
        settings = loop_settings(ctx)
        log_every = settings.log_every

        snapshots: dict[int, Counter] = {}
        counter = HostSyncCounter(info.device)
        tracker = UnshardTracker(groups, total_params)

        def on_step_start(step: int) -> None:
            snapshots[step] = ca.LOG.snapshot()
            step_box["step"] = counter.step = tracker.step = step

        mark_host_state(built.task.pre)
        batches = _Batches(iter(loader), 0, cfg.grad_accum_steps, on_step_start)
        batches.counter = counter
        loop_start = ca.LOG.snapshot()
        violations_before = len(ca.LOG.violations)
        t_loop = time.perf_counter()
        with tracker.installed(), counter:
            records = loop.run(policy, built.optimizer, scheduler, built.task, batches, settings,
                               start_step=0)
        loop_s = time.perf_counter() - t_loop
        snapshots[t.steps] = ca.LOG.snapshot()
        for h in hooks:
            h.remove()

    accum = cfg.grad_accum_steps
    measured = list(range(1, t.steps))  # the first step (lazy initialisation) is left out
    micro = len(measured) * accum

    def per_step_counts(step: int) -> Counter:
        return snapshots[step + 1] - snapshots[step]

    measured_counts = Counter()
    for s in measured:
        measured_counts.update(per_step_counts(s))
    ag = sum(c for (op, _), c in measured_counts.items() if op in ca.ALL_GATHER_OPS)
    rs = sum(c for (op, _), c in measured_counts.items() if op in ca.REDUCE_SCATTER_OPS)
    loop_counts = snapshots[t.steps] - loop_start
    f64 = sum(c for (_, dt), c in loop_counts.items() if dt == "float64")

    def layer_rates(kind: str, names: list[str]) -> dict[str, Any]:
        per = {n: sum(forwards[kind][(s, n)] for s in measured) / micro for n in names}
        vals = list(per.values())
        return {"mean": _mean(vals), "min": min(vals, default=None), "max": max(vals, default=None),
                "layers": len(vals), "per_layer": per}

    def is_log_step(step: int) -> bool:  # 0-based step index
        return (step + 1) % log_every == 0 or step + 1 == t.steps

    syncs = {s: sum(counter.by_step[s].values()) for s in range(t.steps)}

    def census(by_step: dict[int, Counter]) -> dict[str, Any]:
        """Per micro-step of the steps without a fetch; per logging step (its fetch included)."""
        plain = [s for s in measured if not is_log_step(s)]
        found: Counter = Counter()
        for s in plain:
            found.update(by_step[s])
        n = len(plain) * accum
        logging = [s for s in measured if is_log_step(s)]
        return {"per_micro_step": sum(found.values()) / n if n else None,
                "sites": {k: v / n for k, v in found.most_common()} if n else {},
                "per_logging_step": _mean([sum(by_step[s].values()) for s in logging]),
                "logging_sites": dict(sum((by_step[s] for s in logging), Counter()).most_common())}

    from_python = census(counter.from_python_by_step)
    float64_ops = census(counter.float64_by_step)
    sites: Counter = Counter()
    for s in measured:
        sites.update(counter.by_step[s])
    vision_layers = len(vision_names)
    # pi0.5's folder by design: the decoder layer pairs counted by pi0.5's part names
    from pisft.model.pi05.parts import below, EXPERT_NAME, LANGUAGE_MODEL, VLM_MODEL

    vlm = f".{below(LANGUAGE_MODEL, VLM_MODEL)}."
    pairs = min(sum(vlm in n for n in decoder_names), sum(f".{EXPERT_NAME}." in n for n in decoder_names))
    result = {
        "rank": rank,
        "world_size": world,
        "micro_batch_size": t.micro_batch_size,
        "grad_accum_steps": accum,
        "optimizer_steps": t.steps,
        "measured_steps": len(measured),
        "activation_checkpointing": t.activation_checkpointing,
        "attention": attention_name,
        "params_total": total_params,
        "fsdp_units": len(groups),
        "fsdp_units_excluding_root": len([g for g in groups if g is not root]),
        "fsdp_unit_params": {"min": unit_sizes[0] if unit_sizes else None,
                             "median": statistics.median(unit_sizes) if unit_sizes else None,
                             "max": unit_sizes[-1] if unit_sizes else None},
        "root_unit_params": group_numel(root) if root is not None else 0,
        "decoder_layer_pairs": pairs,
        "vision_layers": vision_layers,
        "fsdp_units_target": pairs + vision_layers + 4,  # round 1's bound (the vision layers now 3 to a unit)
        "fsdp_min_unit_params": t.fsdp_min_unit_params,
        "all_gather_bound": 2 * len(groups),
        "all_gather_per_micro_step": ag / micro,
        "reduce_scatter_per_micro_step": rs / micro,
        "collectives_per_micro_step": {f"{op}:{dt}": c / micro
                                       for (op, dt), c in sorted(measured_counts.items())},
        "float64_collectives": f64,
        "float64_collectives_by_op": {op: c for (op, dt), c in sorted(loop_counts.items())
                                      if dt == "float64"},
        "hccl_violations": len(ca.LOG.violations),
        "hccl_violations_in_loop": len(ca.LOG.violations) - violations_before,
        "hccl_violation_messages": sorted(set(ca.LOG.violations)),
        "decoder_layer_forwards_per_micro_step": layer_rates("decoder", decoder_names),
        "vision_layer_forwards_per_micro_step": layer_rates("vision", vision_names),
        "max_unsharded_param_fraction": max((tracker.peak_by_step[s] for s in measured),
                                            default=None),
        "unsharded_param_fraction_by_step": [tracker.peak_by_step[s] for s in range(t.steps)],
        "host_syncs_per_step": {
            "log_every": log_every,
            "logging_steps": _mean([syncs[s] for s in measured if is_log_step(s)]),
            "other_steps": _mean([syncs[s] for s in measured if not is_log_step(s)]),
            "per_step": [syncs[s] for s in range(t.steps)],
            "logging_step_numbers": [s + 1 for s in range(t.steps) if is_log_step(s)],
            "sites": dict(sites.most_common()),
        },
        "tensors_from_python_per_micro_step": from_python["per_micro_step"],
        "tensors_from_python": from_python,
        "float64_ops_per_micro_step": float64_ops["per_micro_step"],
        "float64_ops": float64_ops,
        "losses": [r["loss"] for r in records],
        "inputs_s": inputs_s,
        "build_s": t_loop - t0 - inputs_s,
        "loop_s": loop_s,
    }
    Path(out_dir, f"rank_{rank}.json").write_text(json.dumps(result, indent=2, default=str))
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------- the parent
def bench_config(cfg: Any, work: Path) -> dict:
    """The configuration the workers run, as a dict: the user's config with the bench's shape
    (tiny preset, small demo data under work/results, 2 processes, micro batch 4, ...)."""
    from pisft import config as config_mod
    from pisft.train.fsdp import min_unit_params

    root = work / "results"
    raw = config_mod.to_dict(cfg)
    raw["results_dir"] = str(root)
    raw["device"] = "cpu"
    raw["model"].update(source="tiny", preset="tiny")
    raw["data"].update(recap_dir=f"{root}/demo_recap", demo_episodes_per_task=1,
                       demo_episode_length=24)
    train = raw["train"]
    train.update(nproc_per_node=NPROC, nnodes=1, node_rank=0, rdzv_endpoint="",
                 micro_batch_size=MICRO_BATCH, global_batch_size=MICRO_BATCH * ACCUM * NPROC,
                 steps=STEPS, warmup_steps=1, activation_checkpointing=True, precision="fp32",
                 compile="off",  # the eager step, as written (build() takes no `auto`: pisft.train.decisions)
                 num_workers=0, tensorboard=False,
                 fsdp_min_unit_params=min_unit_params(LAYOUT_OF))  # the accelerator's layout
    if "log_every" in train:
        train["log_every"] = LOG_EVERY
    if "deterministic" in train:
        train["deterministic"] = False
    return config_mod.to_dict(config_mod.from_dict(raw, "train_structure"))


def build_inputs(cfg: Any) -> None:
    """Tiny base model + small demo dataset (the stages' own code), unless already there."""
    from pisft import layout
    from pisft.data import convert, demo
    from pisft.model import fetch

    if not layout.iteration(cfg).split.is_file():
        with contextlib.redirect_stdout(sys.stderr):
            fetch.run(cfg)
            demo.run(cfg)
            convert.run(cfg)


def _agree(a: dict, b: dict) -> bool:
    keys = ("fsdp_units", "all_gather_per_micro_step", "reduce_scatter_per_micro_step",
            "float64_collectives", "decoder_layer_forwards_per_micro_step",
            "tensors_from_python_per_micro_step", "float64_ops_per_micro_step")
    return all(a.get(k) == b.get(k) for k in keys)


def run(cfg: Any, work: Path) -> dict[str, Any]:
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    spec = {"config": bench_config(cfg, work)}
    spec_path = work / "train_structure_spec.json"
    spec_path.write_text(json.dumps(spec))
    out = work / "train_structure_ranks"
    out.mkdir(exist_ok=True)
    for old in out.glob("rank_*.json"):
        old.unlink()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(NPROC), "-m", "pisft.bench.train_structure", "--worker", str(spec_path), str(out)]
    t1 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"train_structure workers failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(NPROC)]
    result = {
        "what": ("structure of the real training path per micro-step: tiny preset, 2 processes, "
                 "the accelerator's FSDP layout (train.fsdp_min_unit_params 0, whatever the host), "
                 "activation checkpointing on, micro batch 4, accumulation 2; rank 0's figures; "
                 "first optimizer step excluded (see pisft/bench/train_structure.py)"),
        **{k: v for k, v in ranks[0].items() if k != "rank"},
        "ranks_agree": all(_agree(ranks[0], r) for r in ranks[1:]),
        "wall_s": time.perf_counter() - t1,
    }
    (work / "train_structure.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(*argv[1:3])
    import tempfile

    from pisft import config as config_mod

    cfg = config_mod.load(config_mod.DEFAULT_CONFIG)
    with tempfile.TemporaryDirectory(prefix="pisft-train-structure-") as tmp:
        print(json.dumps(run(cfg, Path(tmp)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
