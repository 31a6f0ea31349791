"""The launcher: torchrun argument lists, environment, failure messages, the smoke gate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pisft import layout
from pisft import config as config_mod
from pisft import device as devices
from pisft.errors import PisftError
from pisft.train import launch
from pisft.train.worker_errors import ConsoleHold

CONFIG = Path(__file__).resolve().parents[1] / "config" / "config.yaml"

TORCHRUN_FAILURE = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
pisft.train FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================
"""


def _cfg(tmp_path, *extra):
    return config_mod.load(CONFIG, [f"results_dir={tmp_path}", *extra])


def test_single_node_command_is_an_argument_list(tmp_path):
    cfg = _cfg(tmp_path, "train.nproc_per_node=4", "train.global_batch_size=32")
    overrides = ["train.nproc_per_node=4", "data.tasks=['put it; rm -rf /']"]
    cmd = launch.torchrun_command("train_8card", cfg, "config/config.yaml", overrides, tmp_path)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--standalone" in cmd
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert cmd[cmd.index("--max-restarts") + 1] == "0"
    tail = cmd[cmd.index("pisft.train") - 1:]
    assert tail[:6] == ["-m", "pisft.train", "--stage", "train_8card", "--config", "config/config.yaml"]
    assert tail[6:] == ["--set", overrides[0], "--set", overrides[1]]  # one argument each, no shell


def test_multi_node_and_smoke_commands(tmp_path):
    cfg = _cfg(tmp_path, "train.nnodes=2", "train.node_rank=1", "train.rdzv_endpoint=10.0.0.1:29500",
               "train.nproc_per_node=8", "train.global_batch_size=128")
    cmd = launch.torchrun_command("train_8card", cfg, "c.yaml", [], tmp_path)
    for flag, value in (("--nnodes", "2"), ("--node-rank", "1"), ("--master-addr", "10.0.0.1"),
                        ("--master-port", "29500"), ("--nproc-per-node", "8")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--standalone" not in cmd
    smoke = launch.torchrun_command("smoke_1card", cfg, "c.yaml", [], tmp_path)
    assert smoke[smoke.index("--nproc-per-node") + 1] == "1" and "--standalone" in smoke
    with pytest.raises(PisftError, match="HOST:PORT"):
        launch.split_endpoint("10.0.0.1")


def test_slurm_job_command_starts_one_torchrun_per_node_with_a_c10d_rendezvous(tmp_path, monkeypatch):
    """train.nnodes 2 and no endpoint in a Slurm job: srun, one task per node, each a torchrun that
    meets the others at the first node's address; no rank or endpoint typed. The smoke gate stays
    one process on one node."""
    monkeypatch.setattr(launch.slurm_nodes.shutil, "which", lambda name: f"/usr/bin/{name}")
    cfg = _cfg(tmp_path, "train.nnodes=2", "train.nproc_per_node=8", "train.global_batch_size=128")
    nodes = launch.slurm_nodes.Allocation("1234", ("n1", "n2"), "10.1.0.11")
    cmd = launch.torchrun_command("train_8card", cfg, "c.yaml", [], tmp_path, nodes)
    run_at = cmd.index(sys.executable)
    assert cmd[:run_at] == ["/usr/bin/srun", "--jobid", "1234", "--nodes", "2", "--ntasks", "2",
                            "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    assert cmd[run_at:run_at + 3] == [sys.executable, "-m", "torch.distributed.run"]
    for flag, value in (("--nnodes", "2"), ("--rdzv-backend", "c10d"), ("--rdzv-endpoint", "10.1.0.11:29734"),
                        ("--rdzv-id", "1234"), ("--nproc-per-node", "8")):
        assert cmd[cmd.index(flag) + 1] == value
    assert not {"--standalone", "--node-rank", "--master-addr"} & set(cmd)
    assert launch.allocation("smoke_1card", cfg) is None
    smoke = launch.torchrun_command("smoke_1card", cfg, "c.yaml", [], tmp_path)
    assert smoke[0] == sys.executable and "--standalone" in smoke


def test_several_nodes_without_slurm_or_endpoint_is_refused_naming_both_ways(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    cfg = _cfg(tmp_path, "train.nnodes=2", "train.global_batch_size=32")
    with pytest.raises(PisftError) as err:
        launch.allocation("train_8card", cfg)
    assert "profiles/slurm" in str(err.value) and "train.rdzv_endpoint=" in str(err.value)
    assert "train.node_rank=" in str(err.value)
    # the by-hand rendezvous is what it was, in a Slurm job or not
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    by_hand = _cfg(tmp_path, "train.nnodes=2", "train.rdzv_endpoint=10.0.0.1:29500", "train.global_batch_size=32")
    assert launch.allocation("train_8card", by_hand) is None


def test_scontrol_oneliner_fields():
    line = ("JobId=12 JobName=x UserId=root(0) JobState=RUNNING Reason=None NodeList=pisft-n[1-2] "
            "BatchHost=pisft-n1 NumNodes=2 NumCPUs=4 Command=(null)\n")
    fields = launch.slurm_nodes._fields(line)
    assert fields["NodeList"] == "pisft-n[1-2]" and fields["NumNodes"] == "2" and fields["JobId"] == "12"


def test_failure_report_names_rank_signal_and_log(tmp_path):
    log = tmp_path / "run-id_x" / "attempt_0" / "1" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text("boom\n")
    (failure,) = launch._failures(TORCHRUN_FAILURE, tmp_path)
    assert (failure.rank, failure.local_rank, failure.exitcode, failure.log) == ("1", "1", "-9", log)
    assert "SIGKILL" in launch._describe_exit("-9")


def test_launcher_passes_device_environment(tmp_path, monkeypatch, capsys):
    """device npu: the Ascend defaults and JAX_PLATFORMS reach torchrun; 8 processes."""
    cfg = _cfg(tmp_path, "device=npu", "train.nproc_per_node=8", "train.global_batch_size=32")
    _write_report(cfg, passed=True)
    monkeypatch.setattr(devices, "resolve_kind", lambda requested: "npu")
    monkeypatch.setattr(devices, "device_count", lambda kind: 8)
    monkeypatch.delenv("TASK_QUEUE_ENABLE", raising=False)
    monkeypatch.delenv(layout.COMPILE_CACHE_ENV, raising=False)  # torch sets it once it uses its cache
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "77")
    seen = {}

    def fake_run(cmd, env, log_file, workers_check_launcher=True):
        seen.update(cmd=cmd, env=env)
        return 1, TORCHRUN_FAILURE, ConsoleHold(print)

    monkeypatch.setattr(launch, "_run_tee", fake_run)
    rc = launch.main("train_8card", cfg, "c.yaml", [])
    assert rc != 0
    assert seen["cmd"][seen["cmd"].index("--nproc-per-node") + 1] == "8"
    assert seen["env"]["TASK_QUEUE_ENABLE"] == devices.ASCEND_ENV_DEFAULTS["TASK_QUEUE_ENABLE"]
    assert seen["env"]["HCCL_CONNECT_TIMEOUT"] == "77"
    assert seen["env"]["JAX_PLATFORMS"] == "cpu"
    # train.compile's cache under the results, set before torch runs in a worker (the smoke gate's
    # estimate made torch set its own /tmp default before the blocks compiled)
    assert seen["env"][layout.COMPILE_CACHE_ENV] == str(layout.compile_cache(cfg).absolute())
    err = capsys.readouterr().err
    assert "rank 1 (local rank 1) killed by SIGKILL" in err
    assert "out-of-memory killer" in err  # a SIGKILL nobody sent is the kernel's OOM killer: the message says so
    assert "no complete checkpoint yet" in err and "Rerun the same command" in err


def test_a_run_that_succeeds_after_an_error_line_shows_every_line(tmp_path, monkeypatch, capsys):
    """ConsoleHold holds torchrun's lines from a worker's error line on; a run that still ends with
    exit 0 shows them all (they were lost before)."""
    cfg = _cfg(tmp_path)
    _write_report(cfg, passed=True)
    shown = []

    def fake_run(cmd, env, log_file, workers_check_launcher=True):
        console = ConsoleHold(shown.append)
        for line in ("[default0]:step 1\n", "[default0]:error (rank 0): a retried read\n", "[default0]:step 2\n"):
            console.line(line, line)
        return 0, "", console

    monkeypatch.setattr(launch, "_run_tee", fake_run)
    assert launch.main("train_8card", cfg, "c.yaml", []) == 0
    assert shown == ["[default0]:step 1\n", "[default0]:error (rank 0): a retried read\n", "[default0]:step 2\n"]


def test_too_few_devices_fails_before_starting(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "device=cuda", "train.nproc_per_node=8", "train.global_batch_size=32")
    monkeypatch.setattr(devices, "resolve_kind", lambda requested: "cuda")
    monkeypatch.setattr(devices, "device_count", lambda kind: 2)
    with pytest.raises(PisftError, match="8 processes need 8 cuda devices but 2"):
        launch.main("train_8card", cfg, "c.yaml", [])


def _write_report(cfg, *, passed, decided=True, **config_changes):
    """A smoke report as the gate writes it on the CPU (train.compile: auto decided eager, no trial)."""
    from pisft.gates.compile_trial import as_written
    from pisft.train.decisions import COMPILE, DECISIONS

    resolved = config_mod.resolved(cfg)
    for key, value in config_changes.items():
        section, leaf = key.split("__")
        resolved[section][leaf] = value
    path = layout.results(cfg, "smoke", "report.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"passed": passed, "messages": ["loss is NaN"], "pisft_config": resolved}
    if decided:
        report[DECISIONS] = {COMPILE: as_written(cfg.train.compile)}
    path.write_text(json.dumps(report))


def test_smoke_gate(tmp_path):
    cfg = _cfg(tmp_path)
    with pytest.raises(PisftError, match="run smoke_1card first"):
        launch.check_smoke_report(cfg)
    _write_report(cfg, passed=False)
    with pytest.raises(PisftError, match="did not pass:\n  - loss is NaN"):
        launch.check_smoke_report(cfg)
    _write_report(cfg, passed=True, train__micro_batch_size=2)
    with pytest.raises(PisftError, match="train.micro_batch_size: smoke 2, now 4"):
        launch.check_smoke_report(cfg)
    _write_report(cfg, passed=True, decided=False)  # a report from before the gate decided train.compile: auto
    with pytest.raises(PisftError, match="records no decisions .*rerun smoke_1card"):
        launch.check_smoke_report(cfg)
    _write_report(cfg, passed=True)
    launch.check_smoke_report(cfg)


def _other(value):
    """A value of the same kind that differs."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    return f"{value}-other"


def test_every_key_of_a_training_step_must_match_the_smoke_report(tmp_path):
    """The keys whose change reruns smoke_1card under the drivers (train.trainable, the LoRA
    settings, data.augment, ...): a training launched by hand after changing one is refused."""
    from pisft.stages import TRAIN_STEP_KEYS

    cfg = _cfg(tmp_path)
    assert set(TRAIN_STEP_KEYS) <= set(launch.SMOKE_MUST_MATCH)
    for key in (*TRAIN_STEP_KEYS, "device", "model.preset"):
        resolved = config_mod.resolved(cfg)
        node = resolved
        *sections, leaf = key.split(".")
        for part in sections:
            node = node[part]
        node[leaf] = _other(node[leaf])
        path = layout.smoke_report(cfg)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"passed": True, "pisft_config": resolved}))
        with pytest.raises(PisftError) as err:
            launch.check_smoke_report(cfg)
        msg = str(err.value)
        assert f"({key}: smoke " in msg and "\n" not in msg and "rerun smoke_1card" in msg, msg


AGENT_TRACEBACK = """\
E0101 00:00:00.000000 1 torch/distributed/elastic/multiprocessing/api.py:986] failed (exitcode: 2) local_rank: 0
Traceback (most recent call last):
  File "torch/distributed/run.py", line 994, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
pisft.train FAILED
------------------------------------------------------------
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : {code1} (pid: 4243)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 2 (pid: 4242)
============================================================
"""


@pytest.mark.parametrize("code1", ["2", "-15", "1"])
def test_a_workers_own_error_is_the_one_line_the_console_shows(tmp_path, monkeypatch, capfd, code1):
    """Both ranks print the same error and exit 2 (or rank 1 is stopped by torchrun's SIGTERM
    after rank 0 failed): the console shows the message once, without torchrun's traceback or a
    resume advice. When a rank crashed otherwise (exit 1), everything torchrun said is shown and
    the launcher's summary follows."""
    cfg = _cfg(tmp_path)
    _write_report(cfg, passed=True)
    message = "reading the dataset /r/dataset: /r/dataset/x.parquet: sha256 differs; rebuild it: snakemake"
    output = (f"[default0]:[train_8card] starting\n[default0]:error (rank 0): {message}\n"
              f"[default1]:error (rank 1): {message}\n" + AGENT_TRACEBACK.format(code1=code1))
    script = f"import sys; sys.stdout.write({output!r}); sys.exit(1)"
    monkeypatch.setattr(launch, "torchrun_command", lambda *a, **k: [sys.executable, "-c", script])
    rc = launch.main("train_8card", cfg, "c.yaml", [])
    out, err = capfd.readouterr()
    assert "[train_8card] starting" in out  # what came before the error is shown as it came
    if code1 == "1":
        assert rc == 1 and "Traceback" in out and "Rerun the same command" in err
        assert f"error (rank 0): {message}" in out and f"[default1]:error (rank 1): {message}" in out
        return
    assert rc == 2
    assert "Traceback" not in out + err and "error (rank" not in out + err and "resume" not in err.lower()
    assert [line for line in err.splitlines() if line.startswith("error")] == [f"error: train_8card: {message}"]


def test_summary_reaches_the_console_when_the_log_cannot_be_written(tmp_path, monkeypatch, capfd):
    """launcher.log on a full disk (/dev/full: ENOSPC on every write): output and summary survive."""
    import sys

    cfg = _cfg(tmp_path)
    _write_report(cfg, passed=True)
    script = f"import sys; sys.stdout.write({TORCHRUN_FAILURE!r}); sys.exit(1)"
    monkeypatch.setattr(launch, "torchrun_command", lambda *a, **k: [sys.executable, "-c", script])
    real = launch._run_tee
    monkeypatch.setattr(launch, "_run_tee", lambda cmd, env, log_file, **kw: real(cmd, env, Path("/dev/full"), **kw))
    rc = launch.main("train_8card", cfg, "c.yaml", [])
    assert rc == 1
    out, err = capfd.readouterr()
    assert "exitcode  : -9" in out  # torchrun's output still on the console
    assert "cannot write /dev/full" in err
    assert "rank 1 (local rank 1) killed by SIGKILL" in err and "Rerun the same command" in err


def test_thread_counts_come_from_one_place_under_either_driver(monkeypatch):
    """Snakemake exports OMP_NUM_THREADS=<all cores>, DVC nothing: the workers see the same."""
    snakemake = {"PATH": "/bin", "OMP_NUM_THREADS": "64", "MKL_NUM_THREADS": "64", "OPENBLAS_NUM_THREADS": "64"}
    dvc = {"PATH": "/bin"}
    for kind in ("cpu", "cuda", "npu"):
        a = devices.process_env(kind, snakemake, nproc_per_node=2, force_threads=True)
        b = devices.process_env(kind, dvc, nproc_per_node=2, force_threads=True)
        for var in (*devices.THREAD_VARS, devices.THREADS_ENV):
            assert a[var] == b[var] == str(devices.threads_per_process(2, dvc)), (kind, var)
    by_hand = devices.process_env("cpu", {**snakemake, devices.THREADS_ENV: "3"}, nproc_per_node=2,
                                  force_threads=True)
    assert by_hand["OMP_NUM_THREADS"] == by_hand["MKL_NUM_THREADS"] == "3"
    # inside a worker (apply_process_env) the launcher's choice is kept
    assert devices.process_env("cpu", a)["OMP_NUM_THREADS"] == a["OMP_NUM_THREADS"]


def test_rank0_lines_reach_the_console_while_torchrun_runs(tmp_path, monkeypatch):
    """torchrun's agent writes the workers' lines to its stdout without flushing (TailLog): under
    a driver that does not export PYTHONUNBUFFERED (dvc repro), they would sit in its buffer
    until it exits. Here a child writes as the agent does and then waits until the console has
    shown the line: it only ends because the line got through while it ran. Rank 0's line loses
    torchrun's prefix on the console, rank 1's keeps it; the log keeps both as written."""
    import os
    import sys
    import threading

    shown = tmp_path / "shown"
    script = ("import sys, time, pathlib\n"
              "sys.stdout.write('[default0]:[train_8card] step 10/150 (7%) loss 0.5\\n')\n"
              "sys.stdout.write('[default1]:a line of rank 1\\n')\n"
              f"p = pathlib.Path({str(shown)!r})\n"
              "for _ in range(1200):\n"
              "    if p.exists(): sys.exit(0)\n"
              "    time.sleep(0.05)\n"
              "sys.exit(7)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}

    class Console:
        def __init__(self):
            self.lines: list[str] = []

        def write(self, text):
            self.lines.append(text)
            if "a line of rank 1" in text:
                shown.touch()

        def flush(self):
            pass

    console = Console()
    monkeypatch.setattr(sys, "stdout", console)
    done = {}
    t = threading.Thread(target=lambda: done.update(
        out=launch._run_tee([sys.executable, "-c", script], env, tmp_path / "launcher.log")))
    t.start()
    t.join(timeout=120)
    assert not t.is_alive()
    rc, output, _ = done["out"]
    assert rc == 0, "the child never saw its lines on the console: they waited in its buffer"
    assert console.lines == ["[train_8card] step 10/150 (7%) loss 0.5\n", "[default1]:a line of rank 1\n"]
    assert (tmp_path / "launcher.log").read_text().splitlines() == [
        "[default0]:[train_8card] step 10/150 (7%) loss 0.5", "[default1]:a line of rank 1"]


def test_the_launcher_never_imports_torch(tmp_path):
    """`pisft launch` (cli -> pisft.train.launch) reads its stage's run folder (the lock's,
    pisft.train.run_folders) and the device row's environment without torch: the torchrun it starts
    and the workers import it, the launcher would pay its import (about 2 CPU s) once more per
    stage launch."""
    script = f"""
import argparse, sys
from pisft import cli, config
from pisft import device as devices
from pisft.train import launch
cfg = config.load({str(CONFIG)!r}, ["results_dir={tmp_path}/results"])
for stage in ("smoke_1card", "train_8card", "train_value"):
    assert cli._running_trainer(argparse.Namespace(stage=stage, config={str(CONFIG)!r}, iteration=0,
                                overrides=["results_dir={tmp_path}/results"])) is None
    launch.torchrun_command(stage, cfg, {str(CONFIG)!r}, [], launch.Path("{tmp_path}/logs"), None)
env = devices.process_env(devices.resolve_kind(cfg.device), nproc_per_node=2, force_threads=True)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""
    import subprocess

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", f"the launcher imported torch: {out.stdout[:300]}"


def test_a_line_torchrun_copied_in_two_pieces_reaches_the_console_whole(tmp_path):
    """torchrun's TailLog copies a worker's log with readline(): read between the two writes of
    one `print` (the text, then the newline), the line reaches its stdout as
    `[default0]:<text>[default0]:` + newline (CI, stop 64: the terminal test saw `[default0]:` in
    the middle of a step line). Here the real `tail_logfile` copies a file the test writes in two
    pieces, each written once the previous one was copied (progress, not time); rank 1's line
    comes between them. The launcher's `whole_lines` gives the lines whole, and ends a line a worker
    never finished when torchrun's output ends."""
    import io
    import threading

    from torch.distributed.elastic.multiprocessing.tail_log import tail_logfile

    from pisft.train.worker_errors import whole_lines

    class Copied(io.StringIO):
        def __init__(self):
            super().__init__()
            self.copied = threading.Condition()

        def write(self, text):
            with self.copied:
                n = super().write(text)
                self.copied.notify_all()
                return n

    def wait_for(text):
        with out.copied:
            assert out.copied.wait_for(lambda: out.getvalue().endswith(text), timeout=60), out.getvalue()

    log, out, finished = tmp_path / "stdout.log", Copied(), threading.Event()
    log.touch()
    tail = threading.Thread(target=tail_logfile, args=("[default0]:", str(log), out, finished, 0.01),
                            kwargs={"log_line_filter": lambda line: True})
    tail.start()
    with log.open("w", buffering=1) as worker:
        worker.write("[train_8card] precision fp32; FSDP2")
        worker.flush()
        wait_for("FSDP2")
        out.write("[default1]:a line of rank 1\n")
        worker.write("; MFU not reported\n")
        worker.flush()
        wait_for("reported\n")
    finished.set()
    tail.join(timeout=60)
    physical = out.getvalue().splitlines(keepends=True)
    assert physical[0] == "[default0]:[train_8card] precision fp32; FSDP2[default1]:a line of rank 1\n"

    lines = list(whole_lines([*physical, "W1207 07:00:00 torchrun's own line\n",
                              "[default0]:a line a worker never ended"]))
    assert lines == ["[default1]:a line of rank 1\n",
                     "[default0]:[train_8card] precision fp32; FSDP2; MFU not reported\n",
                     "W1207 07:00:00 torchrun's own line\n",
                     "[default0]:a line a worker never ended\n"]
    assert launch.console_line(lines[1]) == "[train_8card] precision fp32; FSDP2; MFU not reported\n"
