"""`convert_recap`: RECAP-format LIBERO (LeRobot v2.0/v2.1/v3.0) -> pi0.5-ready LeRobot v3.0.

The input is a pool of typed sources (`data.recap_dir`; at RECAP iteration k also the rollouts
of iterations 1..k): `sft` demonstrations and `rollout` collections train together, with one
episode split (stratified by task) and one set of statistics over the pool; the report counts
episodes, frames and successes per source. Every episode's Monte-Carlo return is written beside
the dataset (`returns.parquet`, RLinf's `compute_returns`: -1 per step, the last step 0 for a
success or `recap.failure_reward` for a failure; an `sft` episode counts as a success), in this
stage's own output: the inputs are never changed.

Two passes over each source:

1. metadata and every episode's non-image columns (cheap, column projection): the layout and
   naming are detected, every episode is checked (`validate.check_episode`), the filters
   (`data.success_only`, `data.tasks`) decide what is kept and why the rest is dropped, the
   advantages side file is matched to the frames, and the train/eval split is drawn;
2. the kept episodes' camera frames, on all cores (a thread pool; OpenCV and PyAV release the
   GIL): every frame is decoded (a frame that does not decode, or has the wrong size, is an
   error), resized when `data.image_size` asks for it, and the PNG bytes are passed through
   untouched otherwise; the main thread writes episodes in order and computes statistics.

The output is written into a temporary sibling directory and renamed at the end, so a failure
leaves no output behind.

The parts, a module each: the options (`convert_options`), pass 1 (`convert_select`, the side
files' checks in `convert_side_files`), pass 2 (`convert_frames`), the report (`convert_report`)
and the returns (`convert_returns`); this module runs them over the pool and is the stage's entry.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from pisft import layout
from pisft.config import DataSource, PisftConfig, data_sources
from pisft.data import dataset_stats as st
from pisft.data.convert_frames import check_output_shape, output_features, write_episodes
from pisft.data.convert_options import Options
from pisft.data.convert_report import conversion_report
from pisft.data.convert_returns import Returns, write_returns
from pisft.data.convert_select import (Kept, open_source, reason_text, refuse_unknown_tasks,
                                       refuse_untrainable_labels, short)
from pisft.data.prompts import CONDITIONING_FILE, PromptConditioning
from pisft.data.source_weights import SourceSampling
from pisft.data.split import stratified_split
from pisft.data.v30_writer import V30Writer, recorder_layout, write_recorder_meta
from pisft.errors import DataError
from pisft.integrity import stage_output
from pisft.io import write_json_atomic
from pisft.layout import RETURNS_FILE, SPLIT_FILE


def _as_sources(sources: str | Path | DataSource | list) -> list[DataSource]:
    items = sources if isinstance(sources, list | tuple) else [sources]
    return [s if isinstance(s, DataSource) else DataSource(str(s)) for s in items]


def convert_recap(sources: str | Path | DataSource | list, out_dir: Path, opts: Options,
                  cfg: PisftConfig | None = None, returns: Returns | None = None) -> dict:
    """Convert the pool `sources` (a directory, or typed sources) into `out_dir` (written
    atomically). Returns the conversion report."""
    t0 = time.perf_counter()
    pool = _as_sources(sources)
    opened = []
    unknown: list[list[str]] = []  # per source: the data.tasks entries it does not hold
    kept: list[Kept] = []
    for i, source in enumerate(pool):
        src, lowdim, kept_i, dropped_i, unknown_i = open_source(source, opts)
        for k in kept_i:
            k.source = i
        for d in dropped_i:
            d["source"] = i
        opened.append((source, src, lowdim, kept_i, dropped_i))
        unknown.append(unknown_i)
        kept += kept_i
    refuse_unknown_tasks([src for _, src, *_ in opened], unknown, opts.data.tasks)
    dropped = [d for *_, ds in opened for d in ds]
    frames_in = sum(len(c["frame_index"]) for _, _, lowdim, _, _ in opened for c in lowdim.values())
    if not kept:
        by_reason: dict[str, list[int]] = {}
        for d in dropped:
            by_reason.setdefault(d["reason"], []).append(d["source_episode_index"])
        first = opened[0][1]
        parts = [f"episode(s) {short(eps)}: {reason_text(first, r)}" for r, eps in sorted(by_reason.items())]
        where = first.root if len(opened) == 1 else f"the {len(opened)} sources of data.recap_dir"
        raise DataError(f"{where}: nothing left to convert after filtering; all {len(dropped)} episodes "
                        f"were dropped: {'; '.join(parts)}. Relax data.success_only / data.tasks")
    if opts.data.advantage_tag:
        refuse_untrainable_labels(opened, kept, opts)
    out_shape, fps = _pool_shape_and_fps(opened, opts)
    split = stratified_split({i: k.src.tasks[k.task_index] for i, k in enumerate(kept)},  # type: ignore[union-attr]
                             opts.data.eval_fraction, opts.data.split_seed)
    t_meta = time.perf_counter()

    prompt_index: dict[str, int] = {}
    for k in kept:
        for p in k.prompts:
            prompt_index.setdefault(p, len(prompt_index))
    out = Path(out_dir)
    first_src = opened[0][1]
    with stage_output(out, cfg) as tmp:  # every reader checks the dataset against its manifest
        features, info, schema = recorder_layout(output_features(out_shape), fps,
                                                 robot_type=first_src.info.get("robot_type"))
        writer = V30Writer(tmp, schema, features)
        workers = opts.n_workers()
        per_episode_stats, numeric_all = write_episodes(writer, fps, kept, opts, prompt_index, workers,
                                                        set(split["train"]))
        tasks_out = sorted(prompt_index, key=prompt_index.get)
        stats = st.dataset_stats({k: np.concatenate(v) for k, v in numeric_all.items()}, per_episode_stats)
        write_recorder_meta(writer, info, tasks_out, stats)
        t_write = time.perf_counter()
        sampling = SourceSampling(opts.data.balance_source_weights, tuple(s.weight for s in pool),
                                  tuple(k.source for k in kept))
        sampling.write(tmp)  # each episode's source and each source's weight: the training stages' draw
        report = conversion_report(opened, opts, kept, dropped, split, frames_in, tasks_out, out_shape, sampling)
        write_json_atomic(tmp / SPLIT_FILE, split)
        write_json_atomic(tmp / "conversion_report.json", report)
        write_returns(tmp / RETURNS_FILE, kept, [s.type for s in pool], returns or Returns())
        # how the prompts were conditioned; the export copies it next to the trained model
        (opts.conditioning if opts.data.advantage_tag else PromptConditioning()).write(tmp / "meta" / CONDITIONING_FILE)
    frames_out = report["out"]["frames"]
    total = time.perf_counter() - t0
    report["_timing"] = {"total_s": total, "metadata_s": t_meta - t0, "frames_s": t_write - t_meta,
                         "frames_per_s": frames_out / total if total > 0 else 0.0, "workers": workers}
    return report


def _pool_shape_and_fps(opened: list, opts: Options) -> tuple[tuple[int, int, int], int]:
    """One image shape and one frame rate for the whole pool, or a DataError naming the sources."""
    shapes = [(src, check_output_shape(src, opts)) for _, src, _, kept, _ in opened if kept]
    if len({shape for _, shape in shapes}) > 1:
        listed = "; ".join(f"{src.root}: {'x'.join(map(str, shape))}" for src, shape in shapes)
        raise DataError(f"data.recap_dir: the sources' images differ in size ({listed}); set data.image_size "
                        "to convert all of them to one size")
    rates = {src.root: src.fps for _, src, _, kept, _ in opened if kept}
    if len(set(rates.values())) > 1:
        listed = "; ".join(f"{root}: {fps} fps" for root, fps in rates.items())
        raise DataError(f"data.recap_dir: the sources were recorded at different frame rates ({listed}); "
                        "one dataset needs one fps: resample the odd one out or leave it out")
    return shapes[0][1], next(iter(rates.values()))


def output_dir(cfg: PisftConfig) -> Path:
    return layout.iteration(cfg).dataset


def pool(cfg: PisftConfig) -> list[DataSource]:
    """The sources converted at cfg's iteration: `data.recap_dir`, then the rollouts of
    iterations 1..k (RECAP's pool grows by one collection per iteration)."""
    rollouts = [DataSource(str(layout.iteration(cfg, j).rollouts), "rollout")
                for j in range(1, cfg.iteration + 1)]
    return data_sources(cfg) + rollouts


def _require_rollouts(cfg: PisftConfig) -> None:
    """The rollouts of iterations 1..k are all there (one deleted between iterations: named)."""
    for j in range(1, cfg.iteration + 1):
        path = layout.iteration(cfg, j).rollouts
        if not path.is_dir():
            raise DataError(f"convert_recap --iteration {cfg.iteration}: {path} (iteration {j}'s collected rollouts, "
                            f"part of the pool) is missing; collect them again: snakemake --cores all "
                            f"collect_rollouts_{j} (or python -m pisft collect_rollouts --iteration {j} "
                            "--config FILE), then rerun")


def run(cfg: PisftConfig) -> Path:
    out = output_dir(cfg)
    _require_rollouts(cfg)
    report = convert_recap(pool(cfg), out, Options.from_config(cfg), cfg,
                           Returns(cfg.recap.gamma, cfg.recap.failure_reward))
    t = report["_timing"]
    held = report["outcomes"]["eval"]
    print(f"convert_recap: {report['out']['episodes']}/{report['in']['episodes']} episodes, "
          f"{report['out']['frames']} frames, {report['out']['tasks']} tasks "
          f"({len(report['dropped'])} dropped; held out {held['episodes']}: {held['successes']} successes, "
          f"{held['failures']} failures) from {len(report['sources'])} source(s) in {t['total_s']:.1f} s "
          f"({t['frames_per_s']:.0f} frames/s, {t['workers']} workers) -> {out}")
    if len(report["sources"]) > 1:  # the policy trains on every episode at a RECAP iteration
        split = "all" if cfg.iteration else "train"
        for n, s in enumerate(report["sources"]):
            share = s[f"share_{split}"]
            print(f"convert_recap: source {n} ({Path(s['path']).name}, {s['type']}, weight {s['weight']:g}): "
                  f"{report['sampling']['frames'][split][n]} frames, "
                  f"{'-' if share is None else f'{100 * share:.1f}%'} of the policy's samples "
                  f"(data.balance_source_weights {str(report['sampling']['balance_source_weights']).lower()})")
    return out
