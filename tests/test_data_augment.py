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



class _Frames:
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return {**_item(size=24, seed=i), "i": torch.tensor(i)}


def _loader_images(world: int, workers: int, *, kind="openpi", start=0, end=3):
    """Each sample's camera images from the training loaders of `world` ranks, by (step, position)."""
    from pisft.train.batches import make_loader
    from pisft.train.sampler import StepLayout, StepSampler

    data = _Frames()
    sampler = StepSampler(len(data), 5, StepLayout(8, 2, world))
    out = {}
    for rank in range(world):
        loader = make_loader(data, sampler, rank=rank, start_step=start, end_step=end, seed=5, draw=None,
                             num_workers=workers, augment=aug.make_augment(kind, (BASE, WRIST)))
        for refs, batch in zip(sampler.rank_batches(rank, start, end), loader, strict=True):
            for j, ref in enumerate(refs):
                assert int(batch["i"][j]) == ref.index
                out[(ref.step, ref.position)] = (ref.index, batch[BASE][j], batch[WRIST][j])
    return out


def test_the_training_loader_augments_each_sample_alike_at_any_world_size_workers_and_resume():
    one = _loader_images(1, 0)
    assert len(one) == 3 * 8  # 3 steps of the global batch 8
    for got in (_loader_images(2, 0), _loader_images(4, 2), {**_loader_images(1, 0, end=1),
                                                             **_loader_images(1, 0, start=1)}):
        assert got.keys() == one.keys()
        for key, (index, base, wrist) in one.items():
            assert got[key][0] == index and torch.equal(got[key][1], base) and torch.equal(got[key][2], wrist)
    plain = _Frames()
    changed = [not torch.equal(base, plain[index][BASE]) for index, base, _ in one.values()]
    assert all(changed)  # the loader did augment every sample


def test_the_record_says_which_augmentation_trained_and_none_has_nothing_to_apply():
    assert aug.augment_record(None) == {"kind": "none"}
    rec = aug.augment_record(aug.make_augment("openpi", (WRIST, BASE)))
    assert rec["kind"] == "openpi" and rec["image_keys"] == [BASE, WRIST] and rec["cropped_and_rotated"] == [BASE]
    assert (rec["crop_fraction"], rec["max_rotation_deg"]) == (0.95, 5.0)
    assert (rec["brightness"], rec["contrast"], rec["saturation"]) == (0.3, 0.4, 0.5)
    with pytest.raises(ValueError, match="data.augment: 'none' has no augmentation to apply; one of openpi"):
        aug.ImageAugment("none", (BASE,))
