"""One trainer per run folder, with real processes and real signals (no torchrun: fast)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pisft.train.guard import LAUNCHER_PID_ENV, RunLock, RunLockHeld
from pisft.train.metrics import MetricsLog

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc: Linux")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _wait(predicate, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _sigkill_and_take_the_lock(holder: subprocess.Popen, folder: Path, alive: int | None = None) -> None:
    """SIGKILL the lock's holder, check that the process `alive` (if any) still lives, then take
    and release the lock."""
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    if alive is not None:
        os.kill(alive, 0)
    lock = RunLock(folder)
    lock.acquire()
    lock.release()


def _stop(holder: subprocess.Popen) -> None:
    if holder.poll() is None:
        holder.kill()
        holder.wait()


def test_second_trainer_is_refused_naming_the_holder_until_it_dies(tmp_path):
    folder = tmp_path / "run-abc"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pisft.train.guard import RunLock
            RunLock({str(folder)!r}).acquire()
            print("locked", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockHeld) as exc:
            RunLock(folder).acquire()
        msg = str(exc.value)
        assert f"pid {holder.pid}" in msg and socket.gethostname() in msg and "started 20" in msg
        assert str(folder) in msg
        _sigkill_and_take_the_lock(holder, folder)  # however the holder dies, the kernel frees the lock
    finally:
        _stop(holder)


def test_a_child_forked_by_the_holder_neither_frees_nor_keeps_its_lock(tmp_path):
    """A forked child (a DataLoader worker of rank 0) shares the lock's open file: the holder keeps
    the lock while it lives, and a SIGKILLed holder's lock is free at once although the child
    lives on (before: held until the child noticed, and the rerun refused naming a dead pid)."""
    folder = tmp_path / "run-abc"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import multiprocessing, os, time
            from pisft.train.guard import RunLock

            def started(w):  # runs in the child after the fork handlers (the lock's fd closed)
                os.write(w, b"x")
                time.sleep(60)

            RunLock({str(folder)!r}).acquire()
            r, w = os.pipe()
            child = multiprocessing.get_context("fork").Process(target=started, args=(w,))
            child.start()
            os.read(r, 1)  # the child ran: on a loaded host it may not have been scheduled yet
            print(child.pid, flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(holder.stdout.readline())
        with pytest.raises(RunLockHeld, match=f"pid {holder.pid}"):  # the child's close freed nothing
            RunLock(folder).acquire()
        _sigkill_and_take_the_lock(holder, folder, alive=child)  # the child lives on (it sleeps a minute)
    finally:
        _stop(holder)
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


# launcher -> agent (new process group, like torchrun under Snakemake's shell) -> worker in a
# session of its own (torchrun's start_new_session=True); each link installs pisft's guard.
_WORKER = """
import os, time
from pisft.train.guard import worker_dies_with_agent
worker_dies_with_agent()
print(os.getpid(), flush=True)
time.sleep(600)
"""
_AGENT = """
import subprocess, sys, time
w = subprocess.Popen([sys.executable, "-c", {worker!r}], start_new_session=True)
time.sleep(600)
"""
_LAUNCHER = """
import os, signal, subprocess, sys, time
from pisft.train import guard
me = os.getpid()
os.environ[guard.LAUNCHER_PID_ENV] = str(me)
guard._prctl()
subprocess.Popen([sys.executable, "-c", {agent!r}],
                 preexec_fn=lambda: guard.die_with_parent(signal.SIGTERM, me))
time.sleep(600)
"""


def test_killing_the_launchers_process_group_kills_workers_in_their_own_session():
    agent = _AGENT.format(worker=_WORKER)
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER.format(agent=agent)],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    worker_pid = int(launcher.stdout.readline())
    try:
        assert os.getpgid(worker_pid) != launcher.pid  # out of the group: killpg misses it
        os.killpg(launcher.pid, signal.SIGKILL)  # the driver's whole process group, no clean-up
        launcher.wait()
        assert _wait(lambda: not _alive(worker_pid)), "the worker outlived its launcher"
    finally:
        if _alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


# An agent that outlives its launcher (it has no guard of its own here), then starts a worker.
_ORPHAN_AGENT = """
import json, subprocess, sys
sys.stdin.readline()  # the test says when the launcher is gone
w = subprocess.run([sys.executable, "-c", {worker!r}], capture_output=True, text=True, timeout=60)
print(json.dumps({{"returncode": w.returncode, "stderr": w.stderr}}), flush=True)
"""
_LAUNCHER_OF_ORPHAN = """
import os, subprocess, sys, time
os.environ["{env}"] = str(os.getpid())
agent = subprocess.Popen([sys.executable, "-c", {agent!r}])  # shares this process's stdin/stdout
print(agent.pid, flush=True)
time.sleep(600)
"""


def test_a_worker_whose_launcher_is_already_gone_exits_at_once():
    """launcher -> agent; the launcher is killed (kill -9), the agent, reparented, then starts a
    worker: the worker finds that its agent's parent is no longer the launcher and exits."""
    agent_code = _ORPHAN_AGENT.format(worker=_WORKER)
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER_OF_ORPHAN.format(env=LAUNCHER_PID_ENV, agent=agent_code)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    agent_pid = int(launcher.stdout.readline())
    try:
        assert _parent(agent_pid) == launcher.pid
        launcher.kill()
        launcher.wait()
        assert _wait(lambda: _parent(agent_pid) != launcher.pid), "the agent was not reparented"
        launcher.stdin.write("go\n")
        launcher.stdin.flush()
        result = json.loads(launcher.stdout.readline())
        assert result["returncode"] == 1, result
        assert f"the launcher (pid {launcher.pid}) is gone; this orphaned worker exits" in result["stderr"]
    finally:
        if _alive(agent_pid):
            os.kill(agent_pid, signal.SIGKILL)


def test_metrics_are_cut_back_to_unique_increasing_steps_on_resume(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    # what two interleaved trainers left behind (issue 11): duplicates and reordering
    steps = [1, 2, 3, 4, 5, 6, 3, 7, 4, 5, 8]
    log.path.write_text("".join(f'{{"step": {s}, "loss": {s}}}\n' for s in steps))
    log.reset(keep_upto_step=6)
    got = [r["step"] for r in log.read()]
    assert got == [1, 2, 3, 4, 5, 6]
