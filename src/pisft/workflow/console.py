"""What a Snakemake run shows on the terminal: one start line and one end line per stage.

Snakemake's own job block names every input of a rule (each stage depends on its source files:
lines of about 2,000 characters), then its output, log, job id, benchmark, reason, threads,
resources and shell command. On the terminal pisft shows instead, per stage,

    [21:16:04] smoke_1card: started (log results/logs/smoke_1card.log)
    ...what the stage prints (its progress, its summary line)...
    [21:16:35] smoke_1card: finished in 31 s (4 of 16 steps, 25%)

and on a failure a line naming the stage, the executor's reason when it gives one (the Slurm
plugin's sbatch error), and the last `TAIL_LINES` lines of its log, unless the log is older than
this run (a job that never started: its log is an earlier run's). What the stage printed is also
above, as it ran; Snakemake's own line before it gives the command and its exit status. Snakemake's banner,
job table and scheduler chatter ("Select jobs to execute...") are left out of the terminal.

The full job details stay where Snakemake writes them: `.snakemake/log/<time>.snakemake.log`
(every block, every shell command, the whole log of a failed stage; `show-failed-logs` in
profiles/default/config.yaml), and `--verbose` or `--dry-run` (`-n`) print them on the terminal
as Snakemake does (`-n` lists each planned job and why it runs).

How: the Snakefile calls `compact_console(workflow)`, which adds a filter to the handler
Snakemake 9 writes the terminal with (`snakemake.logging`, handler "DefaultStreamHandler"); the
filter returns a shortened copy of a record, or drops it, for this handler only (Python 3.12
`logging.Handler.handle` takes a returned record in place of the original), so the log file's
handler still gets every record unchanged. A Snakemake without that handler keeps its own output.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

SNAKEMAKE_LOGGER = "snakemake.logging"
STREAM_HANDLER = "DefaultStreamHandler"
FILE_HANDLER = "DefaultLogFileHandler"
TAIL_LINES = 20
# Scheduler and set-up messages that say nothing a user acts on (kept in .snakemake/log).
DROPPED = ("Select jobs to execute...", "Building DAG of jobs...")
DROPPED_PREFIXES = ("Using shell: ",)
START = re.compile(r"^\[\d\d:\d\d:\d\d\] (\w+): started", re.M)
FINISH = re.compile(r"^\[\d\d:\d\d:\d\d\] (\w+): finished in ", re.M)


def started_stages(text: str) -> list[str]:
    """The stages a terminal output says were started (the `started` lines), in order."""
    return START.findall(text)


def finished_stages(text: str) -> list[str]:
    """The stages a terminal output says finished, in order."""
    return FINISH.findall(text)


# Linux stamps a file's mtime from its coarse real-time clock (fs/inode.c `current_time` ->
# `ktime_get_coarse_real_ts64`), which lags `time.time()` by up to one tick (4 ms at HZ=250): a log
# written a moment after `time.time()` was read can carry an mtime before it. CLOCK_REALTIME_COARSE
# is 5 in linux/include/uapi/linux/time.h; Python's `time` module does not name it.
CLOCK_REALTIME_COARSE = 5


def file_clock_now() -> float:
    """Now, on the clock the kernel stamps a file's mtime with: a file written after this call has
    an mtime no earlier than what it returns (`time.time()` where there is no coarse clock)."""
    now = time.time()
    if sys.platform.startswith("linux"):
        try:
            return min(now, time.clock_gettime(CLOCK_REALTIME_COARSE))
        except OSError:
            pass
    return now


def _now() -> str:
    return time.strftime("%H:%M:%S")


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    m, s = divmod(seconds, 60)
    return f"{m} min {s:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def log_tail(path: str | Path, lines: int = TAIL_LINES) -> list[str]:
    """The last `lines` lines of a stage's log, or one line saying why there are none."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return [f"(its log {path} cannot be read: {exc.strerror or exc})"]
    kept = text.splitlines()
    if not kept:
        return [f"(its log {path} is empty)"]
    return kept[-lines:]


class ConsoleView(logging.Filter):
    """The terminal's view of Snakemake's records (see the module's docstring)."""

    def __init__(self, logfile: str | None = None) -> None:
        super().__init__()
        self.logfile = logfile
        self.started: dict[Any, tuple[str, float]] = {}  # job id -> (rule, start time)
        self.finished: list[tuple[str, float]] = []  # since the last progress record
        self.cores: int | None = None
        self.since = file_clock_now()  # a log older than this is a previous run's

    def _line(self, record: logging.LogRecord, text: str) -> logging.LogRecord:
        copy = logging.makeLogRecord(record.__dict__)
        copy.msg, copy.args, copy.event = text, (), None
        for key in ("rule_msg", "quietness"):
            copy.__dict__.pop(key, None)
        return copy

    def filter(self, record: logging.LogRecord) -> bool | logging.LogRecord:
        event = getattr(record, "event", None)
        name = getattr(event, "value", event)
        handler = getattr(self, f"_on_{name}", None) if name else None
        if handler is not None:
            return handler(record)
        if event is None:
            msg = str(record.msg) if record.msg is not None else ""
            if msg in DROPPED or msg.startswith(DROPPED_PREFIXES):
                return False
        return True

    # one method per Snakemake LogEvent value this view changes; these leave the terminal
    # (the banner, "Execute 2 jobs...", the shell command: all in .snakemake/log/)
    _on_workflow_started = _on_job_started = _on_shellcmd = staticmethod(lambda _record: False)

    def _on_resources_info(self, record: logging.LogRecord) -> bool:  # "Provided cores: 2", ...
        self.cores = getattr(record, "cores", self.cores)
        return False

    def _on_run_info(self, record: logging.LogRecord) -> bool | logging.LogRecord:  # the job table
        stats = getattr(record, "stats", None)
        if not isinstance(stats, dict) or "total" not in stats:
            return True
        cores = f" on {self.cores} cores" if self.cores else ""
        where = f"; each job's details: {self._relative(self.logfile)}" if self.logfile else ""
        return self._line(record, f"Snakemake: {stats['total']} jobs{cores}{where}")

    def _on_job_info(self, record: logging.LogRecord) -> bool | logging.LogRecord:
        rule = getattr(record, "rule_name", "?")
        self.started[getattr(record, "jobid", None)] = (rule, time.monotonic())
        if rule == "all":
            return False
        logs = getattr(record, "log", None) or []
        where = f" (log {', '.join(logs)})" if logs else ""
        return self._line(record, f"[{_now()}] {rule}: started{where}")

    def _on_job_finished(self, record: logging.LogRecord) -> bool:
        rule, t0 = self.started.pop(getattr(record, "job_id", None), ("?", time.monotonic()))
        self.finished.append((rule, time.monotonic() - t0))
        return False

    def _on_progress(self, record: logging.LogRecord) -> bool | logging.LogRecord:
        done, total = getattr(record, "done", 0), getattr(record, "total", 0)
        pct = f"{100 * done / total:.0f}%" if total else "?"
        finished, self.finished = self.finished, []
        names = ", ".join("every target built" if rule == "all" else f"{rule}: finished in {_duration(dt)}"
                          for rule, dt in finished) or "progress"
        return self._line(record, f"[{_now()}] {names} ({done} of {total} steps, {pct})")

    def _on_job_error(self, record: logging.LogRecord) -> logging.LogRecord:
        rule = getattr(record, "rule_name", "?")
        _, t0 = self.started.get(getattr(record, "jobid", None), (rule, None))
        after = f" after {_duration(time.monotonic() - t0)}" if t0 is not None else ""
        logs = list(getattr(record, "log", None) or [])
        lines = [f"[{_now()}] {rule}: FAILED{after}"]
        # the executor's reason, when it gives one (e.g. the Slurm plugin's "SLURM sbatch failed.
        # The error message was ..." with the sbatch call): often the only word on what went wrong
        reason = getattr(record, "rule_msg", None)
        if reason:
            lines += [f"  {line}" for line in str(reason).strip().splitlines()]
        for log in logs:
            if self._older_than_this_run(log):
                lines.append(f"  its log {log} is from an earlier run: this run did not write to it")
                continue
            tail = log_tail(log)
            lines.append(f"  its log {log}, last {len(tail)} lines:")
            lines += [f"  | {line}" for line in tail]
        if self.logfile:
            lines.append(f"  Snakemake's record of the job: {self._relative(self.logfile)}")
        return self._line(record, "\n".join(lines))

    def _older_than_this_run(self, log: str) -> bool:
        try:
            return Path(log).stat().st_mtime < self.since
        except OSError:
            return False  # log_tail says why it cannot be read

    @staticmethod
    def _relative(path: str | None) -> str:
        if not path:
            return ""
        try:
            return str(Path(path).relative_to(Path.cwd()))
        except ValueError:
            return path


def compact_console(workflow: Any) -> ConsoleView | None:
    """Give Snakemake's terminal handler pisft's view; None (Snakemake's own output) under
    --verbose, --dry-run, or a Snakemake whose handlers are not the ones this was written for."""
    settings = getattr(workflow, "output_settings", None)
    if settings is None or getattr(settings, "verbose", False) or getattr(settings, "dryrun", False):
        return None
    logger = logging.getLogger(SNAKEMAKE_LOGGER)
    stream = next((h for h in logger.handlers if h.name == STREAM_HANDLER), None)
    if stream is None:
        return None
    existing = next((f for f in stream.filters if isinstance(f, ConsoleView)), None)
    if existing is not None:  # the Snakefile parsed twice in one process
        return existing
    logfile = next((getattr(h, "baseFilename", None) for h in logger.handlers if h.name == FILE_HANDLER), None)
    view = ConsoleView(logfile)
    stream.addFilter(view)
    return view
