"""The evaluate stage end to end on a tiny converted dataset and two tiny models."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pisft import config as C
from pisft.errors import PisftError
from pisft.evaluate import offline

TASK_COUNT = 10
EPISODE_LENGTH = 12


def make_cfg(results: Path, data_keys: dict | None = None, **eval_keys) -> C.PisftConfig:
    return C.from_dict({
        "device": "cpu",
        "results_dir": str(results),
        "data": {"recap_dir": str(results / "demo_recap"), "demo_episodes_per_task": 2,
                 "demo_episode_length": EPISODE_LENGTH, "demo_image_size": 16, "eval_fraction": 0.5,
                 **(data_keys or {})},
        "eval": {"batch_size": 8, "frame_stride": 4, "bootstrap_samples": 200, **eval_keys},
    })


def fabricated_train_log(path: Path, steps: int = 30) -> None:
    """A training log shaped like train_8card's (keys as pisft.train.loop writes them)."""
    rng = np.random.default_rng(0)
    with path.open("w") as fh:
        for step in range(1, steps + 1):
            fh.write(json.dumps({
                "step": step, "loss": float(2.0 * np.exp(-step / 10) + 0.05 * rng.random()),
                "grad_norm": 1.0, "lr": 1e-3 * min(1.0, step / 5), "step_time_s": 0.2 + 0.01 * rng.random(),
                "samples_per_s": 80.0, "data_wait_s": 0.01, "peak_memory_bytes": 3 * 2**29, "mfu": None,
                "flops_per_sample": 1.0e9,
            }) + "\n")
        # a resumed run logs step 30 again; the later record wins
        fh.write(json.dumps({"step": steps, "loss": 0.123, "lr": 1e-4}) + "\n")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """demo_recap + convert_recap (the real stages, small), a base and a 'fine-tuned' model."""
    from pisft.data import convert, demo
    from pisft.data import dataset as data
    from pisft.model.policy import build_policy, save_model
    from pisft.model.tokenizer import save_tiny_tokenizer

    root = tmp_path_factory.mktemp("eval") / "results"
    cfg = make_cfg(root)
    demo.run(cfg)
    convert.run(cfg)
    tok = root / "tokenizer-src"
    tok.mkdir()
    save_tiny_tokenizer(tok)
    (root / "base_model").mkdir()
    save_model(build_policy("tiny", seed=0), root / "base_model", tokenizer_dir=tok)
    (root / "train" / "model").mkdir(parents=True)
    save_model(build_policy("tiny", seed=1), root / "train" / "model", tokenizer_dir=tok,
               dataset_stats=data.load_stats(root / "dataset"))
    fabricated_train_log(root / "train" / "metrics.jsonl")
    (root / "benchmarks").mkdir()
    (root / "benchmarks" / "train_8card.tsv").write_text("s\th:m:s\tmax_rss\n12.5\t0:00:12\t900\n")
    (root / "train" / "pisft_config.json").write_text(json.dumps(C.resolved(cfg)))
    (root / "train" / "train_summary.json").write_text(json.dumps(
        {"device": {"kind": "cpu", "name": "cpu", "backend": "gloo"}, "wall_time_s": 184.9, "resumed_from": None}))
    return root


@pytest.fixture(scope="module")
def evaluated(results) -> dict:
    return offline.run(make_cfg(results))


@pytest.mark.integration  # ~4 min on 2 cores for the module: demo, conversion, two tiny models, the evaluation
def test_metrics_have_both_models_per_task_and_intervals(results, evaluated):
    m = json.loads((results / "eval" / "metrics.json").read_text())
    assert m == json.loads(json.dumps(evaluated))
    eval_eps = json.loads((results / "dataset" / "split.json").read_text())["eval"]
    assert m["episodes"] == len(eval_eps) == TASK_COUNT
    # every 4th frame of 12: frames 0, 4, 8
    assert m["frames"] == TASK_COUNT * 3
    for name in ("base", "finetuned"):
        section = m[name]
        for metric in ("action_mse", "action_l1", "action_mse_norm", "action_l1_norm"):
            value = section[metric]
            assert value > 0
            assert section[f"{metric}_ci_low"] <= value <= section[f"{metric}_ci_high"]
        assert len(section["per_task"]) == TASK_COUNT
        assert all(t["episodes"] == 1 and t["frames"] == 3 for t in section["per_task"].values())
        # the overall figure pools the tasks' elements (all tasks have the same number here)
        per_task = [t["action_mse"] for t in section["per_task"].values()]
        assert np.mean(per_task) == pytest.approx(section["action_mse"], rel=1e-9)
    assert m["base"]["action_mse"] != m["finetuned"]["action_mse"]
    comp = m["comparison"]["action_mse"]
    assert comp["ratio"] == pytest.approx(m["finetuned"]["action_mse"] / m["base"]["action_mse"])
    assert comp["ratio_ci_low"] <= comp["ratio"] <= comp["ratio_ci_high"]
    assert m["improvement"] == pytest.approx(1 - comp["ratio"])


@pytest.mark.integration  # ~4 min on 2 cores for the module: demo, conversion, two tiny models, the evaluation
def test_metrics_are_flat_enough_for_dvc(results, evaluated):  # evaluated: the evaluation writes them
    m = json.loads((results / "eval" / "metrics.json").read_text())

    def depth(node, level=0):
        assert not isinstance(node, list), "lists do not diff in `dvc metrics diff`"
        if isinstance(node, dict):
            return max((depth(v, level + 1) for v in node.values()), default=level)
        return level

    assert depth(m) <= 4


@pytest.mark.integration  # ~4 min on 2 cores for the module: demo, conversion, two tiny models, the evaluation
def test_plot_tables_and_report(results, evaluated):  # evaluated: the evaluation writes them
    out = results / "eval"
    for png in ("loss.png", "throughput.png", "per_task.png", "per_step.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    rows = list(csv.DictReader((out / "per_step.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(10))  # tiny chunk_size
    assert {"base_action_mse", "finetuned_action_mse_norm"} <= set(rows[0])
    assert [r["dim"] for r in csv.DictReader((out / "per_dim.csv").open())] == offline.ACTION_NAMES
    assert len(list(csv.DictReader((out / "per_task.csv").open()))) == TASK_COUNT
    text = (out / "report.md").read_text()
    for needle in ("| action_mse |", "![Training loss and learning rate](loss.png)", "(per_task.png)",
                   "| train_8card | 12.5 |", "| lerobot | 0.6.1 |", "put both moka pots on the stove",
                   "\"frame_stride\": 4", "world_size", "every 4th frame", "peak_memory_gib: 1.5",
                   "### Per action dimension", "| gripper |", "| wall_time_s | 184.9 |", "| backend | gloo |"):
        assert needle in text, needle
    assert "loss 0.123" not in text and "→ 0.123" in text  # the resumed record of step 30 wins
    info = json.loads((out / "eval_info.json").read_text())
    assert info["normalisation_stats"] == {"base": "dataset", "finetuned": "model"}
    assert info["cpu_threads"] == torch.get_num_threads()  # the figures' last bits depend on it
    assert json.loads((out / "pisft_config.json").read_text())["eval"]["frame_stride"] == 4


@pytest.mark.integration  # ~4 min on 2 cores for the module: demo, conversion, two tiny models, the evaluation
def test_figures_do_not_depend_on_batching_and_the_same_model_twice_gives_ratio_one(results, evaluated, tmp_path):
    # fewer episodes, another batch size: each episode's figures are unchanged (noise per frame)
    part, _, _ = offline.evaluate_models(make_cfg(results, max_episodes=3, batch_size=5, bootstrap_samples=0),
                                         progress=False)
    assert part["episodes"] == 3 and len(part["base"]["per_task"]) == 3  # round-robin over tasks
    assert "action_mse_ci_low" not in part["base"]
    for name in ("base", "finetuned"):
        for task, entry in part[name]["per_task"].items():
            for metric in ("action_mse", "action_l1_norm"):
                assert entry[metric] == pytest.approx(evaluated[name]["per_task"][task][metric], rel=1e-5)
    # the same weights as "fine-tuned": the paired noise makes every frame's error identical
    twin = tmp_path / "results"
    twin.mkdir()
    for name in ("dataset", "base_model"):
        (twin / name).symlink_to(results / name)
    (twin / "train").mkdir()
    shutil.copytree(results / "base_model", twin / "train" / "model")
    same, _, _ = offline.evaluate_models(make_cfg(twin, max_episodes=2, bootstrap_samples=0), progress=False)
    assert same["comparison"]["action_mse"]["ratio"] == 1.0


@pytest.mark.integration  # ~4 min on 2 cores for the module: demo, conversion, two tiny models, the evaluation
def test_evaluation_never_augments_the_images(results, evaluated, monkeypatch):
    """data.augment is the training loaders' only: the evaluation under `openpi` reads the images as
    recorded (the same figures), and no augmentation is drawn or applied on its path."""
    from pisft.data import augment

    calls = []
    real = augment.apply_openpi
    monkeypatch.setattr(augment, "apply_openpi", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = make_cfg(results, {"augment": "openpi"}, max_episodes=3, bootstrap_samples=0)
    assert cfg.data.augment == "openpi"
    got, _, _ = offline.evaluate_models(cfg, progress=False)
    assert calls == []
    for name in ("base", "finetuned"):
        for task, entry in got[name]["per_task"].items():
            assert entry["action_mse"] == pytest.approx(evaluated[name]["per_task"][task]["action_mse"], rel=1e-6)


@pytest.mark.integration  # ~4 min on 2 cores for the module: demo, conversion, two tiny models, the evaluation
def test_missing_fine_tuned_model_is_a_clear_error(results, tmp_path):
    partial = tmp_path / "results"
    partial.mkdir()
    for name in ("dataset", "base_model"):
        (partial / name).symlink_to(results / name)
    with pytest.raises(PisftError, match=r"train/model: not found; run the train_8card stage"):
        offline.run(make_cfg(partial))
    assert not (partial / "eval").exists()


def test_select_episodes_round_robin():
    tasks = {1: "b", 2: "a", 3: "a", 4: "b", 5: "c"}
    assert offline.select_episodes([1, 2, 3, 4, 5], tasks, 3) == [1, 2, 5]
    assert offline.select_episodes([1, 2, 3, 4, 5], tasks, 4) == [1, 2, 3, 5]
    assert offline.select_episodes([1, 2, 3, 4, 5], tasks, 0) == [1, 2, 3, 4, 5]


STALE_CLOSED_LOOP = {"success_rate": 0.97, "suites": {"libero_10": {
    "per_task": {"stale task": {"task_id": 0, "successes": 97, "trials": 100, "success_rate": 0.97}},
    "successes": 97, "trials": 100, "success_rate": 0.97}}}


@pytest.mark.integration  # ~4 min on 2 cores for the module: demo, conversion, two tiny models, the evaluation
def test_a_stale_closed_loop_file_never_reaches_the_report_when_closed_loop_is_off(results, evaluated):
    """An earlier model's success rates in results/closed_loop/ must not be reported (issue 11)."""
    stale = results / "closed_loop" / "metrics.json"
    stale.parent.mkdir(exist_ok=True)
    stale.write_text(json.dumps(STALE_CLOSED_LOOP))
    try:
        assert offline.closed_loop_results(make_cfg(results)) is None
        offline.run(make_cfg(results))
        text = (results / "eval" / "report.md").read_text()
        assert "Closed-loop" not in text and "stale task" not in text
        # with closed_loop on, the file is what the closed_loop stage just wrote: it is reported
        on = offline.closed_loop_results(make_cfg(results, closed_loop=True))
        assert on["success_rate"] == 0.97
        stale.unlink()
        with pytest.raises(PisftError, match="closed_loop is on but .* is missing"):
            offline.closed_loop_results(make_cfg(results, closed_loop=True))
    finally:
        stale.unlink(missing_ok=True)


def _predicting(monkeypatch) -> dict[int, list[np.ndarray]]:
    """The raw-unit predictions each accumulator of an evaluation receives, by its id, with the
    padded steps of each chunk set to NaN (they are not scored)."""
    seen: dict[int, list[np.ndarray]] = {}
    add = offline.ErrorAccumulator.add

    def keep(self, **kw):
        pred = np.array(kw["pred_raw"], dtype=np.float64)
        pred[np.asarray(kw["is_pad"], dtype=bool)] = np.nan
        seen.setdefault(id(self), []).append(pred)
        return add(self, **kw)

    monkeypatch.setattr(offline.ErrorAccumulator, "add", keep)
    return seen


# bf16 against float32, in action units. bf16 keeps 8 significant bits: a value it stores is off
# by up to 2^-9 of itself. A predicted chunk is 10 Euler steps of the expert's output, each the end
# of bf16 matrix products, unnormalised by (q99 - q01) / 2 per dimension (pisft.policy.predictor),
# so it is compared in units of that half range. Measured on this module's two tiny models (30
# frames x 10 steps x 7 dimensions each): at most 6.6e-3 (openpi's layout) and 6.3e-3 (LeRobot's),
# about 3.4 x 2^-9. The bound, 2^-6 = 1.6e-2 (eight roundings' worth), leaves 2.4 x that for
# another CPU's kernels (another summation order). The figures follow from it: an action_l1 moves
# by at most the mean move of the actions (the triangle inequality), checked below too.
BF16_ACTION_BOUND = 2.0 ** -6


@pytest.mark.integration  # ~30-60 s: three evaluations of two tiny models
def test_bf16_as_openpi_runs_it_moves_the_actions_by_a_bounded_amount(results, monkeypatch):
    """eval.precision bf16 keeps float32 only where openpi does (pisft.policy.precision): every
    predicted action of both models is within BF16_ACTION_BOUND of its float32 value (in each
    dimension's normalised half range), LeRobot's own bf16 layout (the vision path in float32)
    predicts other actions, and eval_info records what stayed float32."""
    seen = _predicting(monkeypatch)
    runs = {}
    for name, precision, layout in (("openpi", "bf16", "openpi"), ("lerobot", "bf16", "lerobot"),
                                    ("fp32", "fp32", "openpi")):
        metrics, accs, info = offline.evaluate_models(make_cfg(results, precision=precision), progress=False,
                                                      bf16_layout=layout)
        runs[name] = metrics, {m: np.concatenate(seen[id(a)]) for m, a in accs.items()}, info
    from pisft.data.dataset import load_stats

    stats = load_stats(results / "dataset")["action"]
    half = (np.asarray(stats["q99"]) - np.asarray(stats["q01"])) / 2  # action units per normalised unit
    openpi, _, info = runs["openpi"]
    _, fp32_info = runs["fp32"][0], runs["fp32"][2]
    for model in ("base", "finetuned"):
        fp32 = runs["fp32"][1][model]
        moved = {name: np.nanmax(np.abs(runs[name][1][model] - fp32) / half) for name in ("openpi", "lerobot")}
        print(f"\n{model}: largest move from float32, in half ranges: {moved}")
        assert moved["openpi"] <= BF16_ACTION_BOUND and moved["lerobot"] <= BF16_ACTION_BOUND, (model, moved)
        assert np.nanmax(np.abs(runs["openpi"][1][model] - runs["lerobot"][1][model])) > 0, model
        # the figures follow: |mean |a - t| - mean |b - t|| <= mean |a - b| (raw units, valid steps)
        step = np.nanmean(np.abs(runs["openpi"][1][model] - fp32))
        assert abs(openpi[model]["action_l1"] - runs["fp32"][0][model]["action_l1"]) <= step + 1e-12, model
    kept = info["inference"]["finetuned"]["precision"]
    assert kept["layout"] == "openpi" and kept["dtype"] == "bfloat16"
    vision = kept["float32_parameters"]["paligemma_with_expert.paligemma.model.vision_tower"]
    assert vision == 128 * 3 * 16 * 16 + 128 + 16 * 128  # the tiny SigLIP's patch and position embeddings
    assert "paligemma_with_expert.paligemma.model.multi_modal_projector" not in kept["float32_parameters"]
    assert fp32_info["inference"]["base"]["precision"]["layout"] == "float32"
    compile_record = fp32_info["inference"]["base"]["compile"]  # eval.compile null: eager on the CPU, no trial
    assert (compile_record["compiled"], compile_record["decided_by"]) == (False, "no trial")
    assert fp32_info["inference"]["base"]["precision"]["decided_by"] == "setting"  # eval.precision fp32 given
