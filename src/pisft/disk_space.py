"""Name a full disk: one line saying where, how much is free, how much the write needed, what was
kept and how to resume; and a check before a checkpoint or an export that cannot fit.

A write that runs out of space fails deep inside a library: torch.distributed.checkpoint
reports `RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos N vs M` from
its zip writer (the "No space left on device" OSError is only its context, sometimes only in a
log line), pyarrow and PIL raise OSError with errno 28 or a message, and a multi-rank save
surfaces on every rank as a CheckpointException. `is_full_disk` recognises all of them;
`named_full_disk` turns them into `DiskFull` (a PisftError: one line, no traceback), and
`require_room` refuses before any byte is written when the free space is already below what
the write needs (known for checkpoints and exports: the bytes of the tensors written).

What was kept is always what the atomic writes leave (`pisft.io.atomic_dir`, the checkpoints'
`.tmp` folders renamed only when complete): the previous complete output and the latest
complete checkpoint; nothing half-written is taken for complete.
"""

from __future__ import annotations

import contextlib
import errno
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pisft.errors import PisftError

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_TEXTS = ("No space left on device", "Disk quota exceeded")
# torch's zip writer (torch.save, DCP's files) when a write came up short.
SHORT_WRITE_TEXTS = ("unexpected pos", "PytorchStreamWriter failed")
MARK = "no space left on the device"  # in every DiskFull line (the launcher repeats those lines)


class DiskFull(PisftError):
    """A write did not fit (or would not fit) on its file system."""


def free_bytes(path: str | Path) -> int:
    """Free bytes (for this user) on the file system holding `path` or its nearest existing parent."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def human(n: float | None) -> str:
    if n is None:
        return "an unknown amount"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def tensor_bytes(obj: Any, _seen: set | None = None) -> int:
    """Bytes of every tensor in a nested state dict, each storage once (tied weights are written
    once); a DTensor counts its local shard."""
    import torch

    from pisft.tensors import local_shard

    seen = set() if _seen is None else _seen
    if isinstance(obj, torch.Tensor):
        local = local_shard(obj)
        n = local.numel() * local.element_size()
        key = (local.device.type, local.untyped_storage().data_ptr(), local.storage_offset(), n)
        if n and key in seen:
            return 0
        seen.add(key)
        return n
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


def model_bytes(model: Any, *, frozen: bool = True) -> int:
    """Bytes of a model's exported weights: every parameter and buffer at its full (gathered) size
    in the dtype it is held in, each tensor once (an export writes the model whole, LoRA merged).
    `frozen` False: without the frozen parameters but the weights a LoRA adapter is merged into (an
    export that leaves the rest in the model it came from, as the value model's does)."""
    seen: set[int] = set()
    total = 0
    params = {id(p) for p in model.parameters()}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not frozen and id(t) in params and not t.requires_grad and not name.endswith(".base_layer.weight"):
            continue
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()  # a DTensor's numel is the global one
    return total


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]  # type: ignore[list-item]
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> exception
        if isinstance(failures, dict):  # values: an exception, or (exception, traceback)
            for f in failures.values():
                first = f[0] if isinstance(f, tuple) and f else f
                if isinstance(first, BaseException):
                    todo.append(first)


def is_full_disk(exc: BaseException, *, short_write_counts: bool = False) -> bool:
    """Whether `exc` (or what caused it) is a full disk or quota. `short_write_counts`: torch's
    "unexpected pos" (a short write of its zip writer) counts too; the caller checks that the
    disk is indeed short of space."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return True
        text = str(e)
        if any(t in text for t in FULL_TEXTS):
            return True
        if short_write_counts and any(t in text for t in SHORT_WRITE_TEXTS):
            return True
    return False


# An OSError's text as Python writes it, carried inside another error's message.
_FULL_FILE = re.compile(r"(?:No space left on device|Disk quota exceeded): '([^']+)'")


def _filename(exc: BaseException) -> str | None:
    for e in _chain(exc):
        if isinstance(e, OSError) and e.filename:
            return str(e.filename)
    for e in _chain(exc):
        m = _FULL_FILE.search(str(e))
        if m:
            return m.group(1)
    return None


def resume_command() -> str:
    """The command running (recorded by `python -m pisft`), to rerun after freeing space."""
    from pisft.io import current_writer

    writer = current_writer()
    if writer and writer.get("command"):
        return f"{writer['command']} --config FILE (or the same snakemake / dvc repro command)"
    return "the same command"


def full_disk_line(path: str | Path, *, what: str, needed: int | None, kept: str,
                   before: bool = False, resume: str | None = None) -> str:
    """One line: what, where, free now, needed, what was kept, how to resume (`resume`: the
    command; default the one running, `resume_command`)."""
    free = free_bytes(path)
    when = "will not fit" if before else "failed"
    return (f"{what} {when}: {path}: {MARK} ({human(free)} free, the write needs {human(needed)}); "
            f"kept: {kept}; free space there (or set results_dir to a larger disk) and resume with "
            f"{resume or resume_command()}")


def _kept_text(kept: str | Callable[[], str]) -> str:
    if callable(kept):
        try:
            return kept()
        except Exception as exc:  # noqa: BLE001 - the message must come out whatever the listing does
            return f"(could not list what was kept: {exc})"
    return kept


def require_room(path: str | Path, needed: int, *, what: str, kept: str | Callable[[], str],
                 free: int | None = None) -> None:
    """Refuse before writing when the file system of `path` has less than `needed` bytes free
    (`free`: a figure measured once for every rank, so all of them decide alike)."""
    free = free_bytes(path) if free is None else free
    if free < needed:
        raise DiskFull(full_disk_line(path, what=what, needed=needed, kept=_kept_text(kept), before=True))


@contextlib.contextmanager
def named_full_disk(path: str | Path, *, what: str, needed: int | None = None,
                    kept: str | Callable[[], str] = "the previous complete output, if any") -> Iterator[None]:
    """Within: a full disk (however the library reports it) becomes one DiskFull line."""
    try:
        yield
    except DiskFull:
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if not isinstance(exc, Exception) and type(exc).__name__ != "CheckpointException":
            raise  # Ctrl-C, SIGTERM (pisft.errors.Terminated), exit
        short = needed is not None and free_bytes(path) < needed
        if not is_full_disk(exc, short_write_counts=short):
            raise
        where = _filename(exc) or path
        raise DiskFull(full_disk_line(where, what=what, needed=needed, kept=_kept_text(kept))) from None


def checkpoint_room(root: Path, state: Any, *, rank: int, world_size: int) -> tuple[int, int]:
    """(bytes every rank's shard of `state` takes together, bytes free at `root` as rank 0 sees
    it): one all-reduce, so every rank takes the same decision."""
    import torch
    import torch.distributed as dist

    local = tensor_bytes(state)
    free = free_bytes(root) if rank == 0 else 0
    if world_size > 1 and dist.is_initialized():
        t = torch.tensor([local, free], dtype=torch.int64)
        dist.all_reduce(t)
        local, free = int(t[0]), int(t[1])
    return local + (1 << 20), free  # + DCP's metadata and the small files


@contextlib.contextmanager
def export_room(out: Path, state: Any, *, what: str, checkpoints: Callable[[], str],
                extra_bytes: int = 0) -> Iterator[None]:
    """Around an export of `state` into `out`: refused before writing when it cannot fit, and a
    full disk while writing named in one line (what was kept: `checkpoints()`, the training's)."""
    needed = tensor_bytes(state) + extra_bytes + (1 << 20)

    def kept() -> str:
        return checkpoints() + f"; the previous {Path(out).name}/, if any, is unchanged"

    require_room(Path(out).parent, needed, what=what, kept=kept)
    with named_full_disk(Path(out).parent, what=what, needed=needed, kept=kept):
        yield
