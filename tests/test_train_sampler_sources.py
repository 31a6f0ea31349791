"""Issue 32, item 6: the pool's sources drawn by weight (RLinf's ReCapMixtureDataset rule), in
the step sampler: shares as computed by hand, deterministic, the same at any world size."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pisft.data.source_weights import shares, uniform_over_frames
from pisft.train.sampler import SourceMixture, StepLayout, StepSampler

# Two sources of different lengths: rows 0..29 are source 0 (30 frames), 30..39 source 1 (10).
ROWS = np.array([0] * 30 + [1] * 10)


def _mixture(weights, balance) -> SourceMixture:
    m = SourceMixture.of(ROWS, weights, balance)
    assert m is not None
    return m


@pytest.mark.parametrize(("weights", "balance", "by_hand"), [
    # balanced: weight x frames = 1 x 30 : 2 x 10 = 30 : 20 -> 0.6, 0.4
    ((1.0, 2.0), True, (30 / 50, 20 / 50)),
    # not balanced: the weights alone, 1 : 2
    ((1.0, 2.0), False, (1 / 3, 2 / 3)),
    # equal weights, not balanced: half each although source 0 has three times the frames
    ((1.0, 1.0), False, (0.5, 0.5)),
    # equal weights, balanced: the frames' own shares, 30 : 10
    ((1.0, 1.0), True, (0.75, 0.25)),
])
def test_shares_by_hand(weights, balance, by_hand):
    assert shares(list(weights), [30, 10], balance) == pytest.approx(by_hand, rel=1e-12)


def test_an_empty_source_gets_no_share_as_rlinf_skips_it():
    assert shares([1.0, 5.0, 2.0], [30, 0, 10], False) == pytest.approx((1 / 3, 0.0, 2 / 3))
    assert uniform_over_frames([1.0, 5.0], [30, 0], False)  # one source left: every frame alike


@pytest.mark.parametrize(("weights", "balance", "by_hand"), [
    ((1.0, 2.0), True, 0.4),
    ((1.0, 2.0), False, 2 / 3),
    ((1.0, 1.0), False, 0.5),
])
def test_empirical_shares_within_the_binomial_deviation(weights, balance, by_hand):
    """Over n = 400 steps x 64 samples, source 1's count is Binomial(n, p): within 4 standard
    deviations (a fixed seed: the same draws every run), and every frame of a source is drawn
    uniformly (each frame's count Binomial(n_source, 1 / frames), within 4.5 deviations)."""
    g, steps = 64, 400
    s = StepSampler(len(ROWS), seed=11, layout=StepLayout(g, 16, 4), mixture=_mixture(weights, balance))
    drawn = np.array([i for k in range(steps) for i in s.global_batch(k)])
    n = len(drawn)
    from_1 = int((drawn >= 30).sum())
    sd = math.sqrt(n * by_hand * (1 - by_hand))
    assert abs(from_1 - n * by_hand) <= 4 * sd, (from_1, n * by_hand, sd)
    for lo, hi in ((0, 30), (30, 40)):
        mine = drawn[(drawn >= lo) & (drawn < hi)]
        counts = np.bincount(mine - lo, minlength=hi - lo)
        p = 1 / (hi - lo)
        assert np.all(np.abs(counts - len(mine) * p) <= 4.5 * math.sqrt(len(mine) * p * (1 - p))), counts


def test_the_weighted_draw_is_the_same_on_one_and_two_processes():
    """The union of the ranks' micro-batches of a step is the same samples in the same positions
    on 1, 2 and 4 processes (the draw depends on (seed, step) only), and a resumed run continues it."""
    m = _mixture((1.0, 3.0), False)
    one = StepSampler(len(ROWS), seed=5, layout=StepLayout(16, 16, 1), mixture=m)
    for world, micro in ((2, 4), (2, 8), (4, 2)):
        other = StepSampler(len(ROWS), seed=5, layout=StepLayout(16, micro, world), mixture=m)
        for step in range(10):
            union = sorted((r.position, r.index) for rank in range(world) for a in range(other.layout.accum)
                           for r in other.micro_batch(step, rank, a))
            assert [i for _, i in union] == one.global_batch(step)
            assert [p for p, _ in union] == list(range(16))
    full = list(one.rank_batches(0, 0, 8))
    assert list(StepSampler(len(ROWS), seed=5, layout=one.layout, mixture=m).rank_batches(0, 3, 8)) == full[3:]
    assert StepSampler(len(ROWS), seed=6, layout=one.layout, mixture=m).global_batch(0) != one.global_batch(0)


def test_one_source_or_balanced_equal_weights_keep_the_permutation_stream():
    """Every frame equally likely: no mixture, the sampler is exactly the permutation sampler
    (each frame once per epoch)."""
    assert SourceMixture.of(np.zeros(40, dtype=int), [2.5], True) is None
    assert SourceMixture.of(np.zeros(40, dtype=int), [2.5], False) is None
    assert SourceMixture.of(ROWS, [2.0, 2.0], True) is None
    plain = StepSampler(40, seed=3, layout=StepLayout(20, 5, 2))
    assert sorted(plain.global_batch(0) + plain.global_batch(1)) == list(range(40))
    again = StepSampler(40, seed=3, layout=StepLayout(20, 5, 2), mixture=SourceMixture.of(ROWS, [1.0, 1.0], True))
    assert [again.global_batch(k) for k in range(6)] == [plain.global_batch(k) for k in range(6)]


def test_a_mixture_that_does_not_cover_the_train_set_is_refused():
    with pytest.raises(ValueError, match="covers 40 rows, the train set has 39"):
        StepSampler(39, seed=0, layout=StepLayout(4, 4, 1), mixture=_mixture((1.0, 2.0), True))


class _Split:
    """A split's rows as the training stages see them: their output episode index."""

    def __init__(self, episode_index):
        self.episode_index = np.asarray(episode_index)

    def __len__(self):
        return len(self.episode_index)


def test_training_draws_by_the_datasets_record_and_a_new_weight_is_a_new_run(tmp_path):
    """make_sampler reads the weights convert_recap recorded with the dataset; the record is part
    of the run's fingerprint (a changed weight never resumes the old run), as is the balancing key."""
    from pisft import config
    from pisft.data.source_weights import SourceSampling
    from pisft.train.run_folders import checkpoint_root
    from pisft.train.job import make_sampler

    cfg = config.from_dict({"results_dir": str(tmp_path), "train": {"micro_batch_size": 4, "global_batch_size": 8}})
    data = tmp_path / "dataset"
    (data / "meta").mkdir(parents=True)
    (data / "split.json").write_text('{"train": [0, 1, 2], "eval": []}')
    split = _Split([0] * 6 + [1] * 6 + [2] * 8)  # episodes 0, 1 from source 0 (12 frames), 2 from source 1 (8)
    assert make_sampler(cfg, split, 1).mixture is None  # no record (an older dataset): the permutations
    before = checkpoint_root(cfg)
    SourceSampling(True, (1.0, 1.0), (0, 0, 1)).write(data)
    assert make_sampler(cfg, split, 1).mixture is None  # balanced equal weights: every frame alike
    SourceSampling(True, (1.0, 3.0), (0, 0, 1)).write(data)
    mixture = make_sampler(cfg, split, 2).mixture
    assert mixture is not None and mixture.probs.tolist() == pytest.approx([12 / 36, 24 / 36])
    assert [g.tolist() for g in mixture.groups] == [list(range(12)), list(range(12, 20))]
    weighted = checkpoint_root(cfg)
    assert len({before, weighted}) == 2
    unbalanced = config.from_dict({"results_dir": str(tmp_path), "data": {"balance_source_weights": False},
                                   "train": {"micro_batch_size": 4, "global_batch_size": 8}})
    assert checkpoint_root(unbalanced) != weighted
