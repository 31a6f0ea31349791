"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic, verified, pruned.

Layout of one checkpoint, `<root>/step_XXXXXX/`:
  dcp/                     model + optimizer state (DCP, sharded; loads on any world size)
  trainer_state.json       step, scheduler state, world size, fingerprint of the run
  rng/rank_XXXXX.json      each rank's torch / numpy / python RNG state
  pisft_config.json        the resolved config that wrote it
  COMPLETE.json            written last: step and the size of every file above

Save: every rank writes into `<root>/.step_XXXXXX.tmp/`; after a barrier rank 0 writes
COMPLETE.json (fsync) and renames the directory into place, then prunes to the last K. A crash
at any moment leaves either a temporary directory (ignored and removed later) or a complete
checkpoint. Load: the newest checkpoint whose COMPLETE.json exists and whose files all exist
with the recorded sizes; anything else (half-written, truncated) is reported and skipped.
The checkpoint folder must be on a filesystem that every node sees (multi-node runs).
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from pisft.errors import PisftError

MARKER = "COMPLETE.json"
STEP_RE = re.compile(r"^step_(\d{6,})$")
TMP_RE = re.compile(r"^\.step_\d{6,}\.tmp$")


class CheckpointMismatch(PisftError):
    """The checkpoint to resume from was written by a different run configuration."""


@dataclass(frozen=True)
class Found:
    path: Path
    step: int


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json_synced(path: Path, obj: Any) -> None:
    with path.open("w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def _file_sizes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_size
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MARKER}


def verify(path: Path) -> str | None:
    """None if `path` is a complete checkpoint, else the reason it is not."""
    marker = path / MARKER
    if not marker.is_file():
        return f"no {MARKER} (the save did not finish)"
    try:
        meta = json.loads(marker.read_text())
        files = meta["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return f"{MARKER} unreadable ({exc})"
    if "dcp/.metadata" not in files:
        return "no DCP metadata recorded"
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} has {f.stat().st_size} bytes, {size} recorded (truncated or altered)"
    return None


def list_checkpoints(root: Path) -> list[Found]:
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append(Found(p, int(m.group(1))))
    return sorted(found, key=lambda f: f.step)


def latest_complete(root: Path, log=print) -> Found | None:
    """The newest complete checkpoint under root; incomplete ones are reported and skipped."""
    for found in reversed(list_checkpoints(root)):
        problem = verify(found.path)
        if problem is None:
            return found
        log(f"checkpoint {found.path}: skipped, {problem}")
    return None


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
        "python": json.loads(json.dumps(random.getstate(), default=list)),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])),
                                         dtype=torch.uint8).clone())
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def fingerprint_mismatches(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(stored) | set(current)):
        if stored.get(key) != current.get(key):
            out.append(f"{key}: checkpoint {stored.get(key)!r}, now {current.get(key)!r}")
    return out


def _saved_optimizer_state(optim_sd: dict[str, Any], saved: set[str]) -> dict[str, Any]:
    """The optimizer state to load: only the entries the checkpoint has.

    Parameters that never received a gradient (in pi0.5, e.g. the last VLM layer's output
    projection and MLP) have no AdamW state when a checkpoint is written, while a fresh
    optimizer's state dict lists (zero) state for every parameter. Those entries are left as
    they are (the optimizer skips parameters without gradients); the model itself must load
    completely (DCP raises on any missing model key).
    """
    state = {}
    for fqn, entry in optim_sd.get("state", {}).items():
        kept = {k: v for k, v in entry.items() if f"optim.state.{fqn}.{k}" in saved}
        if kept:
            state[fqn] = kept
    return {**optim_sd, "state": state}


class CheckpointManager:
    def __init__(self, root: Path, *, keep_last: int, rank: int, world_size: int,
                 fingerprint: dict[str, Any], config: dict[str, Any], log=print) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self.fingerprint = fingerprint
        self.config = config
        self.log = log

    # ---------------- save ----------------
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Any, extra: dict[str, Any] | None = None) -> Path:
        final = self.root / step_dir_name(step)
        tmp = self.root / f".{step_dir_name(step)}.tmp"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        _write_json_synced(tmp / "rng" / f"rank_{self.rank:05d}.json", _rng_state())
        dist.barrier()
        if self.rank == 0:
            state = {
                "step": step,
                "world_size": self.world_size,
                "scheduler": scheduler.state_dict(),
                "fingerprint": self.fingerprint,
                **(extra or {}),
            }
            _write_json_synced(tmp / "trainer_state.json", state)
            _write_json_synced(tmp / "pisft_config.json", self.config)
            _write_json_synced(tmp / MARKER, {"step": step, "files": _file_sizes(tmp)})
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync_dir(self.root)
            self.prune()
        dist.barrier()
        return final

    def prune(self) -> None:
        """Keep the newest `keep_last` complete checkpoints; drop stale temporaries."""
        complete = [f for f in list_checkpoints(self.root) if verify(f.path) is None]
        for old in complete[:-self.keep_last] if self.keep_last > 0 else complete:
            shutil.rmtree(old.path, ignore_errors=True)
        for p in self.root.iterdir():
            if TMP_RE.match(p.name):
                shutil.rmtree(p, ignore_errors=True)

    # ---------------- load ----------------
    def find_resume(self) -> Found | None:
        """Rank 0 picks the checkpoint (reporting skipped ones); every rank gets the same."""
        choice: list[Any] = [None]
        if self.rank == 0:
            found = latest_complete(self.root, log=self.log)
            choice[0] = None if found is None else (str(found.path), found.step)
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        return Found(Path(choice[0][0]), int(choice[0][1]))

    def load(self, found: Found, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Any) -> dict[str, Any]:
        state = json.loads((found.path / "trainer_state.json").read_text())
        problems = fingerprint_mismatches(state.get("fingerprint", {}), self.fingerprint)
        if problems:
            raise CheckpointMismatch(
                f"{found.path} was written by a different run and cannot be resumed:\n  - "
                + "\n  - ".join(problems)
                + f"\nRestore the previous settings to resume it, or delete {self.root} to start "
                "this configuration from step 0."
            )
        model_sd, optim_sd = get_state_dict(model, optimizer)
        saved = set(dcp.FileSystemReader(str(found.path / "dcp")).read_metadata().state_dict_metadata)
        target = {"model": model_sd, "optim": _saved_optimizer_state(optim_sd, saved)}
        dcp.load(target, checkpoint_id=str(found.path / "dcp"))
        set_model_state_dict(model, target["model"])  # strict: every tensor of the model
        # Optimizer: parameters that never had a gradient have no saved state (see above).
        set_optimizer_state_dict(model, optimizer, target["optim"],
                                 options=StateDictOptions(strict=False))
        scheduler.load_state_dict(state["scheduler"])
        rng_file = found.path / "rng" / f"rank_{self.rank:05d}.json"
        if state.get("world_size") == self.world_size and rng_file.is_file():
            _set_rng_state(json.loads(rng_file.read_text()))
        return state
