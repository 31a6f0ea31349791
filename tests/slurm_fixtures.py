"""A one-node Slurm cluster on this host for the tests of profiles/slurm (scripts/slurm-local.sh),
started once per session and stopped after it."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT, tool_env

SCRIPT = ROOT / "scripts" / "slurm-local.sh"
PARTITION = "pisft"  # the script's default partition


@dataclass
class Cluster:
    root: Path
    conf: Path
    partition: str
    start_s: float  # how long `slurm-local.sh start` took, installs included

    def env(self, **extra: str) -> dict[str, str]:
        """The tests' tool environment with Slurm's clients pointed at this cluster."""
        return {**tool_env(), "SLURM_CONF": str(self.conf), **extra}

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-3000:]}")
        return proc


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """munged, MariaDB, slurmdbd, slurmctld and slurmd for the session (needs root, as CI has)."""
    root = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "PISFT_SLURM_DIR": str(root), "PISFT_SLURM_PARTITION": PARTITION}
    start = time.monotonic()
    proc = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=1200)
    took = time.monotonic() - start
    try:
        if proc.returncode != 0:
            raise AssertionError(f"{SCRIPT} start failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        print(f"\nslurm-local.sh start: {took:.1f} s; {proc.stderr.strip().splitlines()[-1]}")
        yield Cluster(root, root / "etc" / "slurm.conf", PARTITION, took)
    finally:
        subprocess.run([str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=300)
