"""What of a tensor this process holds: a DTensor's local shard, its elements and bytes.

FSDP2 holds every sharded parameter, gradient and optimizer moment as a DTensor whose `numel()`
is the global one; the memory a process holds is its local shard's. Every count of "this
process's bytes" (the smoke gate, the sharding report, the EMA, the memory estimate and its
measurement, the checkpoint-size check) asks here, and so does every count of an optimizer's state
(`optimizer_state`).

The shard is the DTensor's own local tensor (`DTensor._local_tensor`, what `DTensor.to_local()`
returns with autograd off: torch 2.11 `torch/distributed/tensor/_api.py`), taken without a call
into torch: the memory estimate asks inside its dispatch mode, where an operation would be
recorded. It shares the DTensor's storage, so an in-place update of it (the EMA, a gradient
zeroed) updates the DTensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor that holds this process's memory); any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t  # noqa: SLF001 - to_local() without a dispatch (above)


def local_numel(t: torch.Tensor) -> int:
    """The elements of `t` this process holds."""
    return local_shard(t).numel()


def local_bytes(tensors: torch.Tensor | Iterable[torch.Tensor]) -> int:
    """The bytes of `tensors` (or of one tensor) this process holds, each counted as often as given."""
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    return sum(local_shard(t).numel() * local_shard(t).element_size() for t in tensors)


def optimizer_state(optimizer: torch.optim.Optimizer, *, scalars: bool = False) -> list[torch.Tensor]:
    """The tensors an optimizer keeps for its parameters (AdamW's two moments per parameter), in
    its order; with `scalars`, its 0-d ones too (AdamW's step counts)."""
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and (scalars or v.dim() > 0)]
