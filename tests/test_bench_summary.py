"""`python -m pisft summary` (what `make run` prints last) reports each stage's wall time."""

from __future__ import annotations

import os

from pisft import cli

HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def _tsv(path, seconds, mtime):
    path.write_text(HEADER + f"{seconds}\t0:00:{int(seconds):02d}\t250.1\t900\t200\t210\t0\t1\t50\t{seconds}\n")
    os.utime(path, (mtime, mtime))


def test_summary_prints_each_stage_wall_time_in_run_order(tmp_path, capsys):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    _tsv(bench / "train_8card.tsv", 61.25, 2000)
    _tsv(bench / "fetch_base.tsv", 3.5, 1000)
    code = cli.main(["summary", "--set", f"results_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 1  # no evaluation yet: said, after the stage times
    lines = out.splitlines()
    assert lines[0].startswith("stage wall times")
    assert lines[1].split() == ["fetch_base", "3.5", "s"]
    assert lines[2].split() == ["train_8card", "61.2", "s"]  # finished later: listed later
    assert lines[3].split() == ["sum", "64.8", "s"]
    assert "no evaluation yet" in out


def test_summary_without_benchmark_files_says_so(tmp_path, capsys):
    cli.main(["summary", "--set", f"results_dir={tmp_path}"])
    assert "none recorded yet" in capsys.readouterr().out
