"""Issue 33, items 1 and 4: the RECAP stages under the faults the SFT stages survive, on a copy of
the embedded default's finished run (the session's `default_pipeline`, which
tests/test_orchestration.py shares): `kill -9` of Snakemake's process group during train_value
and during advantages, then `snakemake --unlock` and the rerun, ending with the bytes of the
uninterrupted run; bytes flipped in collected rollouts before convert_recap reads them; a
rollout source deleted between iterations; and the stages that read a damaged policy or value
model, each refused naming the file and the stage that wrote it."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
from conftest import BIN, run, tool_env, wait_for

pytestmark = pytest.mark.integration

ITER = Path("results/recap/iter_1")


def clone(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_snakemake_during(work: Path, rule: str, started) -> list[str]:
    """Start `snakemake --cores 2 <rule>` in its own process group, wait until `started(procs)`
    says the stage is at work, SIGKILL the whole group (a power cut of the driver); every process
    that was below it must end. Returns their command lines, read before the kill (a process
    that has ended has none to read)."""
    proc = subprocess.Popen([str(BIN / "snakemake"), "--cores", "2", rule], cwd=work, env=tool_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def at_work():
        below = descendants(proc.pid)
        if started(below):
            return below
        # the run ended before the stage was seen at work: fail now, not at the bound
        assert proc.poll() is None, f"snakemake {rule} ended ({proc.returncode}) before it was seen at work"
        return None

    try:
        below = wait_for(at_work, 600, f"{rule} at work")
        cmdlines = _cmdlines(below)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wait_for(lambda: not [p for p in below if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 60,
             "every process of the killed run to end")
    return cmdlines


def recover(work: Path, rule: str) -> subprocess.CompletedProcess:
    """What the README and docs/troubleshooting.md say to type after a killed Snakemake."""
    assert (work / ".snakemake/incomplete").is_dir() and any((work / ".snakemake/incomplete").iterdir())
    locked = run(["snakemake", "--cores", "2", rule], work, check=False)
    assert locked.returncode != 0 and "unlock" in (locked.stdout + locked.stderr).lower()
    run(["snakemake", "--unlock"], work)
    return run(["snakemake", "--cores", "2", "--rerun-incomplete", rule], work)


def _cmdlines(procs: list[psutil.Process]) -> list[str]:
    return [c for _, c in _procs_cmdlines(procs)]


def _procs_cmdlines(procs: list[psutil.Process]) -> list[tuple[psutil.Process, str]]:
    out = []
    for p in procs:
        try:
            out.append((p, " ".join(p.cmdline())))
        except psutil.Error:
            continue
    return out


def _parent(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


# make test-all only (docs/development.md, "Tiers"): make test holds the exact resume of a killed value
# run (test_recap_value.py::test_sigkill_then_rerun_resumes_the_value_run_exactly) and the documented
# recovery of a killed Snakemake (test_orchestration.py's
# test_a_failed_then_a_killed_training_reruns_alone_and_resumes)
@pytest.mark.extended
def test_train_value_killed_with_snakemake_resumes_to_the_same_bytes(default_pipeline, tmp_path):
    work = clone(default_pipeline, tmp_path / "w")
    weights = ITER / "value/model/model.safetensors"
    reference = sha(work / weights)
    shutil.rmtree(work / ITER / "value")
    shutil.rmtree(work / ITER / "checkpoints/value")
    metrics = work / ITER / "checkpoints/value"

    def training(procs) -> bool:  # a few optimizer steps done (rank 0's metrics lines)
        lines = sum(len(p.read_text().splitlines()) for p in metrics.glob("run-*/metrics.jsonl"))
        return lines >= 5 and any("pisft.train" in c and "train_value" in c for c in _cmdlines(procs))

    below = kill_snakemake_during(work, "train_value_1", training)
    assert any("torch.distributed.run" in c for c in below), below  # torchrun and its workers were there
    assert not (work / ITER / "value").exists(), "nothing half-written"
    recover(work, "train_value_1")
    assert sha(work / weights) == reference, "the rerun's value model differs from the uninterrupted run's"
    assert not list((work / ITER).glob(".value.tmp-*"))


def test_advantages_killed_with_snakemake_reruns_to_the_same_bytes(default_pipeline, tmp_path):
    work = clone(default_pipeline, tmp_path / "w")
    labels = ITER / "advantages/labels.parquet"
    reference = sha(work / labels)
    shutil.rmtree(work / ITER / "advantages")

    def labelling(procs) -> bool:
        """The stage infers V: its process has a child with its own command line, the DataLoader
        worker of `value_metrics.predict` (train.num_workers -1: one on the CPU), which lives only
        while V is inferred (and the labels, then the output, come after it)."""
        stage = {p.pid: c for p, c in _procs_cmdlines(procs) if "pisft advantages" in c}
        return any(_parent(p) in stage and stage[_parent(p)] == stage[p] for p in stage)

    kill_snakemake_during(work, "advantages_1", labelling)
    assert not (work / ITER / "advantages").exists()
    recover(work, "advantages_1")
    assert sha(work / labels) == reference
    assert not list((work / ITER).glob(".advantages.tmp-*")), "the killed run's temporary folder is cleared"


def _stage(work: Path, *args: str) -> subprocess.CompletedProcess:
    return run(["python", "-m", "pisft", *args, "--config", "config/config.yaml"], work, check=False)


def _error_line(out: subprocess.CompletedProcess) -> str:
    lines = [line for line in out.stderr.splitlines() if line.startswith("error")]
    assert out.returncode != 0 and lines, out.stderr[-3000:]
    return lines[-1]


def test_flipped_rollout_bytes_are_refused_by_the_pools_conversion(default_pipeline, tmp_path):
    work = clone(default_pipeline, tmp_path / "w")
    target = sorted((work / ITER / "rollouts/data").rglob("*.parquet"))[0]
    data = bytearray(target.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0x5A  # same size, other bytes
    target.write_bytes(bytes(data))
    # Snakemake cannot see a change inside a directory output (DVC can: its hash); the pool's
    # conversion run again (as `dvc repro` or `--forcerun convert_recap_1` would) reads them first
    line = _error_line(_stage(work, "convert_recap", "--iteration", "1"))
    assert str(target.relative_to(work)) in line and "sha256 differs" in line
    assert "collect_rollouts_1" in line and "--forcerun collect_rollouts_1" in line
    from pisft.io import verify_manifest

    assert verify_manifest(work / ITER / "dataset") == []  # the previous complete pool stays as it was


def test_a_rollout_source_deleted_between_iterations_is_named(default_pipeline, tmp_path):
    work = clone(default_pipeline, tmp_path / "w")
    shutil.rmtree(work / ITER / "rollouts")
    line = _error_line(_stage(work, "convert_recap", "--iteration", "1"))
    assert "results/recap/iter_1/rollouts" in line and "is missing" in line
    assert "snakemake --cores all collect_rollouts_1" in line and "collect_rollouts --iteration 1" in line
    # The whole DAG (rule all asks for every output) collects them again, then reruns what follows
    dry = run(["snakemake", "-n", "--cores", "2"], work).stdout
    assert "collect_rollouts_1" in dry


def test_the_stages_refuse_a_damaged_policy_and_value_model(default_pipeline, tmp_path):
    """The adversarial pass's case: 64 KiB of zeros in the middle of each model's weights."""
    work = clone(default_pipeline, tmp_path / "w")
    for model in (work / "results/train/model", work / ITER / "value/model"):
        weights = model / "model.safetensors"
        size = weights.stat().st_size
        with open(weights, "r+b") as fh:
            fh.seek(size // 2)
            fh.write(b"\0" * 65536)
        assert weights.stat().st_size == size
    # (each stage first clears what depends on it: advantages first, its inputs are upstream of the others')
    line = _error_line(_stage(work, "advantages", "--iteration", "1"))
    assert "value/model/model.safetensors: sha256 differs" in line and "train_value_1" in line
    # evaluate (load_policy) and closed_loop (the policy replicas of closed_loop and collect_rollouts)
    for stage in (["evaluate"], ["closed_loop"]):
        line = _error_line(_stage(work, *stage))
        assert "results/train/model/model.safetensors: sha256 differs" in line, (stage, line)
        assert "train_8card" in line and "--forcerun train_8card" in line, (stage, line)

