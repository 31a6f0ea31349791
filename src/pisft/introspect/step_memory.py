"""The storage tracker of the memory estimate and of its measurement: `StepMemory` follows the
bytes of every tensor storage a step creates, resizes and frees, and marks those that FSDP's
collective code creates (its all-gather and reduce-scatter buffers).

On fake tensors in `pisft.introspect.simulated_step` (the estimate), on real ones in
`pisft.introspect.measure` and `bench --only real_size`.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pisft.tensors import local_shard

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
