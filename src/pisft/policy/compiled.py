"""The compiled action chunk (`eval.compile`, `serve --compile`): one program per batch-size bucket.

**What is compiled.** LeRobot's own `PI05Pytorch.sample_actions`, the whole chunk: the prefix
(SigLIP, the prompt, the VLM's pass that fills its KV cache) and the ten Euler steps of the action
expert, as one graph (`torch.compile(..., fullgraph=True, dynamic=False)`), installed where
`predict_action_chunk` calls it (`lerobot_internals` 9.). It is what LeRobot's
`PI05Config.compile_model` and openpi's `Pi0Config.pytorch_compile_mode` compile
(`torch.compile(self.sample_actions, mode=...)` in both `PI05Pytorch.__init__` and
`PI0Pytorch.__init__`, openpi @ 15a9616 src/openpi/models_pytorch/pi0_pytorch.py). Classifier-free
guidance (`pisft.model.guidance`, its doubled batch and blended step) is traced into the same graph.
A chunk with real-time chunking (a previous chunk's leftover, `pisft.policy.rtc`) cannot be one
graph (LeRobot's RTC takes a gradient); it runs LeRobot's `sample_actions` with its three model
calls compiled, each a graph of its own (embedding, prefix pass, denoising step).

**Per device** (`choose`): the CPU, inductor's C++ kernels; CUDA, `mode="reduce-overhead"`
(inductor with CUDA graphs: a chunk is replayed as one captured graph instead of launching each of
its ~13,000 kernels, issue 46's profile of pi0.5 at batch 1 on an H200); an Ascend NPU, the
`npugraph_ex` backend that torch_npu 2.11.0 registers (torch_npu/dynamo/__init__.py,
`NPUGRAPH_EX_BACKEND`, Ascend/pytorch tag v26.1.0-pytorch2.11.0), ACLGraph capture and replay, the
backend the vendor documents for large-model inference
(docs/zh/user_guide/torch_compile/compilation_backend/npugraph_ex.md, Ascend/pytorch @ 9e73e70).

**Buckets.** A batch of n requests runs padded to the next power of two (its last row repeated,
the extra rows' actions dropped): each bucket compiles once, on its first use, and is replayed
after. pi0.5's rows never mix (attention stays within a row), so a padded row changes no other
row's actions beyond the kernels' rounding for a different batch size, which eager has too.

**Tolerance.** The compiled chunk is LeRobot's computation reassociated (inductor fuses
element-wise operations and keeps their intermediates in float32) and computes the same actions
from the same noise within `ACTIONS_ATOL` in normalised action units ([-1, 1] between the q01 and
q99 of each dimension): for a float32 model 1e-4, two hundred times the 2.4e-7 to 6e-7 measured on
the tiny model and 1/78 of the 256-bin resolution at which pi0.5 reads its own state; for a bf16
model (`pisft.policy.precision`) 2**-6, two bf16 ulps (2**-7 at 1.0) of an action at the edge of
the range: eager and compiled round different intermediates to bf16 on the way to the float32
action projection, and the ten steps carry it on (measured: 5e-3 on the tiny model, 1.35e-2 on
pi0.5 at real size, batch 1, on the CPU).

**The default** (`eval.compile: null`): compiled where it measured faster than eager
(`MEASURED_FASTER`, from `python -m pisft bench --only inference`), eager where it measured
slower or was not measured; the stage says which in one line. A compile that fails falls back to
eager with one line (the chunk is recomputed eagerly, so the request is still answered).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pisft.model import lerobot_internals as internals

# eval.compile null: whether a stage runs faster with the compiled chunk than eager on this kind of
# device, its compile included (None: not measured there; eager). The CPU (docs/benchmarks.md,
# "Inference"; `python -m pisft bench --only inference`, 2 shared cores): a compiled chunk is faster
# once compiled, but a bucket compiles in about a minute for the tiny model, more than the default
# pipeline's few hundred chunks save (tens of ms each); pi0.5 at real size, batch 1: 68 s a chunk
# compiled against 144 s eager, after a 17-minute compile and near 10 GiB: eager by default there
# too (`eval.compile: true` pays back after about 14 chunks of one bucket). CUDA and NPU: not yet
# measured (`python -m pisft.bench.gpu_infer` is the prepared run).
MEASURED_FASTER: dict[str, bool | None] = {"cpu": False, "cuda": None, "npu": None}
# Normalised action units (module docstring).
ACTIONS_ATOL = {torch.float32: 1e-4, torch.bfloat16: 2.0 ** -6}
NPU_BACKEND = "npugraph_ex"
CUDA_MODE = "reduce-overhead"
# dynamo compiles a code object at most this many times (its default, 8, is fewer than the buckets
# times the variants: plain, guided, RTC pieces; past it a chunk would run eagerly, silently).
RECOMPILE_LIMIT = 64


@dataclass(frozen=True)
class CompileChoice:
    """Whether the chunk is compiled, how, and the one line that says so."""

    enabled: bool
    backend: str = "inductor"
    mode: str | None = None
    why: str = ""

    def record(self) -> dict[str, Any]:
        return {"compiled": self.enabled, "backend": self.backend if self.enabled else None,
                "mode": self.mode if self.enabled else None, "why": self.why}


def choose(setting: bool | None, kind: str) -> CompileChoice:
    """`eval.compile` (True, False, None: `MEASURED_FASTER`) on a device of `kind`."""
    backend, mode = {"cuda": ("inductor", CUDA_MODE), "npu": (NPU_BACKEND, None)}.get(kind, ("inductor", None))
    how = f"{backend}" + (f", mode {mode}" if mode else "") + ", one graph per batch-size bucket"
    if setting is False:
        return CompileChoice(False, why="eval.compile false: eager")
    if setting is None:
        measured = MEASURED_FASTER.get(kind)
        if measured is None:
            return CompileChoice(False, why=f"eval.compile null: eager on {kind} (the compiled chunk is not yet "
                                            f"measured there: python -m pisft.bench.gpu_infer; set "
                                            f"eval.compile: true to use it)")
        if not measured:
            return CompileChoice(False, why=f"eval.compile null: eager on {kind} (a stage ran faster eager there, "
                                            f"the compile included)")
        return CompileChoice(True, backend, mode, f"eval.compile null: compiled on {kind}, where it measured "
                                                  f"faster ({how})")
    if kind == "npu":
        missing = _npu_backend_missing()
        if missing:
            return CompileChoice(False, why=f"eval.compile true: eager on npu, falling back: {missing}")
    return CompileChoice(True, backend, mode, f"eval.compile true: compiled ({how})")


def _npu_backend_missing() -> str | None:
    """Why torch.compile has no `npugraph_ex` backend here (None: it has)."""
    try:
        import torch_npu  # noqa: F401 - registers its dynamo backends on import
    except ImportError as exc:
        return f"torch_npu cannot be imported ({exc})"
    from torch._dynamo import list_backends

    if NPU_BACKEND not in list_backends(exclude_tags=()):
        return f"torch_npu registered no '{NPU_BACKEND}' backend (torch_npu 2.11.0 registers it)"
    return None


def bucket(n: int) -> int:
    """The batch-size bucket of a batch of n: the next power of two."""
    if n < 1:
        raise ValueError(f"a batch of {n} requests")
    return 1 << math.ceil(math.log2(n))


def _pad_rows(x: Any, n: int, size: int) -> Any:
    """`x` with its batch dimension n padded to `size` by repeating its last row."""
    if isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == n and size > n:
        return torch.cat([x, x[-1:].expand(size - n, *x.shape[1:])])
    if isinstance(x, list):
        return [_pad_rows(v, n, size) for v in x]
    return x


@dataclass
class CompiledChunk:
    """The compiled `sample_actions` of one policy (module docstring); installed by `install`."""

    policy: Any
    choice: CompileChoice
    on_fallback: Callable[[str], None] = print
    # (variant, bucket) -> seconds of its first call (the compile and, on CUDA, the capture)
    compile_s: dict[str, float] = field(default_factory=dict)
    fallen_back: str | None = None

    def __post_init__(self) -> None:
        self.eager = internals.lerobot_sample_actions(self.policy)
        self.whole = self._compile(self.eager)
        self.pieces = {name: self._compile(fn) for name, fn in internals.rtc_pieces(self.policy).items()}
        step = self.pieces["denoise_step"]

        def no_grad_step(**kwargs):  # RTC calls the step under enable_grad (lerobot_internals 9.)
            with torch.no_grad():
                return step(**kwargs)
        self.pieces["denoise_step"] = no_grad_step

    def _compile(self, fn: Callable) -> Callable:
        kw: dict[str, Any] = {"fullgraph": True, "dynamic": False, "backend": self.choice.backend}
        if self.choice.mode:
            kw["mode"] = self.choice.mode
        return torch.compile(fn, **kw)

    def _mark_step(self) -> None:
        if self.choice.mode == CUDA_MODE:  # each chunk starts a new generation of CUDA graph outputs
            torch.compiler.cudagraph_mark_step_begin()

    def __call__(self, images, img_masks, tokens, masks, noise=None, num_steps=None, **kwargs):
        if self.fallen_back:
            return self.eager(images, img_masks, tokens, masks, noise=noise, num_steps=num_steps, **kwargs)
        n = tokens.shape[0]
        size = bucket(n)
        padded = [_pad_rows(x, n, size) for x in (images, img_masks, tokens, masks, noise)]
        rtc = {k: _pad_rows(v, n, size) for k, v in kwargs.items()}
        with_rtc = rtc.get("prev_chunk_left_over") is not None
        variant = f"{'rtc' if with_rtc else 'chunk'}{'_guided' if internals.velocity_hooked(self.policy) else ''}"
        key = f"{variant}@{size}"
        first = key not in self.compile_s
        start = time.perf_counter()
        try:
            self._mark_step()
            if with_rtc:
                with internals.pieces_installed(self.policy, self.pieces):
                    out = self.eager(*padded[:4], noise=padded[4], num_steps=num_steps, **rtc)
            else:
                out = self.whole(*padded[:4], noise=padded[4], num_steps=num_steps, **rtc)
        except Exception as exc:  # noqa: BLE001 - a compile that fails falls back to eager (below)
            out = self.eager(images, img_masks, tokens, masks, noise=noise, num_steps=num_steps, **kwargs)
            self.fallen_back = _reason(exc)
            self.on_fallback(f"eval.compile: the compiled chunk failed ({self.fallen_back}); falling back to "
                             f"eager for this model")
            return out
        if first:
            if out.device.type == "cuda":  # the first call's compile and capture have ended on the device too
                torch.cuda.synchronize(out.device)
            self.compile_s[key] = time.perf_counter() - start
        return out[:n].clone()  # a CUDA graph's output is overwritten by its next replay


def _reason(exc: BaseException) -> str:
    """One line: the exception and, when torch wraps one (BackendCompilerFailed, ...), its cause."""
    def line(e: BaseException) -> str:
        text = next((t for t in str(e).splitlines() if t.strip()), "")
        return f"{type(e).__name__}: {text}" if text else type(e).__name__

    inner = exc
    while True:
        nxt = getattr(inner, "inner_exception", None) or inner.__cause__
        if nxt is None or nxt is inner:
            break
        inner = nxt
    return line(exc) if inner is exc else f"{line(exc)} ({line(inner)})"


def install(policy, choice: CompileChoice, *, on_fallback: Callable[[str], None] = print) -> CompiledChunk | None:
    """Compile `policy`'s chunk as `choice` says (None when it says eager)."""
    if not choice.enabled:
        return None
    from torch._dynamo import config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    chunk = CompiledChunk(policy, choice, on_fallback=on_fallback)
    internals.install_sample_actions(policy, chunk)
    return chunk


def tolerance(policy) -> float:
    """`ACTIONS_ATOL` of the policy's precision (its VLM's weights)."""
    q = internals.part(policy, internals.VLM_LAYERS)[0].self_attn.q_proj.weight
    return ACTIONS_ATOL[q.dtype]
