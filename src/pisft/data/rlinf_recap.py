"""RLinf's offline RECAP labelling steps, as they change a LeRobot dataset on disk.

The demo data and the tests run these on a written dataset so that `convert_recap` meets
exactly what RLinf leaves behind (RLinf: `examples/offline_rl/advantage_labeling/recap/process/`
`compute_returns.py` and `compute_advantages.py`, `rlinf/algorithms/offline/process/`
`advantage.py` and `mixture_config.py`; written here from what those files do):

`compute_returns(root, tag)`:
- reads `episode_index`, `frame_index`, `is_success`, `task_index` (and `task` if a data file
  has it) of every `data/**/*.parquet`, never the images;
- reward -1 per step, the last step 0 for a success (`is_success` of the episode's last frame)
  or `failure_reward` for a failure; return G_t = r_t + gamma * G_{t+1};
- prompt: the task text of `meta/tasks.jsonl` by `task_index` (a v3.0 dataset has no
  tasks.jsonl, so every prompt is RLinf's fallback "perform the task");
- writes `meta/returns_<tag>.parquet` (`meta/returns.parquet` untagged): episode_index,
  frame_index (int64), return, reward (float32), prompt (string);
- adds `return`/`reward` {mean, std, min, max} to `meta/stats.json` (creating it when the
  layout has none, as in v2.1), and declares `return`, `reward` (float32 [1]) and `prompt`
  (string [1]) as features in `meta/info.json` (rewritten with indent 2) although the data
  files do not hold them.

`compute_advantages(root, tag)`:
- A_t = normalize(r_{t:t+N}) + gamma^N V(o_{t+N}) - V(o_t) with normalize mapping the
  [return min, return max] of `meta/stats.json` onto [-1, 0]; V(o_{t+N}) = 0 past the
  episode's end; the boolean label is A >= the (1 - positive_quantile) percentile over all
  frames (RECAP's inclusive rule; `sft` datasets: all True);
- writes `meta/advantages_<tag>.parquet` (pandas, no index): episode_index, frame_index,
  advantage_continuous, return, value_current, value_next, reward_sum, reward_sum_raw,
  num_valid_rewards, dataset_name, advantage (bool); records the threshold in
  `meta/mixture_config.yaml`. Nothing else is touched.

RLinf's value model is a trained critic; here `value` is a function of (task, frame, episode
length, normalised returns of the task's episodes) supplied by the caller (the demo: the task's
mean normalised return at that frame, what an outcome-blind critic learns; the RECAP loop:
`pisft.recap.advantages` with the trained value model).

The arithmetic shared with the RECAP loop lives here once: `value_target` (the value model's
target), `normalize_reward_sum`, `nstep_advantage` and `positive_threshold`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

FALLBACK_PROMPT = "perform the task"  # RLinf's prompt when the task text is unknown
_READ_COLUMNS = ["episode_index", "frame_index", "is_success", "task_index", "task"]


def side_name(kind: str, tag: str | None) -> str:
    return f"{kind}_{tag}.parquet" if tag else f"{kind}.parquet"


def _tasks_jsonl(root: Path) -> dict[int, str]:
    tasks: dict[int, str] = {}
    path = root / "meta" / "tasks.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                tasks[entry.get("task_index", len(tasks))] = entry.get("task", "")
    return tasks


def episode_returns(length: int, success: bool, gamma: float, failure_reward: float
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(returns, rewards), float32, for one episode."""
    rewards = np.full(length, -1.0, dtype=np.float32)
    rewards[-1] = 0.0 if success else failure_reward
    returns = np.zeros(length, dtype=np.float32)
    returns[-1] = rewards[-1]
    for t in range(length - 2, -1, -1):
        returns[t] = rewards[t] + gamma * returns[t + 1]
    return returns, rewards


def _returns_of_file(path: Path, dataset_type: str, gamma: float, failure_reward: float,
                     tasks: dict[int, str]) -> pa.Table | None:
    available = set(pq.ParquetFile(path).schema_arrow.names)
    table = pq.read_table(path, columns=[c for c in _READ_COLUMNS if c in available])
    n = table.num_rows
    if n == 0:
        return None
    ep = table.column("episode_index").to_numpy().astype(np.int64, copy=False)
    fr = table.column("frame_index").to_numpy().astype(np.int64, copy=False)
    if "is_success" in table.column_names:
        success = table.column("is_success").to_pylist()
    elif dataset_type != "sft":
        raise ValueError(f"Column 'is_success' not found in {path}")
    starts = np.concatenate([[0], np.flatnonzero(np.diff(ep) != 0) + 1])
    ends = np.concatenate([starts[1:], [n]])
    returns = np.empty(n, dtype=np.float32)
    rewards = np.empty(n, dtype=np.float32)
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        ok = True if dataset_type == "sft" else bool(success[b - 1])
        returns[a:b], rewards[a:b] = episode_returns(b - a, ok, gamma, failure_reward)
    if "task" in table.column_names:
        prompts = [str(t) for t in table.column("task").to_pylist()]
    elif "task_index" in table.column_names:
        prompts = [tasks.get(int(i), FALLBACK_PROMPT) for i in table.column("task_index").to_pylist()]
    else:
        prompts = [FALLBACK_PROMPT] * n
    return pa.table({"episode_index": pa.array(ep), "frame_index": pa.array(fr), "return": pa.array(returns),
                     "reward": pa.array(rewards), "prompt": pa.array(prompts, type=pa.string())})


def compute_returns(root: str | Path, tag: str | None, *, dataset_type: str = "rollout", gamma: float = 1.0,
                    failure_reward: float = -300.0) -> dict:
    """RLinf's `compute_returns` on the dataset at `root`, in place. Returns the stats it adds."""
    root = Path(root)
    files = sorted((root / "data").rglob("*.parquet"))
    tasks = _tasks_jsonl(root)
    tables = [t for t in (_returns_of_file(f, dataset_type, gamma, failure_reward, tasks) for f in files)
              if t is not None]
    if not tables:
        raise ValueError(f"No data found in dataset: {root}")
    combined = pa.concat_tables(tables)
    pq.write_table(combined, root / "meta" / side_name("returns", tag))
    stats = {}
    for key in ("return", "reward"):
        values = combined.column(key).to_numpy()
        stats[key] = {"mean": float(values.mean()),
                      "std": math.sqrt(max(float(values.astype(np.float64).var()), 0.0)),
                      "min": float(values.min()), "max": float(values.max())}
    stats_path = root / "meta" / "stats.json"
    existing = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    existing.update(stats)
    stats_path.write_text(json.dumps(existing, indent=2))
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["return"] = {"dtype": "float32", "shape": [1], "names": None}
    info["features"]["reward"] = {"dtype": "float32", "shape": [1], "names": None}
    info["features"]["prompt"] = {"dtype": "string", "shape": [1], "names": None}
    info_path.write_text(json.dumps(info, indent=2))
    return stats


ValueFn = Callable[[dict[str, np.ndarray]], np.ndarray]


def task_mean_value(frames: dict[str, np.ndarray]) -> np.ndarray:
    """V(o_t) of an outcome-blind critic: the mean normalised return of the task's episodes at
    the same frame index (over the episodes that reach it)."""
    task, frame, norm = frames["task_index"], frames["frame_index"], frames["normalized_return"]
    out = np.empty(len(norm), dtype=np.float64)
    for t in np.unique(task):
        sel = task == t
        f = frame[sel]
        sums = np.bincount(f, weights=norm[sel])
        counts = np.bincount(f)
        out[sel] = (sums / np.maximum(counts, 1))[f]
    return out


def compute_advantages(root: str | Path, tag: str | None, *, returns_tag: str | None = None,
                       value: ValueFn = task_mean_value, lookahead: int = 10, gamma: float = 1.0,
                       positive_quantile: float = 0.3, dataset_type: str = "rollout",
                       dataset_name: str | None = None, discount_next_value: bool = True,
                       decimals: int | None = None) -> float:
    """RLinf's `compute_advantages` on the dataset at `root` (its returns side file must exist).
    Returns the threshold of the boolean label. `decimals`: round the continuous advantage
    (a stand-in critic that is exact up to float noise gives equal frames equal labels)."""
    root = Path(root)
    returns_tag = tag if returns_tag is None else returns_tag
    side = pq.read_table(root / "meta" / side_name("returns", returns_tag)).to_pandas()
    # dataset order, as LeRobotDataset enumerates frames (episode, then frame)
    task_of: dict[tuple[int, int], int] = {}
    for f in sorted((root / "data").rglob("*.parquet")):
        t = pq.read_table(f, columns=["episode_index", "frame_index", "task_index"])
        for e, fr, k in zip(*(t.column(c).to_numpy() for c in t.column_names), strict=True):
            task_of[(int(e), int(fr))] = int(k)
    side = side.sort_values(["episode_index", "frame_index"], kind="stable").reset_index(drop=True)
    ep = side["episode_index"].to_numpy(np.int64)
    fr = side["frame_index"].to_numpy(np.int64)
    ret = side["return"].to_numpy(np.float64)
    rew = side["reward"].to_numpy(np.float64)
    stats = json.loads((root / "meta" / "stats.json").read_text())
    ret_min, ret_max = float(stats["return"]["min"]), float(stats["return"]["max"])

    task = np.array([task_of[(int(e), int(f))] for e, f in zip(ep, fr, strict=True)], dtype=np.int64)
    v = np.asarray(value({"task_index": task, "frame_index": fr, "episode_index": ep,
                          "normalized_return": normalize_reward_sum(ret, ret_min, ret_max)}), dtype=np.float64)
    out = nstep_advantage(ep, ret, rew, v, lookahead=lookahead, gamma=gamma, ret_min=ret_min,
                          ret_max=ret_max, discount_next_value=discount_next_value)
    advantage = out.advantage
    if decimals is not None:
        advantage = np.round(advantage, decimals)
    df = pd.DataFrame({"episode_index": ep, "frame_index": fr, "advantage": advantage, "return": ret,
                       "value_current": v, "value_next": out.value_next, "reward_sum": out.reward_sum,
                       "reward_sum_raw": out.reward_sum_raw,
                       "num_valid_rewards": out.num_valid.astype(np.int64)})
    df["dataset_name"] = dataset_name or root.name
    threshold = positive_threshold(advantage, positive_quantile)
    df = df.rename(columns={"advantage": "advantage_continuous"})
    df["advantage"] = True if dataset_type == "sft" else df["advantage_continuous"] >= threshold
    df.to_parquet(root / "meta" / side_name("advantages", tag), index=False)
    mix_path = root / "meta" / "mixture_config.yaml"
    mixture = (yaml.safe_load(mix_path.read_text()) or {}) if mix_path.exists() else {}
    mixture["global_return_min"] = ret_min
    mixture["global_return_max"] = ret_max
    mixture["datasets"] = [{"name": dataset_name or root.name, "weight": 1.0, "return_min": None,
                            "return_max": None}]
    entry = {"unified_threshold": threshold, "positive_quantile": positive_quantile}
    if tag:
        mixture.setdefault("tags", {})[tag] = entry
    else:
        mixture.update(entry)
    mix_path.write_text(yaml.safe_dump(mixture, sort_keys=False))
    return threshold


# ------------------------------------------------------------------------------------------------
# The arithmetic of RLinf's value target and N-step advantage, shared with pisft.recap.


def value_target(returns: np.ndarray, ret_min: float) -> np.ndarray:
    """The value model's target: the return divided by |minimum return| of the dataset, clipped to
    [-1, 0] (RLinf `rlinf/data/datasets/recap/value_dataset.py`, `ReturnNormalizer.normalize_value`
    with `normalize_to_minus_one_zero`; a minimum of 0 divides by 1; the clip is the critic's
    `_compute_categorical_loss` clamp to [v_min, v_max])."""
    denom = abs(float(ret_min)) if ret_min != 0 else 1.0
    return np.clip(np.asarray(returns, dtype=np.float64) / denom, -1.0, 0.0)


def normalize_reward_sum(x: np.ndarray, ret_min: float, ret_max: float) -> np.ndarray:
    """RLinf's `normalize` of the N-step reward sum (`compute_advantages_for_dataset`): maps
    [ret_min, ret_max] onto [-1, 0]; a zero-width range gives -0.5 everywhere. With ret_max = 0
    (any successful episode: its last return is 0) it is x / |ret_min|, the value target's scale."""
    x = np.asarray(x, dtype=np.float64)
    span = float(ret_max) - float(ret_min)
    return np.full_like(x, -0.5) if span <= 0 else (x - ret_min) / span - 1.0


@dataclass(frozen=True)
class NStep:
    """Per-frame pieces of the N-step advantage (rows in the caller's order)."""

    advantage: np.ndarray  # A_t
    value_next: np.ndarray  # V(o_{t+N}), 0 past the episode's end
    reward_sum: np.ndarray  # normalised reward sum
    reward_sum_raw: np.ndarray  # sum_{k<n} gamma^k r_{t+k}
    num_valid: np.ndarray  # n = min(N, frames left in the episode)


def nstep_advantage(episode: np.ndarray, returns: np.ndarray, rewards: np.ndarray, values: np.ndarray, *,
                    lookahead: int, gamma: float, ret_min: float, ret_max: float,
                    discount_next_value: bool = True) -> NStep:
    """RLinf's N-step advantage A_t = normalize(sum_{k<n} gamma^k r_{t+k}) + gamma^n V(o_{t+N}) - V(o_t)
    with n = min(N, frames left), V(o_{t+N}) = 0 when t+N is past the episode's end
    (`examples/offline_rl/advantage_labeling/recap/process/compute_advantages.py`,
    `compute_advantages_for_dataset`, `_resolve_lookahead`). With gamma = 1 the reward sum is
    G_t - G_{t+N} (G_t when padded), as RLinf computes it. Rows must be grouped by episode and
    ordered by frame within each episode (the dataset's order)."""
    ep = np.asarray(episode, dtype=np.int64)
    ret = np.asarray(returns, dtype=np.float64)
    rew = np.asarray(rewards, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    n = len(ep)
    ends = np.empty(n, dtype=np.int64)  # one past each frame's episode end, in row order
    starts = np.concatenate([[0], np.flatnonzero(np.diff(ep) != 0) + 1]) if n else np.zeros(0, np.int64)
    stops = np.concatenate([starts[1:], [n]]) if n else np.zeros(0, np.int64)
    for a, b in zip(starts, stops, strict=True):
        ends[a:b] = b
    idx = np.arange(n)
    nxt = idx + lookahead
    pad = nxt >= ends
    num_valid = np.minimum(lookahead, ends - idx)
    last = max(n - 1, 0)
    v_next = np.where(pad, 0.0, v[np.minimum(nxt, last)]) if n else np.zeros(0)
    if abs(gamma - 1.0) < 1e-8:
        raw = np.where(pad, ret, ret - ret[np.minimum(nxt, last)]) if n else np.zeros(0)
    else:
        powers = gamma ** np.arange(lookahead)
        raw = np.array([float(np.sum(powers[:k] * rew[i:i + k])) for i, k in enumerate(num_valid)])
    reward_sum = normalize_reward_sum(raw, ret_min, ret_max)
    gamma_k = gamma ** num_valid if discount_next_value else np.ones(n)
    return NStep(reward_sum + gamma_k * v_next - v, v_next, reward_sum, raw, num_valid)


def positive_threshold(advantage: np.ndarray, positive_quantile: float) -> float:
    """The (1 - positive_quantile) percentile of the advantages (numpy's linear interpolation, as
    RLinf's `quantile_threshold`); a frame is positive when A >= it (inclusive)."""
    return float(np.percentile(np.asarray(advantage, dtype=np.float64), (1.0 - positive_quantile) * 100.0))
