"""Classifier-free guidance (`eval.cfg_scale`, `serve --cfg-scale`; pisft.model.guidance) with
the real tiny pi0.5: w = 1 is today's sampler bit for bit, w > 1 is RLinf's velocity blend
computed here by hand, a plain model ignores w, the server reports and applies it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_fixtures import tiny_model_dir
from test_serve_openpi_client import SERVE_STATS, libero_request, served
from pisft.data import prompts
from pisft.data.libero import advantage_prompt
from pisft.errors import PisftError
from pisft.model import guidance
from pisft.serve import protocol
from pisft.policy.libero import UNCONDITIONED_KEY, LiberoPolicy

RLINF = prompts.PromptConditioning("demo", positive_only_conditional=True, unconditional_prob=0.1)
TASKS = ["put the bowl on the plate", "turn on the stove"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """The shared tiny pi0.5 with SERVE_STATS, once as trained on advantage prompts, once plain."""
    from pisft.model.norm_stats import STATS_FILE, save_stats

    out = {}
    for name in ("conditioned", "plain"):
        model = tiny_model_dir(tmp_path_factory, tmp_path_factory.mktemp(f"guidance_{name}") / "model")
        save_stats(SERVE_STATS, model / STATS_FILE)
        if name == "conditioned":
            RLINF.write(model / prompts.CONDITIONING_FILE)
        out[name] = model
    return out


@pytest.fixture(scope="module")
def predictor(models):
    from pisft.policy.predictor import ChunkPredictor

    return ChunkPredictor.load(models["conditioned"])


def raw_batch(n: int = 2, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = {k: torch.rand(n, 3, 32, 32, generator=g)
             for k in ("observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb")}
    batch["observation.state"] = torch.rand(n, 8, generator=g) * 2 - 1
    batch["task"] = [advantage_prompt(t, True) for t in TASKS[:n]]
    return batch


def noise_for(p, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn((n, p.chunk_size, p.max_action_dim), generator=torch.Generator().manual_seed(seed))


def todays_chunk(p, batch: dict, noise: torch.Tensor) -> torch.Tensor:
    """The path every caller took before guidance existed: preprocess, LeRobot's sampler, unnormalise."""
    return p.postprocessor(p.policy.predict_action_chunk(p.preprocessor(dict(batch)), noise=noise))


def hand_guided_chunk(p, batch: dict, plain: list[str], noise: torch.Tensor, w: float) -> torch.Tensor:
    """RLinf's guided sampler written out with the model's pieces: each prompt gets its own prefix
    pass and KV cache; every Euler step takes two separate velocity calls on the same x_t and t."""
    from lerobot.policies.common.vla_utils import make_att_2d_masks, prepare_attention_masks_4d
    from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

    policy, model = p.policy, p.policy.model
    # LeRobot's sample_actions switches both Gemmas to eager attention (a guided or plain
    # predict has run before this helper in every test that calls it)
    prefixes = []
    for tasks in (batch["task"], plain):
        processed = p.preprocessor({**batch, "task": list(tasks)})
        images, img_masks = policy._preprocess_images(processed)
        embs, pad, att = model.embed_prefix(images, img_masks, processed[OBS_LANGUAGE_TOKENS],
                                            processed[OBS_LANGUAGE_ATTENTION_MASK])
        _, cache = model.paligemma_with_expert.forward(
            attention_mask=prepare_attention_masks_4d(make_att_2d_masks(pad, att)),
            position_ids=torch.cumsum(pad, dim=1) - 1, past_key_values=None,
            inputs_embeds=[embs, None], use_cache=True)
        prefixes.append((pad, cache))
    steps = policy.config.num_inference_steps
    x = noise.clone()
    for k in range(steps):
        t = torch.full((x.shape[0],), 1.0 - k / steps, dtype=torch.float32)
        v_cond, v_uncond = (model.denoise_step(pad, cache, x, t) for pad, cache in prefixes)
        x = x + (-1.0 / steps) * ((1 - w) * v_uncond + w * v_cond)
    return p.postprocessor(x[:, :, :p.action_dim])


def test_scale_one_is_todays_sampler_bit_for_bit(predictor):
    batch, noise = raw_batch(), noise_for(predictor, 2)
    expected = todays_chunk(predictor, batch, noise)
    np.testing.assert_array_equal(predictor.predict(batch, noise), expected)
    np.testing.assert_array_equal(predictor.predict(batch, noise, cfg_scale=1.0, unconditioned_tasks=TASKS),
                                  expected)
    assert "denoise_step" not in vars(predictor.policy.model)  # LeRobot's own step, never hooked


def test_guided_chunk_is_rlinfs_velocity_blend_computed_by_hand(predictor):
    """w = 4 against two separately prompted denoisings blended at every step, row by row
    (two requests with different tasks); the guided chunk moves far more than the tolerance."""
    batch, noise, w = raw_batch(), noise_for(predictor, 2), 4.0
    guided = predictor.predict(batch, noise, cfg_scale=w, unconditioned_tasks=TASKS)
    with torch.no_grad():
        by_hand = hand_guided_chunk(predictor, batch, TASKS, noise, w)
    np.testing.assert_allclose(guided.numpy(), by_hand.numpy(), rtol=0, atol=1e-5)
    # the tolerance tells the blend from what it is not: no guidance, or the branches swapped
    unguided = todays_chunk(predictor, batch, noise)
    swapped = predictor.predict({**batch, "task": TASKS}, noise, cfg_scale=w, unconditioned_tasks=batch["task"])
    assert (guided - unguided).abs().max() > 1e-3 and (guided - swapped).abs().max() > 1e-3
    assert "denoise_step" not in vars(predictor.policy.model)  # the hook is gone afterwards


def test_guidance_is_one_doubled_forward_per_step_and_none_at_scale_one(predictor):
    """Rows entering the action head at each denoising step: 1 per request at w = 1, 2 at w > 1."""
    rows: list[int] = []
    hook = predictor.policy.model.action_out_proj.register_forward_hook(
        lambda _m, inputs, _o: rows.append(inputs[0].shape[0]))
    try:
        batch, noise = raw_batch(1), noise_for(predictor, 1)
        predictor.predict(batch, noise)
        plain_rows, rows[:] = list(rows), []
        predictor.predict(batch, noise, cfg_scale=2.5, unconditioned_tasks=TASKS[:1])
    finally:
        hook.remove()
    steps = predictor.policy.config.num_inference_steps
    assert plain_rows == [1] * steps and rows == [2] * steps


def test_a_failed_guided_inference_leaves_the_model_unhooked(predictor):
    # noise of the wrong width fails inside the hooked sampler (the action expert's input layer)
    bad_noise = torch.zeros(1, predictor.chunk_size, predictor.max_action_dim - 1)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        predictor.predict(raw_batch(1), bad_noise, cfg_scale=2.0, unconditioned_tasks=TASKS[:1])
    assert "denoise_step" not in vars(predictor.policy.model)
    with pytest.raises(ValueError, match="unconditioned prompts"):
        predictor.predict(raw_batch(1), noise_for(predictor, 1), cfg_scale=2.0)


def test_libero_policy_guides_a_conditioned_model_and_records_the_scale(models):
    one = LiberoPolicy.from_model_dir(models["conditioned"], device="cpu", seed=3)
    two = LiberoPolicy.from_model_dir(models["conditioned"], device="cpu", seed=3, cfg_scale=2.0)
    assert one.metadata["cfg_scale"] == 1.0 and not one.metadata["guidance"]["guided"]
    assert two.metadata["cfg_scale"] == 2.0 and two.metadata["guidance"]["guided"]
    assert "openpi_cfg_action_model.py" in two.metadata["guidance"]["source"]
    request = libero_request()
    prepared = two.prepare(request)
    # the conditioned branch gets RLinf's positive prompt, the unconditioned one the task as sent
    assert prepared["task"] == [advantage_prompt(request["prompt"], True)]
    assert prepared.pop(UNCONDITIONED_KEY) == [request["prompt"]]
    assert UNCONDITIONED_KEY not in one.prepare(request)  # w = 1: the request as before
    p = two.predictor
    draw = torch.randn((1, p.chunk_size, p.max_action_dim), generator=two.new_noise(3))
    expected = p.predict(prepared, draw, cfg_scale=2.0, unconditioned_tasks=[request["prompt"]])
    np.testing.assert_array_equal(two.infer(request)["actions"], expected[0].numpy())
    assert not np.allclose(one.infer(request)["actions"], expected[0].numpy(), atol=1e-4)


def test_a_plain_model_ignores_the_scale_and_says_so(models):
    plain = LiberoPolicy.from_model_dir(models["plain"], device="cpu", seed=3, cfg_scale=3.0)
    reference = LiberoPolicy.from_model_dir(models["plain"], device="cpu", seed=3)
    request = libero_request()
    np.testing.assert_array_equal(plain.infer(request)["actions"], reference.infer(request)["actions"])
    record = plain.metadata["guidance"]
    assert plain.cfg_scale == plain.metadata["cfg_scale"] == 1.0 and record["cfg_scale_requested"] == 3.0
    assert not record["guided"] and "cfg_scale 3 ignored" in record["note"]
    assert reference.metadata["guidance"]["note"] is None  # nothing to say when nothing was asked


@pytest.mark.parametrize("bad", [0.5, 0.0, -1.0, float("nan"), float("inf"), "x"])
def test_a_scale_below_one_or_not_finite_is_refused(models, bad):
    with pytest.raises(PisftError, match="cfg_scale: the guidance scale must be"):
        LiberoPolicy.from_model_dir(models["conditioned"], device="cpu", cfg_scale=bad)


def test_the_server_reports_the_scale_and_serves_guided_actions(models):
    from websockets.sync.client import connect

    policy = LiberoPolicy.from_model_dir(models["conditioned"], device="cpu", seed=3, cfg_scale=2.0)
    request = libero_request()
    policy.reset(3)
    expected = policy.infer(request)["actions"]
    unguided = LiberoPolicy.from_model_dir(models["conditioned"], device="cpu", seed=3).infer(request)["actions"]
    assert not np.allclose(expected, unguided, atol=1e-4)
    with served(policy) as url, connect(url, compression=None, max_size=None) as ws:
        meta = protocol.unpackb(ws.recv())
        assert meta["cfg_scale"] == 2.0 and meta["guidance"]["guided"]
        ws.send(protocol.packb(request))
        reply = protocol.unpackb(ws.recv(timeout=300))
    np.testing.assert_array_equal(reply["actions"], expected)


def test_serve_takes_cfg_scale_and_refuses_a_bad_one(capsys):
    from pisft.serve import server

    assert server.build_parser().parse_args(["--model", "m"]).cfg_scale == 1.0
    assert server.build_parser().parse_args(["--model", "m", "--cfg-scale", "1.5"]).cfg_scale == 1.5
    with pytest.raises(SystemExit) as err:
        server.build_parser().parse_args(["--model", "m", "--cfg-scale", "0.5"])
    assert err.value.code == 2
    assert "--cfg-scale: the guidance scale must be a finite number >= 1" in capsys.readouterr().err


def test_records_say_what_was_applied():
    plain = prompts.PLAIN_PROMPTS
    assert guidance.record(1.0, RLINF)["describe"].startswith("guidance scale 1: the positive prompt alone")
    assert guidance.record(2.0, RLINF)["cfg_scale"] == 2.0
    assert guidance.record(2.0, plain)["cfg_scale"] == 1.0
    assert guidance.note(1.0, plain) is None and guidance.note(2.0, RLINF) is None
