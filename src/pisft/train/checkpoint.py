"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic, verified, pruned. The run
folder they live in (`checkpoint_root`: one folder per `run_fingerprint`) is pisft.train.run_folders'.

Layout of one checkpoint, `<root>/step_XXXXXX/`:
  dcp/                     what training changes: the trained parameters (and the buffers) with
                           their optimizer state (DCP, sharded; loads on any world size). Frozen
                           parameters (train.trainable other than `all`) are not in it: they are
                           the base model's, which trainer_state.json names (`base`)
  trainer_state.json       step, scheduler state, world size, fingerprint of the run, the base
                           model the checkpoint applies to (`pisft.base_identity.base_record`)
  rng/rank_XXXXX.json      each rank's torch / numpy / python RNG state (seeded per rank from
                           train.seed, `seed_host_generators`: equal runs write equal bytes)
  pisft_config.json        the resolved config that wrote it
  COMPLETE.json            written last: the commit marker (its presence means the save
                           finished): {"step", "files": {relpath: {"sha256", "size"}} of every
                           file above, "written_by": {"stage", "command"} when a stage runs}, the
                           files record of a stage output's MANIFEST.json (`pisft.io.write_manifest`),
                           compared with the folder by the same function (`pisft.io.compare_files`).
                           A marker written before that record (issue 48: "files" relpath -> size
                           and "sha256" relpath -> hex beside it) is read too: such checkpoints are
                           still found, verified and resumed

Save: every rank writes into `<root>/.step_XXXXXX.tmp/`; after a barrier the ranks hash the
files (each rank a share, balanced by size), rank 0 writes COMPLETE.json (fsync) and renames
the directory into place, then prunes to the last K. A crash at any moment leaves either a
temporary directory (ignored and removed later) or a complete checkpoint. Load: the newest
checkpoint whose COMPLETE.json exists, whose files all exist with the recorded sizes and whose
content matches the recorded sha256 (the ranks again share the hashing, then
`pisft.io.compare_files` compares what they computed with the record; files it does not list
are not looked at); a damaged one (bytes altered without a size change, truncated, a file
missing) is reported and skipped for the previous one, and when checkpoints exist but every
one is damaged the run stops instead of silently starting over. The checkpoint folder must be
on a filesystem that every node sees.

Why sha256: measured on this project's 2-core host (hashlib/zlib over 384 MiB in memory, 8 MiB
updates, best of 3, two runs on a host shared with other jobs, load 4-6): sha256 0.45-0.76 GB/s
(SHA-NI), crc32 0.51-1.85, adler32 0.46-1.58, sha1 0.20-1.05, blake2b 0.11-0.42, md5 0.11-0.36.
At pi0.5 size a checkpoint is 3.6e9 parameters × 4 bytes × 3 (fp32 weights + 2 AdamW moments)
= 43.2 GB, 5.4 GB per rank on 8 ranks: sha256 costs 7-12 s per rank (crc32 3-11 s), once per
save and once per resume, the ranks in parallel. A save every 1000 steps of ~1 s costs ~1%;
writing the 5.4 GB takes as long. sha256 is chosen: the same order of cost as a CRC on CPUs with
SHA extensions, no alteration goes unseen, and the project's MANIFEST.json already uses it.
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
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from pisft import disk_space
from pisft.errors import PisftError
from pisft.io import FileProblem, compare_files, current_writer, sha256_file
from pisft.base_identity import base_id, same_base

MARKER = "COMPLETE.json"
STEP_RE = re.compile(r"^step_(\d{6,})$")
TMP_RE = re.compile(r"^\.step_\d{6,}\.tmp$")


class CheckpointMismatch(PisftError):
    """The checkpoint to resume from was written by a different run configuration."""


class OtherBase(CheckpointMismatch):
    """The checkpoint's trained weights apply to another base model than this run's."""


# What a checkpoint holds of the model: the trained parameters (requires_grad) and the buffers.
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)


def frozen_names(model: torch.nn.Module) -> set[str]:
    """State-dict names of frozen parameters, tied aliases included (torch's ignore_frozen_params
    drops only the first name of a tied parameter: pi0.5's frozen 257k-row token embedding would
    stay in every checkpoint under its second name)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _trained_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    frozen = frozen_names(model)
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd


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


INCOMPLETE = "the save did not finish"


def _record(meta: dict) -> dict[str, dict]:
    """The marker's files record, relpath -> {"size", "sha256"} (the latter where recorded), from
    either layout: today's (MANIFEST.json's `files`) or the one before it ("files": relpath ->
    size, "sha256": relpath -> hex; absent in the oldest markers)."""
    files = meta["files"]
    if not isinstance(files, dict):
        raise TypeError("files is not a mapping")
    old_sums = meta.get("sha256") if isinstance(meta.get("sha256"), dict) else {}
    record = {}
    for rel, entry in files.items():
        if isinstance(entry, dict):
            size, digest = entry.get("size"), entry.get("sha256")
        else:  # the earlier layout
            size, digest = entry, old_sums.get(rel)
        if not isinstance(size, int) or isinstance(size, bool):
            raise TypeError(f"no size recorded for {rel}")
        record[rel] = {"size": size, **({"sha256": digest} if isinstance(digest, str) else {})}
    return record


def _marker(path: Path) -> tuple[dict | None, str | None]:
    """(the marker with its files record in today's layout (`_record`), None) or (None, why not)."""
    marker = path / MARKER
    if not marker.is_file():
        return None, f"no {MARKER} ({INCOMPLETE})"
    try:
        meta = json.loads(marker.read_text())
        meta["files"] = _record(meta)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return None, f"{MARKER} unreadable ({exc})"
    return meta, None


def _share(files: dict[str, int], rank: int, world_size: int) -> list[str]:
    """This rank's share of the files to hash: largest first, each to the least loaded rank."""
    load = [0] * world_size
    mine = []
    for rel in sorted(files, key=lambda r: (-files[r], r)):
        who = load.index(min(load))
        load[who] += files[rel]
        if who == rank:
            mine.append(rel)
    return mine


def _gather(part: dict[str, Any], world_size: int) -> dict[str, Any]:
    if world_size <= 1 or not dist.is_initialized():
        return dict(part)
    parts: list[Any] = [None] * world_size
    dist.all_gather_object(parts, part)
    return {k: v for p in parts for k, v in p.items()}


def checksums(root: Path, files: dict[str, int], rank: int = 0, world_size: int = 1) -> dict[str, str]:
    """sha256 of `files` (relative path -> size) under root; collective when world_size > 1."""
    return _gather({rel: sha256_file(root / rel) for rel in _share(files, rank, world_size)},
                   world_size)


def verify(path: Path, content: bool = True, rank: int = 0, world_size: int = 1) -> str | None:
    """None if `path` is a complete, undamaged checkpoint, else the reason it is not.

    content=False checks presence and sizes only (cheap). With world_size > 1 it is a
    collective: every rank must call it with the same path (each hashes its share).
    """
    meta, problem = _marker(path)
    if problem is None:
        problem = _verify_sizes(path, meta["files"])
    if not content:
        return problem
    if world_size > 1 and dist.is_initialized():  # every rank takes the same branch
        flag = [problem]
        dist.broadcast_object_list(flag, src=0)
        problem = flag[0]
    if problem is not None:
        return problem
    record = meta["files"]
    if any("sha256" not in entry for entry in record.values()):
        return f"no content checksums recorded in {MARKER} (written by an older pisft)"
    actual = checksums(path, {rel: entry["size"] for rel, entry in record.items()}, rank, world_size)
    found = compare_files(path, record, sha256=actual)
    bad = [p.rel for p in found if p.kind == "sha256"]
    if len(bad) < len(found):  # a file removed or resized since the sizes were checked
        return _problem_text(next(p for p in found if p.kind != "sha256"))
    if bad:
        return (f"content damaged: sha256 of {', '.join(bad[:5])}"
                f"{' …' if len(bad) > 5 else ''} differs from {MARKER} (same size, altered bytes)")
    return None


def _problem_text(problem: FileProblem) -> str:
    if problem.kind == "missing":
        return f"{problem.rel} is missing"
    return f"{problem.rel} has {problem.size} bytes, {problem.recorded} recorded (truncated or altered)"


def _verify_sizes(path: Path, record: dict[str, dict]) -> str | None:
    """The first file of the record missing or of another size (`compare_files` without content)."""
    if "dcp/.metadata" not in record:
        return "no DCP metadata recorded"
    found = compare_files(path, record)
    return _problem_text(found[0]) if found else None


class CheckpointsDamaged(PisftError):
    """Checkpoints exist but none can be resumed safely."""


def list_checkpoints(root: Path) -> list[Found]:
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append(Found(p, int(m.group(1))))
    return sorted(found, key=lambda f: f.step)


def latest_complete(root: Path, log=print, content: bool = True, rank: int = 0,
                    world_size: int = 1, candidates: list[Found] | None = None) -> Found | None:
    """The newest complete, undamaged checkpoint under root; others are reported and skipped.

    Raises CheckpointsDamaged when checkpoints exist, none is usable and at least one is
    damaged (rather than incomplete): starting over from step 0 would hide the damage.
    Collective when world_size > 1 (the ranks share the hashing; only rank 0 logs); then
    every rank passes rank 0's listing as `candidates`.
    """
    damaged = []
    for found in reversed(list_checkpoints(root) if candidates is None else candidates):
        problem = verify(found.path, content=content, rank=rank, world_size=world_size)
        if problem is None:
            return found
        if rank == 0:
            log(f"checkpoint {found.path}: skipped, {problem}")
        if INCOMPLETE not in problem:
            damaged.append(f"{found.path.name}: {problem}")
    if damaged:
        writer = (current_writer() or {}).get("stage") or "the training stage"
        raise CheckpointsDamaged(
            f"no usable checkpoint in {root}: every complete one differs from what {writer} wrote "
            f"({'; '.join(damaged)}); a resume cannot use them and starting over would hide the damage: "
            f"restore them from a backup, or delete {root} and rerun the same command to start this run "
            "from step 0")
    return None


def seed_host_generators(seed: int, rank: int) -> None:
    """Seed Python's `random` and NumPy's global generator for one rank from the run's seed
    (train.seed), as torch's is (`pisft.train.job.build`): a checkpoint saves all three
    (`rng/rank_XXXXX.json`), and unseeded ones start from the OS's entropy, so two identical
    runs wrote different checkpoint bytes (issue 56). Per rank: (seed, rank) through NumPy's
    SeedSequence, so no two ranks draw alike and the same rank of a rerun draws the same."""
    words = np.random.SeedSequence([seed, rank]).generate_state(4)  # 4 uint32 words
    random.seed(int.from_bytes(words.tobytes(), "little"))
    np.random.seed(words)


class _CheckpointWriter(FileSystemWriter):
    """DCP's file writer (the one `dcp.save(checkpoint_id=...)` makes), whose `.metadata` records
    neither the random save id it draws per save (uuid4) nor the absolute path it wrote to (the
    temporary folder, renamed right after): with them, equal checkpoints had different bytes.
    Nothing reads them back: torch 2.11's `_FileSystemWriter.storage_meta` writes them into
    `Metadata.storage_meta`, which a reader only gives its own load id
    (torch/distributed/checkpoint/filesystem.py)."""

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta()


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
                 fingerprint: dict[str, Any], config: dict[str, Any], log=print,
                 base: dict[str, Any] | None = None) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self.fingerprint = fingerprint
        self.config = config
        self.log = log
        self.base = base  # base_record of the model training started from (None: not checked)

    # ---------------- save ----------------
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Any, extra: dict[str, Any] | None = None, ema: Any = None) -> Path:
        final = self.root / step_dir_name(step)
        tmp = self.root / f".{step_dir_name(step)}.tmp"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = _trained_state(model, optimizer)
        pieces = {"model": model_sd, "optim": optim_sd}
        if ema is not None:  # the weights' EMA (pisft.train.ema), sharded like the parameters
            pieces["ema"] = ema.state_dict()
        # A checkpoint that cannot fit is refused before writing; a full disk while writing is one line.
        room = disk_space.checkpoint_room(self.root, pieces, rank=self.rank, world_size=self.world_size)
        named = {"what": f"checkpoint of step {step}", "needed": room[0], "kept": self.kept_text}
        disk_space.require_room(self.root, room[0], free=room[1], what=named["what"], kept=self.kept_text)
        with disk_space.named_full_disk(self.root, **named):
            dcp.save(pieces, storage_writer=_CheckpointWriter(str(tmp / "dcp")))
        _write_json_synced(tmp / "rng" / f"rank_{self.rank:05d}.json", _rng_state())
        dist.barrier()
        # Every rank hashes a share of what the ranks wrote (rank 0 adds its own files below).
        shared_sums = checksums(tmp, _file_sizes(tmp), self.rank, self.world_size)
        if self.rank == 0:
            state = {
                "step": step,
                "world_size": self.world_size,
                "scheduler": scheduler.state_dict(),
                "fingerprint": self.fingerprint,
                "base": self.base,
                **(extra or {}),
            }
            _write_json_synced(tmp / "trainer_state.json", state)
            _write_json_synced(tmp / "pisft_config.json", self.config)
            files = _file_sizes(tmp)
            sums = {**shared_sums, **checksums(tmp, {k: v for k, v in files.items()
                                                     if k not in shared_sums})}
            # MANIFEST.json's record (pisft.io.write_manifest), with the step: the commit marker.
            marker: dict[str, Any] = {"step": step, "files": {rel: {"sha256": sums[rel], "size": size}
                                                              for rel, size in files.items()}}
            if writer := current_writer():
                marker["written_by"] = writer
            _write_json_synced(tmp / MARKER, marker)
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync_dir(self.root)
            self.prune()
        dist.barrier()
        return final

    def kept_text(self) -> str:
        """What a failed save leaves: the latest complete checkpoint (sizes checked)."""
        found = latest_complete(self.root, log=lambda _msg: None, content=False)
        return (f"the latest complete checkpoint {found.path} (step {found.step})" if found
                else f"no complete checkpoint in {self.root} yet (a rerun starts from step 0)")

    def prune(self) -> None:
        """Keep the newest `keep_last` complete checkpoints; drop stale temporaries."""
        complete = [f for f in list_checkpoints(self.root) if verify(f.path, content=False) is None]
        for old in complete[:-self.keep_last] if self.keep_last > 0 else complete:
            shutil.rmtree(old.path, ignore_errors=True)
        for p in self.root.iterdir():
            if TMP_RE.match(p.name):
                shutil.rmtree(p, ignore_errors=True)

    # ---------------- load ----------------
    def find_resume(self) -> Found | None:
        """Rank 0 picks the checkpoint (reporting skipped ones); every rank gets the same."""
        # Rank 0's listing is the one every rank walks through (same candidates, same order).
        listing: list[Any] = [None]
        if self.rank == 0:
            listing[0] = [(str(f.path), f.step) for f in list_checkpoints(self.root)]
        dist.broadcast_object_list(listing, src=0)
        candidates = [Found(Path(p), int(s)) for p, s in listing[0]]
        return latest_complete(self.root, log=self.log, rank=self.rank,
                               world_size=self.world_size, candidates=candidates)

    def load(self, found: Found, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Any, ema: Any = None) -> dict[str, Any]:
        state = json.loads((found.path / "trainer_state.json").read_text())
        self.check_base(found, state)
        problems = fingerprint_mismatches(state.get("fingerprint", {}), self.fingerprint)
        if problems:
            raise CheckpointMismatch(
                f"{found.path} was written by a different run and cannot be resumed:\n  - "
                + "\n  - ".join(problems)
                + f"\nRestore the previous settings to resume it, or delete {self.root} to start "
                "this configuration from step 0."
            )
        model_sd, optim_sd = _trained_state(model, optimizer)
        saved = set(dcp.FileSystemReader(str(found.path / "dcp")).read_metadata().state_dict_metadata)
        target = {"model": model_sd, "optim": _saved_optimizer_state(optim_sd, saved)}
        if ema is not None:  # loaded in place into the EMA's (sharded) tensors
            target["ema"] = ema.state_dict()
        dcp.load(target, checkpoint_id=str(found.path / "dcp"))  # raises on any trained tensor missing
        # Strict for what the checkpoint holds (every trained parameter and buffer); the frozen
        # parameters are the base model's, loaded with it.
        result = set_model_state_dict(model, target["model"], options=StateDictOptions(strict=False))
        missing = sorted(set(result.missing_keys) - frozen_names(model))
        if missing or result.unexpected_keys:
            raise CheckpointMismatch(f"{found.path}: the model does not match the checkpoint: missing "
                                     f"{missing[:5]}, unexpected {list(result.unexpected_keys)[:5]}; delete "
                                     f"{self.root} to start this configuration from step 0")
        # Optimizer: parameters that never had a gradient have no saved state (see above).
        set_optimizer_state_dict(model, optimizer, target["optim"],
                                 options=StateDictOptions(strict=False))
        scheduler.load_state_dict(state["scheduler"])
        rng_file = found.path / "rng" / f"rank_{self.rank:05d}.json"
        if state.get("world_size") == self.world_size and rng_file.is_file():
            _set_rng_state(json.loads(rng_file.read_text()))
        return state

    def check_base(self, found: Found, state: dict[str, Any]) -> None:
        """Refuse a checkpoint whose trained weights apply to another base model than this run's."""
        stored = state.get("base")
        if self.base is None or stored is None or same_base(stored, self.base):
            return
        raise OtherBase(
            f"{found.path} holds weights trained on the base model {stored.get('dir')} "
            f"({base_id(stored)}), but this run starts from {self.base.get('dir')} ({base_id(self.base)}): "
            "the frozen weights it needs are another model's, so it cannot be resumed. Point the "
            f"run at its base model again, or delete {self.root} to start this configuration from step 0.")
