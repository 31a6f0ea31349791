"""Training-time image augmentation (`data.augment`): `none`, or `openpi` (openpi's pi0/pi0.5 recipe).

openpi (Physical-Intelligence/openpi @ 15a9616, src/openpi/models/model.py `preprocess_observation`
with `train=True`, lines 168-187): for every camera whose key does not contain "wrist", a random
crop to 95% of the height and width (`augmax.RandomCrop(int(w * 0.95), int(h * 0.95))`) resized
back (`augmax.Resize(w, h)`) and a rotation by an angle in [-5, 5] degrees (`augmax.Rotate((-5,
5))`); for every camera, `augmax.ColorJitter(brightness=0.3, contrast=0.4, saturation=0.5)`; each
image of the batch draws its own parameters (`jax.vmap` over one key per image). RLinf's value
model augments the same way (RLinf/RLinf, rlinf/models/embodiment/value_model/value_common/
image_text_processing.py).

Here each sample's parameters are drawn from (train.seed, step, position in the global batch),
from a stream of their own (`augment_rng`), in the data loader (`pisft.train.batches.StepDataset`):
the same sample gets the same augmentation at any world size, micro batch or number of workers,
and the flow-matching draws do not change when augmentation is switched on. Only the training
loaders apply it: evaluation, the value model's held-out figures and inference never do.

The transforms are torchvision's v2 functionals on the CHW float image in [0, 1]:
- crop: `resized_crop` at an integer offset drawn uniformly in [0, H - int(0.95 H)] and
  [0, W - int(0.95 W)] (augmax's RandomCrop), bilinear back to H x W (augmax's Resize is bilinear);
- rotation: `rotate` by a uniform angle in [-5, 5] degrees about the centre, bilinear, the corners
  filled with 0 (black), as openpi's PyTorch port (`grid_sample`, padding "zeros");
- colour: brightness, contrast and saturation factors drawn uniformly in [1 - 0.3, 1 + 0.3],
  [1 - 0.4, 1 + 0.4], [1 - 0.5, 1 + 0.5], applied in that fixed order (openpi's PyTorch port,
  src/openpi/models_pytorch/preprocessing_pytorch.py, lines 119-139: its reading of augmax's
  parameters; augmax itself is a JAX library not in this environment).
Where this differs from openpi, and why:
- openpi augments after resizing to 224 x 224 with padding; here at the dataset's resolution,
  before the policy's own resize (the crop is a fraction, the rotation an angle: the same
  geometry; a crop offset is an integer pixel of the smaller of the two sizes);
- torchvision clamps to [0, 1] after each colour step and takes contrast's mean and saturation's
  grey from the luma (0.2989 R + 0.587 G + 0.114 B); openpi's PyTorch port clamps once at the end
  and uses the plain channel mean (which augmax uses is not readable here);
- torchvision's `ColorJitter` class draws the order of the steps at random; the functionals are
  applied in openpi's port's fixed order instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pisft.config import AUGMENTS  # the choices of data.augment (validated in pisft.config)
CROP_FRACTION = 0.95  # openpi: augmax.RandomCrop(int(width * 0.95), int(height * 0.95))
MAX_ROTATION_DEG = 5.0  # openpi: augmax.Rotate((-5, 5))
BRIGHTNESS, CONTRAST, SATURATION = 0.3, 0.4, 0.5  # openpi: augmax.ColorJitter(0.3, 0.4, 0.5)
_STREAM = 0xA06  # augment_rng: a stream apart from the objective's draws (sampler.sample_rng)


def augment_rng(seed: int, step: int, position: int) -> np.random.Generator:
    """The generator of one sample's augmentation: (seed, step, position in the global batch)."""
    return np.random.default_rng([seed, _STREAM, step, position])


def geometric(key: str) -> bool:
    """openpi crops and rotates every camera but the wrist ones (`"wrist" not in key`)."""
    return "wrist" not in key


def draw_openpi(rng: np.random.Generator, key: str, height: int, width: int) -> dict[str, Any]:
    """One camera's parameters, in openpi's ranges."""
    params: dict[str, Any] = {}
    if geometric(key):
        ch, cw = int(height * CROP_FRACTION), int(width * CROP_FRACTION)
        params["crop"] = (int(rng.integers(0, height - ch + 1)), int(rng.integers(0, width - cw + 1)), ch, cw)
        params["angle"] = float(rng.uniform(-MAX_ROTATION_DEG, MAX_ROTATION_DEG))
    params["brightness"] = float(rng.uniform(1 - BRIGHTNESS, 1 + BRIGHTNESS))
    params["contrast"] = float(rng.uniform(1 - CONTRAST, 1 + CONTRAST))
    params["saturation"] = float(rng.uniform(1 - SATURATION, 1 + SATURATION))
    return params


def apply_openpi(image: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """`image` (C, H, W) float in [0, 1] augmented with `params` (draw_openpi)."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    height, width = image.shape[-2:]
    if "crop" in params:
        top, left, ch, cw = params["crop"]
        image = F.resized_crop(image, top, left, ch, cw, [height, width],
                               interpolation=InterpolationMode.BILINEAR, antialias=True)
        image = F.rotate(image, params["angle"], interpolation=InterpolationMode.BILINEAR, fill=0.0)
    image = F.adjust_brightness(image, params["brightness"])
    image = F.adjust_contrast(image, params["contrast"])
    image = F.adjust_saturation(image, params["saturation"])
    return image.clamp(0.0, 1.0)


class ImageAugment:
    """Callable on a dataset item: its camera images augmented (openpi's recipe), drawn from `rng`."""

    def __init__(self, kind: str, image_keys: tuple[str, ...]) -> None:
        if kind not in AUGMENTS or kind == "none":
            raise ValueError(f"data.augment: '{kind}' has no augmentation to apply; one of "
                             f"{', '.join(AUGMENTS[1:])} (or none: no ImageAugment)")
        self.kind = kind
        self.image_keys = tuple(sorted(image_keys))  # the draw order: by camera key

    def draws(self, item: dict[str, Any], rng: np.random.Generator) -> dict[str, dict[str, Any]]:
        return {k: draw_openpi(rng, k, *item[k].shape[-2:]) for k in self.image_keys if k in item}

    def __call__(self, item: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        out = dict(item)
        for key, params in self.draws(item, rng).items():
            out[key] = apply_openpi(item[key].float(), params).to(item[key].dtype)
        return out


def make_augment(kind: str, image_keys) -> ImageAugment | None:
    """The training loader's augmentation for `data.augment`, or None (`none`)."""
    return None if kind == "none" else ImageAugment(kind, tuple(image_keys))


def augment_record(augment: ImageAugment | None) -> dict[str, Any]:
    """What the train summary and `pisft_model.json` say of the training images (`augment`)."""
    if augment is None:
        return {"kind": "none"}
    return {"kind": augment.kind, "image_keys": list(augment.image_keys),
            "cropped_and_rotated": [k for k in augment.image_keys if geometric(k)],
            "crop_fraction": CROP_FRACTION, "max_rotation_deg": MAX_ROTATION_DEG,
            "brightness": BRIGHTNESS, "contrast": CONTRAST, "saturation": SATURATION}
