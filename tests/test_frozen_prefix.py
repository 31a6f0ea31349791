"""The frozen-prefix forward (pisft.model.pi05, 8.): with the whole VLM frozen the
prefix runs once without grad and the action expert attends to its keys/values; the loss and every
trainable gradient equal LeRobot's joint forward, and nothing of the prefix runs in backward."""

from __future__ import annotations

import pytest
import torch

from pisft.introspect.synthetic import synthetic_batch
from pisft.model.pi05.construction import prepare_for_training
from pisft.model.pi05.forward import frozen_prefix_forward, joint_forward, prefix_frozen, sync_free_forward
from pisft.model.policy import build_policy
from pisft.model.pi05.attention import fused_joint_attention
from pisft.train.policy_task import injected_flow_samples


def _expert_only(policy) -> None:
    """LeRobot's train_expert_only, by hand: every PaliGemma parameter frozen."""
    for p in policy.model.paligemma_with_expert.paligemma.parameters():
        p.requires_grad_(False)


def _tiny_expert(checkpointing: bool):
    policy = build_policy("tiny", seed=0)
    prepare_for_training(policy, checkpointing=checkpointing)
    _expert_only(policy)
    policy.train()
    return policy


class _Calls:
    """Counts forward calls of the VLM's and the expert's q_proj, split by forward/backward."""

    def __init__(self, policy) -> None:
        pwe = policy.model.paligemma_with_expert
        self.phase = "forward"
        self.counts: dict[tuple[str, str], int] = {}
        self.handles = []
        for name, layers in (("vlm", pwe.paligemma.model.language_model.layers),
                             ("expert", pwe.gemma_expert.model.layers)):
            for layer in layers:
                self.handles.append(layer.self_attn.q_proj.register_forward_hook(self._hook(name)))

    def _hook(self, name):
        def hook(*_):
            key = (name, self.phase)
            self.counts[key] = self.counts.get(key, 0) + 1
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _loss_and_grads(policy, batch, rand, frozen_prefix, fused: bool):
    calls = _Calls(policy)
    try:
        with fused_joint_attention(fused):  # as the training: the recompute in backward too
            with injected_flow_samples(policy.model, rand["noise"], rand["time"]), \
                    sync_free_forward(policy, frozen_prefix=frozen_prefix):
                loss = policy(batch)
            calls.phase = "backward"
            loss.backward()
    finally:
        calls.close()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    return loss.detach(), grads, calls.counts


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_frozen_prefix_gives_the_joint_forwards_loss_and_gradients(checkpointing, fused):
    policy = _tiny_expert(checkpointing)
    assert prefix_frozen(policy)
    batch, rand = synthetic_batch(policy, 3, torch.device("cpu"), seed=1)
    batch["observation.language.attention_mask"][:, -5:] = False  # padded prompt tails
    batch["observation.language.attention_mask"][0, -12:] = False
    loss0, grads0, calls0 = _loss_and_grads(policy, batch, rand, False, fused)
    loss1, grads1, calls1 = _loss_and_grads(policy, batch, rand, None, fused)  # None: chosen (frozen)
    assert float(loss1) == pytest.approx(float(loss0), rel=1e-5)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert set(grads0) == set(grads1) == trainable  # the expert and the action/time projections
    assert any("gemma_expert" in n for n in trainable) and not any(".paligemma." in n for n in trainable)
    for name in trainable:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-4, atol=1e-6, msg=name)
    depth = len(policy.model.paligemma_with_expert.gemma_expert.model.layers)
    # The joint layer recomputes the VLM's half in backward when checkpointed; the frozen prefix never.
    assert calls0.get(("vlm", "backward"), 0) == (depth if checkpointing else 0)
    assert calls1.get(("vlm", "backward"), 0) == 0 and calls1[("vlm", "forward")] == depth
    assert calls1.get(("expert", "backward"), 0) == (depth if checkpointing else 0)


def test_the_prefix_never_attends_to_the_suffix():
    """The premise of the split: LeRobot's own masks (embed_prefix, embed_suffix, make_att_2d_masks)."""
    from lerobot.policies.common.vla_utils import make_att_2d_masks

    policy = build_policy("tiny", seed=0)
    batch, rand = synthetic_batch(policy, 2, torch.device("cpu"), seed=0)
    batch["observation.language.attention_mask"][:, -4:] = False
    core = policy.model
    images, img_masks = policy._preprocess_images(batch)
    _, prefix_pad, prefix_att = core.embed_prefix(images, img_masks, batch["observation.language.tokens"],
                                                  batch["observation.language.attention_mask"])
    _, suffix_pad, suffix_att, _ = core.embed_suffix(rand["noise"], rand["time"])
    att = make_att_2d_masks(torch.cat([prefix_pad, suffix_pad], 1), torch.cat([prefix_att, suffix_att], 1))
    n = prefix_pad.shape[1]
    assert not att[:, :n, n:].any()  # no prefix row sees a suffix column
    assert att[:, n:, :n].sum() == suffix_pad.shape[1] * prefix_pad.sum()  # the suffix sees the real prefix


def test_frozen_prefix_refused_while_the_vlm_trains_and_the_joint_path_chosen():
    policy = build_policy("tiny", seed=0)
    prepare_for_training(policy, checkpointing=False)
    assert not prefix_frozen(policy)
    with pytest.raises(ValueError, match="trainable parameters"), \
            sync_free_forward(policy, frozen_prefix=True):
        pass
    with sync_free_forward(policy):
        assert policy.model.forward.__func__ is joint_forward
    _expert_only(policy)
    with sync_free_forward(policy):
        assert policy.model.forward.__func__ is frozen_prefix_forward
    assert "forward" not in vars(policy.model)


def test_fsdp_units_of_a_frozen_prefix_are_per_layer_in_its_forward_order():
    from pisft.model.pi05.units import policy_units

    policy = _tiny_expert(checkpointing=True)
    units = policy_units(policy)
    groups = [u.group for u in units]
    depth = len(policy.model.paligemma_with_expert.gemma_expert.model.layers)
    assert groups.count("vlm_decoder") == depth and groups.count("decoder") == depth
    order = [g for i, g in enumerate(groups) if i == 0 or groups[i - 1] != g]
    assert order[-3:] == ["vlm_decoder", "action", "decoder"]
    assert not any(u.group == "vision" and not u.reshard_after_forward for u in units)
    joint = policy_units(build_policy("tiny", seed=0))
    assert [u.group for u in joint].count("decoder") == depth and "vlm_decoder" not in {u.group for u in joint}
    # every parameter in exactly one unit or the root, both ways
    for us in (units, joint):
        ids = [id(p) for u in us for p in u.parameters()]
        assert len(ids) == len(set(ids))
