"""The results layout (`pisft.layout`): every name is the path the stages wrote before it existed,
the iterations' folders move and the shared ones stay, and no stage spells a results path."""

import re
from pathlib import Path

import pytest

from pisft import config as C
from pisft import layout

ROOT = Path(__file__).resolve().parents[1]

# Each name of an iteration and the path as the stages spelled it (relative to the iteration's folder).
ITERATION_NAMES = {
    "rollouts": "rollouts", "dataset": "dataset", "split": "dataset/split.json",
    "returns": "dataset/returns.parquet", "value_smoke": "value_smoke",
    "value_smoke_report": "value_smoke/report.json", "value": "value",
    "value_model": "value/model", "advantages": "advantages", "advantage_labels": "advantages/labels.parquet",
    "train": "train", "trained_model": "train/model", "train_metrics": "train/metrics.jsonl",
    "checkpoints": "checkpoints", "policy_checkpoints": "checkpoints/train",
    "value_checkpoints": "checkpoints/value", "closed_loop": "closed_loop",
    "closed_loop_metrics": "closed_loop/metrics.json", "eval": "eval", "eval_metrics": "eval/metrics.json",
    "logs": "logs", "shards": "shards",
}
SHARED_NAMES = {
    layout.base_model: "base_model", layout.demo_data: "demo_recap", layout.smoke: "smoke",
    layout.smoke_report: "smoke/report.json",
    layout.benchmarks: "benchmarks", layout.bench_report: "bench/bench.json",
    layout.effective_config: "config/effective.yaml", layout.recap_summary: "recap",
    layout.recap_metrics: "recap/metrics.json",
}


def _cfg(iterations: int = 2) -> C.PisftConfig:
    return C.from_dict({"results_dir": "r", "eval": {"closed_loop": True, "trials_per_task": 2},
                        "recap": {"iterations": iterations}})


def test_every_iteration_name_is_the_path_the_stages_spelled():
    cfg = _cfg()
    assert set(ITERATION_NAMES) == {n for n, v in vars(layout.Iteration).items() if isinstance(v, property)}
    for k, root in ((0, "r"), (1, "r/recap/iter_1"), (2, "r/recap/iter_2")):
        at = cfg.at_iteration(k)
        for name, spelled in ITERATION_NAMES.items():
            path = getattr(layout.iteration(at), name)
            assert str(path) == f"{root}/{spelled}", (k, name)
            assert path == getattr(layout.iteration(cfg, k), name)  # k given, or the config's own
            # the old spelling, through the one rule that places a folder in its iteration
            assert path == layout.results(at, spelled)
        assert str(layout.iteration(at).stage_logs("smoke_1card")) == f"{root}/logs/smoke_1card"
    assert {spelled.split("/")[0] for spelled in ITERATION_NAMES.values()} == set(layout.ITERATION_FOLDERS)


def test_the_shared_paths_stay_in_results_dir_at_every_iteration():
    cfg = _cfg()
    for k in (0, 1, 2):
        at = cfg.at_iteration(k)
        for name_of, spelled in SHARED_NAMES.items():
            assert str(name_of(at)) == f"r/{spelled}", (k, name_of.__name__)
        assert str(layout.benchmark(at, "train_8card")) == "r/benchmarks/train_8card.tsv"


def test_what_an_iteration_starts_from():
    cfg = _cfg()
    assert layout.policy(cfg, 0) == Path("r/train/model")
    assert layout.policy(cfg, 2) == Path("r/recap/iter_2/train/model")
    assert layout.training_labels(cfg.at_iteration(0)) is None
    assert layout.training_labels(cfg.at_iteration(1)) == Path("r/recap/iter_1/advantages/labels.parquet")
    with pytest.raises(C.ConfigError, match="iteration 3: recap.iterations is 2"):
        layout.iteration(cfg, 3)
    with pytest.raises(C.ConfigError, match="iteration 1: recap.iterations is 0"):
        layout.policy(_cfg(0), 1)


# Files that still spell results paths by hand (issue #34: converted after the branches merge);
# the path each should name is in the closing note. Shrinks to nothing.
NOT_YET_CONVERTED: set[str] = set()
SPELLED = re.compile(r"""\.results\(\s*(?:\*|["'A-Z])""")  # cfg.results("x" ...), (*parts), (OUTPUT_DIR)


def test_no_stage_spells_a_results_path():
    spelling = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "src/pisft").rglob("*.py")
                      if p.name != "layout.py" and SPELLED.search(p.read_text()))
    assert sorted(set(spelling) - NOT_YET_CONVERTED) == [], (
        "these files spell a path under results_dir by hand (cfg.results(...)); name it through "
        "pisft.layout (layout.iteration(cfg).<folder>, layout.base_model(cfg), ...), adding the name there")


def test_the_writer_of_a_folder_is_read_off_the_stage_rows(tmp_path):
    """Which stage (and iteration) wrote a folder, from where it lies (integrity's messages for a
    manifest that does not say): the rows' folder outputs, and a folder directly in one."""
    from pisft import integrity
    from pisft.stages import CONVERT_RECAP, FETCH_BASE, TRAIN_8CARD, TRAIN_VALUE

    results = tmp_path / "results"
    assert layout.writer_of(results / "base_model") == (FETCH_BASE, 0)
    assert layout.writer_of(results / "train" / "model") == (TRAIN_8CARD, 0)
    assert layout.writer_of(results / "recap" / "iter_2" / "train" / "model") == (TRAIN_8CARD, 2)
    assert layout.writer_of(results / "recap" / "iter_2" / "value" / "model") == (TRAIN_VALUE, 2)
    assert layout.writer_of(results / "recap" / "iter_1" / "dataset") == (CONVERT_RECAP, 1)
    assert layout.writer_of(results / "recap" / "iter_1" / "base_model") == (FETCH_BASE, 0)  # shared
    assert layout.writer_of(tmp_path / "my_data") is None
    assert integrity.writer_of(results / "recap" / "iter_2" / "value" / "model") == (
        "train_value_2", "python -m pisft launch train_value --iteration 2")
    assert integrity.writer_of(results / "dataset") == ("convert_recap", "python -m pisft convert_recap")
