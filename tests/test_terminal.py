"""What the terminal shows under Snakemake (issue 35; docs/workflow.md, "What the terminal shows").

The default pipeline's own run (the `default_pipeline` fixture keeps what it printed) shows one
start and one end line per stage, the training and episode progress, no rule dumps, no line of
200 characters or more, and nothing of robosuite; the job details are in .snakemake/log/. A failed
stage's start line, its log's tail and the details kept in Snakemake's log are checked where a
stage fails anyway: tests/test_orchestration.py's killed training rank.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from conftest import TERMINAL
from pisft.workflow.console import finished_stages, started_stages

pytestmark = pytest.mark.integration

RULE_DUMP = re.compile(r"^(?:local)?rule \w+:$|^\s+(?:input|output|log|jobid|benchmark|reason|resources): |"
                       r"^Shell command: |^Job stats:|^Finished jobid: |^SNAKEMAKE$", re.M)
PROGRESS = re.compile(r"^\[\w+\] step \d+/\d+ \(|^\[\w+\] smoke step \d+/\d+: |^\w+: \d+/\d+ (?:episodes|frames)",
                      re.M)


def _snakemake_logs(work: Path) -> list[Path]:
    return sorted((work / ".snakemake" / "log").glob("*.snakemake.log"))


def test_the_default_run_shows_one_line_at_each_stage_start_and_end(default_pipeline):
    text = (default_pipeline / TERMINAL).read_text()
    # the fixture's run: the first log with jobs in it (`pisft profile`, which switched in the
    # fixture's counts, reads the rules through Snakemake's API first and leaves an empty one)
    details = next(log.read_text() for log in _snakemake_logs(default_pipeline) if log.stat().st_size)
    ran = set(re.findall(r"^(?:local)?rule (\w+):$", details, re.M)) - {"all"}
    assert len(ran) >= 10, "the fixture ran the whole pipeline"
    started, finished = started_stages(text), finished_stages(text)
    assert sorted(started) == sorted(finished) == sorted(ran), (started, finished, ran)
    assert not RULE_DUMP.search(text), RULE_DUMP.search(text)
    assert re.search(r"^\s+input: src/pisft/", details, re.M), "the job details stay in .snakemake/log/"
    assert re.search(r"^\[\d\d:\d\d:\d\d\] train_8card: finished in .* \(\d+ of \d+ steps, \d+%\)$", text, re.M)

    lines = text.splitlines()
    assert max(len(line) for line in lines) < 200, max(lines, key=len)
    progress = PROGRESS.findall(text)
    assert len(lines) - len(progress) < 100, f"{len(lines)} lines, {len(progress)} of them progress"
    assert "robosuite" not in text and "[info] using task orders" not in text
    assert "[default0]:" not in text

    # rank 0's step lines, every train.log_every steps (and the last), for both trained models
    cfg = yaml.safe_load((default_pipeline / "config/config.yaml").read_text())
    every, steps = cfg["train"]["log_every"], cfg["train"]["steps"]
    shown = [int(n) for n in re.findall(rf"^\[train_8card\] step (\d+)/{steps} ", text, re.M)]
    assert shown == [*range(every, steps + 1, every)] + ([steps] if steps % every else [])
    assert re.search(r"^\[train_8card\] step \d+/\d+ \(\d+%\) loss \S+ grad_norm \S+ lr \S+ \S+ samples/s.* ETA "
                     r"\d+:\d\d:\d\d$", text, re.M)
    assert re.search(rf"^\[train_value\] step {cfg['recap']['value_steps']}/", text, re.M)
    assert re.search(r"^\[smoke_1card\] smoke step 1/", text, re.M)
    assert re.search(r"^\[smoke_value\] smoke step 1/", text, re.M)
    assert re.search(r"^closed_loop: 2/2 episodes", text, re.M)
    # what the simulator libraries printed is in the stage's log, not lost
    assert "[info] using task orders" in (default_pipeline / "results/logs/closed_loop.log").read_text()
