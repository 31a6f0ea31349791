"""FSDP units of pi0.5 are modules LeRobot invokes through __call__; analytic FLOPs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate
from torch.utils.flop_counter import FlopCounterMode
from train_fixtures import inputs_dir

from pisft.train import fsdp
from pisft.train.flops import pi05_forward_flops
from pisft.train.policy_task import PolicyTask


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pisft.data.dataset import load_split, load_stats
    from pisft.model.policy import load_policy, make_processors

    root = inputs_dir(tmp_path_factory)
    policy = load_policy(root / "base_model", dtype="float32")
    pre, _ = make_processors(policy, root / "base_model", load_stats(root / "dataset"))
    ds = load_split(root / "dataset", "train", chunk_size=policy.config.chunk_size)
    batch = pre(default_collate([ds[i] for i in range(2)]))
    return policy, batch


def _decoder_layers(policy):
    pwe = policy.model.paligemma_with_expert
    return list(pwe.paligemma.model.language_model.layers) + list(pwe.gemma_expert.model.layers)


def test_every_unit_is_invoked_through_call(tiny):
    policy, batch = tiny
    units = fsdp.choose_units(policy)
    called: set[str] = set()
    layer_calls: list[int] = []
    hooks = [u.module.register_forward_pre_hook(lambda m, a, name=u.name: called.add(name))
             for u in units]
    hooks += [layer.register_forward_pre_hook(lambda m, a: layer_calls.append(1))
              for layer in _decoder_layers(policy)]
    try:
        with torch.no_grad():
            policy(batch)
    finally:
        for h in hooks:
            h.remove()
    assert called == {u.name for u in units}, sorted({u.name for u in units} - called)
    # LeRobot calls the decoder layers' parts, never the layers: a unit there would never gather.
    assert layer_calls == []


def test_units_cover_vision_vlm_and_expert(tiny):
    policy, _ = tiny
    units = fsdp.choose_units(policy)
    groups = {u.group for u in units}
    assert {"vision", "vlm", "expert", "action"} <= groups
    n_layers = len(policy.model.paligemma_with_expert.gemma_expert.model.layers)
    expert = [u for u in units if u.group == "expert"]
    assert len(expert) >= 5 * n_layers  # q, k, v, o, mlp (+ adaptive norms) per layer
    vision_layers = policy.model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder.layers
    assert sum(1 for u in units if ".encoder.layers." in u.name) == len(vision_layers)
    in_units = {id(p) for u in units for p in u.module.parameters()}
    trained_linear = [m for layer in _decoder_layers(policy) for m in layer.modules()
                      if isinstance(m, torch.nn.Linear)]
    assert all(id(m.weight) in in_units for m in trained_linear)


def test_analytic_flops_match_a_flop_counter(tiny):
    policy, batch = tiny
    task = PolicyTask(policy, lambda b: b, torch.device("cpu"))
    b = policy.config.chunk_size
    rand = {"noise": torch.randn(2, b, policy.config.max_action_dim), "time": torch.rand(2) * 0.9 + 0.05}
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        task.loss(policy, batch, rand)
    measured = counter.get_total_flops() / 2  # per sample
    analytic = pi05_forward_flops(policy, lang_tokens=batch["observation.language.tokens"].shape[1])
    assert analytic == pytest.approx(measured, rel=0.15)


def test_sdpa_joint_attention_matches_eager(tiny, monkeypatch):
    from unittest import mock

    from pisft.train import attention
    from pisft.train.attention import sdpa_joint_attention, structure_problem

    spy = mock.Mock(wraps=attention.sdpa_attention_forward)
    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)

    assert structure_problem() is None
    policy, batch = tiny
    task = PolicyTask(policy, lambda b: b, torch.device("cpu"))
    b = policy.config.chunk_size
    g = torch.Generator().manual_seed(1)
    rand = {"noise": torch.randn(2, b, policy.config.max_action_dim, generator=g),
            "time": torch.rand(2, generator=g) * 0.9 + 0.05}
    policy.zero_grad()
    eager = task.loss(policy, batch, rand)
    eager.backward()
    eager_grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad()
    with sdpa_joint_attention():
        sdpa = task.loss(policy, batch, rand)
        sdpa.backward()
    n_layers = len(policy.model.paligemma_with_expert.gemma_expert.model.layers)
    assert spy.call_count == n_layers  # the joint attention of every layer went through SDPA
    assert sdpa.item() == pytest.approx(eager.item(), rel=1e-5)
    for n, p in policy.named_parameters():
        if n in eager_grads:
            torch.testing.assert_close(p.grad, eager_grads[n], rtol=1e-4, atol=1e-6)
    policy.zero_grad()
