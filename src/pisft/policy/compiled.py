"""The compiled action chunk (`eval.compile`, `serve --compile`): one program per batch-size bucket.

**What is compiled.** LeRobot's own `PI05Pytorch.sample_actions`, the whole chunk: the prefix
(SigLIP, the prompt, the VLM's pass that fills its KV cache) and the ten Euler steps of the action
expert, as one graph (`torch.compile(..., fullgraph=True, dynamic=False)`), installed where
`predict_action_chunk` calls it (`pisft.model.pi05` 9.). It is what LeRobot's
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

**The default** (`eval.compile: null`): decided on the node by the stage's first chunk (`Trial`).
On an accelerator the first chunk a stage asks for runs eagerly and compiled from the same inputs
and noise, each `TRIAL_WARMUP` times and then `TRIAL_REPS` times timed (the compiled one after its
first call, the compile and on CUDA the capture): actions further apart than `ACTIONS_ATOL`, or a
compile that fails, choose eager with one line; else compiled when its median is at least
`TRIAL_MIN_GAIN` below eager's, eager otherwise. The chunk is answered by the chosen path, so what a
stage records is what that path computes, as if the choice had been set by hand; the stage's
replicas share one trial (`Trial`: the first chunk of any replica measures, the others wait for the
decision and follow it). The decision is in the stage's output (`compiled`, `why`, `decided_by`);
its figures (`trial`: both medians, the compile's seconds, the actions' difference) vary run to run
and go where the compile times go (the timing record of closed_loop and collect_rollouts). On the
CPU the default does not pay a compile to learn what is known (`CPU_DEFAULT`: a bucket compiles in
about a minute for the tiny model and 17 for pi0.5, more than a stage's chunks save): eager, and
the record says why no trial ran. Determinism: two runs on an accelerator can decide differently
when the two paths are near a tie, and compiled and eager agree within the tolerance, not to the
bit; `eval.compile: true` or `false` pins it (docs/serving.md).
A compile that fails later (another bucket) falls back to eager with one line (the chunk is
recomputed eagerly, so the request is still answered).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pisft import device as device_mod
from pisft.model.registry import spec_of

# eval.compile null on the CPU: eager without a trial (docs/benchmarks.md, "Inference"; `python -m
# pisft bench --only inference`, 2 shared cores): a compiled chunk is faster once compiled, but a
# bucket compiles in about a minute for the tiny model, more than the default pipeline's few hundred
# chunks save (tens of ms each); pi0.5 at real size, batch 1: 68 s a chunk compiled against 144 s
# eager, after a 17-minute compile and near 10 GiB (`eval.compile: true` pays back after about 14
# chunks of one bucket). A trial would pay that compile to learn it.
CPU_DEFAULT = ("eval.compile null: eager on the CPU, no trial run: a bucket's compile here (about a minute for the "
               "tiny model, 17 minutes for pi0.5) costs more than a stage's chunks save (docs/benchmarks.md, "
               "Inference); eval.compile: true compiles")
# The trial (`Trial`): calls of each path before the timed ones, timed calls of each (their median
# decides), and how much faster the compiled chunk must be to be chosen: a near tie stays eager, the
# path whose bits do not depend on a compiler, and a tie cannot flip the choice from run to run.
TRIAL_WARMUP = 2
TRIAL_REPS = 3
TRIAL_MIN_GAIN = 0.05
# Normalised action units (module docstring).
ACTIONS_ATOL = {torch.float32: 1e-4, torch.bfloat16: 2.0 ** -6}
CUDA_MODE = device_mod.CUDA_GRAPH_MODE  # the CUDA row's compile mode (CUDA graphs)
# dynamo compiles a code object at most this many times (its default, 8, is fewer than the buckets
# times the variants: plain, guided, RTC pieces; past it a chunk would run eagerly, silently).
RECOMPILE_LIMIT = 64


@dataclass(frozen=True)
class CompileChoice:
    """Whether the chunk is compiled, how, and the one line that says so. `decided_by`: "setting"
    (`eval.compile` true or false, or a choice made by hand), "trial" (null on an accelerator: the
    stage's first chunk decides, `Trial`; `enabled` is then whether the compiled path is prepared,
    not yet whether it runs) or "no trial" (null where no trial runs: the CPU, `CPU_DEFAULT`; an NPU
    without torch_npu's backend)."""

    enabled: bool
    backend: str = "inductor"
    mode: str | None = None
    why: str = ""
    decided_by: str = "setting"

    @property
    def trial(self) -> bool:
        return self.decided_by == "trial"

    def record(self) -> dict[str, Any]:
        backend = getattr(self.backend, "__name__", self.backend)  # a test's backend is a function
        if self.trial:  # not yet decided (no chunk asked for yet): CompiledChunk.record after
            return {"compiled": None, "backend": backend, "mode": self.mode, "why": self.why,
                    "decided_by": "trial"}
        return {"compiled": self.enabled, "backend": backend if self.enabled else None,
                "mode": self.mode if self.enabled else None, "why": self.why, "decided_by": self.decided_by}


def choose(setting: bool | None, kind: str) -> CompileChoice:
    """`eval.compile` (True, False, None: the stage's first chunk decides, `Trial`; on the CPU eager,
    `CPU_DEFAULT`) on a device of `kind`."""
    row = device_mod.row(kind)
    backend, mode = row.compile_backend, row.compile_mode
    how = f"{backend}" + (f", mode {mode}" if mode else "") + ", one graph per batch-size bucket"
    if setting is False:
        return CompileChoice(False, why="eval.compile false: eager")
    if setting is None and not row.compile_trial:
        return CompileChoice(False, why=CPU_DEFAULT, decided_by="no trial")
    asked = "true" if setting else "null"
    if row.compile_backend_missing is not None:
        missing = row.compile_backend_missing()
        if missing:
            return CompileChoice(False, why=f"eval.compile {asked}: eager on npu, falling back: {missing}",
                                 decided_by="setting" if setting else "no trial")
    if setting is None:
        return CompileChoice(True, backend, mode, f"eval.compile null: eager against compiled ({how}) on the "
                                                  f"stage's first chunk decides", decided_by="trial")
    return CompileChoice(True, backend, mode, f"eval.compile true: compiled ({how})")


@dataclass
class Trial:
    """`eval.compile` null's measurement, one per stage: shared by its replicas, so that the first
    chunk of any of them decides for all (a replica that answered eagerly beside one that answered
    compiled would make an episode's bits depend on which replica took its chunk)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    compiled: bool | None = None  # the decision; None: not yet
    why: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    def decide(self, compiled: bool, why: str, figures: dict[str, Any]) -> None:
        self.compiled, self.why, self.figures = compiled, why, figures


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
    trial: Trial | None = None  # choice.trial: the stage's shared measurement
    # (variant, bucket) -> seconds of its first call (the compile and, on CUDA, the capture)
    compile_s: dict[str, float] = field(default_factory=dict)
    fallen_back: str | None = None

    def __post_init__(self) -> None:
        if self.choice.trial and self.trial is None:
            self.trial = Trial()
        entry = spec_of(self.policy).chunk
        self.eager = entry.own(self.policy)
        self.whole = self._compile(self.eager)
        self.pieces = {name: self._compile(fn) for name, fn in entry.pieces(self.policy).items()}
        step = self.pieces["denoise_step"]

        def no_grad_step(**kwargs):  # RTC calls the step under enable_grad (pisft.model.pi05 9.)
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

    @property
    def runs_compiled(self) -> bool:
        """Whether chunks run compiled now (False: fallen back, or the trial chose eager)."""
        return not self.fallen_back and (self.trial is None or self.trial.compiled is not False)

    def record(self) -> dict[str, Any]:
        """`choice.record()` with what happened since: the trial's decision and figures, a fallback."""
        out = self.choice.record()
        if self.trial is not None and self.trial.compiled is not None:
            out.update(compiled=self.trial.compiled, why=self.trial.why, trial=dict(self.trial.figures))
        if self.fallen_back:
            out["compiled"] = False
        return out

    def __call__(self, images, img_masks, tokens, masks, noise=None, num_steps=None, **kwargs):
        def eager():
            return self.eager(images, img_masks, tokens, masks, noise=noise, num_steps=num_steps, **kwargs)

        if self.trial is not None and self.trial.compiled is None:
            with self.trial.lock:  # another replica's first chunk may be measuring: wait for its decision
                if self.trial.compiled is None:
                    return self._measure(eager, images, img_masks, tokens, masks, noise, num_steps, kwargs)
        if not self.runs_compiled:
            return eager()
        start = time.perf_counter()
        try:
            key, first, out = self._compiled(images, img_masks, tokens, masks, noise, num_steps, kwargs)
        except Exception as exc:  # noqa: BLE001 - a compile that fails falls back to eager (below)
            self.fallen_back = _reason(exc)
            self.on_fallback(f"eval.compile: the compiled chunk failed ({self.fallen_back}); falling back to "
                             f"eager for this model")
            return eager()
        if first:
            _synchronize(out)  # the first call's compile and capture have ended on the device too
            self.compile_s[key] = time.perf_counter() - start
        return out

    def _compiled(self, images, img_masks, tokens, masks, noise, num_steps, kwargs) -> tuple[str, bool, Any]:
        """One compiled chunk: (its variant@bucket, whether that was its first call, the actions)."""
        n = tokens.shape[0]
        size = bucket(n)
        padded = [_pad_rows(x, n, size) for x in (images, img_masks, tokens, masks, noise)]
        rtc = {k: _pad_rows(v, n, size) for k, v in kwargs.items()}
        with_rtc = rtc.get("prev_chunk_left_over") is not None
        guided = spec_of(self.policy).chunk.velocity_hooked(self.policy)
        variant = f"{'rtc' if with_rtc else 'chunk'}{'_guided' if guided else ''}"
        key = f"{variant}@{size}"
        first = key not in self.compile_s
        self._mark_step()
        if with_rtc:
            with spec_of(self.policy).chunk.pieces_installed(self.policy, self.pieces):
                out = self.eager(*padded[:4], noise=padded[4], num_steps=num_steps, **rtc)
        else:
            out = self.whole(*padded[:4], noise=padded[4], num_steps=num_steps, **rtc)
        return key, first, out[:n].clone()  # a CUDA graph's output is overwritten by its next replay

    def _measure(self, eager: Callable, images, img_masks, tokens, masks, noise, num_steps, kwargs) -> Any:
        """The trial (module docstring) on this chunk; the chunk's actions from the chosen path."""
        def compiled():
            return self._compiled(images, img_masks, tokens, masks, noise, num_steps, kwargs)[2]

        eager_ms, eager_out = _timed(eager)
        figures: dict[str, Any] = {"batch": int(tokens.shape[0]), "warmup": TRIAL_WARMUP, "reps": TRIAL_REPS,
                                   "eager_ms": eager_ms}
        start = time.perf_counter()
        try:
            key, _, first = self._compiled(images, img_masks, tokens, masks, noise, num_steps, kwargs)
            _synchronize(first)
            self.compile_s[key] = figures["compile_s"] = time.perf_counter() - start
            figures["compiled_ms"], compiled_out = _timed(compiled)
        except Exception as exc:  # noqa: BLE001 - a compile that fails chooses eager (one line)
            self.fallen_back = _reason(exc)
            return self._decide(False, f"eval.compile null: eager, the compiled chunk failed on the stage's first "
                                       f"chunk ({self.fallen_back})", figures, eager_out)
        diff = float((compiled_out.float() - eager_out.float()).abs().max())
        atol = tolerance(self.policy)
        figures.update(actions_max_abs_diff=diff, actions_atol=atol)
        if not diff <= atol:  # NaN too
            return self._decide(False, f"eval.compile null: eager, the compiled chunk's actions differ from eager's "
                                       f"by more than {atol:g} (normalised units) on the stage's first chunk",
                                figures, eager_out)
        median_c, median_e = figures["compiled_ms"]["median"], eager_ms["median"]
        if median_c <= (1 - TRIAL_MIN_GAIN) * median_e:
            return self._decide(True, "eval.compile null: compiled, faster than eager on the stage's first chunk "
                                      "(trial: both figures)", figures, compiled_out)
        return self._decide(False, f"eval.compile null: eager, the compiled chunk was not {TRIAL_MIN_GAIN:.0%} "
                                   f"faster on the stage's first chunk (trial: both figures)", figures, eager_out)

    def _decide(self, compiled: bool, why: str, figures: dict[str, Any], out: Any) -> Any:
        """Record the trial's decision, say it in one line, and answer the chunk with `out`."""
        figures["chose"] = "compiled" if compiled else "eager"
        self.trial.decide(compiled, why, figures)
        e, c = figures["eager_ms"]["median"], figures.get("compiled_ms", {}).get("median")
        measured = f"eager {e:.1f} ms" + (f", compiled {c:.1f} ms" if c is not None else "")
        detail = f" (batch {figures['batch']}: {measured}, medians of {TRIAL_REPS})"
        self.on_fallback(why + detail)
        if not compiled:  # the compiled programs (and, on CUDA, their graphs' memory) are not needed
            self.whole, self.pieces = None, {}
        return out


def _synchronize(out: Any) -> None:
    if isinstance(out, torch.Tensor):  # else nothing ran on a device
        device_mod.synchronize(out.device.type, out.device)


def _timed(fn: Callable) -> tuple[dict[str, Any], Any]:
    """`TRIAL_WARMUP` calls of `fn`, then `TRIAL_REPS` timed to the device's end: ms (each, median), the last output."""
    for _ in range(TRIAL_WARMUP):
        out = fn()
    times = []
    for _ in range(TRIAL_REPS):
        start = time.perf_counter()
        out = fn()
        _synchronize(out)
        times.append(1000.0 * (time.perf_counter() - start))
    return {"each": times, "median": statistics.median(times)}, out


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


def install(policy, choice: CompileChoice, *, on_fallback: Callable[[str], None] = print,
            trial: Trial | None = None) -> CompiledChunk | None:
    """Compile `policy`'s chunk as `choice` says (None when it says eager); `trial`: the stage's shared
    one when `choice.trial` (None: this chunk's own)."""
    if not choice.enabled:
        return None
    from torch._dynamo import config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    chunk = CompiledChunk(policy, choice, on_fallback=on_fallback, trial=trial if choice.trial else None)
    spec_of(policy).chunk.install(policy, chunk)
    return chunk


def tolerance(policy) -> float:
    """`ACTIONS_ATOL` of the policy's precision (its VLM's weights)."""
    return ACTIONS_ATOL[spec_of(policy).weights_dtype(policy)]
