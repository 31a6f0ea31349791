"""data.augment: openpi's image augmentation, its parameters within openpi's ranges, drawn per sample
from (seed, step, position) in the training loader only, against hand computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pisft.data import augment as aug
from pisft.train.batches import RAND_KEY, StepDataset
from pisft.train.sampler import SampleRef

BASE, WRIST = "observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb"


def _item(size=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {BASE: torch.rand(3, size, size, generator=g), WRIST: torch.rand(3, size, size, generator=g),
            "task": "put the bowl on the plate"}


def test_parameters_are_within_openpis_ranges_and_wrist_cameras_are_not_moved():
    h, w = 40, 60
    ch, cw = int(h * 0.95), int(w * 0.95)  # 38, 57
    seen = {"top": set(), "left": set()}
    for step in range(400):
        rng = aug.augment_rng(3, step, step % 7)
        base = aug.draw_openpi(rng, BASE, h, w)
        wrist = aug.draw_openpi(rng, WRIST, h, w)
        top, left, got_h, got_w = base["crop"]
        assert (got_h, got_w) == (ch, cw) and 0 <= top <= h - ch and 0 <= left <= w - cw
        seen["top"].add(top)
        seen["left"].add(left)
        assert -5.0 <= base["angle"] <= 5.0
        for p in (base, wrist):
            assert 0.7 <= p["brightness"] <= 1.3 and 0.6 <= p["contrast"] <= 1.4 and 0.5 <= p["saturation"] <= 1.5
        assert "crop" not in wrist and "angle" not in wrist  # openpi: "wrist" not in key
    assert seen["top"] == {0, 1, 2} and seen["left"] == {0, 1, 2, 3}  # every offset is drawn


def test_each_transform_against_a_hand_computation():
    img = torch.rand(3, 20, 20, generator=torch.Generator().manual_seed(1)) * 0.5 + 0.25
    identity = {"brightness": 1.0, "contrast": 1.0, "saturation": 1.0}
    torch.testing.assert_close(aug.apply_openpi(img, identity), img)
    torch.testing.assert_close(aug.apply_openpi(img, {**identity, "brightness": 1.2}), (img * 1.2).clamp(0, 1))
    gray = (0.2989 * img[0] + 0.587 * img[1] + 0.114 * img[2])
    want = (gray.mean() + (img - gray.mean()) * 1.3).clamp(0, 1)  # contrast: around the luma's mean
    torch.testing.assert_close(aug.apply_openpi(img, {**identity, "contrast": 1.3}), want, atol=1e-5, rtol=0)
    want = (gray + (img - gray) * 0.6).clamp(0, 1)  # saturation: towards the luma
    torch.testing.assert_close(aug.apply_openpi(img, {**identity, "saturation": 0.6}), want, atol=1e-5, rtol=0)
    # crop of the top-left 19 x 19 with no rotation, resized back: the image is stretched from there
    ramp = torch.arange(20.0).repeat(3, 20, 1) / 20  # value = column / 20
    out = aug.apply_openpi(ramp, {**identity, "crop": (0, 0, 19, 19), "angle": 0.0})
    assert out.shape == ramp.shape
    assert float(out[0, 5, 0]) == pytest.approx(0.0, abs=0.02)
    assert float(out[0, 5, -1]) == pytest.approx(18 / 20, abs=0.02)
    # a rotation moves pixels and fills the corners with black
    rotated = aug.apply_openpi(torch.ones(3, 20, 20), {**identity, "crop": (0, 0, 20, 20), "angle": 5.0})
    assert float(rotated[:, 0, 0].max()) < 0.5 and float(rotated[:, 10, 10].min()) == pytest.approx(1.0)


def test_draws_follow_seed_step_and_position_and_leave_the_objectives_draws_alone():
    class Base:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return _item(seed=i)

    def draw(rng):
        return {"noise": rng.standard_normal(3).astype(np.float32)}

    plain = StepDataset(Base(), 0, draw)
    augmented = StepDataset(Base(), 0, draw, augment=aug.make_augment("openpi", (BASE, WRIST)))
    ref = SampleRef(index=2, step=5, position=3)
    a, b, raw = augmented[ref], augmented[ref], plain[ref]
    assert torch.equal(a[BASE], b[BASE]) and torch.equal(a[WRIST], b[WRIST])  # deterministic
    assert not torch.equal(a[BASE], raw[BASE]) and not torch.equal(a[WRIST], raw[WRIST])
    assert torch.equal(a[RAND_KEY]["noise"], raw[RAND_KEY]["noise"])  # flow-matching draws unchanged
    for other in (SampleRef(2, 6, 3), SampleRef(2, 5, 4)):  # another step, another position
        assert not torch.equal(augmented[other][BASE], a[BASE])
    assert not torch.equal(StepDataset(Base(), 1, draw, augment=augmented.augment)[ref][BASE], a[BASE])
    assert aug.make_augment("none", (BASE,)) is None
