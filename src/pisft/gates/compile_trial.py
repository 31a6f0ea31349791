"""`train.compile: auto`, decided by measurement on the run's device (the smoke gate, `smoke_1card`).

The gate runs its smoke steps eagerly, then the same steps again with the blocks compiled
(`pisft.train.blocks.Compiler.set_mode`), from the same weights (restored from a host copy taken
before the eager steps), on the same fixed micro-batch with the same flow-matching draws, with a
fresh optimizer state. The compiled run is kept only if

- it ran: a compile that raises, or that has not finished the steps within `TRIAL_BOUND_S`
  (SIGALRM in the gate's main thread: a compile stuck in native code without returning to Python
  is not interrupted), is one line in the report and eager is chosen;
- it agrees with eager: every step's loss and gradient norm within `TOLERANCE` of eager's,
  relative, for the run's precision (fp32: the same arithmetic in another order: on this CPU the
  tiny model's losses leave eager's in the 7th digit, docs/ascend.md; bf16: inductor keeps
  intermediates in fp32 where eager rounds them to bf16, tests/test_train_compile.py);
- it is faster: its median step time after the first (which holds the compilation) below eager's
  by more than `MIN_GAIN`, timing noise.

A default never makes the run slower or less correct than eager. On the CPU the trial is skipped
(eager, and the report says why): compiling the blocks there costs more than the embedded default's
whole training (docs/benchmarks.md). `FORCE_ENV=1` runs it there anyway (the tests, with the tiny
model). An explicit `off` or `layers` runs as written and the gate measures that.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pisft import device as devices
from pisft.train.decisions import AUTO, decision

FORCE_ENV = "PISFT_COMPILE_TRIAL"  # "1": run the trial on the CPU too (tests)
BOUND_ENV = "PISFT_COMPILE_TRIAL_BOUND_S"  # the bound below, in seconds (tests)
TRIAL_BOUND_S = 1200.0  # the compiled smoke steps, compilation included
# relative tolerance of every step's (loss, gradient norm), compiled against eager, by train.precision
TOLERANCE = {"fp32": (1e-4, 1e-3), "bf16": (2e-2, 5e-2)}
MIN_GAIN = 0.02  # compiled is chosen when its step is more than 2% faster than eager's
CPU_SKIP = ("no trial on the CPU: compiling costs more than the default's training saves "
            "(docs/benchmarks.md); train.compile: layers compiles")


class TrialTimeout(Exception):
    """The compiled steps did not finish within the bound."""


def wants_trial(setting: str, kind: str) -> bool:
    """Whether the gate measures compiled against eager: `auto`, off the CPU (or forced)."""
    return setting == AUTO and (devices.row(kind).compile_trial or os.environ.get(FORCE_ENV) == "1")


def first_mode(setting: str) -> str:
    """The mode the gate builds and runs its steps in: eager for `auto` (the trial, if any, comes
    after), else the setting as written."""
    return "off" if setting == AUTO else setting


def as_written(setting: str) -> dict[str, Any]:
    """The decision for an explicit setting, or `auto` on the CPU without a trial."""
    if setting == AUTO:
        return decision(setting, "off", CPU_SKIP, trial=None)
    return decision(setting, setting, f"train.compile: {setting} as written; the gate measured it",
                    trial=None)


def bound_s() -> float:
    raw = os.environ.get(BOUND_ENV, "").strip()
    try:
        return float(raw) if raw else TRIAL_BOUND_S
    except ValueError:
        return TRIAL_BOUND_S


@contextmanager
def time_bound(seconds: float) -> Iterator[dict[str, bool]]:
    """Raise TrialTimeout in this (main) thread after `seconds` (the yielded state's `fired` then
    says so, whatever wraps the exception); elsewhere no bound."""
    state = {"fired": False}
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield state
        return

    def expired(_signum, _frame):
        state["fired"] = True
        raise TrialTimeout(f"the compiled steps did not finish within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield state
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    """A host copy of every parameter and buffer (this process's shard): where both runs start."""
    return [_local(t).detach().to("cpu", copy=True) for t in (*model.parameters(), *model.buffers())]


@torch.no_grad()
def restore(model: torch.nn.Module, saved: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """The weights back to `snapshot`'s, the gradients and the optimizer's state dropped."""
    for t, s in zip((*model.parameters(), *model.buffers()), saved, strict=True):
        _local(t).copy_(s)
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()


def figures(records: list[dict[str, Any]], peak: int | None) -> dict[str, Any]:
    """One run's losses, gradient norms, step times (the median after the first) and peak memory."""
    times = [r["step_time_s"] for r in records]
    return {"losses": [r["loss"] for r in records], "grad_norms": [r["grad_norm"] for r in records],
            "step_times_s": times, "step_time_s": statistics.median(times[1:] if len(times) > 1 else times),
            "peak_memory_bytes": peak}


def _max_rel(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)), default=0.0)


def judge(eager: dict[str, Any], compiled: dict[str, Any], precision: str) -> dict[str, Any]:
    """Compiled against eager: the decision entry (chosen, one line, both figures)."""
    loss_tol, norm_tol = TOLERANCE[precision]
    loss_rel, norm_rel = _max_rel(eager["losses"], compiled["losses"]), _max_rel(eager["grad_norms"],
                                                                                compiled["grad_norms"])
    agree = loss_rel <= loss_tol and norm_rel <= norm_tol
    te, tc = eager["step_time_s"], compiled["step_time_s"]
    speedup = te / tc if tc else None
    trial = {"eager": eager, "compiled": compiled, "agree": agree,
             "max_rel_loss": loss_rel, "max_rel_grad_norm": norm_rel,
             "tolerance": {"loss": loss_tol, "grad_norm": norm_tol, "precision": precision},
             "speedup": speedup, "min_gain": MIN_GAIN}
    if not agree:
        line = (f"compiled disagrees with eager (losses {loss_rel:.2g}, gradient norms {norm_rel:.2g} relative; "
                f"tolerance {loss_tol:g}, {norm_tol:g} in {precision}): eager")
        return decision(AUTO, "off", line, trial=trial)
    if tc < te * (1 - MIN_GAIN):
        return decision(AUTO, "layers", f"compiled {tc:.4g} s a step against eager {te:.4g} s "
                        f"({speedup:.2f}x), within tolerance: layers", trial=trial)
    return decision(AUTO, "off", f"compiled {tc:.4g} s a step against eager {te:.4g} s: not more than "
                    f"{MIN_GAIN:.0%} faster: eager", trial=trial)


def _root(exc: BaseException) -> BaseException:
    """The error a wrapper was raised for (dynamo's BackendCompilerFailed holds the backend's as
    `inner_exception`, and chains it as the cause)."""
    seen = {id(exc)}
    while True:
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if inner is None or id(inner) in seen:
            return exc
        seen.add(id(inner))
        exc = inner


def failed(exc: BaseException, eager: dict[str, Any], timed_out: bool = False) -> dict[str, Any]:
    """The decision when the compiled steps raised or ran past the bound: eager, one line."""
    root = _root(exc)
    what = "hung past its bound" if timed_out or isinstance(root, TrialTimeout) else "failed"
    text = " ".join(str(root).split())[:300]
    named = type(exc).__name__ if root is exc else f"{type(exc).__name__} from {type(root).__name__}"
    line = f"the compiled step {what} ({named}: {text}): eager"
    return decision(AUTO, "off", line, trial={"eager": eager, "compiled": None, "error": line})


def run_trial(compiler: Any, compiled_mode: Callable[[], Any], steps: Callable[[], tuple[list, int | None]],
              eager: dict[str, Any], precision: str, reset: Callable[[], None]) -> dict[str, Any]:
    """The compiled smoke steps (`steps()`: their records and peak memory) under the bound, judged
    against `eager`'s figures; the blocks left in the chosen mode. `compiled_mode()` checks the
    backend (a Compiler, off when there is none); `reset()` brings the weights back to the start."""
    from torch import _dynamo

    backend = compiled_mode()
    if not backend.enabled:
        return decision(AUTO, "off", "no compiler backend on this device (see the log line above): eager",
                        trial={"eager": eager, "compiled": None})
    reset()
    compiler.set_mode("layers")
    bound = {"fired": False}
    try:
        with time_bound(bound_s()) as bound:
            records, peak = steps()
        entry = judge(eager, figures(records, peak), precision)
    except Exception as exc:  # noqa: BLE001 - any failure of the compiled step means eager
        entry = failed(exc, eager, bound["fired"])
        _dynamo.reset()
    compiler.set_mode(entry["chosen"])
    reset()
    return entry
