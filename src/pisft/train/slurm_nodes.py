"""Training over several nodes as one Slurm job: the nodes and the rendezvous come from the allocation.

Under `profiles/slurm`, a training stage with `train.nnodes` N > 1 (and `train.rdzv_endpoint`
left empty) is one Slurm job of N nodes with one task per node
(`pisft.workflow.snakemake_support.node_resources`). Its launcher, `python -m pisft launch`, runs
once, in the job's batch step on the allocation's first node, and starts one torchrun per node:

  srun --nodes N --ntasks N --ntasks-per-node 1 --kill-on-bad-exit=1 \\
    python -m torch.distributed.run --nnodes N --nproc-per-node P --rdzv-backend c10d \\
      --rdzv-endpoint <first node's address>:<port> --rdzv-id <job id> ... -m pisft.train ...

the field's practice (torchtitan's multinode_trainer.slurm: `srun torchrun --rdzv_backend c10d
--rdzv_endpoint "$head_node_ip:29500"`, its head node the first of `scontrol show hostnames
$SLURM_JOB_NODELIST`). Nothing here is typed by the user:
- the nodes: `scontrol show job` of SLURM_JOB_ID (the job's Snakemake keeps only SLURM_JOB_ID of
  the job's SLURM_* variables for the command: snakemake-executor-plugin-slurm-jobstep 0.6.1,
  `run_job`), checked against `train.nnodes`;
- the endpoint: the first node's NodeAddr (`scontrol show node`: the address slurmctld reaches it
  at; its NodeName when the site sets none) and a port from the job id
  (RDZV_PORT_BASE + job id mod RDZV_PORT_SPAN: two jobs that share a first node do not collide
  unless their ids do modulo the span); the rendezvous id is the job id;
- the node ranks: the c10d rendezvous assigns them, in the order of the nodes' host names
  (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, `_mark_rendezvous_complete`:
  `sorted(state.participants)`, each participant the node's FQDN and pid); torchrun reads
  `--node-rank` only under the static backend (torch/distributed/run.py, `config_from_args`), so
  it is not passed. Which node holds global rank 0 does not change what is computed (the same
  model on every rank, the data split by global rank); rank 0, wherever it runs, writes the
  checkpoints' metadata and the export, once, to the results folder, which every node must share.
srun's step gets every CPU and memory of each node (no `--exact`) and the job's gres. The
launcher's own pid is not handed to the workers (`pisft.train.guard.worker_dies_with_agent`
checks it against their agent's parent, which is slurmstepd here): each worker still dies with
its torchrun, each torchrun with its step, and the step with srun, which gets SIGTERM when the
launcher dies.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from pisft.errors import PisftError

JOB_ID_ENV = "SLURM_JOB_ID"
RDZV_PORT_BASE = 29500
RDZV_PORT_SPAN = 1000
SLURM_TIMEOUT_S = 60  # one client call to slurmctld


@dataclass(frozen=True)
class Allocation:
    """The nodes of the running Slurm job and where their rendezvous is."""

    job_id: str
    nodes: tuple[str, ...]
    head_addr: str

    @property
    def endpoint(self) -> str:
        return f"{self.head_addr}:{rdzv_port(self.job_id)}"

    def srun(self) -> list[str]:
        """srun, one task (a torchrun) on each node of the job."""
        n = str(len(self.nodes))
        srun = shutil.which("srun")
        if srun is None:
            raise PisftError(f"Slurm job {self.job_id}: srun is not on PATH on {self.nodes[0]}; the launcher "
                             "starts one torchrun per node with it")
        return [srun, "--jobid", self.job_id, "--nodes", n, "--ntasks", n, "--ntasks-per-node", "1",
                "--kill-on-bad-exit=1"]

    def rendezvous(self) -> list[str]:
        """torchrun's arguments for a rendezvous across the job's nodes."""
        return ["--nnodes", str(len(self.nodes)), "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", self.job_id]


def rdzv_port(job_id: str) -> int:
    return RDZV_PORT_BASE + int(job_id) % RDZV_PORT_SPAN


def job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The Slurm job this process runs in, if any."""
    value = (os.environ if env is None else env).get(JOB_ID_ENV, "").strip()
    return value or None


def _fields(text: str) -> dict[str, str]:
    """`Key=Value` pairs of a `scontrol show ... --oneliner` line."""
    return dict(re.findall(r"(?:^|\s)(\w+)=(\S*)", text))


def _scontrol(*args: str) -> str:
    cmd = ["scontrol", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except FileNotFoundError:
        raise PisftError("train.nnodes > 1 in a Slurm job: scontrol is not on PATH, and the launcher reads the "
                         "job's nodes with it; put Slurm's clients on PATH") from None
    except subprocess.TimeoutExpired:
        raise PisftError(f"`{' '.join(cmd)}` did not answer in {SLURM_TIMEOUT_S} s: is slurmctld reachable "
                         "from this node (`scontrol ping`)?") from None
    if proc.returncode != 0:
        raise PisftError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return proc.stdout


def allocation(job: str, nnodes: int) -> Allocation:
    """The nodes of Slurm job `job`, which must be `nnodes` (train.nnodes)."""
    fields = _fields(_scontrol("show", "job", "--oneliner", job))
    nodelist = fields.get("NodeList", "")
    if not nodelist or nodelist == "(null)":
        raise PisftError(f"Slurm job {job} has no nodes yet (scontrol show job {job}: NodeList={nodelist!r})")
    nodes = tuple(_scontrol("show", "hostnames", nodelist).split())
    if len(nodes) != nnodes:
        raise PisftError(
            f"train.nnodes is {nnodes} but Slurm job {job} has {len(nodes)} node(s) ({nodelist}): the workflow "
            f"asks for train.nnodes nodes (the rule's `nodes` resource); a profile's set-resources `nodes` or an "
            f"sbatch --nodes overrides it. Make them agree: set train.nnodes to {len(nodes)}, or remove the "
            "override")
    addr = _fields(_scontrol("show", "node", "--oneliner", nodes[0])).get("NodeAddr") or nodes[0]
    return Allocation(job, nodes, addr)


def for_training(nnodes: int, endpoint: str, stage: str, env: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation a multi-node training stage runs on; None where the rendezvous is typed by hand
    (`train.rdzv_endpoint` set: `train.node_rank` on each node, as without Slurm) or one node trains."""
    if nnodes <= 1 or endpoint:
        return None
    job = job_id(env)
    if job is None:
        raise PisftError(
            f"{stage}: train.nnodes is {nnodes} and train.rdzv_endpoint is empty, which asks for a Slurm job of "
            f"{nnodes} nodes (snakemake --profile profiles/slurm), but this is not one (no {JOB_ID_ENV}). Without "
            "Slurm, run the same command on every node with train.rdzv_endpoint=<node 0's host>:<port> and "
            "train.node_rank=<0..nnodes-1> (docs/workflow.md, \"Several nodes\")")
    return allocation(job, nnodes)
