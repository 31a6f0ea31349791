"""The Slurm cluster on this host for the tests of profiles/slurm (scripts/slurm-local.sh), started
once per session and stopped after it: two nodes, each a slurmd in a network namespace of its own
(the multi-node jobs; the single-node ones run on either node)."""

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
NETNS = "pisft"  # the script's default prefix of the nodes' namespaces and names
TWO_NODES_PORT = 16827  # the script's default for several nodes (one node's: 16817)


@dataclass
class Cluster:
    root: Path
    conf: Path
    partition: str
    start_s: float  # how long `slurm-local.sh start` took, installs included
    nodes: tuple[str, ...] = ()  # the node names of a multi-node cluster
    script_env: dict[str, str] | None = None  # what scripts/slurm-local.sh needs to find this cluster

    def env(self, **extra: str) -> dict[str, str]:
        """The tests' tool environment with Slurm's clients pointed at this cluster."""
        return {**tool_env(), "SLURM_CONF": str(self.conf), **extra}

    def script(self, *args: str) -> str:
        """scripts/slurm-local.sh ARGS on this cluster (start-node I); its stderr."""
        proc = subprocess.run([str(SCRIPT), *args], env=self.script_env, capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise AssertionError(f"{SCRIPT} {' '.join(args)} failed ({proc.returncode}): {proc.stderr[-3000:]}")
        return proc.stderr

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-3000:]}")
        return proc


def _cluster(root: Path, nodes: int, port: int):
    env = {**os.environ, "PISFT_SLURM_DIR": str(root), "PISFT_SLURM_PARTITION": PARTITION,
           "PISFT_SLURM_NODES": str(nodes), "PISFT_SLURM_PORT": str(port)}
    start = time.monotonic()
    proc = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=1200)
    took = time.monotonic() - start
    try:
        if proc.returncode != 0:
            raise AssertionError(f"{SCRIPT} start failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        print(f"\nslurm-local.sh start ({nodes} node(s)): {took:.1f} s; {proc.stderr.strip().splitlines()[-1]}")
        names = tuple(f"{NETNS}-n{i}" for i in range(1, nodes + 1)) if nodes > 1 else ()
        yield Cluster(root, root / "etc" / "slurm.conf", PARTITION, took, names, env)
    finally:
        subprocess.run([str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="session")
def slurm_two_nodes(tmp_path_factory):
    """munged, MariaDB, slurmdbd, slurmctld and two slurmds, each in a network namespace of its own,
    for the session (needs root, as CI has)."""
    yield from _cluster(tmp_path_factory.mktemp("slurm2"), 2, TWO_NODES_PORT)
