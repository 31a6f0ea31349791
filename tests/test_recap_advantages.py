"""RLinf's returns and N-step advantages against hand computations; the threshold scopes, sft
frames forced positive, and the refusals of a degenerate or non-finite labelling."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pisft import config as config_mod
from pisft.data.rlinf_recap import episode_returns, nstep_advantage
from pisft.errors import PisftError
from pisft.recap import advantages
from pisft.recap.advantages import LabellingError, label
from pisft.recap.value_data import ReturnRange


def test_returns_of_a_success_and_a_failure_by_hand():
    ret, rew = episode_returns(4, True, 1.0, -10.0)
    np.testing.assert_array_equal(rew, [-1, -1, -1, 0])
    np.testing.assert_array_equal(ret, [-3, -2, -1, 0])
    ret, rew = episode_returns(3, False, 1.0, -10.0)
    np.testing.assert_array_equal(rew, [-1, -1, -10])
    np.testing.assert_array_equal(ret, [-12, -11, -10])
    ret, _ = episode_returns(4, True, 0.5, -10.0)  # G = r + 0.5 G'
    np.testing.assert_allclose(ret, [-1.75, -1.5, -1.0, 0.0])


def _pool() -> pd.DataFrame:
    """A success of 4 frames, a failure of 3, a success of 2 (shorter than N = 3); failure
    reward -10, gamma 1: the minimum return is -12, the maximum 0."""
    rows = []
    for ep, (length, ok, values) in enumerate([(4, True, [-0.3, -0.2, -0.1, 0.0]),
                                                (3, False, [-0.9, -0.95, -0.99]),
                                                (2, True, [-0.05, 0.0])]):
        ret, rew = episode_returns(length, ok, 1.0, -10.0)
        for t in range(length):
            rows.append({"episode_index": ep, "frame_index": t, "return": float(ret[t]),
                         "reward": float(rew[t]), "value": values[t], "task_index": 0,
                         "source_type": "rollout"})
    return pd.DataFrame(rows)


# A_t = (sum of the next n rewards) / 12 + V(o_{t+3}) - V(o_t), n = min(3, frames left),
# V(o_{t+3}) = 0 when t + 3 is past the episode's end. Written out frame by frame:
HAND = [
    -3 / 12 + 0.0 + 0.3,  # success t0: r0+r1+r2 = -3, V(o_3) = 0.0
    -2 / 12 + 0 + 0.2,  # t1: t+3 = 4 is past the end; r1+r2+r3 = -2
    -1 / 12 + 0 + 0.1,  # t2: n = 2, r2+r3 = -1
    0 / 12 + 0 - 0.0,  # t3: n = 1, r3 = 0
    -12 / 12 + 0 + 0.9,  # failure t0: t+3 = 3 is past the end; -1-1-10
    -11 / 12 + 0 + 0.95,  # t1: n = 2
    -10 / 12 + 0 + 0.99,  # t2: n = 1
    -1 / 12 + 0 + 0.05,  # short success t0: n = 2 < N
    0 / 12 + 0 - 0.0,  # t1: n = 1
]


def test_nstep_advantage_by_hand():
    pool = _pool()
    out = nstep_advantage(pool["episode_index"].to_numpy(), pool["return"].to_numpy(),
                          pool["reward"].to_numpy(), pool["value"].to_numpy(), lookahead=3, gamma=1.0,
                          ret_min=-12.0, ret_max=0.0)
    np.testing.assert_allclose(out.advantage, HAND, atol=1e-12)
    np.testing.assert_array_equal(out.num_valid, [3, 3, 2, 1, 3, 2, 1, 2, 1])
    np.testing.assert_array_equal(out.value_next, [0.0, 0, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(out.reward_sum_raw, [-3, -2, -1, 0, -12, -11, -10, -1, 0])
    # N = 1: V(o_{t+1}) of the same episode, 0 after its last frame
    out1 = nstep_advantage(pool["episode_index"].to_numpy(), pool["return"].to_numpy(),
                           pool["reward"].to_numpy(), pool["value"].to_numpy(), lookahead=1, gamma=1.0,
                           ret_min=-12.0, ret_max=0.0)
    np.testing.assert_allclose(out1.value_next, [-0.2, -0.1, 0.0, 0, -0.95, -0.99, 0, 0.0, 0])
    assert out1.advantage[0] == pytest.approx(-1 / 12 + -0.2 + 0.3)


def test_nstep_advantage_with_a_discount_by_hand():
    ret, rew = episode_returns(4, True, 0.5, -10.0)  # returns -1.75, -1.5, -1, 0
    v = np.array([-0.5, -0.4, -0.3, -0.1])
    out = nstep_advantage(np.zeros(4, np.int64), ret, rew, v, lookahead=2, gamma=0.5, ret_min=-1.75, ret_max=0.0)
    # t0: (r0 + 0.5 r1) / 1.75 + 0.5^2 V(o_2) - V(o_0); t3: n = 1, r3 = 0, V past the end 0
    assert out.advantage[0] == pytest.approx(-1.5 / 1.75 + 0.25 * -0.3 + 0.5)
    assert out.advantage[2] == pytest.approx(-1.0 / 1.75 + 0.5 ** 2 * 0 + 0.3)
    assert out.advantage[3] == pytest.approx(0.0 + 0.1)


def test_label_writes_rlinfs_columns_and_the_hand_advantages():
    result = label(_pool(), scale=ReturnRange(-12.0, 0.0), lookahead=3, gamma=1.0, positive_quantile=0.3,
                   scope="global", tasks={0: "put both moka pots on the stove"})
    labels = result.labels
    assert list(labels.columns[:4]) == ["episode_index", "frame_index", "advantage_continuous", "advantage"]
    np.testing.assert_allclose(labels["advantage_continuous"], HAND, atol=1e-12)
    threshold = np.percentile(HAND, 70)
    assert result.summary["threshold"] == pytest.approx(threshold)
    assert labels["advantage"].tolist() == [a >= threshold for a in HAND]
    assert result.summary["per_task"]["0"]["task"] == "put both moka pots on the stove"


def _one_frame_episodes(advantages: list[float], tasks: list[int], kinds: list[str] | None = None) -> pd.DataFrame:
    """Episodes of one successful frame each: return 0, so A = normalize(0) - V = -V."""
    n = len(advantages)
    return pd.DataFrame({"episode_index": np.arange(n), "frame_index": np.zeros(n, np.int64),
                         "return": np.zeros(n), "reward": np.zeros(n), "value": -np.asarray(advantages),
                         "task_index": tasks, "source_type": kinds or ["rollout"] * n})


SCALE = ReturnRange(-10.0, 0.0)
TASK0 = [0.1, 0.2, 0.3, 0.4, 0.5]
TASK1 = [-0.5, -0.4, -0.3, -0.2, -0.1]


def test_global_threshold_over_all_frames():
    frames = _one_frame_episodes(TASK0 + TASK1, [0] * 5 + [1] * 5)
    result = label(frames, scale=SCALE, lookahead=10, gamma=1.0, positive_quantile=0.4, scope="global")
    # 60th percentile of the ten values: position 0.6 * 9 = 5.4 between 0.1 and 0.2 -> 0.14
    assert result.summary["thresholds"] == {"global": pytest.approx(0.14)}
    assert result.labels["advantage"].tolist() == [False, True, True, True, True] + [False] * 5
    assert result.summary["per_task"]["1"]["positive"] == 0


def test_task_threshold_per_task():
    frames = _one_frame_episodes(TASK0 + TASK1, [0] * 5 + [1] * 5)
    result = label(frames, scale=SCALE, lookahead=10, gamma=1.0, positive_quantile=0.4, scope="task")
    # each task's 60th percentile: position 0.6 * 4 = 2.4 -> 0.34 and -0.26
    assert result.summary["thresholds"] == {"0": pytest.approx(0.34), "1": pytest.approx(-0.26)}
    assert result.summary["threshold"] is None
    assert result.labels["advantage"].tolist() == [False, False, False, True, True] * 2
    assert result.summary["per_task"]["0"]["positive_fraction"] == 0.4


def test_the_threshold_is_inclusive():
    frames = _one_frame_episodes([0.0, 1.0, 2.0, 3.0, 4.0], [0] * 5)
    result = label(frames, scale=SCALE, lookahead=10, gamma=1.0, positive_quantile=0.25, scope="global")
    assert result.summary["threshold"] == pytest.approx(3.0)  # the 75th percentile, a frame's own value
    assert result.labels["advantage"].tolist() == [False, False, False, True, True]


@pytest.mark.parametrize("scope", ["global", "task"])
def test_sft_frames_are_positive_after_the_threshold_over_all_frames(scope):
    kinds = ["sft", "rollout", "rollout", "rollout", "sft"] + ["rollout"] * 5
    frames = _one_frame_episodes(TASK0 + TASK1, [0] * 5 + [1] * 5, kinds)
    result = label(frames, scale=SCALE, lookahead=10, gamma=1.0, positive_quantile=0.4, scope=scope)
    # the thresholds are those of the test above: the sft frames count in them
    expected = {"global": {"global": 0.14}, "task": {"0": 0.34, "1": -0.26}}[scope]
    assert result.summary["thresholds"] == pytest.approx(expected)
    labels = result.labels
    assert labels.loc[labels.source_type == "sft", "advantage"].all()
    forced = {"global": 1, "task": 1}[scope]  # the sft frame of A = 0.1 is below the threshold
    assert result.summary["sft_forced_positive"] == forced
    assert result.summary["per_source_type"]["sft"] == {"frames": 2, "positive": 2, "positive_fraction": 1.0}


def test_a_labelling_with_every_frame_positive_is_refused():
    frames = _one_frame_episodes([0.1, 0.2, 0.3], [0, 0, 0], ["sft"] * 3)
    with pytest.raises(LabellingError, match="3 of 3 frames would be positive.*add policy rollouts"):
        label(frames, scale=SCALE, lookahead=10, gamma=1.0, positive_quantile=0.3, scope="global")
    frames = _one_frame_episodes([0.2, 0.2, 0.2, 0.2], [0, 0, 0, 0])  # a constant value model
    with pytest.raises(LabellingError, match="4 of 4 frames would be positive.*1 distinct advantage"):
        label(frames, scale=SCALE, lookahead=10, gamma=1.0, positive_quantile=0.3, scope="global")


def test_a_labelling_with_no_frame_is_refused():
    with pytest.raises(LabellingError, match="0 positive of 0"):
        label(_one_frame_episodes([], []), scale=SCALE, lookahead=10, gamma=1.0, positive_quantile=0.3,
              scope="global")


def test_non_finite_values_are_refused_with_the_count():
    frames = _one_frame_episodes([0.1, 0.2, 0.3, 0.4], [0] * 4)
    frames.loc[[1, 3], "value"] = [np.nan, np.inf]
    with pytest.raises(LabellingError, match="non-finite V for 2 of 4 frames"):
        label(frames, scale=SCALE, lookahead=10, gamma=1.0, positive_quantile=0.3, scope="global")


def test_the_stage_reads_and_writes_its_iterations_folders(tmp_path):
    from train_fixtures import CONFIG

    cfg = config_mod.load(CONFIG, [f"results_dir={tmp_path}", "recap.iterations=1", "eval.closed_loop=true",
                                   "eval.trials_per_task=1"]).at_iteration(1)
    with pytest.raises(PisftError, match=f"{tmp_path}/recap/iter_1/dataset/split.json not found"):
        advantages.run(cfg)
