"""pisft.workflow.console: a stage's failure on the terminal, from the records Snakemake 9 emits
(`Job.log_error`: event JOB_ERROR, the executor's message as `rule_msg`, the rule's logs)."""

from __future__ import annotations

import logging
import os
import sys
import time

from snakemake_interface_logger_plugins.common import LogEvent

from pisft.workflow.console import CLOCK_REALTIME_COARSE, ConsoleView


def _error(log: str, reason: str | None) -> logging.LogRecord:
    return logging.makeLogRecord({"msg": "Error in rule smoke_1card, jobid: 3", "levelno": logging.ERROR,
                                  "event": LogEvent.JOB_ERROR, "rule_name": "smoke_1card", "jobid": 3,
                                  "rule_msg": reason, "log": [log]})


def test_the_executors_reason_is_shown_and_a_previous_runs_log_is_not_its_tail(tmp_path):
    log = tmp_path / "smoke_1card.log"
    log.write_text("[smoke_1card] passed: the old line\n")
    old = time.time() - 3600
    os.utime(log, (old, old))
    reason = ("SLURM sbatch failed. The error message was 'sbatch: error: Invalid generic resource (gres) "
              "specification'.\n    sbatch call:\n        sbatch --parsable --gres=gpu:1 ...")
    text = ConsoleView().filter(_error(str(log), reason)).getMessage()
    assert "smoke_1card: FAILED" in text
    assert "  SLURM sbatch failed. The error message was 'sbatch: error: Invalid generic" in text
    assert "--gres=gpu:1" in text
    assert "the old line" not in text and f"its log {log} is from an earlier run" in text


def test_a_log_this_run_wrote_is_shown_as_its_tail(tmp_path):
    view = ConsoleView()
    log = tmp_path / "smoke_1card.log"
    log.write_text("".join(f"line {i}\n" for i in range(30)))
    text = view.filter(_error(str(log), None)).getMessage()
    assert f"its log {log}, last 20 lines:" in text
    assert "  | line 29" in text and "  | line 9\n" not in text and "None" not in text


def test_a_log_written_just_after_the_run_began_is_this_runs(tmp_path):
    # Linux stamps mtimes from its coarse clock, up to a tick behind time.time(): with `since` read
    # off time.time(), about 1 in 250 logs written just after came out "from an earlier run" here
    # (CI stop 52 failed on test_a_log_this_run_wrote_is_shown_as_its_tail that way).
    if sys.platform.startswith("linux"):
        for _ in range(100):
            view = ConsoleView()
            assert view.since <= time.clock_gettime(CLOCK_REALTIME_COARSE)
    written = []
    for i in range(1000):
        view = ConsoleView()
        log = tmp_path / f"{i}.log"
        log.write_text("line\n")
        written.append((view, log))
        time.sleep(0.0002)
    earlier = [str(log) for view, log in written if view._older_than_this_run(str(log))]
    assert earlier == []
