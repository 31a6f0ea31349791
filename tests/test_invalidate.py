"""A starting stage removes what was derived from its previous outputs (the Snakemake 9 trap)."""

import shutil
from pathlib import Path

from pisft.workflow.invalidate import downstream_outputs, invalidate_downstream, load_dag

ROOT = Path(__file__).resolve().parents[1]


def test_downstream_of_training_is_the_evaluation_only():
    dag = load_dag(ROOT / "dvc.yaml")
    down = downstream_outputs("train_8card", dag)
    # the evaluations, and the RECAP iteration that starts from this policy
    assert down and all(p.startswith(("results/eval/", "results/closed_loop/", "results/recap/")) for p in down)
    assert "results/recap/iter_1/rollouts" in down and "results/recap/metrics.json" in down
    assert not [p for p in downstream_outputs("advantages_1", dag)
                if "rollouts" in p or "/value" in p]  # a new labelling never reruns collection or the value model
    assert {"results/eval/metrics.json", "results/eval/report.md", "results/eval/loss.png"} <= set(down)
    down = downstream_outputs("convert_recap", dag)
    assert "results/train/model" in down and "results/smoke/report.json" in down
    assert "results/checkpoints/train" not in down  # persistent: never removed
    assert "results/base_model" not in down
    assert downstream_outputs("evaluate", dag) == []
    # dvc.yaml's templates are filled in as DVC does: the demo feeds convert_recap through data.recap_dir
    assert "results/dataset" in downstream_outputs("demo_recap", dag)


def test_invalidate_removes_files_and_dirs_but_keeps_checkpoints(tmp_path, monkeypatch):
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    monkeypatch.chdir(tmp_path)
    for d in ("results/train/model", "results/checkpoints/train/step_000010", "results/eval"):
        Path(d).mkdir(parents=True)
    Path("results/eval/metrics.json").write_text("{}")
    Path("results/train/metrics.jsonl").write_text("")
    removed = invalidate_downstream("smoke_1card")
    assert set(removed) == {"results/train/model", "results/train/metrics.jsonl", "results/eval/metrics.json"}
    assert Path("results/checkpoints/train/step_000010").is_dir()
    assert invalidate_downstream("smoke_1card") == []


def test_another_results_dir_is_rebased_and_the_default_one_left_alone(tmp_path, monkeypatch):
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    monkeypatch.chdir(tmp_path)
    Path("results/eval").mkdir(parents=True)
    Path("results/eval/metrics.json").write_text("{}")  # the user's real run
    Path("scratch/eval").mkdir(parents=True)
    Path("scratch/eval/metrics.json").write_text("{}")  # a run with --set results_dir=scratch
    assert invalidate_downstream("train_8card", "scratch") == ["scratch/eval/metrics.json"]
    assert Path("results/eval/metrics.json").is_file()


def _invalidate_at_once(barrier, results: str, failures) -> None:
    barrier.wait()
    try:
        invalidate_downstream("smoke_1card", results)
    except (OSError, ValueError) as e:  # what the stage would have died of (FileNotFoundError)
        failures.put(repr(e))


def test_two_stages_that_start_together_both_remove_the_same_outputs(tmp_path, monkeypatch):
    """`snakemake --forceall --cores 2` starts fetch_base and demo_recap at once, and both remove
    results/train/model: two real processes race through the same folders (three rounds), and
    neither fails on an entry the other removed first."""
    import multiprocessing

    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    monkeypatch.chdir(tmp_path)
    ctx = multiprocessing.get_context("spawn")  # not fork: the test runs in a process with threads (xdist)
    for _ in range(3):
        for d in range(40):
            folder = Path(f"results/train/model/part{d:02d}")
            folder.mkdir(parents=True)
            for f in range(50):
                (folder / f"f{f}").write_bytes(b"x")
        barrier, failures = ctx.Barrier(2), ctx.Queue()
        racers = [ctx.Process(target=_invalidate_at_once, args=(barrier, "results", failures)) for _ in range(2)]
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join(timeout=60)
            if racer.is_alive():  # a bound on waiting, and nothing left running
                racer.kill()
                racer.join()
        assert [r.exitcode for r in racers] == [0, 0]
        assert failures.empty(), failures.get()
        assert not Path("results/train/model").exists()
