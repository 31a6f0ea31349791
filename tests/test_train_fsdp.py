"""FSDP units of pi0.5 are modules LeRobot invokes through __call__; analytic FLOPs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import default_collate
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count
from train_fixtures import inputs_dir

from pisft.train import fsdp
from pisft.model.pi05.flops import (
    _walk_training_step,
    pi05_forward_flops,
    pi05_inference_flops,
    pi05_training_flops_per_sample,
)
from pisft.train.policy_task import PolicyTask
from pisft.model.pi05.units import VISION_LAYERS_PER_UNIT


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


@pytest.mark.parametrize("frozen", [False, True], ids=["joint", "frozen_prefix"])
def test_every_unit_is_gathered_by_a_call_fsdp_sees(tiny, frozen, monkeypatch):
    """FSDP2 gathers a unit on a call of one of its modules (or of a registered forward method)
    and frees it after the last: in the training forward every unit's modules are called, or its
    blocks run through `run_block` on their anchors (the runner is the unit's forward method)."""
    from pisft.model.pi05 import forward as pi05_forward
    from pisft.train.policy_task import injected_flow_samples

    policy, batch = tiny
    if frozen:  # train.trainable: expert
        policy = copy.deepcopy(policy)
        policy.model.paligemma_with_expert.paligemma.requires_grad_(False)
    units = fsdp.choose_units(policy)
    called: set[int] = set()
    blocks: list[int] = []
    layer_calls: list[int] = []
    real_run_block = pi05_forward.run_block

    def run_block(anchor, fn, *args, **kwargs):
        blocks.append(id(anchor))
        return real_run_block(anchor, fn, *args, **kwargs)

    monkeypatch.setattr(pi05_forward, "run_block", run_block)
    modules = [m for u in units if not u.anchors for m in u.modules]
    hooks = [m.register_forward_pre_hook(lambda mod, a: called.add(id(mod))) for m in modules]
    hooks += [layer.register_forward_pre_hook(lambda m, a: layer_calls.append(1))
              for layer in _decoder_layers(policy)]
    b = policy.config.chunk_size
    rand = {"noise": torch.randn(2, b, policy.config.max_action_dim), "time": torch.rand(2) * 0.9 + 0.05}
    try:
        with torch.no_grad(), injected_flow_samples(policy.model, rand["noise"], rand["time"]), \
                pi05_forward.sync_free_forward(policy):
            policy(batch)
    finally:
        for h in hooks:
            h.remove()
    never = [u.name for u in units for m in u.modules if not u.anchors and id(m) not in called]
    never += [u.name for u in units for a in u.anchors if id(a) not in blocks]
    assert never == []
    assert sum(len(u.anchors) for u in units) == len(blocks) == len(set(blocks))  # each block once
    assert {u.group for u in units if u.anchors} == ({"vlm_decoder", "decoder"} if frozen else {"decoder"})
    # nothing calls a decoder layer as a module: its unit's hooks there would never fire
    assert layer_calls == []


def test_one_unit_per_decoder_layer_pair_and_per_three_vision_layers(tiny):
    policy, _ = tiny
    units = fsdp.choose_units(policy)
    pwe = policy.model.paligemma_with_expert
    vlm_layers = pwe.paligemma.model.language_model.layers
    expert_layers = pwe.gemma_expert.model.layers
    vision_layers = pwe.paligemma.model.vision_tower.vision_model.encoder.layers
    decoder = [u for u in units if u.group == "decoder"]
    assert len(decoder) == len(vlm_layers)
    for unit, vlm, expert in zip(decoder, vlm_layers, expert_layers, strict=True):
        assert {id(p) for p in unit.parameters()} == {id(p) for p in [*vlm.parameters(), *expert.parameters()]}
        assert unit.reshard_after_forward
    vision = [u for u in units if u.group == "vision"]
    encoder = [u for u in vision if ".encoder.layers." in u.name]
    per_unit = VISION_LAYERS_PER_UNIT
    assert len(encoder) == -(-len(vision_layers) // per_unit)
    assert [m for u in encoder for m in u.modules] == list(vision_layers)  # in order, each once
    assert [m for u in encoder for m in u.compiled_modules] == list(vision_layers)
    assert not any(u.reshard_after_forward for u in vision)  # two cameras, one gather
    # The bound: decoder layer pairs + vision layers + 4.
    assert len(units) <= len(vlm_layers) + len(vision_layers) + 4
    in_units = {id(p) for u in units for p in u.parameters()}
    root = [n for n, p in policy.named_parameters() if id(p) not in in_units]
    assert all(n.endswith(("norm.weight", "norm.dense.weight", "norm.dense.bias", "embed_tokens.weight",
                           "lm_head.weight")) for n in root), root


def test_small_units_merge_within_their_group_in_forward_order(tiny):
    policy, _ = tiny
    layers = fsdp.choose_units(policy)
    sizes = {u.name: u.numel() for u in layers}
    vision = [u for u in layers if u.group == "vision"]
    smallest = vision[1].numel()  # the encoder layers' unit (the tiny model's two): the embeddings are smaller
    merged = fsdp.choose_units(policy, smallest)
    assert [(u.group, u.reshard_after_forward) for u in merged] == [
        ("vision", False), ("decoder", True), ("decoder", True)]
    # the embeddings took the encoder layers along; the projector, a remainder, joined them; the
    # action projections (41k parameters, a group of their own) went to the root
    assert merged[0].name.startswith(f"{vision[0].name}..{vision[1].name}") and merged[0].name.endswith(vision[-1].name)
    assert list(merged[0].compiled_modules) == list(vision[1].compiled_modules)  # the layers still compile
    assert [u.name for u in merged[1:]] == ["decoder_pair.0", "decoder_pair.1"]
    assert all(u.numel() >= smallest for u in merged)
    assert sum(u.numel() for u in merged) == sum(sizes.values()) - sizes["model.action_time_projections"]
    modules = [m for u in merged for m in u.modules]
    assert modules == [m for u in layers if u.group != "action" for m in u.modules]
    # the CPU's floor leaves the tiny model to the root unit alone; accelerators keep the layers
    assert fsdp.choose_units(policy, fsdp.min_unit_params("cpu")) == []
    assert fsdp.min_unit_params("npu") == fsdp.min_unit_params("cuda") == 0


def _cpu_sdpa_flops(query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query, key, value)


# torch 2.11's FLOP counter has no formula for the CPU's fused attention kernel (SigLIP's attention
# runs it here): the one it uses for the other SDPA kernels, so that the counter sees every product
CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}


def _t_prefix(policy, lang: int) -> int:
    vision = policy.model.paligemma_with_expert.paligemma.model.vision_tower.config
    return len(policy.config.image_features) * (vision.image_size // vision.patch_size) ** 2 + lang


def _rope_flops(policy, positions: int) -> int:
    """One call of Gemma's rotary embedding: the product of its head_dim / 2 frequencies with the
    positions (a batched matmul)."""
    rope = policy.model.paligemma_with_expert.paligemma.model.language_model.rotary_emb
    return 2 * rope.inv_freq.numel() * positions


def _final_norm_flops(policy) -> int:
    dense = policy.model.paligemma_with_expert.gemma_expert.model.norm.dense
    return 2 * dense.in_features * dense.out_features


def test_analytic_flops_match_a_flop_counter(tiny):
    policy, batch = tiny
    task = PolicyTask(policy, lambda b: b, torch.device("cpu"))
    b = policy.config.chunk_size
    rand = {"noise": torch.randn(2, b, policy.config.max_action_dim), "time": torch.rand(2) * 0.9 + 0.05}
    counter = FlopCounterMode(display=False, custom_mapping=CPU_SDPA)
    with counter, torch.no_grad():
        task.loss(policy, batch, rand)
    measured = counter.get_total_flops() / 2  # per sample
    lang = batch["observation.language.tokens"].shape[1]
    analytic = pi05_forward_flops(policy, lang_tokens=lang)
    # to the FLOP, but for what the analytic count leaves out (pisft.model.pi05.flops): the expert's final
    # adaRMS norm (its conditioning vector) and RoPE's angles, which LeRobot's joint forward
    # computes twice over every position (prefix and chunk)
    t_all = _t_prefix(policy, lang) + policy.config.chunk_size
    assert measured - analytic == _final_norm_flops(policy) + 2 * _rope_flops(policy, t_all)


def test_analytic_inference_flops_match_a_flop_counter(tiny):
    """One action chunk: the prefix once, then num_inference_steps expert passes over its cache."""
    policy, batch = tiny
    lang = batch["observation.language.tokens"].shape[1]
    counter = FlopCounterMode(display=False, custom_mapping=CPU_SDPA)
    with counter, torch.no_grad():
        policy.predict_action_chunk(batch)
    measured = counter.get_total_flops() / 2  # per sample
    analytic = pi05_inference_flops(policy, lang_tokens=lang)
    # the same left out: the expert's final norm at every denoising step, RoPE's angles for the
    # prefix once and for the chunk at every step
    steps = policy.config.num_inference_steps
    assert measured - analytic == steps * _final_norm_flops(policy) + _rope_flops(
        policy, _t_prefix(policy, lang) + steps * policy.config.chunk_size)
    # one step less is one expert pass less; with one step it is the training forward without the
    # prefix's attention to the suffix (4 · layers · heads_dim · T_prefix · T_suffix) and with the
    # last VLM layer's output projection and MLP (inference runs them, the training forward not)
    steps = policy.config.num_inference_steps
    per_step = analytic - pi05_inference_flops(policy, lang_tokens=lang, num_steps=steps - 1)
    assert per_step > 0 and per_step == pytest.approx(
        pi05_inference_flops(policy, lang_tokens=lang, num_steps=steps - 1)
        - pi05_inference_flops(policy, lang_tokens=lang, num_steps=steps - 2))
    paligemma = policy.model.paligemma_with_expert.paligemma.model
    vlm, vision = paligemma.language_model.layers, paligemma.vision_tower.config
    t_prefix = len(policy.config.image_features) * (vision.image_size // vision.patch_size) ** 2 + lang
    cross = 4 * len(vlm) * vlm[0].self_attn.q_proj.out_features * t_prefix * policy.config.chunk_size
    one = pi05_inference_flops(policy, lang_tokens=lang, num_steps=1)
    last = [m for part in (vlm[-1].self_attn.o_proj, vlm[-1].mlp) for m in part.modules() if isinstance(m, nn.Linear)]
    unread = 2 * t_prefix * sum(m.in_features * m.out_features for m in last)
    assert pi05_forward_flops(policy, lang_tokens=lang) - one == pytest.approx(cross - unread)


@pytest.mark.integration  # ~17 s
def test_fused_joint_attention_matches_eager(tiny, monkeypatch):
    from unittest import mock

    from pisft.model.pi05 import attention
    from pisft.model.pi05.attention import fused_joint_attention, structure_problem

    spy = mock.Mock(wraps=attention.fused_attention_forward)
    monkeypatch.setattr(attention, "fused_attention_forward", spy)

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
    with fused_joint_attention():
        sdpa = task.loss(policy, batch, rand)
        sdpa.backward()
    n_layers = len(policy.model.paligemma_with_expert.gemma_expert.model.layers)
    assert spy.call_count == n_layers  # the joint attention of every layer went through SDPA
    assert sdpa.item() == pytest.approx(eager.item(), rel=1e-5)
    for n, p in policy.named_parameters():
        if n in eager_grads:
            torch.testing.assert_close(p.grad, eager_grads[n], rtol=1e-4, atol=1e-6)
    policy.zero_grad()


@pytest.mark.parametrize(("checkpointing", "forwards"), [(True, 2), (False, 1)])
def test_one_level_of_activation_checkpointing(tmp_path_factory, checkpointing, forwards):
    """Per decoder layer and micro-step: forward + one recompute with checkpointing, never 3."""
    from pisft.data.dataset import load_split, load_stats
    from pisft.model.pi05.construction import prepare_for_training
    from pisft.model.policy import load_policy, make_processors

    root = inputs_dir(tmp_path_factory)
    policy = load_policy(root / "base_model", dtype="float32")
    pre, _ = make_processors(policy, root / "base_model", load_stats(root / "dataset"))
    ds = load_split(root / "dataset", "train", chunk_size=policy.config.chunk_size)
    prepare_for_training(policy, checkpointing=checkpointing)
    assert policy.model.paligemma_with_expert.gemma_expert.lm_head is None  # detached, unused
    policy.train()
    layers = _decoder_layers(policy)
    calls = [0] * len(layers)
    hooks = [layer.self_attn.q_proj.register_forward_pre_hook(
        lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1)) for i, layer in enumerate(layers)]
    task = PolicyTask(policy, pre, torch.device("cpu"))
    batch = task.prepare(default_collate([ds[i] for i in range(2)]))
    b = policy.config.chunk_size
    rand = {"noise": torch.randn(2, b, policy.config.max_action_dim), "time": torch.full((2,), 0.5)}
    try:
        task.loss(policy, batch, rand).backward()
    finally:
        for h in hooks:
            h.remove()
    assert calls == [forwards] * len(layers)


MODES = [("all", None), ("expert", None), ("no_vision", None), ("lora", "openpi"), ("lora", "lerobot"),
         ("lora", "rlinf")]


@pytest.mark.parametrize(("mode", "targets"), MODES, ids=[m if t is None else f"{m}-{t}" for m, t in MODES])
def test_training_flops_follow_the_mode_and_match_a_flop_counter(mode, targets):
    """The step's model FLOPs (what MFU divides) in each train.trainable mode against what torch's
    FLOP counter sees autograd run over a forward and a backward (no checkpointing: MFU does not
    count recomputation). Before, every mode counted 3 × forward: `expert`'s MFU 2.9 × too high."""
    from pisft.introspect.synthetic import build_random_policy, synthetic_batch
    from pisft.train import trainable

    policy = build_random_policy("tiny", torch.device("cpu"), checkpointing=False)
    trainable.apply_mode(policy, mode, trainable.lora_spec(targets) if targets else None, seed=0)
    policy.train()
    task = PolicyTask(policy, None, torch.device("cpu"))
    batch, rand = synthetic_batch(policy, 2, torch.device("cpu"), 0)
    counter = FlopCounterMode(display=False)
    with counter:
        task.loss(policy, batch, rand).backward()
    measured = counter.get_total_flops() / 2  # per sample
    lang = policy.config.tokenizer_max_length
    analytic = pi05_training_flops_per_sample(policy, lang_tokens=lang)
    assert analytic == pytest.approx(measured, rel=0.05)
    forward = pi05_forward_flops(policy, lang_tokens=lang)
    # the walk behind the training count covers exactly the forward count's parts
    assert _walk_training_step(policy, lang_tokens=lang).forward == pytest.approx(forward, rel=1e-12)
    if mode == "expert":  # the frozen prefix runs once without grad: little more than a forward
        assert analytic < 1.2 * forward
    if mode == "all":
        assert 2.2 * forward < analytic <= 3 * forward
