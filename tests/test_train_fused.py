"""The training model's fused projections (pisft.model.pi05 12.): each decoder layer's
q/k/v in one Linear and its gate/up in one, fused after loading, split again on export.

The fused model computes the separate products' rows: the same loss, and gradients whose rows are
the separate parameters' gradients; a LoRA-adapted projection stays separate; the export is the
plain LeRobot file, tensor for tensor what the unfused model holds."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file
from train_fixtures import inputs_dir

from pisft.introspect.synthetic import build_random_policy, synthetic_batch
from pisft.model.pi05.construction import prepare_for_training
from pisft.model.pi05.fused import decoder_layers, fuse_decoder_projections, split_rows
from pisft.train import trainable
from pisft.model.pi05.attention import fused_joint_attention
from pisft.train.policy_task import PolicyTask

CPU = torch.device("cpu")


def _loss_and_grads(policy, batch, rand):
    policy.train()
    with fused_joint_attention():
        loss = PolicyTask(policy, None, CPU).loss(policy, batch, rand)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _split_grads(policy, grads):
    """The fused parameters' gradients as LeRobot's separate parameters' (their rows)."""
    modules = dict(policy.named_modules())
    out = {}
    for name, g in grads.items():
        parts = split_rows(lambda n: modules[n.rsplit(".", 1)[0]], name)
        if parts is None:
            out[name] = g
        else:
            out.update({plain: g[start:end] for plain, start, end in parts})
    return out


@pytest.mark.parametrize("mode", ["all", "expert", "lora"])
def test_the_fused_model_has_the_separate_ones_loss_and_gradients(mode):
    plain = build_random_policy("tiny", CPU, checkpointing=True, seed=0)
    for p in plain.parameters():  # LeRobot starts the adaRMS projections at zero: give them a value
        if p.dim() and not p.abs().sum():
            torch.nn.init.normal_(p, std=0.05)
    trainable.apply_mode(plain, mode, trainable.spec_for_mode(mode, "openpi"), seed=0)
    fused = copy.deepcopy(plain)
    count = fuse_decoder_projections(fused)
    layers = len(decoder_layers(fused))
    # lora (openpi's targets): every q/k/v and gate/up carries an adapter: nothing fuses
    assert count == (0 if mode == "lora" else 2 * layers)
    names = {n for n, _ in fused.named_parameters()}
    if mode != "lora":
        assert not any(".q_proj." in n or ".gate_proj." in n for n in names if ".language_model." in n)
        assert any(".self_attn.qkv_proj.weight" in n for n in names)
    batch, rand = synthetic_batch(plain, 3, CPU, seed=2)
    loss0, grads0 = _loss_and_grads(plain, batch, rand)
    loss1, grads1 = _loss_and_grads(fused, batch, rand)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    grads1 = _split_grads(fused, grads1)
    assert set(grads1) == set(grads0)
    for name, g in grads0.items():
        torch.testing.assert_close(grads1[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_a_frozen_group_fuses_frozen_and_a_mixed_one_stays_separate():
    policy = build_random_policy("tiny", CPU, checkpointing=False, seed=0)
    trainable.apply_mode(policy, "expert", None)
    layer = decoder_layers(policy)[0]  # a VLM layer: frozen in expert mode
    layer.mlp.up_proj.weight.requires_grad_(True)  # gate frozen, up trained: not one parameter
    fuse_decoder_projections(policy)
    assert not layer.self_attn.qkv_proj.weight.requires_grad
    assert hasattr(layer.mlp, "gate_proj") and hasattr(layer.mlp, "up_proj")


def test_the_export_of_a_fused_model_is_the_plain_lerobot_file(tmp_path_factory, tmp_path, one_process_group):
    from pisft.model.policy import load_policy
    from pisft.model.weights import lerobot_name
    from pisft.train import export_weights

    base = inputs_dir(tmp_path_factory) / "base_model"
    policy = load_policy(base, dtype="float32")
    prepare_for_training(policy, checkpointing=False)
    trainable.apply_mode(policy, "all", None)
    with torch.no_grad():  # trained away from the base: every exported tensor is the model's
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    expected = {lerobot_name(n): t.clone() for n, t in policy.state_dict().items()}
    fuse_decoder_projections(policy)
    out = tmp_path / "model.safetensors"
    export_weights.write_policy_weights(policy, base / "model.safetensors", out, is_main=True)
    written = load_file(out)
    fused_names = [n for n in written if "qkv_proj" in n or "gate_up_proj" in n]
    assert fused_names == []
    for name, tensor in written.items():
        if name in expected:
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    assert {n for n in expected if ".q_proj." in n or ".up_proj." in n} <= set(written)
