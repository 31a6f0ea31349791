"""Every frame's Monte-Carlo return and reward beside the converted dataset (`returns.parquet`,
RLinf's `compute_returns`), and the settings it is computed with (`Returns`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pisft.data.convert_select import Kept


@dataclass(frozen=True)
class Returns:
    """RLinf's return settings (`recap_compute_returns.yaml`: gamma 1, failure reward -300)."""

    gamma: float = 1.0
    failure_reward: float = -300.0


def episode_outcome(k: Kept, source_type: str) -> bool:
    """An episode's success for its return: an sft episode always; a rollout by the success
    column of its last frame (RLinf's compute_returns)."""
    if source_type == "sft":
        return True
    return bool(k.cols["is_success"][-1])


def write_returns(path: Path, kept: list[Kept], types: list[str], settings: Returns) -> None:
    """Every frame's Monte-Carlo return and reward, by output episode and frame index."""
    from pisft.data.rlinf_recap import episode_returns

    eps, frs, rets, rews = [], [], [], []
    for i, k in enumerate(kept):
        n = len(k.cols["frame_index"])
        ret, rew = episode_returns(n, episode_outcome(k, types[k.source]), settings.gamma, settings.failure_reward)
        eps.append(np.full(n, i, dtype=np.int64))
        frs.append(np.arange(n, dtype=np.int64))
        rets.append(ret)
        rews.append(rew)
    table = pa.table({"episode_index": np.concatenate(eps), "frame_index": np.concatenate(frs),
                      "return": np.concatenate(rets).astype(np.float32),
                      "reward": np.concatenate(rews).astype(np.float32)})
    meta = {b"pisft": json.dumps({"gamma": settings.gamma, "failure_reward": settings.failure_reward,
                                  "source": "RLinf compute_returns: -1 per step; last step 0 (success) "
                                            "or failure_reward; G_t = r_t + gamma G_{t+1}"}, sort_keys=True).encode()}
    pq.write_table(table.replace_schema_metadata(meta), path)
