"""Issue 22, item 7: a refused trainer touches nothing; the trainer lock follows no symlink."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pisft import config as C
from pisft.errors import PisftError
from pisft.train import guard, run_folders

ROOT = Path(__file__).resolve().parents[1]

HOLDER = """
import sys, time
from pathlib import Path
from pisft import config as C
from pisft.train import guard, run_folders
cfg = C.load(sys.argv[1])
lock = guard.RunLock(run_folders.stage_checkpoint_root("train_8card", cfg))
lock.acquire("train_8card")
print("locked", flush=True)
sys.stdin.read()   # hold the lock until the test closes our stdin
"""


def write_config(tmp_path: Path) -> Path:
    raw = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    raw["results_dir"] = str(tmp_path / "results")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_second_launch_on_a_running_run_folder_is_refused_before_it_opens_the_stage_log(tmp_path):
    cfg_path = write_config(tmp_path)
    log = tmp_path / "results/logs/train_8card.log"
    log.parent.mkdir(parents=True)
    running = "".join(f"step {i} loss 0.{i}\n" for i in range(21)).encode()  # the running trainer's log
    log.write_bytes(running)
    downstream = tmp_path / "results/train/model/config.json"  # an output the stage would invalidate
    downstream.parent.mkdir(parents=True)
    downstream.write_text("{}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(cfg_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        second = subprocess.run([sys.executable, "-m", "pisft", "launch", "train_8card", "--config", str(cfg_path),
                                 "--log", str(log)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert second.returncode != 0
    assert f"in use by another trainer (pid {holder.pid}" in second.stderr
    assert log.read_bytes() == running  # all 21 step lines of the running trainer's log are there
    assert downstream.read_text() == "{}"
    folder = run_folders.stage_checkpoint_root("train_8card", C.load(cfg_path))
    assert guard.lock_holder(folder) is None  # the holder is gone: the lock is free, nothing stale


def test_the_trainer_lock_is_never_followed_through_a_symlink(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    victim = tmp_path / "precious.txt"
    victim.write_text("do not truncate me\n")
    (folder / guard.LOCK_NAME).symlink_to(victim)
    with pytest.raises(PisftError, match=r"trainer lock .*\.trainer\.lock is a symbolic link .* Remove the link"):
        guard.RunLock(folder).acquire("train_8card")
    with pytest.raises(PisftError, match="symbolic link"):
        guard.lock_holder(folder)
    assert victim.read_text() == "do not truncate me\n"


def test_lock_holder_only_looks(tmp_path):
    folder = tmp_path / "run"
    assert guard.lock_holder(folder) is None and not folder.exists()  # creates nothing
    lock = guard.RunLock(folder)
    lock.acquire()
    try:
        assert f"pid {os.getpid()}" in guard.lock_holder(folder)
    finally:
        lock.release()
    assert guard.lock_holder(folder) is None
    lock.acquire()  # and the lock is still free to take
    lock.release()
