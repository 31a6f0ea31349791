"""What the console shows when training processes stop on an error the user can act on.

A training process stopped by a `PisftError` (a damaged input, a full disk, a refused setting)
prints `error (rank N): <message>` and exits 2 (`python -m pisft.train`). Around that one line
torchrun used to put every other rank's copy of it, its agent's log line and a traceback of its
own (`ChildFailedError`, whatever the workers did), and the launcher a "rerun to resume" advice
that a rerun cannot honour when the data must be rewritten first. The message itself already
says what is wrong and what to do.

`ConsoleHold` stands between torchrun's output and the console: from the first error line a
worker prints, or the first failure torchrun's agent reports (its `E` log lines, its traceback),
it holds every further line (they still reach the log files). When the run ends
and the ranks torchrun lists as failed exited 2, or were stopped by its agent after the first
one did (`explained`), the launcher prints each distinct
message once, as one `error:` line, and nothing else; when the results' file system is full (a
worker that could not even write its log), one line naming the full disk; otherwise (a crash, a
signal, a bug) it releases the held lines as they came, followed by its usual summary. The console is then what it
was before, only later.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

# torchrun's prefix of a worker's lines under --tee (torch.distributed.elastic's TailLog):
# `.match` finds it at a line's start, `.finditer` wherever TailLog put it.
WORKER_PREFIX = re.compile(r"\[default(\d+)\]:")
ERROR_LINE = re.compile(r"^error \(rank (\d+)\): ")
# torchrun's agent reporting a failure: its error log lines (glog format, level E) and its traceback.
AGENT_FAILURE = re.compile(r"^(E\d{4} |Traceback \(most recent call last\))")
USER_ERROR_EXIT = "2"  # python -m pisft.train's exit status after a PisftError
STOPPED_BY_AGENT = "-15"  # SIGTERM: torchrun stops the other workers after the first failure


def worker_prefix(local_rank: str) -> str:
    """torchrun's prefix of a worker's lines (`WORKER_PREFIX`)."""
    return f"[default{local_rank}]:"


def whole_lines(physical: Iterable[str]) -> Iterator[str]:
    """torchrun's output lines with each worker's line in one piece.

    TailLog (torch/distributed/elastic/multiprocessing/tail_log.py, `tail_logfile`) copies a
    worker's log file with `readline()` and writes `header + line`. When it reads while the worker
    is between two writes of one line (`print` writes the text, then the newline), it copies the
    start of the line without its newline, and the rest later under a prefix of its own:
    `[default0]:...(MFU not reported)[default0]:` + newline. A prefix in the middle of a physical
    line therefore starts the next piece of that worker's output; a piece without a newline waits
    for its rank's next piece, and what still waits when torchrun's output ends (a worker that died
    mid-line) is ended then. torchrun's own lines (no prefix) pass as they are.
    """
    pending: dict[str, str] = {}  # local rank -> the start of a line that has no end yet
    for line in physical:
        starts = list(WORKER_PREFIX.finditer(line))
        if not starts or starts[0].start() != 0:
            yield line
            continue
        for m, after in zip(starts, [*starts[1:], None], strict=True):
            rank = m.group(1)
            text = pending.pop(rank, "") + line[m.end():after.start() if after else None]
            if text.endswith("\n"):
                yield worker_prefix(rank) + text
            else:
                pending[rank] = text
    for rank, text in pending.items():
        yield worker_prefix(rank) + text + "\n"


def split_prefix(line: str) -> tuple[str | None, str]:
    """(local rank, the line as the worker wrote it); the local rank is None for torchrun's own lines."""
    m = WORKER_PREFIX.match(line)
    if m is None:
        return None, line
    return m.group(1), line[m.end():]


class ConsoleHold:
    """torchrun's lines on their way to the console: held from a worker's first error line on."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self._write = write
        self.held: list[str] = []
        self._messages: dict[str, list[str]] = {}  # local rank -> the lines of its error message
        self._holding = False

    def line(self, raw: str, shown: str) -> None:
        """`raw` as torchrun wrote it, `shown` as the console would show it."""
        local, text = split_prefix(raw)
        if local is None and AGENT_FAILURE.match(text):
            self._holding = True  # the run is failing: what follows is torchrun's account of it
        if local is not None:
            if ERROR_LINE.match(text):
                self._messages[local] = [ERROR_LINE.sub("", text, count=1).rstrip("\n")]
                self._holding = True
            elif local in self._messages:  # the rest of a message of several lines
                self._messages[local].append(text.rstrip("\n"))
        if self._holding:
            self.held.append(shown)
        else:
            self._write(shown)

    def messages(self) -> list[str]:
        """The distinct error messages the workers printed, in the order of their first line."""
        return list(dict.fromkeys("\n".join(lines) for lines in self._messages.values()))

    def explained(self, exit_codes: list[str]) -> bool:
        """Whether the failure is the workers' own errors: a rank listed as failed exited 2 after
        printing its message, and every other one exited 2 too or was stopped by SIGTERM (what
        torchrun's agent sends the remaining workers once one has failed)."""
        return (bool(self._messages) and USER_ERROR_EXIT in exit_codes
                and all(c in (USER_ERROR_EXIT, STOPPED_BY_AGENT) for c in exit_codes))

    def release(self) -> None:
        """Show the held lines, as they came."""
        for shown in self.held:
            self._write(shown)
        self.held.clear()
        self._holding = False
