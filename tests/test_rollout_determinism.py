"""Issue 47, item 1: the same rollouts give the same bytes, whatever the environment processes,
their speed, or a kill and a rerun.

A real policy (the tiny pi0.5 with its zero-initialised parameters filled, whose actions follow
a forward's rows as a trained model's do: `model_fixtures.trained_like_model_dir`) answers
stand-in environments in spawned worker processes. One run has one environment process, the
other two, chosen by `eval.num_envs: 0` from the memory it finds, with a real delay in one of
them and a hold that gathers the other's requests into its forwards: different batches
(checked in their timing records), the same config. Without the fixed forward shape
(`pisft.policy.fixed_shape`) their actions, states and frames differ from the first chunk that
shared a forward.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_eval_closed_loop import StandInSimulator, StandInTask

from pisft import config as C
from pisft import device as device_mod
from pisft import layout

# Worker processes import this module to build `OneSlowSimulator`: what is heavy to import (the
# stages, torch) is imported inside the tests.
ROOT = Path(__file__).resolve().parents[1]
TASKS = [StandInTask("reach 0.3 0 0", [0.3, 0, 0]), StandInTask("reach 99 0 0", [99.0, 0, 0])]
HOLD_MS = 500  # eval.policy_batch_wait_ms: how the timing goes, never what it gives
DELAY_S = 0.02  # the slowed process's seconds per simulator step


class ShowsPosition(StandInSimulator):
    """Its environments' agent view carries the end effector's position bit for bit (its float64
    bytes in the first pixels), so a video shows any difference in the actions executed, as
    LIBERO's renders do."""

    def make_env(self, task, *, resolution, seed):
        env = super().make_env(task, resolution=resolution, seed=seed)
        plain = env._obs

        def shown():
            obs = plain()
            image = obs["agentview_image"].copy()
            image[0, :24] = np.frombuffer(env.pos.astype(np.float64).tobytes(), np.uint8)[:, None]
            obs["agentview_image"] = image
            return obs

        env._obs = shown
        return env


class OneSlowSimulator(ShowsPosition):
    """The first process to build an environment with one (it claims `marker`; the stage's own
    process only plans) sleeps `delay_s` every step, as a slow or descheduled environment process
    does; the others run at full speed."""

    def __init__(self, tasks, marker: str, delay_s: float):
        super().__init__(tasks)
        self.marker, self.delay_s = marker, delay_s
        self.slow: bool | None = None

    def make_env(self, task, *, resolution, seed):
        env = super().make_env(task, resolution=resolution, seed=seed)
        if self.slow is None:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                self.slow = True
            except FileExistsError:
                self.slow = False
        if self.slow:
            step, delay = env.step, self.delay_s

            def slow_step(action):
                time.sleep(delay)
                return step(action)

            env.step = slow_step
        return env


def config(tmp: Path) -> C.PisftConfig:
    """RECAP iteration 1's collection: 2 tasks x 2 episodes of 15 steps (3 chunks each); the
    environment processes picked by `eval.num_envs: 0` from the memory available (`memory_for`)."""
    return C.from_dict({
        "results_dir": str(tmp / "results"), "device": "cpu",
        "eval": {"closed_loop": True, "trials_per_task": 3, "num_envs": 0, "policy_batch_wait_ms": HOLD_MS},
        "recap": {"iterations": 1, "suite": "libero_10", "task_ids": [0, 1], "episodes_per_task": 2,
                  "max_steps": 15, "collect_seed": 1000}}).at_iteration(1)


def memory_for(monkeypatch, envs: int) -> None:
    """`eval.num_envs: 0` picks `envs` environment processes on 2 cores (settings.auto_num_envs)."""
    monkeypatch.setattr(device_mod, "usable_cores", lambda: 2)
    monkeypatch.setattr(device_mod, "available_memory", lambda: int((envs + 0.5) * (3.5 * 2**30)))


def files(root: Path) -> dict[str, str]:
    """Every file under `root` by its sha256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def batches(cfg, stage: str) -> tuple[int, int]:
    """(environment processes, the most requests in one forward) of the run's timing record."""
    t = json.loads(layout.iteration(cfg).timing(stage).read_text())
    return t["num_envs"], t["max_policy_batch"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One collection with one environment, in this process (every forward one request, padded
    to 2 rows): its results folder and the files of its rollouts."""
    from model_fixtures import trained_like_model_dir

    from pisft.recap import collect

    tmp = tmp_path_factory.mktemp("determinism")
    cfg = config(tmp)
    shutil.copytree(trained_like_model_dir(tmp_path_factory), layout.policy(cfg, 0))
    with pytest.MonkeyPatch.context() as mp:
        memory_for(mp, 1)
        collect.run(cfg, simulator=functools.partial(ShowsPosition, TASKS), inline=True)
    assert batches(cfg, "collect_rollouts") == (1, 1)
    return tmp, files(layout.iteration(cfg).rollouts)


@pytest.mark.integration  # ~10 s: the tiny pi0.5 and 2 spawned environment processes
def test_a_collection_gives_the_same_bytes_whatever_its_environments_and_their_speed(reference, monkeypatch):
    from pisft.recap import collect

    tmp, expected = reference
    cfg = config(tmp)
    shutil.rmtree(layout.iteration(cfg).rollouts)
    memory_for(monkeypatch, 2)
    collect.run(cfg, simulator=functools.partial(OneSlowSimulator, TASKS, str(tmp / "slow-marker"), DELAY_S))
    assert (tmp / "slow-marker").exists()  # one process was slowed down
    assert batches(cfg, "collect_rollouts") == (2, 2)  # two processes, requests shared forwards
    got = files(layout.iteration(cfg).rollouts)
    assert got == expected  # every file: the parquet frames, meta/, collection.json, the manifest
    assert any(name.endswith(".parquet") for name in got) and "collection.json" in got


RUNNER = """
import functools, sys
sys.path[:0] = [{tests!r}]
from pathlib import Path
import pytest
from test_rollout_determinism import OneSlowSimulator, TASKS, config, memory_for
from pisft.recap import collect
with pytest.MonkeyPatch.context() as mp:
    memory_for(mp, 1)
    collect.run(config(Path({tmp!r})), simulator=functools.partial(OneSlowSimulator, TASKS, {marker!r}, {delay!r}))
"""


@pytest.mark.integration  # ~15 s: a collection started in its own process, killed, and run again
def test_a_collection_killed_and_run_again_gives_the_same_bytes(reference, monkeypatch):
    from pisft.recap import collect

    tmp, expected = reference
    cfg = config(tmp)
    final = layout.iteration(cfg).rollouts
    shutil.rmtree(final, ignore_errors=True)
    script = RUNNER.format(tests=str(ROOT / "tests"), tmp=str(tmp), marker=str(tmp / "kill-marker"), delay=DELAY_S)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                                                              os.environ.get("PYTHONPATH", "")])})
    try:
        deadline = time.monotonic() + 240  # a bound on waiting, not a verdict on speed
        while not list(final.parent.glob(f".{final.name}.tmp-*/{collect.RECORDINGS}/episode_000000/steps.npz")):
            assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "the collection never finished its first episode"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)  # mid-collection: its first episode recorded, the others not
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL and not final.exists()
    left = list(final.parent.glob(f".{final.name}.tmp-*"))
    assert left  # the killed run's temporary folder, as a power cut leaves it
    # the same command again (after `snakemake --unlock`): the stale folder goes, the bytes are the first run's
    memory_for(monkeypatch, 2)
    collect.run(cfg, simulator=functools.partial(ShowsPosition, TASKS), inline=True)
    assert files(final) == expected
    assert not any(p.exists() for p in left), [(p, sorted(p.rglob("*"))) for p in left if p.exists()]


@pytest.mark.integration  # ~10 s: the tiny pi0.5, one environment in this process, then two spawned
def test_the_closed_loop_gives_the_same_metrics_episodes_and_videos_whatever_its_environments(
        tmp_path, tmp_path_factory, monkeypatch):
    from model_fixtures import trained_like_model_dir

    from pisft.evaluate import closed_loop

    cfg = C.from_dict({"results_dir": str(tmp_path / "results"), "device": "cpu",
                       "eval": {"closed_loop": True, "libero_suites": ["libero_10"], "task_ids": [0, 1],
                                "trials_per_task": 1, "max_steps": 15, "num_envs": 0,
                                "policy_batch_wait_ms": HOLD_MS}})
    shutil.copytree(trained_like_model_dir(tmp_path_factory), layout.iteration(cfg).trained_model)
    out = layout.iteration(cfg).closed_loop
    runs = []
    for envs, factory in ((1, functools.partial(ShowsPosition, TASKS)),
                          (2, functools.partial(OneSlowSimulator, TASKS, str(tmp_path / "marker"), DELAY_S))):
        memory_for(monkeypatch, envs)
        closed_loop.run(cfg, simulator=factory, inline=envs == 1)
        assert batches(cfg, "closed_loop") == (envs, envs)
        runs.append({name: digest for name, digest in files(out).items()
                     if name in ("metrics.json", "episodes.jsonl") or name.startswith("videos/")})
    assert runs[0] == runs[1]
    assert {"metrics.json", "episodes.jsonl", "videos/libero_10_task00.mp4", "videos/libero_10_task01.mp4"} \
        <= set(runs[0])
