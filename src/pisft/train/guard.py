"""One trainer per run folder: workers die with their launcher, rank 0 locks the run folder.

Why workers need help to die. torchrun's agent starts every worker in a session of its own
(`subprocess.Popen(..., start_new_session=True)` in torch.distributed.elastic), so a signal to
Snakemake's or DVC's process group (`kill -9 -PGID`: a power cut of the driver, the OOM killer,
a scheduler) kills the driver, the launcher and the agent, but not the workers. Orphaned
workers go on training and writing into the run folder while a rerun starts a second trainer.
Killing the group together is not possible (the workers are outside it by torch's design), so
each link of the chain asks the kernel to be killed when its parent dies (Linux
`prctl(PR_SET_PDEATHSIG)`):

  `python -m pisft launch` ──> torchrun agent (SIGTERM on the launcher's death: the agent
  then stops its workers) ──> workers (SIGKILL on the agent's death).

Setting it is racy (the parent may die just before), so after setting it each process checks
that its parent is still the process that started it, and exits otherwise.

The lock. Rank 0 holds `fcntl.flock` on `<run folder>/.trainer.lock` for the whole run; the
kernel releases it when the process dies, however it dies, so a stale lock cannot exist. A flock
belongs to the open file, which a forked child shares (flock(2)): a DataLoader worker forked by
rank 0 would hold the lock until it noticed its parent's death (seconds after a SIGKILL), and a
rerun started at once was refused in the name of a dead trainer. Every forked child therefore
closes its copy at once (`os.register_at_fork`); an exec'd one never gets it (Python opens files
non-inheritable, PEP 446).
A second trainer on the same folder (a rerun beside orphans, `snakemake` and `dvc repro` at
once) stops before it reads or writes anything, naming the holder (pid, host, start time) that
the holder wrote into the lock file. flock on a network filesystem: local on Linux NFS clients
(NFSv4 maps it to byte-range locks, which are cluster-wide); the file records the host.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from pisft.errors import PisftError
from pisft.stages import TRAIN_8CARD

LAUNCHER_PID_ENV = "PISFT_LAUNCHER_PID"
LOCK_NAME = ".trainer.lock"
_PR_SET_PDEATHSIG = 1


@functools.cache
def _prctl():
    """libc's prctl, loaded once in the parent (a preexec_fn must not load libraries)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _prctl_pdeathsig(sig: int) -> bool:
    prctl = _prctl()
    return prctl is not None and prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
    return int(stat.rsplit(")", 1)[1].split()[1])


def die_with_parent(sig: int = signal.SIGTERM, expected_parent: int | None = None) -> None:
    """This process receives `sig` when its parent dies; exit now if it is already gone.

    Meant for `preexec_fn` (between fork and exec: the setting survives exec); call
    `_prctl()` in the parent first so the child only makes the system call.
    """
    if not _prctl_pdeathsig(sig):
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)  # the parent died before the setting took effect


def worker_dies_with_agent() -> None:
    """In a torchrun worker, before anything else: SIGKILL when torchrun's agent dies.

    The agent is this process's parent; the launcher (`python -m pisft launch`, whose pid is in
    PISFT_LAUNCHER_PID) is the agent's parent. If either is already gone, exit at once.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not _prctl_pdeathsig(signal.SIGKILL) or not launcher:
        return
    agent = os.getppid()
    if _parent_of(agent) != int(launcher):
        print(f"[pisft] the launcher (pid {launcher}) is gone; this orphaned worker exits",
              file=sys.stderr, flush=True)
        os._exit(1)


class RunLockHeld(PisftError):
    """Another trainer holds the run folder."""


_HELD: set[int] = set()  # the descriptors of the locks this process holds


def _close_held_in_child() -> None:
    """In a forked child: close the copies of this process's lock descriptors (the lock stays with
    the parent; a close, unlike LOCK_UN, releases nothing while another copy is open)."""
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


class RunLock:
    """An exclusive, non-blocking flock on `<folder>/.trainer.lock`, released on close/exit."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None
        self._pid: int | None = None  # the holder: a forked copy of this object holds nothing

    def acquire(self, stage: str = TRAIN_8CARD.name) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = _open_lock_file(self.path, stage, create=True)
        assert fd is not None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLockHeld(held_message(stage, self.folder, holder)) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd, self._pid = fd, os.getpid()
        _HELD.add(fd)

    def release(self) -> None:
        if self._fd is None or self._pid != os.getpid():  # a forked child's copy: closed at the fork
            return
        _HELD.discard(self._fd)
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the descriptor releases the flock
        self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def held_message(stage: str, folder: Path, holder: str) -> str:
    return (f"{stage}: the run folder {folder} is in use by another trainer ({holder}). "
            "Two trainers on one run would interleave checkpoints and metrics; wait for it "
            "to finish, or stop it (kill that pid) and rerun.")


def _open_lock_file(path: Path, stage: str, *, create: bool) -> int | None:
    """The lock file's descriptor, never through a symbolic link (the holder's record is written
    into it: a link would have the trainer truncate whatever file it points at); None when it
    does not exist and `create` is false."""
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    try:
        return os.open(path, flags, 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PisftError(f"{stage}: the trainer lock {path} is a symbolic link (to {os.readlink(path)}); "
                             "the lock is never followed. Remove the link and rerun") from None
        raise


def lock_holder(folder: Path, stage: str = TRAIN_8CARD.name) -> str | None:
    """Who holds `<folder>/.trainer.lock` now (a description, as `RunLockHeld` words it), or None
    when nobody does. Only looks: creates nothing and leaves the lock free."""
    fd = _open_lock_file(Path(folder) / LOCK_NAME, stage, create=False)
    if fd is None:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "holder not recorded yet"
    return f"pid {info.get('pid')} on host {info.get('host')}, started {info.get('started')}"
