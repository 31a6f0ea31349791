"""The `advantages` stage: every frame of the pool labelled by RLinf's N-step advantage.

1. V(o_t) for every frame of `results/dataset` (both splits) by the trained value model
   (`results/value/model`), batched, without gradients (`value_metrics.predict`).
2. A_t = normalize(sum_{k<n} gamma^k r_{t+k}) + gamma^n V(o_{t+N}) - V(o_t), N = recap.lookahead,
   n = min(N, frames left), V = 0 past the episode's end, rewards and returns from
   `dataset/returns.parquet`, normalize mapping the pool's [min return, max return] onto [-1, 0]
   (`rlinf_recap.nstep_advantage`, RLinf's `compute_advantages_for_dataset`; with a successful or
   sft episode in the pool the maximum return is 0 and this is the value target's scale,
   return / |min return|).
3. The threshold: the (1 - recap.positive_quantile) percentile of A (inclusive: A >= threshold is
   positive), taken per recap.threshold_scope over
   - `global`: all frames of the pool, sft and rollout alike (RLinf's `unified_threshold` over the
     concatenated advantages of every dataset, `compute_advantages`), or
   - `task`: each task's frames (the pi*0.6 paper, arXiv 2511.14759: a per-task threshold).
4. Labels: positive iff A >= the frame's threshold; then every frame of an `sft` episode is
   positive whatever its A (RLinf `save_advantages_to_dataset`: a dataset of type sft gets
   `advantage = True` after the unified threshold was computed over all frames, its own
   included). The rule is the same in both scopes: thresholds over all frames, sft forced after.
5. Refused (`LabellingError`): a non-finite V or A (with the count), and a labelling in which no
   frame or every frame is positive (it cannot train an advantage-conditioned policy).

Output, `results/advantages/` (atomic):
  labels.parquet     one row per frame, sorted by (episode_index, frame_index): RLinf's
                     episode_index, frame_index (int64), advantage_continuous (float64),
                     advantage (bool), and value_current, value_next, reward_sum, reward_sum_raw,
                     num_valid_rewards, return (float64/int64), task_index (int64),
                     source_type (string: sft | rollout)
  summary.json       scope, lookahead, gamma, positive_quantile, threshold(s), frame counts and
                     the positive fraction overall, per task and per source type, the return
                     range, the advantage's mean/std/min/max, the value model, the wall time
  pisft_config.json  the resolved config
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from pisft import layout
from pisft import device as devices
from pisft.config import PisftConfig
from pisft.data import rlinf_recap
from pisft.data.dataset import episode_tasks
from pisft.errors import PisftError
from pisft.integrity import stage_output
from pisft.io import write_json_atomic
from pisft.layout import LABELS_FILE, SPLIT_FILE
from pisft.recap import value_metrics, value_model
from pisft.recap.value_data import (
    PromptCollate,
    ReturnRange,
    ValueFrames,
    episode_source_types,
    read_returns,
)
from pisft.recap.value_task import ValueTask
from pisft.stages import TRAIN_VALUE

SUMMARY_FILE = "summary.json"


class LabellingError(PisftError):
    """The advantages cannot make a usable labelling (non-finite, or no/every frame positive)."""


@dataclass
class Labelling:
    labels: pd.DataFrame
    summary: dict[str, Any]


def _thresholds(frames: pd.DataFrame, advantage: np.ndarray, scope: str, quantile: float
                ) -> tuple[np.ndarray, dict[str, float]]:
    """Each frame's threshold, and the thresholds by name (`global`, or the task index)."""
    if scope == "global":
        t = rlinf_recap.positive_threshold(advantage, quantile)
        return np.full(len(advantage), t), {"global": t}
    if scope != "task":
        raise ValueError(f"threshold scope must be global or task, got {scope!r}")
    out = np.empty(len(advantage))
    named: dict[str, float] = {}
    task = frames["task_index"].to_numpy(np.int64)
    for k in np.unique(task):
        sel = task == k
        named[str(int(k))] = rlinf_recap.positive_threshold(advantage[sel], quantile)
        out[sel] = named[str(int(k))]
    return out, named


def _fraction(positive: np.ndarray) -> dict[str, Any]:
    n = int(len(positive))
    p = int(np.sum(positive))
    return {"frames": n, "positive": p, "positive_fraction": p / n if n else None}


def label(frames: pd.DataFrame, *, scale: ReturnRange, lookahead: int, gamma: float,
          positive_quantile: float, scope: str, tasks: dict[int, str] | None = None) -> Labelling:
    """Label `frames` (columns episode_index, frame_index, return, reward, value, task_index,
    source_type; one row per frame of every episode, whole episodes) as the module docstring says."""
    if lookahead < 1:  # config validation refuses it too: N = 0 makes every advantage 0
        raise LabellingError(f"advantages: recap.lookahead must be at least 1, got {lookahead} (with 0 every "
                             "frame's advantage is V - V = 0)")
    frames = frames.sort_values(["episode_index", "frame_index"], kind="stable").reset_index(drop=True)
    if len(frames) == 0:
        raise LabellingError("advantages: the pool has no frames (0 positive of 0); check data.recap_dir")
    v = frames["value"].to_numpy(np.float64)
    bad = int(np.sum(~np.isfinite(v)))
    if bad:
        raise LabellingError(f"advantages: the value model gave a non-finite V for {bad} of {len(v)} frames; "
                             "check results/value/metrics.json and retrain it (train_value) with a lower "
                             "recap.value_lr / recap.value_head_lr")
    out = rlinf_recap.nstep_advantage(
        frames["episode_index"].to_numpy(np.int64), frames["return"].to_numpy(np.float64),
        frames["reward"].to_numpy(np.float64), v, lookahead=lookahead, gamma=gamma,
        ret_min=scale.min, ret_max=scale.max)
    a = out.advantage
    bad = int(np.sum(~np.isfinite(a)))
    if bad:
        raise LabellingError(f"advantages: {bad} of {len(a)} advantages are not finite; check the returns "
                             "(dataset/returns.parquet) and the value model (results/value/metrics.json)")
    thresholds, named = _thresholds(frames, a, scope, positive_quantile)
    by_value = a >= thresholds
    sft = (frames["source_type"] == "sft").to_numpy()
    positive = by_value | sft
    _refuse_degenerate(positive, sft, a, named, scope, positive_quantile)
    labels = pd.DataFrame({
        "episode_index": frames["episode_index"].to_numpy(np.int64),
        "frame_index": frames["frame_index"].to_numpy(np.int64),
        "advantage_continuous": a,
        "advantage": positive,
        "value_current": v,
        "value_next": out.value_next,
        "reward_sum": out.reward_sum,
        "reward_sum_raw": out.reward_sum_raw,
        "num_valid_rewards": out.num_valid.astype(np.int64),
        "return": frames["return"].to_numpy(np.float64),
        "task_index": frames["task_index"].to_numpy(np.int64),
        "source_type": frames["source_type"].astype(str).to_numpy(),
    })
    task = labels["task_index"].to_numpy()
    kinds = labels["source_type"].to_numpy()
    summary = {
        "scope": scope,
        "lookahead": lookahead,
        "gamma": gamma,
        "positive_quantile": positive_quantile,
        "thresholds": named,
        "threshold": named.get("global"),
        **_fraction(positive),
        "positive_by_value": int(np.sum(by_value)),
        "sft_forced_positive": int(np.sum(sft & ~by_value)),
        "per_task": {str(int(k)): {"task": (tasks or {}).get(int(k)), "threshold": float(thresholds[task == k][0]),
                                   **_fraction(positive[task == k])} for k in np.unique(task)},
        "per_source_type": {str(s): _fraction(positive[kinds == s]) for s in np.unique(kinds)},
        "return_min": scale.min,
        "return_max": scale.max,
        "advantage": {"mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()),
                      "max": float(a.max())},
    }
    return Labelling(labels, summary)


def _refuse_degenerate(positive: np.ndarray, sft: np.ndarray, a: np.ndarray, thresholds: dict[str, float],
                       scope: str, quantile: float) -> None:
    n, p = len(positive), int(np.sum(positive))
    if 0 < p < n:
        return
    shown = ", ".join(f"{k} {v:.6g}" for k, v in list(thresholds.items())[:5])
    head = (f"advantages: {p} of {n} frames would be positive ({int(sft.sum())} sft frames, forced "
            f"positive; threshold(s) ({scope} scope, recap.positive_quantile {quantile}): {shown}); a "
            "labelling without both positive and negative frames cannot train an advantage-conditioned policy. ")
    if n == 0:
        raise LabellingError(head + "The dataset has no frames: check the pool (data.recap_dir).")
    if sft.all():
        raise LabellingError(head + "Every frame comes from an sft source: add policy rollouts to the pool "
                             "(data.recap_dir with type: rollout sources; collect_rollouts at iteration k >= 1).")
    distinct = len(np.unique(a[~sft]))
    raise LabellingError(head + f"The {int((~sft).sum())} rollout frames have {distinct} distinct advantage "
                         "value(s), all at or above the threshold: the value model is (nearly) constant; check "
                         "results/value/metrics.json (spearman_heldout) and train it longer (recap.value_steps), "
                         "or use recap.threshold_scope: global.")


# ----------------------------------------------------------------------------------------- stage
def _frame_table(dataset_dir: Path) -> pd.DataFrame:
    files = sorted((dataset_dir / "data").rglob("*.parquet"))
    cols = ["episode_index", "frame_index", "task_index"]
    return pd.concat([pq.read_table(f, columns=cols).to_pandas() for f in files], ignore_index=True
                     ).astype({c: np.int64 for c in cols})


def predict_values(cfg: PisftConfig, model: value_model.ValueModel, base: Path, dataset_dir: Path,
                   returns: pd.DataFrame, scale: ReturnRange, device: Any) -> pd.DataFrame:
    """V of every frame of the pool (both splits): episode_index, frame_index, value."""
    from pisft.model.policy import TOKENIZER_DIR
    from pisft.model.tokenizer import load_tokenizer
    from pisft.train.batches import resolve_workers

    collate = PromptCollate(load_tokenizer(base / TOKENIZER_DIR), int(model.policy.config.tokenizer_max_length))
    kind = devices.resolve_kind(cfg.device)
    task = ValueTask(collate, device, cfg.train.precision)
    from pisft.data.dataset import split_episodes

    parts = []
    # Both splits; a split without episodes (recap.holdout_fraction 0: no held-out part) has no frames.
    for split in (name for name, episodes in split_episodes(dataset_dir).items() if episodes):
        frames = ValueFrames(dataset_dir, split, returns, scale, tuple(model.policy.config.image_features))
        pred = value_metrics.predict(model, frames, task, batch_size=cfg.eval.batch_size,
                                     num_workers=resolve_workers(cfg.train.num_workers, kind, 1))
        parts.append(pd.DataFrame({"episode_index": frames.episode_index, "frame_index": frames.frame_index,
                                   "value": pred["value"]}))
    return pd.concat(parts, ignore_index=True)


def _require(cfg: PisftConfig) -> tuple[Path, Path]:
    data, model_dir = layout.iteration(cfg).dataset, layout.iteration(cfg).value_model
    for path, producer in ((data / SPLIT_FILE, "the pool's conversion"),
                           (model_dir / value_model.CONFIG_FILE, TRAIN_VALUE.name)):
        if not path.is_file():
            raise PisftError(f"advantages: {path} not found; run {producer} first "
                             "(snakemake --cores all advantages runs what is missing)")
    return data, model_dir


def run(cfg: PisftConfig) -> Path:
    """The advantages stage (in-process): V, A, labels and summary into results/advantages/."""
    import torch

    t0 = time.perf_counter()
    data, model_dir = _require(cfg)
    returns = read_returns(data)
    scale = ReturnRange.of(returns)
    kind = devices.resolve_kind(cfg.device)
    device = torch.device(str(devices.local_device(kind, 0)))  # the CPU: cpu
    model, vcfg = value_model.load(model_dir, device=device)
    if (vcfg.return_min, vcfg.return_max) != (scale.min, scale.max):
        raise PisftError(f"advantages: the value model in {model_dir} was trained on returns in "
                         f"[{vcfg.return_min}, {vcfg.return_max}] but {data / 'returns.parquet'} now spans "
                         f"[{scale.min}, {scale.max}]: the pool changed; run train_value again")
    values = predict_values(cfg, model, Path(vcfg.base_model), data, returns, scale, device)
    t_infer = time.perf_counter() - t0
    frames = returns.merge(values, on=["episode_index", "frame_index"], how="left")
    missing = int(frames["value"].isna().sum())
    if missing:
        raise PisftError(f"advantages: {missing} frames of {data} are in neither split of split.json; "
                         "convert the pool again")
    frames = frames.merge(_frame_table(data), on=["episode_index", "frame_index"], how="left")
    kinds = episode_source_types(data)
    frames["source_type"] = frames["episode_index"].map(kinds)
    tasks = episode_tasks(data)
    task_text = {int(k): tasks[int(e)] for k, e in frames.groupby("task_index")["episode_index"].first().items()}
    r = cfg.recap
    result = label(frames, scale=scale, lookahead=r.lookahead, gamma=r.gamma,
                   positive_quantile=r.positive_quantile, scope=r.threshold_scope, tasks=task_text)
    result.summary.update({"value_model": str(model_dir), "device": str(device),
                           "inference_s": t_infer, "wall_time_s": time.perf_counter() - t0})
    # train_8card checks the labels against its manifest
    with stage_output(layout.iteration(cfg).advantages, cfg) as tmp:
        result.labels.to_parquet(tmp / LABELS_FILE, index=False)
        write_json_atomic(tmp / SUMMARY_FILE, result.summary)
    s = result.summary
    print(f"advantages: {s['positive']}/{s['frames']} frames positive ({s['positive_fraction']:.1%}; "
          f"{s['scope']} threshold(s), {s['sft_forced_positive']} sft frames forced), "
          f"{time.perf_counter() - t0:.1f} s -> {layout.iteration(cfg).advantages}")
    return layout.iteration(cfg).advantages
