"""Operations the host dispatches per training micro-step: host overhead as a count.

An accelerator idles while its host prepares the next operation: on the H200 pi0.5's step was
host-bound, about 13,000 kernel launches per step with the card busy a third of it
(docs/what-has-run-where.md). How many operations the host dispatches needs no clock and no
accelerator, so it is counted here on any machine, and counts the same wherever it is counted:

- every aten operator call that reaches the dispatcher (`torch.utils._python_dispatch`'s
  TorchDispatchMode): all of an eager step's operators, views included (each costs host time);
  in a compiled step the operators its graphs still call (matrix products, attention,
  collectives' copies) and everything outside the compiled regions (FSDP2, clipping, AdamW);
- every kernel a compiled graph launches itself: inductor's generated C++ kernels on the CPU
  are called from its Python wrapper as functions of a module loaded from inductor's cache
  (`torch._inductor.codecache.CppPythonBindingsCodeCache`, entry function `kernel`), seen here
  through `sys.setprofile`'s C-call events. On CUDA the compiled kernels are Triton launches:
  `pisft.bench.gpu_step` counts those with torch.profiler instead.

The mode declares `ignore_compile_internals`, so Dynamo runs compiled code under it (a mode
without it makes Dynamo fall back to eager, `torch._dynamo.convert_frame`'s dispatch-mode skip).
Count after a warm-up: the first call of a compiled block compiles it, and its tracing is not a
step's work.
"""

from __future__ import annotations

import sys
from collections import Counter
from types import FrameType
from typing import Any

from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

KERNEL_ENTRY = "kernel"  # CppPythonBindingsCodeCache.entry_function: a generated C++ kernel's name
# Metadata queries, not operations: a fake tensor answers `.device` through `prim.device`, a real one
# in C++ without dispatching (the real-size eager count runs on fake tensors).
METADATA_NAMESPACES = ("prim",)


def _inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


class DispatchedOps(TorchDispatchMode):
    """Counts the aten operators dispatched, and the compiled kernels launched, while active.

    `ops` by operator name; `compiled_kernels` the generated kernels called; `total` both."""

    # Compiled graphs call higher-order operators at run time (a checkpointed region's
    # `run_and_save_rng_state`): each is one dispatched operation.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # run compiled code under the mode (module docstring)
        return True

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.compiled_kernels = 0
        self._kernel_modules: dict[str, bool] = {}
        self._previous_profile: Any = None
        self._cache = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, HigherOrderOperator):
            self.ops[f"higher_order.{func.name()}"] += 1
        elif func.namespace not in METADATA_NAMESPACES:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def _is_compiled_kernel(self, fn: Any) -> bool:
        module = getattr(fn, "__module__", None)
        if getattr(fn, "__name__", None) != KERNEL_ENTRY or not module:
            return False
        known = self._kernel_modules.get(module)
        if known is None:
            loaded = sys.modules.get(module)
            known = (getattr(loaded, "__file__", None) or "").startswith(self._cache)
            self._kernel_modules[module] = known
        return known

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:  # noqa: ARG002 - sys.setprofile's
        if event == "c_call" and self._is_compiled_kernel(arg):
            self.compiled_kernels += 1

    def __enter__(self):
        self._cache = _inductor_cache_dir()
        self._previous_profile = sys.getprofile()
        sys.setprofile(self._profile)
        return super().__enter__()

    def __exit__(self, *exc):
        sys.setprofile(self._previous_profile)
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.ops.values()) + self.compiled_kernels

    def summary(self, top: int = 12) -> dict[str, Any]:
        return {"total": self.total, "aten_ops": sum(self.ops.values()),
                "compiled_kernels": self.compiled_kernels,
                "most_dispatched": dict(self.ops.most_common(top))}
