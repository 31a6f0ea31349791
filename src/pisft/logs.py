"""Per-stage log files: everything a stage prints (its child processes too) also goes to a log.

Snakemake and DVC call the same command with `--log results/logs/<stage>.log`, so both tools
leave the same log, and the console still shows the output.

Third-party start-up chatter (robosuite's and LIBERO's lines at import, MuJoCo's warnings in
a simulator process) goes to the stage's log only: `output_to_stage_log` sends a process's
file descriptors 1 and 2 there for good (the simulator's worker processes), `only_in_stage_log`
for a block of code (LIBERO's import in the stage's own process). Without a stage log (a stage
run by hand without `--log`) both leave the output where it was.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path


DRAIN_IDLE_S = 0.2
# The console is shared: Snakemake runs stages side by side, and each stage's pump writes to the
# same terminal. Output goes out in whole lines, so two stages' lines never run into one another
# (under PYTHONUNBUFFERED, which the Makefile sets, `print` writes its text and its newline in two
# calls). A line still unfinished after PARTIAL_LINE_S (a prompt, a progress bar redrawn with \r)
# or longer than MAX_HELD_BYTES goes out as it is.
PARTIAL_LINE_S = 1.0
MAX_HELD_BYTES = 65536
# Set by `tee_output` while it runs (an absolute path): the stage's log file, for the stage and
# its child processes (the closed-loop workers put MuJoCo's log beside it, `mujoco_log_dir`).
STAGE_LOG_ENV = "PISFT_STAGE_LOG"


def mujoco_log_dir(stage: str, default_logs: str | Path) -> Path:
    """Where the simulator workers of `stage` run, so that MuJoCo's own log (`MUJOCO_LOG.TXT`,
    written into the working folder on every simulator warning) lands with the stage's log:
    `<log folder>/<log name>.mujoco/`, `default_logs/<stage>.mujoco/` without a `--log`."""
    log = os.environ.get(STAGE_LOG_ENV)
    if log:
        p = Path(log)
        return p.parent / f"{p.stem}.mujoco"
    return Path(default_logs).absolute() / f"{stage}.mujoco"


@contextlib.contextmanager
def tee_output(log_path: str | Path | None) -> Iterator[None]:
    """Copy file descriptors 1 and 2 (this process and its children) to `log_path`."""
    if not log_path:
        yield
        return
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    read_fd, write_fd = os.pipe()
    # O_APPEND: the simulator's worker processes append their own output to the same file
    # (`output_to_stage_log`); without it this process's writes would land over theirs.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    log = os.fdopen(fd, "wb")  # closed by the pump thread's owner below

    failed: list[OSError] = []
    stop = threading.Event()

    def emit(data: bytes) -> None:
        # The console always gets everything; a log that cannot be written (disk full, a
        # folder gone read-only) is given up with one warning at the end, never the output.
        os.write(saved_out, data)
        if failed:
            return
        try:
            log.write(data)
            log.flush()
        except OSError as exc:
            failed.append(exc)

    def pump() -> None:
        # After the stage, the pipe is drained until it stays empty for DRAIN_IDLE_S: its end
        # of file may never come while the stage runs, because a helper process that outlives
        # the stage's work holds the pipe open (multiprocessing's resource tracker, started by
        # any "spawn" start method, lives until this process exits).
        held, held_since = b"", 0.0  # the unfinished last line, and since when
        while True:
            if not select.select([read_fd], [], [], DRAIN_IDLE_S)[0]:
                if held and (stop.is_set() or time.monotonic() - held_since >= PARTIAL_LINE_S):
                    emit(held)
                    held = b""
                if stop.is_set():
                    return
                continue
            chunk = os.read(read_fd, 65536)
            if not chunk:
                if held:
                    emit(held)
                return
            if not held:
                held_since = time.monotonic()
            data = held + chunk
            cut = len(data) if len(data) >= MAX_HELD_BYTES else data.rfind(b"\n") + 1
            if cut:
                emit(data[:cut])
                held_since = time.monotonic()
            held = data[cut:]

    thread = threading.Thread(target=pump, name="pisft-log-tee", daemon=True)
    thread.start()
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    previous = os.environ.get(STAGE_LOG_ENV)
    os.environ[STAGE_LOG_ENV] = str(log_path.absolute())
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(STAGE_LOG_ENV, None)
        else:
            os.environ[STAGE_LOG_ENV] = previous
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        stop.set()
        thread.join()
        os.close(read_fd)
        try:
            log.close()
        except OSError as exc:
            failed.append(exc)
        if failed:
            os.write(saved_err, f"warning: the log {log_path} could not be written "
                                f"({failed[0].strerror}); the console output above is complete\n"
                     .encode())
        os.close(saved_out)
        os.close(saved_err)


def _open_stage_log() -> int | None:
    log = os.environ.get(STAGE_LOG_ENV)
    if not log:
        return None
    try:
        return os.open(log, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return None  # the log is gone or not writable: the output stays where it was


def output_to_stage_log() -> bool:
    """This process's stdout and stderr (descriptors 1 and 2) appended to the stage's log, for
    the rest of its life; False (nothing changed) without one. For helper processes whose output
    is third-party detail (the simulator workers: what they have to say reaches the stage
    through their pipe)."""
    fd = _open_stage_log()
    if fd is None:
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return True


@contextlib.contextmanager
def only_in_stage_log() -> Iterator[bool]:
    """Inside the block, what this process (and a child it starts) writes to descriptors 1 and 2
    goes to the stage's log only, not the console; yields False (nothing changed) without one."""
    fd = _open_stage_log()
    if fd is None:
        yield False
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield True
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
