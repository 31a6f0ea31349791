"""The `evaluate` stage: open-loop action error of the base and the fine-tuned model, side by side.

On the held-out episodes of `results/dataset` (split.json "eval"; at most `eval.max_episodes`,
taken round-robin over tasks so every task keeps its share), every `eval.frame_stride`-th frame
of each episode (frame_index % stride == 0) is fed to both models: preprocessor ->
`predict_action_chunk` -> postprocessor (raw units). The predicted chunk is compared with the
dataset's chunk of the next `chunk_size` actions; steps past the episode's end are padding and
left out. The flow-matching noise of a frame is fixed by (eval.seed, episode, frame), the same
for both models, so the comparison is paired and a rerun gives the same figures.

Prompts: each model gets the task instruction the way it is meant to be prompted
(`pisft.data.prompts.for_model`): the base model the plain task; a model fine-tuned with
advantage-conditioned prompts (`data.advantage_tag`) RLinf's positive prompt
`"<task>\nAdvantage: positive"` — never the per-frame labels the dataset stores for training.
With `eval.cfg_scale` w > 1 such a model is guided (`pisft.model.guidance`): every denoising
step blends (1 - w) v_uncond + w v_cond, v_uncond under the plain task; a model trained on
plain prompts ignores w (eval_info.json `guidance` and the report say which model got what).

Writes `results/eval/` atomically:
  metrics.json     base / finetuned sections (action_mse, action_l1, their `_norm` variants,
                   bootstrap intervals, per task), comparison ratios, improvement (DVC metrics)
  per_step.csv     error per step of the chunk, per_dim.csv per action dimension,
                   per_task.csv per task (DVC plots)
  loss.png, throughput.png, per_task.png, per_step.png, report.md
  eval_info.json   what was evaluated and how (device, frames, stats used, wall time)
  pisft_config.json
"""

from __future__ import annotations

import csv
import gc
import io
import json
import time
from pathlib import Path

import numpy as np
import torch

from pisft import layout
from pisft import config as config_mod
from pisft import device as device_mod
from pisft.errors import DataError, ModelLoadError, PisftError
from pisft.evaluate import plots, report, run_info, summary, train_log
from pisft.evaluate.action_error import ErrorAccumulator
from pisft.policy.predictor import ChunkPredictor, frame_noise, quantile_normalize
from pisft.io import atomic_dir, write_json_atomic, write_text_atomic
from pisft.stages import CLOSED_LOOP, FETCH_BASE, TRAIN_8CARD

# LIBERO's 7-D action: end-effector delta position, delta rotation (axis-angle), gripper.
ACTION_NAMES = ["x", "y", "z", "roll", "pitch", "yaw", "gripper"]


def action_names(dim: int) -> list[str]:
    return ACTION_NAMES if dim == len(ACTION_NAMES) else [f"a{i}" for i in range(dim)]


def select_episodes(eval_episodes: list[int], tasks: dict[int, str], max_episodes: int) -> list[int]:
    """All held-out episodes, or `max_episodes` of them taken round-robin over tasks (sorted)."""
    if max_episodes <= 0 or max_episodes >= len(eval_episodes):
        return sorted(eval_episodes)
    by_task: dict[str, list[int]] = {}
    for ep in sorted(eval_episodes):
        by_task.setdefault(tasks.get(ep, ""), []).append(ep)
    queues = [by_task[t] for t in sorted(by_task)]
    chosen: list[int] = []
    depth = 0
    while len(chosen) < max_episodes:
        for q in queues:
            if depth < len(q) and len(chosen) < max_episodes:
                chosen.append(q[depth])
        depth += 1
    return sorted(chosen)


def frame_positions(dataset, episodes: list[int], stride: int) -> list[int]:
    """Dataset positions of the frames to evaluate: the chosen episodes, every stride-th frame."""
    keep = np.isin(dataset.episode_index, episodes) & (dataset.frame_index % stride == 0)
    return np.flatnonzero(keep).tolist()


def _device(requested: str) -> str:
    kind = device_mod.resolve_kind(requested)
    return str(device_mod.local_device(kind, 0))  # the CPU: "cpu"


def _require_dir(path: Path, stage: str) -> None:
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not found; run the {stage} stage first "
                             f"(python -m pisft {stage} ... or snakemake {stage})")


def _chunk_shape(model_dir: Path) -> tuple[int, int]:
    """(chunk_size, action dim) of a model directory, from its config.json (nothing loaded)."""
    from pisft.model.policy import CONFIG_FILE, read_config

    config, _ = read_config(model_dir / CONFIG_FILE, tolerate_unknown=True)
    return int(config.chunk_size), int(config.output_features["action"].shape[0])


def evaluate_models(cfg: config_mod.PisftConfig, *, progress: bool = True,
                    bf16_layout: str = "openpi") -> tuple[dict, dict, dict]:
    """(metrics, accumulators by model name, eval_info). Writes nothing. `bf16_layout`: a bf16 model's
    (`pisft.policy.precision`; "lerobot" only to measure what openpi's layout moves)."""
    from torch.utils.data import DataLoader, Subset

    from pisft.data import dataset as data
    from pisft.data import prompts
    from pisft.data.libero import strip_advantage
    from pisft.model import guidance

    dataset_dir = layout.iteration(cfg).dataset
    model_dirs = {"base": layout.base_model(cfg), "finetuned": layout.iteration(cfg).trained_model}
    if not dataset_dir.is_dir():
        raise DataError(f"{dataset_dir}: not found; run the convert_recap stage first")
    _require_dir(model_dirs["base"], FETCH_BASE.name)
    _require_dir(model_dirs["finetuned"], TRAIN_8CARD.name)
    device = _device(cfg.device)
    stats = data.load_stats(dataset_dir)
    # One model at a time (pi0.5: 13.4 GB each in fp32): its chunk size and action dim first
    shapes = {name: _chunk_shape(d) for name, d in model_dirs.items()}
    chunk, action_dim = shapes["base"]
    for name, shape in shapes.items():
        if shape != shapes["base"]:
            raise ModelLoadError(
                f"{model_dirs[name]}: chunk_size {shape[0]} / action dim {shape[1]} differ from "
                f"the base model's {chunk} / {action_dim}; the two cannot be compared")
    q01 = np.asarray(stats["action"]["q01"], dtype=np.float64)
    q99 = np.asarray(stats["action"]["q99"], dtype=np.float64)

    conditioning = {"base": prompts.for_model(model_dirs["base"]),
                    "finetuned": prompts.for_model(model_dirs["finetuned"], trained_on=dataset_dir)}
    scale = guidance.check_scale(cfg.eval.cfg_scale, "eval.cfg_scale")
    guided = {name: guidance.record(scale, c) for name, c in conditioning.items()}
    for name, g in guided.items():
        if g["note"] and progress:
            print(f"evaluate: {name} model: {g['note']}", flush=True)
    tasks = data.episode_tasks(dataset_dir)
    eval_eps = data.split_episodes(dataset_dir)["eval"]
    if not eval_eps:
        raise DataError(f"{dataset_dir / 'split.json'}: no held-out episodes; raise data.eval_fraction")
    episodes = select_episodes(eval_eps, tasks, cfg.eval.max_episodes)
    ds = data.load_split(dataset_dir, "eval", chunk_size=chunk)
    positions = frame_positions(ds, episodes, cfg.eval.frame_stride)
    loader = DataLoader(Subset(ds, positions), batch_size=cfg.eval.batch_size, shuffle=False,
                        num_workers=0)

    accs = {name: ErrorAccumulator(chunk_size=chunk, action_dim=action_dim) for name in model_dirs}
    inference: dict[str, dict] = {}
    start = time.monotonic()
    for name, model_dir in model_dirs.items():  # the same frames and noise for each model
        predictor = ChunkPredictor.load(model_dir, device=device, dataset_stats=stats, precision=cfg.eval.precision,
                                        compiled=cfg.eval.compile, layout=bf16_layout,
                                        note=lambda line, n=name: progress and print(f"evaluate: {n} model: {line}",
                                                                                    flush=True))
        done = 0
        for batch in loader:
            ep_ids = [int(e) for e in batch["episode_index"]]
            frames = [int(f) for f in batch["frame_index"]]
            noise = frame_noise(list(zip(ep_ids, frames)), seed=cfg.eval.seed, chunk_size=chunk,
                                max_action_dim=predictor.max_action_dim)
            target_raw = batch["action"].to(torch.float64).numpy()
            batch_tasks = [tasks.get(e, t) for e, t in zip(ep_ids, batch["task"], strict=True)]
            prompted = {**batch, "task": [conditioning[name].inference_prompt(t) for t in batch_tasks]}
            w = guided[name]["cfg_scale"]
            blend = {} if w == 1.0 else {"cfg_scale": w,
                                         "unconditioned_tasks": [strip_advantage(t) for t in batch_tasks]}
            pred_raw = predictor.predict(prompted, noise, **blend).to(torch.float64).numpy()
            accs[name].add(episodes=ep_ids, tasks=batch_tasks, pred_norm=quantile_normalize(pred_raw, q01, q99),
                           target_norm=quantile_normalize(target_raw, q01, q99), pred_raw=pred_raw,
                           target_raw=target_raw, is_pad=batch["action_is_pad"])
            done += len(ep_ids)
            if progress:
                print(f"evaluate: {name} model: {done}/{len(positions)} frames "
                      f"({time.monotonic() - start:.0f} s)", flush=True)
        inference[name] = predictor.describe()  # precision, compiled chunk (its compile times)
        del predictor  # freed before the next model is loaded
        gc.collect()
    if done == 0:
        raise DataError(f"{dataset_dir}: no frames selected for evaluation (episodes {episodes}, "
                        f"eval.frame_stride {cfg.eval.frame_stride})")
    metrics = summary.summarize(accs["base"], accs["finetuned"], n_bootstrap=cfg.eval.bootstrap_samples,
                                seed=cfg.eval.seed)
    from pisft.model.norm_stats import STATS_FILE

    info = {
        "device": device,
        # the float32 sums of a forward on the CPU depend on the thread count: the same figures
        # to the last bit need the same count (docs/workflow.md, "Same threads under either driver")
        "cpu_threads": torch.get_num_threads(),
        "batch_size": cfg.eval.batch_size,
        "frame_stride": cfg.eval.frame_stride,
        "chunk_size": chunk,
        "seed": cfg.eval.seed,
        "episodes": episodes,
        "frames": done,
        "models": {name: str(d) for name, d in model_dirs.items()},
        "normalisation_stats": {name: ("model" if (d / STATS_FILE).is_file() else "dataset")
                                for name, d in model_dirs.items()},
        "prompts": {name: {**c.to_dict(), "describe": c.describe()} for name, c in conditioning.items()},
        "guidance": guided,
        # how each model ran: eval.precision (what stayed float32), eval.compile
        "inference": inference,
        # successes and failures among the evaluated held-out episodes (failed rollouts are held
        # out too when data.success_only is false, and scored like demonstrations)
        "held_out": data.outcome_counts(dataset_dir, episodes),
        "wall_time_s": time.monotonic() - start,
    }
    return metrics, accs, info


def closed_loop_results(cfg: config_mod.PisftConfig) -> dict | None:
    """The closed-loop success rates for the report, only when eval.closed_loop is on, with the
    run's throughput (`timing`) from its timing record when there is one (informative only).

    With it off, a results/closed_loop/metrics.json left by an earlier run (an earlier model)
    is ignored: the report never shows numbers this run did not make.
    """
    if not cfg.eval.closed_loop:
        return None
    path = layout.iteration(cfg).closed_loop_metrics
    if not path.is_file():
        raise PisftError(f"evaluate: eval.closed_loop is on but {path} is missing; run the "
                         "`closed_loop` stage first (snakemake/dvc repro run it before evaluate)")
    results = json.loads(path.read_text())
    if results.get(CLOSED_LOOP.name) is False:  # its flag, written by the stage while the key was off
        raise PisftError(f"evaluate: eval.closed_loop is on but {path} says closed-loop evaluation "
                         "was not run (it was off then); rerun the `closed_loop` stage")
    timing = layout.iteration(cfg).timing(CLOSED_LOOP.name)
    if timing.is_file():
        results["timing"] = json.loads(timing.read_text())
    return results


NO_HELD_OUT = ("data.eval_fraction is 0: every episode trains, so no episode is held out and the offline "
               "evaluation was not run; the closed loop (eval.closed_loop) is the measure. Set "
               "data.eval_fraction > 0 to hold episodes out.")


def write_not_run(cfg: config_mod.PisftConfig) -> dict:
    """The stage when the dataset holds no episode out (data.eval_fraction 0): an explicit "not
    run" output with every file the workflow declares (the CSVs with their header only, plots
    that say why), never numbers; the training curves and a closed-loop result still appear."""
    from pisft.evaluate.action_error import METRICS

    records = train_log.read_metrics(layout.iteration(cfg).train_metrics)
    closed = closed_loop_results(cfg)
    metrics = {"evaluated": False, "note": NO_HELD_OUT}
    cols = [f"{name}_{m}" for name in ("base", "finetuned") for m in METRICS]
    with atomic_dir(layout.iteration(cfg).eval) as out:
        write_json_atomic(out / layout.METRICS_FILE, metrics)
        for name, first in (("per_step.csv", ["step"]), ("per_dim.csv", ["dim"]),
                            ("per_task.csv", ["task", "episodes", "frames"])):
            write_text_atomic(out / name, ",".join(first + cols) + "\n")
        for name, title in (("loss", "training loss"), ("throughput", "throughput and memory"),
                            ("per_task", "held-out error per task"), ("per_step", "held-out error per chunk step")):
            made = {"loss": plots.loss_and_lr, "throughput": plots.throughput_and_memory}.get(name)
            if made is None or made(records, out / f"{name}.png") is None:
                why = NO_HELD_OUT if name.startswith("per_") else "no training log"
                plots.note_figure(title, why, out / f"{name}.png")
        write_json_atomic(out / "eval_info.json", {"evaluated": False, "note": NO_HELD_OUT})
        lines = ["# pisft evaluation report", "", f"Offline evaluation not run: {NO_HELD_OUT}", ""]
        if closed is not None:
            lines += report.closed_loop_section(closed)
        write_text_atomic(out / "report.md", "\n".join(lines) + "\n")
        config_mod.write_resolved(cfg, out / "pisft_config.json")
    print(f"evaluate: not run ({NO_HELD_OUT})", flush=True)
    return metrics


def _holds_episodes_out(cfg: config_mod.PisftConfig) -> bool:
    from pisft.data import dataset as data

    dataset_dir = layout.iteration(cfg).dataset
    if not dataset_dir.is_dir():
        return True  # evaluate_models says what is missing
    return bool(data.split_episodes(dataset_dir)["eval"]) or cfg.data.eval_fraction > 0


def run(cfg: config_mod.PisftConfig) -> dict:
    stage_start = time.monotonic()
    if not _holds_episodes_out(cfg):
        return write_not_run(cfg)
    metrics, accs, info = evaluate_models(cfg)
    records = train_log.read_metrics(layout.iteration(cfg).train_metrics)
    closed = closed_loop_results(cfg)
    with atomic_dir(layout.iteration(cfg).eval) as out:
        write_json_atomic(out / layout.METRICS_FILE, metrics)
        write_text_atomic(out / "per_step.csv", summary.per_step_csv(accs))
        per_dim = summary.per_dim_csv(accs, action_names(accs["base"].action_dim))
        write_text_atomic(out / "per_dim.csv", per_dim)
        write_text_atomic(out / "per_task.csv", summary.per_task_csv(metrics))
        made = {
            "loss": plots.loss_and_lr(records, out / "loss.png"),
            "throughput": plots.throughput_and_memory(records, out / "throughput.png"),
            "per_task": plots.per_task_error(metrics, out / "per_task.png"),
            "per_step": plots.per_step_error({n: a.per_step("action_mse_norm") for n, a in accs.items()},
                                             out / "per_step.png", "action_mse_norm"),
        }
        info["wall_time_s"] = time.monotonic() - stage_start
        write_json_atomic(out / "eval_info.json", info)
        resolved = config_mod.resolved(cfg)
        text = report.build(metrics=metrics, eval_info=info, train_summary=train_log.summary(records),
                            run_info=run_info.collect(cfg),
                            plots={k: (p.name if p else None) for k, p in made.items()},
                            resolved_config=resolved, closed_loop=closed,
                            per_dim=[{k: (v if k == "dim" else float(v or "nan")) for k, v in row.items()}
                                     for row in csv.DictReader(io.StringIO(per_dim))])
        write_text_atomic(out / "report.md", text)
        config_mod.write_resolved(cfg, out / "pisft_config.json")
    b, f = metrics["base"]["action_mse"], metrics["finetuned"]["action_mse"]
    ratio = metrics["comparison"]["action_mse"]["ratio"]
    print(f"evaluate: held-out action MSE base {b:.4g}, fine-tuned {f:.4g} "
          f"(ratio {ratio if ratio is None else round(ratio, 3)}) on {metrics['episodes']} episodes, "
          f"{metrics['frames']} frames -> "
          f"{layout.iteration(cfg).eval}/report.md", flush=True)
    return metrics
