"""What a model's training structure offers pisft's training, whatever the model: its FSDP2 units
(`Unit`; the spec's `fsdp_units` lists them, pisft.train.fsdp shards them) and its blocks (the runner
a block's first layer holds, `BLOCK_RUNNER`, which pisft.train.blocks installs; `checkpointed`, the
activation checkpoint a block runs under). Model-neutral: a model's folder builds its units of these
(pi0.5's: `pisft.model.pi05.units`) and runs its blocks through them (`pisft.model.pi05.forward.run_block`),
and pisft.train applies them, neither importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

BLOCK_RUNNER = "pisft_block_runner"  # attribute of a block's first layer (pisft.train.blocks)


@dataclass(frozen=True)
class Unit:
    """One FSDP2 unit: the modules `fully_shard` takes as one parameter group."""

    name: str
    group: str  # vision | decoder | vlm_decoder | action | embed | other: units of one group merge (the CPU's)
    modules: tuple[nn.Module, ...]
    reshard_after_forward: bool = True
    # The blocks it holds (pisft.train.blocks): the first layer of each block the training forward
    # runs through its runner (`BLOCK_RUNNER`; pi0.5: a decoder layer pair's VLM layer), and the
    # layers called as modules that are compiled whole (pi0.5: SigLIP's encoder layers).
    anchors: tuple[nn.Module, ...] = ()
    compiled_modules: tuple[nn.Module, ...] = ()

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def numel(self) -> int:
        return sum(p.numel() for p in self.parameters())


def checkpointed(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` with its activations recomputed in backward: LeRobot's per-layer
    checkpoint (`torch.utils.checkpoint`, non-reentrant, no RNG state: the layers draw none)."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
