"""`python -m pisft launch smoke_1card|train_8card|train_value`: start the training processes under torchrun.

The command is an argument list (no shell), the environment comes from the device layer
(Ascend defaults, JAX_PLATFORMS=cpu). Every worker's stdout/stderr goes to the console and to
`results/logs/<stage>/<launch>/…/<local_rank>/{stdout,stderr}.log`; torchrun's own output to
`launcher.log` beside them. The console gets each line as it is written (rank 0's step lines
while training runs): torchrun's agent copies the workers' lines to its stdout without
flushing, so it runs with PYTHONUNBUFFERED=1, which `dvc repro` (unlike the Makefile and the
Snakefile) does not export. Local rank 0's lines lose torchrun's `[default0]:` prefix on the
console (the other ranks keep theirs); the log files keep every line with its prefix. A worker's
line that torchrun copied in two pieces (it read the line between two writes) is one line again
on the console and in `launcher.log` (`worker_errors.whole_lines`).
On failure the launcher says which rank failed and how, where its log is, and that rerunning
the same command resumes from the latest complete checkpoint; when every failed rank stopped on
an error the user can act on (exit 2: a damaged input, a full disk, a refused setting), it prints
that message once instead, as one line, without torchrun's traceback (`worker_errors`).

Single node: `torchrun --standalone` (a free port is picked). Several nodes in a Slurm job
(`train.nnodes` > 1, `train.rdzv_endpoint` empty: `snakemake --profile profiles/slurm`): this
launcher runs once and starts one torchrun per node through srun, the nodes and the rendezvous
from the allocation (`pisft.train.slurm_nodes`). Several nodes by hand: run the same command on
every node with `train.nnodes`, `train.node_rank` and `train.rdzv_endpoint` (host:port of node 0)
set. Either way the results and checkpoint folders must be on storage all nodes share.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pisft import disk_space, layout, records
from pisft import device as devices
from pisft.config import SMOKE_MEASURED, PisftConfig, flatten, keys_marked, resolved
from pisft.errors import PisftError, Terminated
from pisft.stages import SMOKE_1CARD, STAGES, TRAIN_8CARD
from pisft.train import decisions, guard, slurm_nodes
from pisft.train.worker_errors import ConsoleHold, whole_lines, worker_prefix

# Free space a training run needs before it starts, at the least: its logs and small files (the
# checkpoints and the export ask for their own room before they write, pisft.disk_space).
START_ROOM = 1 << 20
# Settings of the smoke run that must match the training run for its report to be meaningful,
# read off the keys' marks (pisft.config): the model it measured (SMOKE_MEASURED; the drivers
# follow that through base_model) and the keys whose change makes the drivers rerun smoke_1card
# (its row in the stage table: the device and every key marked TRAIN_STEP), less its own `smoke`
# section. A key that reruns the smoke gate is one the report must match.
SMOKE_MUST_MATCH = (*keys_marked(SMOKE_MEASURED),
                    *(key for key in SMOKE_1CARD.keys if key != "smoke"))


@dataclass
class Failure:
    rank: str
    local_rank: str
    exitcode: str
    log: Path | None


def split_endpoint(endpoint: str) -> tuple[str, str]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise PisftError(f"train.rdzv_endpoint: '{endpoint}' must be HOST:PORT of node 0 "
                         "(e.g. 10.0.0.1:29500)")
    return host, port


def one_process(stage: str) -> bool:
    """A smoke gate: one process on one device (the stage table's `one_process`)."""
    return STAGES[stage].one_process


def nproc_for(stage: str, cfg: PisftConfig) -> int:
    """Processes per node: a smoke gate runs one process on one node."""
    return 1 if one_process(stage) else cfg.train.nproc_per_node


def world_size_for(stage: str, cfg: PisftConfig) -> int:
    """Processes in all: what `python -m pisft.train` checks torchrun started."""
    return 1 if one_process(stage) else cfg.world_size


def allocation(stage: str, cfg: PisftConfig) -> slurm_nodes.Allocation | None:
    """The Slurm job's nodes a multi-node stage trains on (None: one node, or the by-hand rendezvous)."""
    if one_process(stage):
        return None
    return slurm_nodes.for_training(cfg.train.nnodes, cfg.train.rdzv_endpoint, stage)


def torchrun_command(stage: str, cfg: PisftConfig, config_path: str, overrides: list[str],
                     log_dir: Path, nodes: slurm_nodes.Allocation | None = None) -> list[str]:
    """torchrun's command on this node; with `nodes` (a Slurm job's), srun's command that starts
    it on each of them."""
    t = cfg.train
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if nodes is not None:
        cmd = [*nodes.srun(), *cmd, *nodes.rendezvous()]
    elif one_process(stage) or t.nnodes == 1:
        cmd += ["--standalone", "--nnodes", "1"]
    else:
        host, port = split_endpoint(t.rdzv_endpoint)
        cmd += ["--nnodes", str(t.nnodes), "--node-rank", str(t.node_rank),
                "--master-addr", host, "--master-port", port]
    cmd += ["--nproc-per-node", str(nproc_for(stage, cfg)), "--max-restarts", "0",
            "--log-dir", str(log_dir), "--tee", "3",
            "-m", "pisft.train", "--stage", stage, "--config", str(config_path)]
    if cfg.iteration:
        cmd += ["--iteration", str(cfg.iteration)]
    for item in overrides:
        cmd += ["--set", item]
    return cmd


def gate_report(cfg: PisftConfig, gate: str) -> Path:
    """The report a smoke gate writes: its stage's (only) output."""
    return layout.output(cfg, STAGES[gate])


def check_gate_report(cfg: PisftConfig, stage: str) -> dict:
    """A training stage needs its smoke gate's report (the stage table's `gate`), passed."""
    gate = STAGES[stage].gate
    assert gate is not None, stage
    path = gate_report(cfg, gate)
    if not path.is_file():
        raise PisftError(f"{stage}: {path} not found; run {gate} first "
                         f"(`python -m pisft launch {gate}`, or let the workflow do it)")
    report = records.read(path, {"passed": bool, "messages": (list, str), "pisft_config": dict},
                          writer=f"{gate} (python -m pisft launch {gate})", required=("passed",))
    if not report["passed"]:
        msgs = "\n  - ".join(report.get("messages") or ["(no message)"])
        raise PisftError(f"{stage}: the smoke report {path} did not pass:\n  - {msgs}\n"
                         f"fix the cause and rerun {gate}")
    return report


def check_smoke_report(cfg: PisftConfig) -> None:
    """train_8card needs a passing smoke report made with the same model and micro batch."""
    path = layout.smoke_report(cfg)
    report = check_gate_report(cfg, TRAIN_8CARD.name)
    then = flatten(report.get("pisft_config") or {})
    now = flatten(resolved(cfg))
    stale = [f"{k}: smoke {then.get(k)!r}, now {now.get(k)!r}" for key in SMOKE_MUST_MATCH
             for k in sorted({*_under(then, key), *_under(now, key)}) if then.get(k) != now.get(k)]
    if stale:
        raise PisftError(f"train_8card: the smoke report {path} was made with other settings ({'; '.join(stale)}), "
                         "so what it measured (memory, step time) is not this run's step: rerun smoke_1card with "
                         "the current config (python -m pisft launch smoke_1card, or snakemake --cores all / "
                         "dvc repro, which rerun it)")
    decisions.for_training(cfg, log=lambda _line: None)  # what the gate decided for `auto`, there to follow


def _under(flat: dict, key: str) -> list[str]:
    """The dotted keys of `flat` that are `key` or lie under it (a whole section)."""
    return [k for k in flat if k == key or k.startswith(key + ".")] or [key]


def _failures(output: str, log_dir: Path) -> list[Failure]:
    """Failed ranks from torchrun's summary ('rank : 1 (local_rank: 1)', 'exitcode : -9 ...')."""
    failures = []
    for m in re.finditer(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)",
                         output):
        rank, local_rank, code = m.groups()
        logs = sorted(log_dir.glob(f"*/attempt_*/{local_rank}/stderr.log"))
        failures.append(Failure(rank, local_rank, code, logs[-1] if logs else None))
    return failures


def _describe_exit(code: str) -> str:
    n = int(code)
    if n < 0:
        try:
            name = signal.Signals(-n).name
        except ValueError:
            return f"killed by signal {-n}"
        if name == "SIGKILL":  # nothing in the trainer sends it: a user, a scheduler or the kernel did
            return (f"killed by SIGKILL (exit code {n}; when nobody sent it, the kernel's out-of-memory killer "
                    "did: `dmesg | grep -i 'killed process'`, and `python -m pisft estimate` for the memory "
                    "a step needs)")
        return f"killed by {name} (exit code {n})"
    return {2: "stopped with a configuration/input error (exit code 2)",
            3: "smoke check failed (exit code 3)"}.get(n, f"exit code {n}")


def _latest_checkpoint(cfg: PisftConfig, stage: str = TRAIN_8CARD.name) -> str:
    from pisft.train.checkpoint import CheckpointsDamaged, latest_complete
    from pisft.train.run_folders import stage_checkpoint_root

    try:  # sizes only: the trainer checks the content before it resumes
        found = latest_complete(stage_checkpoint_root(stage, cfg), log=lambda _msg: None, content=False)
    except CheckpointsDamaged as exc:
        return str(exc)
    if found is None:
        return "no complete checkpoint yet: a rerun starts from step 0"
    return f"latest complete checkpoint: {found.path} (step {found.step}); a rerun resumes from it"


def _kept(cfg: PisftConfig, stage: str) -> str:
    """What a failed run leaves for the next: the latest complete checkpoint, finished outputs."""
    what = "every finished output"
    return f"{_latest_checkpoint(cfg, stage)}; {what}" if STAGES[stage].resumable else what


class _NoLog:
    """Stands in for a log file that could not be opened: the console still gets everything."""

    def write(self, _text: str) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


def _open_log(path: Path):
    try:
        return path.open("w")
    except OSError as exc:
        print(f"[launch] warning: cannot open {path} ({exc.strerror}); output goes to the "
              "console only", file=sys.stderr, flush=True)
        return _NoLog()


RANK0_PREFIX = worker_prefix("0")  # local rank 0's lines under torchrun's --tee


def console_line(line: str) -> str:
    """A line of torchrun's output as the console shows it: local rank 0's without its prefix."""
    return line[len(RANK0_PREFIX):] if line.startswith(RANK0_PREFIX) else line


def _run_tee(cmd: list[str], env: dict[str, str], log_file: Path,
             workers_check_launcher: bool = True) -> tuple[int, str, ConsoleHold]:
    """Run torchrun, copying its output to the console (through `ConsoleHold`: held from a
    worker's error line on) and to `log_file`.

    torchrun's agent gets SIGTERM when this launcher dies (it then stops its workers), and each
    worker gets SIGKILL when the agent dies (`pisft.train.guard`): a killed driver leaves no
    orphaned trainer behind. `workers_check_launcher` False (srun between the launcher and the
    agents: `pisft.train.slurm_nodes`): the workers are not told this launcher's pid.
    """
    lines: list[str] = []
    me = os.getpid()
    log = _open_log(log_file)
    console = ConsoleHold(_to_console)
    guard._prctl()  # noqa: SLF001 - loaded here, not in the forked child
    env = {**env, "PYTHONUNBUFFERED": "1"}
    if workers_check_launcher:
        env[guard.LAUNCHER_PID_ENV] = str(me)
    else:
        env.pop(guard.LAUNCHER_PID_ENV, None)
    with subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1, preexec_fn=lambda: guard.die_with_parent(signal.SIGTERM, me)) as proc:
        assert proc.stdout is not None
        log_ok = True
        try:
            for line in whole_lines(proc.stdout):  # a worker's line TailLog copied in pieces: whole
                console.line(line, console_line(line))
                lines.append(line)
                if log_ok:  # a full disk loses the log file, never the console or the summary
                    try:
                        log.write(line)
                        log.flush()
                    except OSError as exc:
                        log_ok = False
                        print(f"[launch] warning: cannot write {log_file} ({exc.strerror}); "
                              "output continues on the console", file=sys.stderr, flush=True)
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            proc.wait()
            console.release()
            raise
        except Terminated as exc:  # SIGTERM to the launcher: torchrun stops its workers, then we go
            proc.send_signal(exc.signum)
            proc.wait()
            console.release()
            raise
        finally:
            try:
                log.close()
            except OSError:
                pass
        rc = proc.wait()
    return rc, "".join(lines), console


def _to_console(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def preflight(stage: str, cfg: PisftConfig) -> str:
    """What refuses a launch before anything starts or is removed (the CLI runs it before it
    invalidates the downstream outputs): the devices, the gate's report and its settings, room
    for the logs. Returns the device kind."""
    kind = devices.resolve_kind(cfg.device)
    nproc = nproc_for(stage, cfg)
    if devices.row(kind).accelerator and devices.device_count(kind) < nproc:
        raise PisftError(f"{stage}: {nproc} processes need {nproc} {kind} devices but "
                         f"{devices.device_count(kind)} are visible; lower train.nproc_per_node")
    if stage == TRAIN_8CARD.name:
        check_smoke_report(cfg)
    elif STAGES[stage].gate:
        check_gate_report(cfg, stage)
    disk_space.require_room(cfg.results_dir, START_ROOM, what=f"{stage}'s logs",
                            kept=lambda: _kept(cfg, stage))
    allocation(stage, cfg)  # a multi-node stage: in a Slurm job of train.nnodes nodes, or by hand
    return kind


def main(stage: str, cfg: PisftConfig, config_path: str, overrides: list[str]) -> int:
    kind = preflight(stage, cfg)
    nproc = nproc_for(stage, cfg)
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    log_dir = layout.iteration(cfg).stage_logs(stage) / stamp
    log_dir.mkdir(parents=True, exist_ok=True)
    nodes = allocation(stage, cfg)
    cmd = torchrun_command(stage, cfg, config_path, overrides, log_dir, nodes)
    env = devices.process_env(kind, nproc_per_node=nproc, force_threads=True)
    env.setdefault(layout.COMPILE_CACHE_ENV, str(layout.compile_cache(cfg).absolute()))  # train.compile's cache
    where = (f" (Slurm job {nodes.job_id}: {', '.join(nodes.nodes)}; rendezvous at {nodes.endpoint})"
             if nodes else "")
    print(f"[launch] {stage}: {nproc} process(es) × {1 if one_process(stage) else cfg.train.nnodes} "
          f"node(s){where} on {kind}; logs in {log_dir}", file=sys.stderr, flush=True)
    # with `nodes`, srun stands between this launcher and the torchruns
    rc, output, console = _run_tee(cmd, env, log_dir / "launcher.log", workers_check_launcher=nodes is None)
    if rc == 0:
        console.release()  # lines held after an error line the run then got past: the console shows them
        return 0
    failures = _failures(output, log_dir)
    if console.explained([f.exitcode for f in failures]):
        # the workers' own message says what is wrong and what to do (a damaged input names the
        # stage that rewrites it, a full disk how to resume): once, without torchrun's traceback
        for message in console.messages():
            print(f"error: {stage}: {message}", file=sys.stderr, flush=True)
        return 2
    if disk_space.free_bytes(log_dir) < START_ROOM:  # a worker that could not write even its log
        print("error: " + disk_space.full_disk_line(cfg.results_dir, what=stage, needed=None,
                                                    kept=_kept(cfg, stage)), file=sys.stderr, flush=True)
        return 2
    console.release()
    lines = [f"{stage} failed (torchrun exit code {rc})."]
    for f in failures:
        where = f"its log: {f.log}" if f.log else f"logs under {log_dir}"
        lines.append(f"rank {f.rank} (local rank {f.local_rank}) {_describe_exit(f.exitcode)}; {where}")
    if not failures:
        lines.append(f"torchrun output: {log_dir / 'launcher.log'}")
    if STAGES[stage].resumable:
        lines.append(_latest_checkpoint(cfg, stage))
        lines.append(f"Rerun the same command (`snakemake --cores all {stage}`, `dvc repro "
                     f"{stage}` or `python -m pisft launch {stage} ...`) to resume.")
    else:
        report = (layout.iteration(cfg).stage_logs(stage) / layout.REPORT_FILE if stage == SMOKE_1CARD.name
                  else gate_report(cfg, stage))
        lines.append(f"smoke report (if written): {report}")
    print("error: " + "\n  ".join(lines), file=sys.stderr, flush=True)
    return 3 if one_process(stage) and any(f.exitcode == "3" for f in failures) else 1
