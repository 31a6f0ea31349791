"""pisft.model.policy / weights / stats: build, save, strict load, processors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from model_fixtures import fake_batch, fake_stats, tiny_model_dir
from pisft.errors import ModelLoadError
from pisft.model import weights
from pisft.model.pi05.construction import vlm_embeddings_tied
from pisft.model.policy import (LIBERO_FEATURES, build_policy, load_policy, make_processors,
                                read_model_info, save_model)
from pisft.model.norm_stats import STATS_FILE, import_openpi_norm_stats, load_stats, save_stats, stats_equal

LM_HEAD = "model.paligemma_with_expert.paligemma.lm_head.weight"
EMBED = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture()
def scratch_dir(tmp_path_factory, tmp_path):
    return tiny_model_dir(tmp_path_factory, tmp_path / "m")


def _equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_libero_features():
    assert set(LIBERO_FEATURES) == {"observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb",
                                    "observation.state", "action"}
    assert LIBERO_FEATURES["observation.state"].shape == (8,)
    assert LIBERO_FEATURES["action"].shape == (7,)


def test_tiny_build_is_deterministic_per_seed():
    a, b, c = (build_policy("tiny", seed=s) for s in (3, 3, 4))
    assert _equal(a, b)
    assert not _equal(a, c)
    # the built config carries every field the preset sets
    from pisft.model.pi05.presets import PRESETS

    assert {k: getattr(a.config, k) for k in PRESETS["tiny"].config} == PRESETS["tiny"].config


def test_save_load_roundtrip_is_exact_and_keeps_the_tie(model_dir):
    original = build_policy("tiny", seed=0)
    loaded = load_policy(model_dir)
    assert _equal(original, loaded)
    assert vlm_embeddings_tied(loaded)
    stored = load_file(str(model_dir / "model.safetensors"))
    # the tied pair is stored once, under lm_head's name (openpi / lerobot/pi05_base layout)
    assert LM_HEAD in stored and EMBED not in stored
    # non-persistent buffers (rotary frequencies, position ids) are rebuilt, not left uninitialised
    from pisft.introspect.estimate import _dummy_inputs

    inputs = list(_dummy_inputs(original.config, 2, "cpu"))
    inputs[5] = torch.randn_like(inputs[5], generator=torch.Generator().manual_seed(0))
    original.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(original.model.forward(*inputs), loaded.model.forward(*inputs))
    assert read_model_info(model_dir)["preset"] == "tiny"
    assert stats_equal(load_stats(model_dir / STATS_FILE), fake_stats())


def test_load_into_bfloat16_keeps_lerobots_fp32_parts(model_dir):
    policy = load_policy(model_dir, dtype="bfloat16")
    dtypes = {n: p.dtype for n, p in policy.named_parameters()}
    pwe = "model.paligemma_with_expert"
    assert dtypes[f"{pwe}.gemma_expert.model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes[f"{pwe}.paligemma.model.vision_tower.vision_model.post_layernorm.weight"] == torch.float32


def _rewrite(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_strict_load_rejects_a_missing_tensor(scratch_dir):
    name = "model.time_mlp_out.bias"
    _rewrite(scratch_dir, lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match="missing from the file \\(1\\)") as err:
        load_policy(scratch_dir)
    assert name in str(err.value)


def test_a_file_without_the_unused_expert_lm_head_loads(scratch_dir):
    """lerobot/pi05_base may lack gemma_expert.lm_head (never used): that alone is accepted."""
    from pisft.model.pi05.parts import EXPERT_HEAD

    _rewrite(scratch_dir, lambda t: t.pop(EXPERT_HEAD))
    policy = load_policy(scratch_dir)
    assert torch.count_nonzero(dict(policy.named_parameters())[EXPERT_HEAD]) == 0
    # every tensor the forward uses is still checked strictly
    _rewrite(scratch_dir, lambda t: t.pop("model.action_out_proj.weight"))
    with pytest.raises(ModelLoadError, match="missing from the file \\(1\\)"):
        load_policy(scratch_dir)


def test_strict_load_rejects_an_extra_tensor(scratch_dir):
    _rewrite(scratch_dir, lambda t: t.__setitem__("model.extra_head.weight", torch.zeros(3)))
    with pytest.raises(ModelLoadError, match="in the file but not in the model \\(1\\)") as err:
        load_policy(scratch_dir)
    assert "model.extra_head.weight" in str(err.value)


def test_strict_load_rejects_a_wrong_shape(scratch_dir):
    name = "model.action_out_proj.weight"
    _rewrite(scratch_dir, lambda t: t.__setitem__(name, torch.zeros(32, 7)))
    with pytest.raises(ModelLoadError, match="wrong shape") as err:
        load_policy(scratch_dir)
    assert f"{name}: file [32, 7]" in str(err.value)


def test_strict_load_rejects_a_pi0_checkpoint(scratch_dir):
    def to_pi0(t):
        # pi0: state_proj, action_time_mlp_* (2*width inputs) and plain RMSNorm weights on the expert
        width = t["model.time_mlp_in.weight"].shape[0]
        t["model.state_proj.weight"] = torch.zeros(width, 32)
        t["model.state_proj.bias"] = torch.zeros(width)
        t["model.action_time_mlp_in.weight"] = torch.zeros(width, 2 * width)
        t["model.action_time_mlp_in.bias"] = t.pop("model.time_mlp_in.bias")
        t["model.action_time_mlp_out.weight"] = t.pop("model.time_mlp_out.weight")
        t["model.action_time_mlp_out.bias"] = t.pop("model.time_mlp_out.bias")
        del t["model.time_mlp_in.weight"]
        for key in [k for k in t if ".gemma_expert.model." in k and "layernorm.dense" in k]:
            del t[key]
    _rewrite(scratch_dir, to_pi0)
    with pytest.raises(ModelLoadError) as err:
        load_policy(scratch_dir)
    text = str(err.value)
    assert "pi0 checkpoint" in text and "model.time_mlp_in.weight" in text
    assert "input_layernorm.dense.weight" in text and "model.state_proj.weight" in text


def test_a_pi0_config_is_refused(scratch_dir):
    config = json.loads((scratch_dir / "config.json").read_text())
    config["type"] = "pi0"
    (scratch_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="pi0 model, not pi0.5"):
        load_policy(scratch_dir)


def test_long_name_lists_are_truncated():
    missing = [f"model.layer{i}.weight" for i in range(40)]
    with pytest.raises(ModelLoadError) as err:
        weights.raise_if_not_strict("x", missing, [], [])
    assert "missing from the file (40)" in str(err.value) and "and 28 more" in str(err.value)


def test_tied_pair_loads_from_either_name_and_the_used_one_wins(scratch_dir):
    reference = load_policy(scratch_dir)
    # 1) only embed_tokens in the file
    _rewrite(scratch_dir, lambda t: t.__setitem__(EMBED, t.pop(LM_HEAD)))
    assert _equal(load_policy(scratch_dir), reference)
    # 2) both, different: embed_tokens (read by the forward pass) wins, the conflict is reported
    _rewrite(scratch_dir, lambda t: t.__setitem__(LM_HEAD, torch.zeros_like(t[EMBED])))
    fresh = build_policy("tiny", seed=1)
    report = weights.load_strict(fresh, scratch_dir / "model.safetensors")
    assert torch.equal(fresh.state_dict()[EMBED], reference.state_dict()[EMBED])
    assert report["tied_conflicts"] and LM_HEAD in report["tied_conflicts"][0]


def test_unprefixed_openpi_names_load(scratch_dir):
    reference = load_policy(scratch_dir)
    _rewrite(scratch_dir, lambda t: [t.__setitem__(k[len("model."):], t.pop(k)) for k in list(t)])
    assert _equal(load_policy(scratch_dir), reference)


def test_corrupt_weights_file_is_a_clear_error(scratch_dir):
    path = scratch_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[: 1000])
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_policy(scratch_dir)


def test_preset_mismatch_is_refused(model_dir):
    with pytest.raises(ModelLoadError, match="model.preset is 'pi05'"):
        load_policy(model_dir, preset="pi05")


def test_save_model_from_a_full_state_dict(tmp_path, model_dir):
    policy = build_policy("tiny", seed=0)
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    state[EMBED] = state[EMBED] + 1.0  # a "trained" embedding; lm_head left stale
    state[LM_HEAD] = torch.zeros_like(state[LM_HEAD])
    out = tmp_path / "export"
    out.mkdir()
    save_model(policy, out, tokenizer_dir=model_dir / "tokenizer", dataset_stats=fake_stats(), state_dict=state)
    loaded = load_policy(out)
    assert torch.equal(loaded.state_dict()[EMBED], state[EMBED])
    assert (out / "tokenizer" / "tokenizer.json").is_file()


def test_processors_feed_forward_and_predict(model_dir):
    policy = load_policy(model_dir)
    pre, post = make_processors(policy, model_dir, fake_stats())
    raw = fake_batch(batch_size=4, chunk=policy.config.chunk_size)
    batch = pre(dict(raw))
    tokens = batch["observation.language.tokens"]
    assert tokens.shape == (4, policy.config.tokenizer_max_length)
    assert batch["observation.language.attention_mask"].sum(1).max() < policy.config.tokenizer_max_length
    embed = policy.model.paligemma_with_expert.paligemma.model.language_model.embed_tokens
    assert int(tokens.max()) < embed.num_embeddings
    # quantile normalisation: state q01/q99 = -2/2 -> x / 2; action -1/1 -> unchanged
    assert torch.allclose(batch["observation.state"], raw["observation.state"] / 2, atol=1e-6)
    assert torch.allclose(batch["action"], raw["action"], atol=1e-6)
    policy.train()
    loss, info = policy(batch)
    assert loss.ndim == 0 and math.isfinite(loss.item())
    loss.backward()
    # Every parameter gets a gradient except those that cannot reach the action loss: the VLM's
    # last layer after its keys and values (the action expert reads only those), the VLM's final
    # norm, the action expert's (unused) LM head.
    vlm = "model.paligemma_with_expert.paligemma.model.language_model"
    last = f"{vlm}.layers.{len(policy.model.paligemma_with_expert.paligemma.model.language_model.layers) - 1}"
    no_grad = {n for n, p in policy.named_parameters() if p.grad is None}
    assert no_grad == {f"{last}.self_attn.o_proj.weight", f"{last}.mlp.gate_proj.weight",
                       f"{last}.mlp.up_proj.weight", f"{last}.mlp.down_proj.weight",
                       f"{last}.post_attention_layernorm.weight", f"{vlm}.norm.weight",
                       "model.paligemma_with_expert.gemma_expert.lm_head.weight"}, sorted(no_grad)
    grads = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    assert all(torch.isfinite(g).all() for g in grads.values())
    # the loss reaches the action head, the expert, the VLM's first layer and the vision tower
    for name in ("model.action_out_proj.weight",
                 "model.paligemma_with_expert.gemma_expert.model.layers.0.mlp.down_proj.weight",
                 f"{vlm}.layers.0.self_attn.k_proj.weight",
                 "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings.patch_embedding.weight"):
        assert grads[name].abs().sum() > 0, name
    chunk = policy.predict_action_chunk(batch)
    assert chunk.shape == (4, policy.config.chunk_size, 7)
    actions = post(chunk)
    assert actions.shape == (4, policy.config.chunk_size, 7) and torch.isfinite(actions).all()


def test_processors_use_stored_stats_and_need_some(scratch_dir):
    policy = load_policy(scratch_dir)
    make_processors(policy, scratch_dir)  # stats stored in the model directory
    (scratch_dir / STATS_FILE).unlink()
    with pytest.raises(ModelLoadError, match="no normalisation stats"):
        make_processors(policy, scratch_dir)
    bad = fake_stats()
    del bad["action"]["q99"]
    with pytest.raises(ModelLoadError, match="'action' has no 'q99'"):
        make_processors(policy, scratch_dir, bad)


def test_a_tokenizer_larger_than_the_embedding_is_refused(scratch_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(scratch_dir / "tokenizer"))
    tok.add_tokens([f"newtoken{i}" for i in range(5000)])
    tok.save_pretrained(str(scratch_dir / "tokenizer"))
    with pytest.raises(ModelLoadError, match="wrong tokenizer"):
        make_processors(load_policy(scratch_dir), scratch_dir, fake_stats())


def test_stats_roundtrip(tmp_path):
    save_stats(fake_stats(), tmp_path / "s.safetensors")
    assert stats_equal(load_stats(tmp_path / "s.safetensors"), fake_stats())


def _norm_stats_json(path, state_dims=8, action_dims=7, pad_to=None):
    def entry(n):
        q01 = [-1.0 - i for i in range(n)]
        q99 = [1.0 + i for i in range(n)]
        if pad_to:
            q01 += [0.0] * (pad_to - n)
            q99 += [0.0] * (pad_to - n)
        m = len(q01)
        return {"mean": [0.0] * m, "std": [1.0] * m, "q01": q01, "q99": q99}
    path.write_text(json.dumps({"norm_stats": {"state": entry(state_dims), "actions": entry(action_dims)}}))
    return path


def test_openpi_norm_stats_import(tmp_path):
    stats = import_openpi_norm_stats(_norm_stats_json(tmp_path / "a.json"))
    assert stats["observation.state"]["q01"].tolist() == [-1.0 - i for i in range(8)]
    assert stats["action"]["q99"].shape == (7,)
    padded = import_openpi_norm_stats(_norm_stats_json(tmp_path / "b.json", pad_to=32))
    assert stats_equal(padded, stats)


def test_openpi_norm_stats_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="are not padding"):
        import_openpi_norm_stats(_norm_stats_json(tmp_path / "a.json", state_dims=32))
    with pytest.raises(ModelLoadError, match="6 dims, the data has 7"):
        import_openpi_norm_stats(_norm_stats_json(tmp_path / "b.json", action_dims=6))
    raw = json.loads(_norm_stats_json(tmp_path / "c.json").read_text())
    del raw["norm_stats"]["actions"]["q99"]
    (tmp_path / "c.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="'actions' has no 'q99'"):
        import_openpi_norm_stats(tmp_path / "c.json")
    with pytest.raises(ModelLoadError, match="not found"):
        import_openpi_norm_stats(tmp_path / "missing.json")


def test_tiny_tokenizer_encodes_the_pi05_prompt_without_unknowns():
    from pisft.model.tokenizer import build_tiny_tokenizer

    from pisft.model.pi05.presets import PRESETS

    tok = build_tiny_tokenizer()
    prompt = ("Task: put the yellow and white mug in the microwave and close it Advantage: negative, "
              "State: 0 17 255 -1 128 64 3 200;\nAction: ")
    ids = tok(prompt)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    assert len(ids) < PRESETS["tiny"].config["tokenizer_max_length"]  # the prompt is not truncated
    assert tok.unk_token_id not in tok("Zebra-42 (odd) wörds!")["input_ids"]
    assert np.array_equal(tok(prompt)["input_ids"], build_tiny_tokenizer()(prompt)["input_ids"])


def test_saved_weights_follow_the_umask(tmp_path):
    import os
    import stat

    from pisft.model.weights import save_weights

    module = torch.nn.Linear(2, 2)
    old = os.umask(0o022)
    try:
        save_weights(module, tmp_path / "w.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "w.safetensors").stat().st_mode) == 0o644
