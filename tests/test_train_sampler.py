"""The step sampler: samples of step k depend on (seed, k) only, never on the world size."""

from __future__ import annotations

import numpy as np
import pytest

from pisft.train.optim import lr_at
from pisft.train.sampler import SampleRef, StepLayout, StepSampler, sample_rng


def _union(sampler: StepSampler, step: int) -> list[tuple[int, int]]:
    lay = sampler.layout
    refs = [r for rank in range(lay.world_size) for a in range(lay.accum)
            for r in sampler.micro_batch(step, rank, a)]
    return sorted((r.position, r.index) for r in refs)


@pytest.mark.parametrize("world,micro", [(1, 4), (2, 4), (2, 2), (4, 1), (8, 2)])
def test_every_layout_trains_on_the_same_samples(world, micro):
    ref = StepSampler(50, seed=3, layout=StepLayout(16, 16, 1))
    other = StepSampler(50, seed=3, layout=StepLayout(16, micro, world))
    for step in range(12):  # wraps over several epochs of 50 samples
        assert _union(other, step) == _union(ref, step)
        assert [i for _, i in _union(other, step)] == ref.global_batch(step)


def test_epochs_are_permutations_and_seed_matters():
    s = StepSampler(32, seed=0, layout=StepLayout(16, 4, 2))
    first_epoch = s.global_batch(0) + s.global_batch(1)
    assert sorted(first_epoch) == list(range(32))
    assert s.global_batch(2) + s.global_batch(3) != first_epoch  # a new permutation
    other_seed = StepSampler(32, seed=1, layout=StepLayout(16, 4, 2))
    assert other_seed.global_batch(0) != s.global_batch(0)


def test_rank_batches_resume_midway():
    s = StepSampler(40, seed=0, layout=StepLayout(8, 2, 2))
    full = list(s.rank_batches(1, 0, 6))
    resumed = list(StepSampler(40, seed=0, layout=StepLayout(8, 2, 2)).rank_batches(1, 3, 6))
    assert resumed == full[3 * s.layout.accum:]


def test_sample_draws_depend_on_seed_step_position_only():
    a = sample_rng(0, SampleRef(index=5, step=7, position=3)).standard_normal(4)
    b = sample_rng(0, SampleRef(index=9, step=7, position=3)).standard_normal(4)
    c = sample_rng(0, SampleRef(index=5, step=8, position=3)).standard_normal(4)
    assert np.array_equal(a, b)  # the same slot of the same step: same draw
    assert not np.array_equal(a, c)


def test_layout_rejects_indivisible_batch():
    with pytest.raises(ValueError, match="not divisible"):
        StepLayout(10, 4, 2)


def test_warmup_cosine_schedule():
    kw = dict(lr=1e-3, warmup_steps=10, decay_lr=1e-4, steps=110)
    assert lr_at(0, **kw) == pytest.approx(1e-3 / 11)
    assert lr_at(9, **kw) == pytest.approx(1e-3 * 10 / 11)
    assert lr_at(10, **kw) == pytest.approx(1e-3)
    assert lr_at(60, **kw) == pytest.approx((1e-3 + 1e-4) / 2)
    assert lr_at(110, **kw) == pytest.approx(1e-4)
    after = [lr_at(k, **kw) for k in range(10, 111)]
    assert all(x >= y for x, y in zip(after, after[1:]))
