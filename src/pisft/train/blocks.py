"""The training step's repeated blocks: each one an FSDP2 unit's forward, a checkpointed region and
a compiled region (`train.compile`).

pi0.5's training forward (`pisft.model.pi05`, 11.) runs each decoder layer pair (with a
frozen VLM: each VLM layer and each expert layer) as one call of `run_block` on the block's first
layer, its anchor; HF's SigLIP encoder calls each encoder layer as a module. Here each block gets a
runner (`BlockRunner`, set as the anchor's `BLOCK_RUNNER` attribute; that name and `checkpointed` are
model-neutral, `pisft.model.units`, which the model's forward and this module both import):

- FSDP2: the runner is registered as a forward method of the unit holding the block
  (`torch.distributed.fsdp.register_fsdp_forward_method`): FSDP2 gathers the unit before the
  block, frees it after, and reduce-scatters its gradients after the block's backward. Its hooks
  run around the runner, outside the compiled region, as torchtitan's FSDP2 units wrap each
  compiled TransformerBlock (torchtitan/models/llama3/infra/parallelize.py, `apply_compile` then
  `apply_fsdp`). A unit of several blocks (the CPU's merged units, `fsdp.merge_small_units`) is
  gathered by its first block and kept until its backward.
- Activation checkpointing: the runner recomputes the block in backward (`checkpointed`); the
  recomputation runs the block's function, not FSDP2's forward hooks (the unit is gathered by
  FSDP2's pre-backward hook on the block's outputs).
- torch.compile (`train.compile: layers`): the block's function (`pair_layer`, `prefix_layer`,
  `suffix_layer`; the SigLIP layer's forward) is compiled once per function and reused by every
  block of that kind (Dynamo treats the layers' parameters as inputs,
  `torch._dynamo.config.inline_inbuilt_nn_modules`, so one graph serves all 18 pairs), with
  static shapes (a micro-batch's shapes do not change within a run). Inside, inductor fuses the
  element-wise work between the matrix products (norms, rotary embedding, gated residuals,
  activations, the autocast casts) into a few kernels; the products stay cuBLAS/oneDNN calls.
  The backend is inductor on CPU and CUDA, torchair's on an NPU (the device row's
  `train_compile_backend`, made by `COMPILE_BACKENDS`).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from pisft import device as devices
from pisft import layout
from pisft.model.units import BLOCK_RUNNER, checkpointed

CACHE_ENV = layout.COMPILE_CACHE_ENV


def _inductor(kind: str) -> Any:  # noqa: ARG001 - every backend function takes the device kind
    return "inductor"


def _torchair(kind: str) -> Any:  # noqa: ARG001
    """torch_npu's graph mode: torchair's Dynamo backend (Ascend/torchair, python/torchair/npu_fx_compiler.py
    `get_npu_backend`; torch-npu 2.11.0 bundles torchair as `torch_npu.dynamo.torchair`, CANN 9.1.0's
    docs "PyTorch graph mode (TorchAir)": `torch.compile(model, backend=torchair.get_npu_backend(config=...))`).
    The default CompilerConfig runs the graph in max-autotune mode (the whole graph sunk to the NPU as one
    GE graph); pisft keeps it."""
    try:
        torchair = importlib.import_module("torch_npu.dynamo.torchair")
    except ImportError:
        torchair = importlib.import_module("torchair")
    return torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())


# A device row's `train_compile_backend` -> the function that makes that backend for the kind.
COMPILE_BACKENDS: dict[str, Callable[[str], Any]] = {"inductor": _inductor, "torchair": _torchair}


def _backend_name(kind: str) -> str | None:
    """The name of train.compile's backend on devices of `kind` (None: a device type without a row)."""
    found = devices.ROWS.get(kind)
    return None if found is None else found.train_compile_backend
# Every block kind runs through the same code object (`checkpointed`), compiled once per kind, per
# shape (dynamic=False) and per last-layer flag: dynamo's default limit of 8 compilations of one code
# object is reached by a few kinds at two micro batches, and past it a block runs eagerly, silently.
RECOMPILE_LIMIT = 64


@dataclass
class Compiler:
    """torch.compile for one run (train.compile): one compiled function per block function."""

    mode: str = "off"
    kind: str = "cpu"
    compiled: dict[Any, Callable] = field(default_factory=dict)
    modules: list[nn.Module] = field(default_factory=list)  # the blocks called as modules (`install`)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def set_mode(self, mode: str) -> None:
        """Run the installed blocks `mode` (off | layers) from the next call on: the smoke gate's
        trial of the compiled step on the model it has just run eagerly (pisft.gates.compile_trial).
        The anchors' runners ask this Compiler at every call; the blocks called as modules get their
        compiled forward, or their class's back."""
        self.mode = mode
        for module in self.modules:
            if self.enabled:
                module.forward = self(type(module).forward.__get__(module))
            elif "forward" in vars(module):
                delattr(module, "forward")

    def describe(self) -> str:
        return f"compiled per block ({_backend_name(self.kind)})" if self.enabled else "eager"

    def __call__(self, fn: Callable) -> Callable:
        if not self.enabled:
            return fn
        if fn not in self.compiled:
            from torch._dynamo import config as dynamo_config

            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
            backend = COMPILE_BACKENDS[_backend_name(self.kind)](self.kind)
            self.compiled[fn] = torch.compile(fn, backend=backend, dynamic=False)
        return self.compiled[fn]


def compiler_for(mode: str, kind: str, cache_dir: Any, log: Callable[[str], None]) -> Compiler:
    """The run's Compiler for train.compile `mode` (off | layers) on devices of `kind`: the backend
    checked (a device without one runs eagerly, saying so in one line), the compiled code cached in
    `cache_dir` (unless TORCHINDUCTOR_CACHE_DIR is set: by the user, by the launcher for the training
    stages' workers, `layout.COMPILE_CACHE_ENV`, or by torch itself once it has used its cache).

    `auto` is decided by the smoke gate on the run's device (pisft.gates.compile_trial) and reaches
    training as the mode it chose (pisft.train.decisions); it never arrives here."""
    if mode not in ("off", "layers"):
        raise ValueError(f"compiler_for: train.compile {mode!r} must be resolved to off or layers first "
                         "(the smoke gate decides auto: pisft.train.decisions)")
    chosen = mode
    if chosen == "off":
        return Compiler("off", kind)
    if _backend_name(kind) not in COMPILE_BACKENDS:
        log(f"train.compile: {mode}: no compiler backend for {kind} devices; the step runs eagerly")
        return Compiler("off", kind)
    try:
        COMPILE_BACKENDS[_backend_name(kind)](kind)
    except (ImportError, AttributeError, RuntimeError) as exc:
        log(f"train.compile: {mode}: the {kind} compiler backend is not available ({type(exc).__name__}: "
            f"{exc}); the step runs eagerly (train.compile: off says so without this line)")
        return Compiler("off", kind)
    os.environ.setdefault(CACHE_ENV, str(cache_dir))
    return Compiler(chosen, kind)


class BlockRunner:
    """What `run_block` calls for one block: its function, compiled when the run compiles, with
    its activations recomputed in backward when checkpointed. Compiled, the checkpoint is inside
    the compiled region (torchtitan's order: activation checkpointing, then compile): the
    recomputation is part of the compiled backward graph."""

    def __init__(self, compiler: Compiler) -> None:
        self.compiler = compiler

    def __call__(self, fn: Callable, *args: Any, checkpoint: bool = False, plain: bool = False, **kwargs: Any) -> Any:
        if plain:  # only the unit's gather around `fn` (`run_block`'s partner)
            return fn(*args, **kwargs)
        if checkpoint:
            fn = _checkpointed_fns.setdefault(fn, functools.partial(checkpointed, fn))
        return self.compiler(fn)(*args, **kwargs)


# One checkpointed function per block function: the compiled function's cache key.
_checkpointed_fns: dict[Callable, Callable] = {}


def install(units: Iterable[Any], compiler: Compiler) -> int:
    """Give every block of `units` (pisft.model.units.Unit: `anchors`, the blocks' first layers;
    `compiled_modules`, the layers called as modules) its runner; a sharded unit's runner is its
    FSDP2 forward method on its first anchor. Returns the number of blocks."""
    blocks = 0
    for unit in units:
        for i, anchor in enumerate(unit.anchors):
            setattr(anchor, BLOCK_RUNNER, BlockRunner(compiler))
            if i == 0 and isinstance(anchor, FSDPModule):
                register_fsdp_forward_method(anchor, BLOCK_RUNNER)
            blocks += 1
        for module in unit.compiled_modules:
            compiler.modules.append(module)
            if compiler.enabled:
                module.forward = compiler(type(module).forward.__get__(module))
            blocks += 1
    return blocks
