"""`snakemake` for the Slurm tests: the same command, with the Slurm plugin's status queries kept
at `--seconds-between-status-checks` (run as `python tests/slurm_polls.py <snakemake arguments>`).

snakemake-executor-plugin-slurm (2.6.1, `Executor.check_active_jobs`) lengthens the wait before
its next status query by 10 s after each query that saw no job end, up to 180 s: a cluster's
slurmctld is spared, and a job of minutes is seen to have ended up to a few minutes late. At the
tests' job lengths (tens of seconds) that wait was most of a run: in the time-limit phase of
`test_slurm_ending_train_8card_then_the_next_run_resumes` the end of the job was seen 25 s late
and Snakemake's shutdown then waited out the plugin's current sleep, 56 s more (measured
2026-12-03). Here the wait never grows past the interval the test asked for; what is queried,
how often when a job has ended, and what is reported are the plugin's own.
"""

from __future__ import annotations

import sys

from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor

_growing = RemoteExecutor.next_seconds_between_status_checks


def _at_most_the_asked_interval(self, value):
    asked = self.workflow.remote_execution_settings.seconds_between_status_checks
    _growing.fset(self, value if value is None else min(value, asked))


RemoteExecutor.next_seconds_between_status_checks = property(_growing.fget, _at_most_the_asked_interval)

if __name__ == "__main__":
    from snakemake.cli import main

    sys.argv[0] = "snakemake"
    sys.exit(main())
