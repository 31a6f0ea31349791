"""bf16 where openpi runs bf16 (`eval.precision`, pisft.policy.precision; pisft.model.pi05 10.)."""

from __future__ import annotations

import pytest
import torch

from model_fixtures import fake_batch, tiny_model_dir
from pisft.errors import PisftError
from pisft.model.pi05.precision import OPENPI_FP32
from pisft.policy import precision
from pisft.policy.predictor import ChunkPredictor, frame_noise

PROJECTIONS = ("model.action_in_proj.", "model.action_out_proj.", "model.time_mlp_in.", "model.time_mlp_out.")


def test_auto_is_bf16_on_an_accelerator_and_the_models_own_on_the_cpu():
    assert precision.choose("auto", "cuda", "float32").dtype == "bfloat16"
    assert precision.choose("auto", "npu", "float32").layout == "openpi"
    assert precision.choose("auto", "cpu", "float32").dtype == "float32"
    assert precision.choose("auto", "cpu", "bfloat16").dtype == "bfloat16"
    assert precision.choose("fp32", "cuda", "bfloat16").layout == "float32"
    assert precision.choose("bf16", "cpu", "float32", layout="lerobot").layout == "lerobot"
    with pytest.raises(PisftError, match="eval.precision: 'fp16'"):
        precision.choose("fp16", "cpu", "float32")


def _float32_names(policy) -> set[str]:
    return {n for n, p in policy.named_parameters() if p.dtype == torch.float32}


def test_float32_stays_only_where_openpi_keeps_it(tmp_path_factory):
    model = tiny_model_dir(tmp_path_factory)
    openpi = ChunkPredictor.load(model, precision="bf16")
    lerobot = ChunkPredictor.load(model, precision="bf16", layout="lerobot")
    names = _float32_names(openpi.policy)
    for name in names:  # openpi's selectors (gemma_pytorch.py) and the projections made after them
        rel = name.removeprefix("model.paligemma_with_expert.")
        assert any(sel in rel for sel in OPENPI_FP32) or name.startswith(PROJECTIONS), name
    assert any("patch_embedding" in n for n in names) and any("gemma_expert" in n and "input_layernorm" in n
                                                               for n in names)
    assert all(name.startswith(PROJECTIONS) or "paligemma_with_expert" in name for name in names)
    vision = "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder."
    extra = _float32_names(lerobot.policy) - names  # what LeRobot's layout adds: the vision path
    assert extra and all(".vision_tower." in n or ".multi_modal_projector." in n for n in extra)
    assert any(n.startswith(vision) for n in extra)
    # the encoder gets its embeddings in bf16 (openpi's cast), and the chunk is close to LeRobot's
    seen = []
    encoder = openpi.policy.model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder
    encoder.layers[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    batch = fake_batch(2)
    noise = frame_noise([(0, 0), (0, 1)], seed=0, chunk_size=10, max_action_dim=32)
    ours, theirs = openpi.predict(batch, noise), lerobot.predict(batch, noise)
    assert seen and set(seen) == {torch.bfloat16}
    assert torch.isfinite(ours).all() and 0 < (ours - theirs).abs().max() < 0.05
    assert openpi.describe()["precision"]["layout"] == "openpi"
