"""Issue 57, items 2 and 4 on the two-node cluster: the scattered closed loop (`eval.shards`) through
`profiles/slurm`, a shard's job killed mid-run, and `dvc repro` of the shard stages; the scattered
RECAP collection (`collect_rollouts_1`) through `profiles/slurm`.

The small SFT run of tests/dvc_fixtures.py (its trained model) with the closed loop switched on: 2
LIBERO-10 tasks x 2 trials of a few steps in the real simulator, one environment process, one
thread per process. The one-job run of the same config (a local `snakemake`, eval.shards 1) is the
reference every scattered run must give byte for byte.

make test-all only (docs/development.md, "Tiers"): make test holds the same behaviour with the same
rules and the same simulator on this host (tests/test_rollout_shards.py::
test_snakemake_runs_a_job_per_shard_and_reruns_only_a_lost_shard: two shard jobs and the merge give
the one-job run's bytes; a shard's folder lost plans that shard and the merge only) and the byte
identity of the merge at 2 and 3 shards (test_the_merged_closed_loop_is_the_one_job_runs_bytes).
These add the shards as Slurm jobs on two nodes, a job really killed, and the DVC driver. The
collection's own reference is a local one-job `snakemake collect_rollouts_1` of the same run with one
RECAP iteration switched on; make test holds its merge's bytes in one process (tests/
test_rollout_shards.py::test_the_merged_collection_is_the_one_job_runs_dataset) and its shard rules
and dvc.yaml (tests/test_workflow.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import BIN, run, tool_env, wait_for
from dvc_fixtures import CHECK, RAN
from slurm_fixtures import Cluster
from test_slurm import DEFAULT, NOTHING, ONE_THREAD, SNAKEMAKE, _finish, fit_profile, slurm_snakemake, submitted

pytestmark = [pytest.mark.integration, pytest.mark.extended]

# The closed loop on the small run: 4 episodes (2 per shard, one after the other: num_envs 1), each
# task's first with its video, a few policy chunks each (eval.replan_steps 5).
CLOSED_LOOP = {"closed_loop": True, "libero_suites": ["libero_10"], "task_ids": [0, 1], "trials_per_task": 2,
               "max_steps": 20, "num_envs": 1}
SHARDS = "results/shards/closed_loop"
SHARD_RULES = [f"closed_loop__shard_{i}_of_2" for i in (1, 2)]
# What the runs ask for: the closed loop and its shards' folders (a bare target does not plan a lost
# intermediate again, Snakemake 9), not the whole DAG: `evaluate` reads the closed loop's metrics and
# would run again after it (minutes here), which this test does not need
TARGETS = ["closed_loop", *(f"{SHARDS}/shard_{i}_of_2" for i in (1, 2))]
JOB = re.compile(r"^(?:local)?rule (\w+):", re.M)
# The collection: one RECAP iteration switched on (with the closed loop's eval settings above, which
# it needs), policy 0 (dvc_run's trained model) rolled out on 2 LIBERO-10 tasks x 1 episode of 20
# steps (one per shard), one environment process. Only collect_rollouts_1 runs: the targets are it
# and its shards' folders (the closed loops and what follows the collection are not asked for).
COLLECTION = {"iterations": 1, "suite": "libero_10", "task_ids": [0, 1], "episodes_per_task": 1, "max_steps": 20}
COLLECT = "collect_rollouts_1"
COLLECT_SHARDS = "results/recap/iter_1/shards/collect_rollouts"
COLLECT_SHARD_RULES = [f"{COLLECT}__shard_{i}_of_2" for i in (1, 2)]
COLLECT_TARGETS = [COLLECT, *(f"{COLLECT_SHARDS}/shard_{i}_of_2" for i in (1, 2))]


def configure(work: Path, shards: int, recap: dict | None = None) -> None:
    """config/config.yaml's eval set to the closed loop above at `shards` (a RECAP iteration needs the
    closed loop on) and its recap section updated by `recap`, dvc.yaml regenerated (its stages follow
    eval.shards and recap.iterations), committed."""
    path = work / "config/config.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["eval"].update(CLOSED_LOOP, shards=shards)
    cfg["recap"].update(recap or {})
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run([str(BIN / "python"), "-m", "pisft", "dvc-yaml"], work)
    run(["git", "commit", "-qam", f"{'closed loop' if recap is None else 'collection'}, eval.shards {shards}"], work)


def local(work: Path, *cmd: str) -> subprocess.CompletedProcess:
    """A driver (`snakemake`, `dvc`) on this machine, a thread per process as in the Slurm jobs."""
    proc = subprocess.run([str(BIN / cmd[0]), *cmd[1:]], cwd=work, env={**tool_env(), **ONE_THREAD},
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, \
        f"{' '.join(cmd)} failed ({proc.returncode})\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    return proc


def planned(work: Path, *targets: str) -> set[str]:
    return set(JOB.findall(run(["snakemake", "-n", "--cores", "2", *targets], work).stdout))


def outputs(work: Path) -> dict[str, bytes]:
    """The closed loop's outputs that the one-job and the scattered runs share byte for byte: the
    metrics, the episodes, the videos and their pages (report.md has lines of how the run went)."""
    out = work / "results/closed_loop"
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and (p.name in ("metrics.json", "episodes.jsonl") or p.parent.name == "videos")}


def rollouts(work: Path) -> dict[str, bytes]:
    """The collection's outputs that the one-job and the scattered runs share byte for byte, as
    tests/test_rollout_shards.py compares them: every file of the rollout dataset (parquet, meta/,
    collection.json) and the manifest's lines but the resolved config's (it has eval.shards)."""
    out = work / "results/recap/iter_1/rollouts"
    got = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
           if p.is_file() and p.name not in ("pisft_config.json", "MANIFEST.json")}
    manifest = json.loads((out / "MANIFEST.json").read_text())["files"]
    return {**got, "MANIFEST.json files": json.dumps({k: v for k, v in manifest.items() if k != "pisft_config.json"},
                                                     sort_keys=True).encode()}


def fit_shards(work: Path, cluster: Cluster, rules=SHARD_RULES) -> None:
    """The test profile (tests/test_slurm.py) with each shard job asking for a whole node's CPUs and
    a LIBERO environment's memory: Slurm then places the two on different nodes (each node has the
    host's cores, cons_tres would otherwise pack both on the first)."""
    cpus = {int(c) for c in cluster.run("sinfo", "-h", "-N", "-o", "%c").stdout.split()}
    assert len(cpus) == 1, cpus
    profile = fit_profile(work, cluster)
    for rule in rules:
        profile["set-resources"][rule] = {**DEFAULT, "cpus_per_task": next(iter(cpus)), "mem_mb": 4000}
    (work / "profiles/slurm/config.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))


def nodes_of(cluster: Cluster, jobs: dict[str, str]) -> dict[str, tuple[str, str]]:
    """rule -> (NodeList, State) of its Slurm job, as accounting recorded it."""
    out = cluster.run("sacct", "-X", "-n", "-P", "-j", ",".join(jobs.values()), "-o", "JobID,NodeList,State").stdout
    by_id = {job: (where, state) for job, where, state in (line.split("|") for line in out.splitlines() if line)}
    return {rule: by_id[job] for rule, job in jobs.items()}


def job_cpu_s(work: Path, rules) -> float:
    """The CPU seconds of the rules' last jobs, from their Snakemake benchmark records (the job's
    processes are slurmd's children, not this test's; this cluster's accounting gathers no CPU time)."""
    return sum(float((work / f"results/benchmarks/{rule}.tsv").read_text().splitlines()[1].split("\t")[-1])
               for rule in rules)


def stats(folder: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of a folder and everything in it."""
    return {str(p.relative_to(folder)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in [folder, *folder.rglob("*")]}


@pytest.fixture(scope="module")
def base(dvc_run, tmp_path_factory) -> Path:
    """dvc_run's finished SFT run (its trained model) with the closed loop switched on, not run."""
    work = tmp_path_factory.mktemp("slurm_shards") / "base"
    shutil.copytree(dvc_run, work, symlinks=True)
    configure(work, 1)
    return work


@pytest.fixture(scope="module")
def one_job(base, tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """The reference: the closed loop as one job, a local `snakemake` of the same copy."""
    work = tmp_path_factory.mktemp("slurm_shards") / "one"
    shutil.copytree(base, work, symlinks=True)
    assert planned(work, "closed_loop") == {"closed_loop"}
    local(work, "snakemake", "--cores", "2", "closed_loop")
    got = outputs(work)
    assert {"metrics.json", "episodes.jsonl", "videos/libero_10_task00.mp4", "videos/libero_10_task01.mp4"} <= set(got)
    return work, got


@pytest.fixture(scope="module")
def collection_base(dvc_run, tmp_path_factory) -> Path:
    """dvc_run's finished SFT run (its trained model, policy 0) with one RECAP iteration's small
    collection switched on, not run."""
    work = tmp_path_factory.mktemp("slurm_shards") / "collection_base"
    shutil.copytree(dvc_run, work, symlinks=True)
    configure(work, 1, recap=COLLECTION)
    return work


@pytest.fixture(scope="module")
def collection_one_job(collection_base, tmp_path_factory) -> dict[str, bytes]:
    """The collection's reference: collect_rollouts_1 as one job, a local `snakemake` of the same copy."""
    work = tmp_path_factory.mktemp("slurm_shards") / "collection_one"
    shutil.copytree(collection_base, work, symlinks=True)
    assert planned(work, COLLECT) == {COLLECT}
    start = time.monotonic()
    local(work, "snakemake", "--cores", "2", COLLECT)
    print(f"\none-job collection (local snakemake): {time.monotonic() - start:.0f} s")
    got = rollouts(work)
    assert "collection.json" in got and any(name.endswith(".parquet") for name in got), sorted(got)
    assert len(json.loads(got["collection.json"])["episodes"]) == 2, got["collection.json"][:2000]
    return got


def scattered_copy(base: Path, work: Path, cluster: Cluster, rules=SHARD_RULES, merge="closed_loop",
                   targets=TARGETS, recap: dict | None = None) -> Path:
    shutil.copytree(base, work, symlinks=True)
    configure(work, 2, recap)
    fit_shards(work, cluster, rules)
    run(["git", "commit", "-qam", "the test cluster's partition and sizes"], work)
    assert planned(work, *targets) == {*rules, merge}
    return work


def test_the_shards_run_as_slurm_jobs_on_both_nodes_and_merge_to_the_one_job_bytes(slurm_two_nodes, base, one_job,
                                                                                   tmp_path):
    """eval.shards 2 under profiles/slurm: each shard a Slurm job, the two on different nodes, then
    the merge; the merged metrics, episodes and videos are the one-job run's bytes; afterwards
    Snakemake and DVC have nothing to do."""
    _, reference = one_job
    work = scattered_copy(base, tmp_path / "w", slurm_two_nodes)
    start = time.monotonic()
    proc = slurm_snakemake(work, slurm_two_nodes, *TARGETS, env=ONE_THREAD)
    jobs = submitted(proc.stdout + proc.stderr)
    print(f"\nscattered closed loop through Slurm: {time.monotonic() - start:.0f} s; cluster start "
          f"{slurm_two_nodes.start_s:.1f} s")
    assert set(jobs) == {*SHARD_RULES, "closed_loop"}, (proc.stdout + proc.stderr)[-4000:]
    where = nodes_of(slurm_two_nodes, jobs)
    print("  " + "\n  ".join(f"{rule}: job {jobs[rule]} on {n} {s}" for rule, (n, s) in where.items()))
    print(f"  the jobs' CPU: {job_cpu_s(work, jobs):.0f} s")
    assert all(state == "COMPLETED" for _, state in where.values()), where
    assert {where[rule][0] for rule in SHARD_RULES} == set(slurm_two_nodes.nodes), where
    assert outputs(work) == reference
    dry = run(["snakemake", "-n", "--cores", "2", *TARGETS], work)
    assert NOTHING in dry.stdout + dry.stderr, dry.stdout[-3000:]
    assert "up to date" in run(["dvc", "status", "--with-deps", "closed_loop"], work).stdout.lower()


def test_a_shard_job_killed_mid_run_reruns_alone(slurm_two_nodes, base, one_job, tmp_path):
    """Both shard jobs running; shard 1's stage process SIGKILLed once its first episode is in the
    simulator (its video being written in its temporary folder, which names the process and the
    node). The job fails, shard 2 ends; the next run runs shard 1 and the merge only, shard 2's
    folder untouched (its inodes and times), and the merge is the one-job run's bytes."""
    _, reference = one_job
    work = scattered_copy(base, tmp_path / "w", slurm_two_nodes)
    shards = work / SHARDS
    start = time.monotonic()
    # --keep-going: the other shard's job runs to its end after the first fails (as a user who
    # scatters over a cluster runs it), so that only the killed shard is left to do
    proc = subprocess.Popen([*SNAKEMAKE, "--keep-going", *TARGETS], cwd=work, env=slurm_two_nodes.env(**ONE_THREAD),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        def under_way():  # shard 1's first episode in the simulator: its video has frames
            if proc.poll() is not None:
                raise AssertionError(f"snakemake ended ({proc.returncode}) before shard 1 ran:\n"
                                     f"{proc.communicate()[0][-4000:]}")
            return next((tmp for tmp in shards.glob(".shard_1_of_2.tmp-*")
                         if (v := tmp / "videos/libero_10_task00.mp4").is_file() and v.stat().st_size > 0), None)

        tmp = wait_for(under_way, 900, "shard 1's first episode", poll=0.05)
        pid, node = re.fullmatch(r"\.shard_1_of_2\.tmp-(\d+)@(.+)-\w+", tmp.name).groups()
        stage = psutil.Process(int(pid))
        cmd = stage.cmdline()
        assert cmd[1:4] == ["-m", "pisft", "closed_loop"] and cmd[cmd.index("--shard") + 1] == "1/2", cmd
        stage.send_signal(signal.SIGKILL)
        print(f"\nshard 1's stage (pid {pid} on {node}) killed at {time.monotonic() - start:.0f} s")
        text = _finish(proc, 900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.communicate(timeout=120)
    assert proc.returncode != 0, text[-3000:]
    jobs = submitted(text)
    where = nodes_of(slurm_two_nodes, jobs)
    print(f"killed run ({time.monotonic() - start:.0f} s): {where}; shard 2's CPU "
          f"{job_cpu_s(work, SHARD_RULES[1:]):.0f} s")
    assert set(jobs) == set(SHARD_RULES) and where[SHARD_RULES[0]][0] == node, (where, text[-3000:])
    assert where[SHARD_RULES[0]][1] == "FAILED" and where[SHARD_RULES[1]][1] == "COMPLETED", where
    assert not (shards / "shard_1_of_2").exists() and not (work / "results/closed_loop").exists()
    kept = stats(shards / "shard_2_of_2")
    assert planned(work, *TARGETS) == {SHARD_RULES[0], "closed_loop"}

    start = time.monotonic()
    proc = slurm_snakemake(work, slurm_two_nodes, *TARGETS, env=ONE_THREAD)
    jobs = submitted(proc.stdout + proc.stderr)
    print(f"rerun ({time.monotonic() - start:.0f} s): {nodes_of(slurm_two_nodes, jobs)}; the jobs' CPU "
          f"{job_cpu_s(work, jobs):.0f} s")
    assert set(jobs) == {SHARD_RULES[0], "closed_loop"}, (proc.stdout + proc.stderr)[-4000:]
    assert stats(shards / "shard_2_of_2") == kept
    assert outputs(work) == reference
    assert planned(work, *TARGETS) == set()


def test_dvc_repro_runs_the_shard_stages_then_the_merge(base, one_job, tmp_path):
    """The DVC driver at eval.shards 2: dvc.yaml's stage per shard, then the merge, the one-job bytes."""
    _, reference = one_job
    work = tmp_path / "w"
    shutil.copytree(base, work, symlinks=True)
    configure(work, 2)
    start = time.monotonic()
    ran = RAN.findall(local(work, "dvc", "repro", "closed_loop").stdout)
    print(f"\ndvc repro of the scattered closed loop: {time.monotonic() - start:.0f} s; {ran}")
    assert set(ran) == {CHECK, *SHARD_RULES, "closed_loop"} and ran[-1] == "closed_loop", ran
    assert outputs(work) == reference
    assert "up to date" in run(["dvc", "status", "--with-deps", "closed_loop"], work).stdout.lower()
    assert planned(work, *TARGETS) == set()


def test_the_collection_shards_run_as_slurm_jobs_on_both_nodes_and_merge_to_the_one_job_dataset(
        slurm_two_nodes, collection_base, collection_one_job, tmp_path):
    """RECAP iteration 1's collection at eval.shards 2 under profiles/slurm: each shard a Slurm job,
    the two on different nodes, then the merge; the merged rollout dataset, collection.json and the
    manifest are the one-job run's bytes; afterwards Snakemake and DVC have nothing to do."""
    work = scattered_copy(collection_base, tmp_path / "w", slurm_two_nodes, COLLECT_SHARD_RULES, COLLECT,
                          COLLECT_TARGETS, COLLECTION)
    start = time.monotonic()
    proc = slurm_snakemake(work, slurm_two_nodes, *COLLECT_TARGETS, env=ONE_THREAD)
    jobs = submitted(proc.stdout + proc.stderr)
    print(f"\nscattered collection through Slurm: {time.monotonic() - start:.0f} s")
    assert set(jobs) == {*COLLECT_SHARD_RULES, COLLECT}, (proc.stdout + proc.stderr)[-4000:]
    where = nodes_of(slurm_two_nodes, jobs)
    print("  " + "\n  ".join(f"{rule}: job {jobs[rule]} on {n} {s}" for rule, (n, s) in where.items()))
    print(f"  the jobs' CPU: {job_cpu_s(work, jobs):.0f} s")
    assert all(state == "COMPLETED" for _, state in where.values()), where
    assert {where[rule][0] for rule in COLLECT_SHARD_RULES} == set(slurm_two_nodes.nodes), where
    assert rollouts(work) == collection_one_job
    dry = run(["snakemake", "-n", "--cores", "2", *COLLECT_TARGETS], work)
    assert NOTHING in dry.stdout + dry.stderr, dry.stdout[-3000:]
    assert "up to date" in run(["dvc", "status", "--with-deps", COLLECT], work).stdout.lower()


def test_dvc_repro_runs_the_collection_shard_stages_then_the_merge(collection_base, collection_one_job, tmp_path):
    """The DVC driver at eval.shards 2 on the collection: dvc.yaml's stage per shard, then the merge,
    the one-job run's dataset."""
    work = tmp_path / "w"
    shutil.copytree(collection_base, work, symlinks=True)
    configure(work, 2, COLLECTION)
    start = time.monotonic()
    ran = RAN.findall(local(work, "dvc", "repro", COLLECT).stdout)
    print(f"\ndvc repro of the scattered collection: {time.monotonic() - start:.0f} s; {ran}")
    assert set(ran) == {CHECK, *COLLECT_SHARD_RULES, COLLECT} and ran[-1] == COLLECT, ran
    assert rollouts(work) == collection_one_job
    assert "up to date" in run(["dvc", "status", "--with-deps", COLLECT], work).stdout.lower()
    assert planned(work, *COLLECT_TARGETS) == set()
