"""Issue 57, item 2: the scattered closed loop and collection (`eval.shards`, pisft.rollout.plan, "Scattered rollouts").

Shard i of N runs its block of the episodes, the merge writes the stage's outputs: the same bytes as
the one-job run of the same config. A real policy (the tiny pi0.5 with its zero-initialised parameters
filled, whose actions follow a forward's rows as a trained model's do) answers stand-in environments
in this process; 7 episodes, so 2 and 3 shards split them unevenly (3 + 4, 2 + 2 + 3).
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from test_eval_closed_loop import StandInTask
from test_rollout_determinism import ShowsPosition

from pisft import config as C
from pisft import layout
from pisft.errors import PisftError
from pisft.rollout import plan as shards

TASKS = [StandInTask(f"reach {x} 0 0", [x, 0, 0]) for x in (0.3, 99.0, 0.1, -0.2, 0.5, 2.0, 0.05)]
SIM = functools.partial(ShowsPosition, TASKS)


def files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_shards_are_contiguous_blocks_covering_the_plan_once():
    for total in range(1, 12):
        for n in range(1, total + 1):
            blocks = [shards.shard_range(total, i, n) for i in range(1, n + 1)]
            assert [p for b in blocks for p in b] == list(range(total))
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    with pytest.raises(PisftError, match="eval.shards is 3 but the stage plans 2 episode"):
        shards.shard_range(2, 1, 3)
    assert shards.parse_shard("2/3") == (2, 3)
    for bad in ("3/2", "0/2", "x", "1-2"):
        with pytest.raises(PisftError, match="--shard"):
            shards.parse_shard(bad)


def closed_loop_cfg(tmp: Path, n: int) -> C.PisftConfig:
    """7 tasks x 1 trial of 15 steps, plus each again under pixel noise (14 episodes), videos on."""
    return C.from_dict({"results_dir": str(tmp / "results"), "device": "cpu",
                        "eval": {"closed_loop": True, "libero_suites": ["libero_10"], "task_ids": list(range(7)),
                                 "trials_per_task": 1, "max_steps": 15, "num_envs": 1, "shards": n,
                                 "perturbations": ["obs_noise"]}})


@pytest.mark.integration  # ~15 s: the tiny pi0.5 over 14 episodes three times
def test_the_merged_closed_loop_is_the_one_job_runs_bytes(tmp_path, tmp_path_factory):
    from model_fixtures import trained_like_model_dir

    from pisft.evaluate import closed_loop

    model = layout.iteration(closed_loop_cfg(tmp_path, 1)).trained_model
    shutil.copytree(trained_like_model_dir(tmp_path_factory), model)
    outputs = {}
    for n in (1, 2, 3):  # in one results folder: metrics.json names the model's folder
        cfg = closed_loop_cfg(tmp_path, n)
        shutil.rmtree(layout.iteration(cfg).closed_loop, ignore_errors=True)
        if n == 1:  # the one-job run (eval.shards does not enter the outputs but pisft_config.json)
            closed_loop.run(cfg, simulator=SIM, inline=True)
        else:
            for i in range(1, n + 1):
                closed_loop.run(cfg, simulator=SIM, inline=True, shard=(i, n))
            got = [json.loads((layout.iteration(cfg).shard("closed_loop", i, n) / shards.SHARD_RESULTS).read_text())
                   for i in range(1, n + 1)]
            assert [len(g["passes"]["episodes"]) for g in got] == [len(shards.shard_range(14, i, n))
                                                                   for i in range(1, n + 1)]
            closed_loop.merge(cfg, n, simulator=SIM)
            timing = json.loads(layout.iteration(cfg).timing("closed_loop").read_text())
            assert len(timing["shards"]) == n and timing["simulator_steps"] == sum(
                t["simulator_steps"] for t in timing["shards"])
        out = layout.iteration(cfg).closed_loop
        report = (out / "report.md").read_text().splitlines()
        # the report's lines of how the run went (environments, throughput) come from the timing record
        outputs[n] = ({k: v for k, v in files(out).items() if k != "pisft_config.json"},
                      [line for line in report if "environment processes" not in line
                       and not line.startswith("Throughput:")])
    assert {"metrics.json", "episodes.jsonl", "videos/libero_10_task06.mp4", "videos/libero_10_task00.html",
            "videos/obs_noise_0.05/libero_10_task00.mp4"} <= set(outputs[1][0])
    for n in (2, 3):
        # every file (metrics, episodes, videos, their pages) but report.md, whose lines of how the run went
        # differ between any two runs; its other lines are the same
        assert {k: v for k, v in outputs[n][0].items() if k != "report.md"} == \
            {k: v for k, v in outputs[1][0].items() if k != "report.md"}
        assert outputs[n][1] == outputs[1][1]


def collection_cfg(tmp: Path, n: int) -> C.PisftConfig:
    """RECAP iteration 1's collection: 7 tasks x 1 episode of 15 steps."""
    return C.from_dict({
        "results_dir": str(tmp / "results"), "device": "cpu",
        "eval": {"closed_loop": True, "trials_per_task": 3, "num_envs": 1, "shards": n},
        "recap": {"iterations": 1, "suite": "libero_10", "task_ids": list(range(7)), "episodes_per_task": 1,
                  "max_steps": 15, "collect_seed": 1000}}).at_iteration(1)


@pytest.mark.integration  # ~15 s: the tiny pi0.5 over 7 episodes three times, a LeRobot dataset each
def test_the_merged_collection_is_the_one_job_runs_dataset(tmp_path, tmp_path_factory):
    from model_fixtures import trained_like_model_dir

    from pisft.recap import collect

    shutil.copytree(trained_like_model_dir(tmp_path_factory), layout.policy(collection_cfg(tmp_path, 1), 0))
    datasets = {}
    for n in (1, 2, 3):  # in one results folder: collection.json names the policy's folder
        cfg = collection_cfg(tmp_path, n)
        shutil.rmtree(layout.iteration(cfg).rollouts, ignore_errors=True)
        if n == 1:
            collect.run(cfg, simulator=SIM, inline=True)
        else:
            for i in range(1, n + 1):
                collect.run(cfg, simulator=SIM, inline=True, shard=(i, n))
            collect.merge(cfg, n, simulator=SIM)
        rollouts = layout.iteration(cfg).rollouts
        manifest = json.loads((rollouts / "MANIFEST.json").read_text())
        # the resolved config (and its line in the manifest) has eval.shards: n
        datasets[n] = ({k: v for k, v in files(rollouts).items() if k not in ("pisft_config.json", "MANIFEST.json")},
                       {k: v for k, v in manifest["files"].items() if k != "pisft_config.json"})
    assert any(name.endswith(".parquet") for name in datasets[1][0]) and "collection.json" in datasets[1][0]
    assert datasets[2] == datasets[1] and datasets[3] == datasets[1]


def test_a_merge_names_the_missing_shard_and_refuses_another_plan(tmp_path):
    """Without running a policy: a missing shard and a shard of another number of shards are refused."""
    from pisft.recap import collect

    cfg = collection_cfg(tmp_path, 2)
    with pytest.raises(PisftError, match=r"shard 1 of 2 has no .*results.json; run it first \(python -m pisft "
                                         r"collect_rollouts --shard 1/2"):
        collect.merge(cfg, 2, simulator=SIM)
    folder = layout.iteration(cfg).shard("collect_rollouts", 1, 2)
    folder.mkdir(parents=True)
    (folder / shards.SHARD_RESULTS).write_text(json.dumps({"stage": "collect_rollouts", "shard": 1, "shards": 3,
                                                          "episodes": 7, "record": {}, "passes": {}}))
    with pytest.raises(PisftError, match="written as shard 1 of 3 of 7 episodes, not shard 1 of 2 of 7"):
        shards.load_shards([folder, folder], stage="collect_rollouts", total=7, passes={"episodes": 7},
                           result=dict)


@pytest.mark.integration  # the default pipeline's closed loop again as 2 shard jobs and a merge, in LIBERO
def test_snakemake_runs_a_job_per_shard_and_reruns_only_a_lost_shard(default_pipeline, tmp_path):
    """Real Snakemake and the real simulator on a copy of the default pipeline's finished run: with
    eval.shards 2 the closed loop is two shard jobs and the merge, which writes the one-job run's
    bytes; a shard's output lost (what a killed job leaves: its folder is written whole or not at
    all) plans that shard and the merge again, not the other shard."""
    from test_orchestration import JOB, clone_run, set_key

    from conftest import run

    def planned(*targets: str) -> set[str]:
        return set(JOB.findall(run(["snakemake", "-n", "--cores", "2", *targets], work).stdout)) - {"all"}

    work = clone_run(default_pipeline, tmp_path / "w")
    set_key(work, "eval.shards", 2)
    shard_jobs = {"closed_loop__shard_1_of_2", "closed_loop__shard_2_of_2"}
    # the closed loop and its shards' folders, as `rule all` asks for every rule's outputs: a lost
    # intermediate is not planned again for a target whose own outputs exist (Snakemake 9;
    # src/pisft/workflow/invalidate.py); the plain `snakemake` here would also rerun iteration 1,
    # whose collection and closed loop the new eval.shards scatters too
    targets = ["closed_loop", *(f"results/shards/closed_loop/shard_{i}_of_2" for i in (1, 2))]
    assert planned(*targets) == {*shard_jobs, "closed_loop"}
    run(["snakemake", "--cores", "2", *targets], work)
    one_job, merged = default_pipeline / "results/closed_loop", work / "results/closed_loop"
    compared = ["metrics.json", "episodes.jsonl",
                *(str(p.relative_to(one_job)) for p in sorted((one_job / "videos").rglob("*")) if p.is_file())]
    assert len(compared) > 2 and all((merged / name).read_bytes() == (one_job / name).read_bytes() for name in compared)
    for i in (1, 2):
        assert (work / f"results/logs/closed_loop__shard_{i}_of_2.log").is_file()
        assert json.loads((work / f"results/logs/closed_loop.shard_{i}_of_2.timing.json").read_text())["episodes"]
    assert planned(*targets) == set()
    shutil.rmtree(work / "results/shards/closed_loop/shard_2_of_2")
    assert planned(*targets) == {"closed_loop__shard_2_of_2", "closed_loop"}
