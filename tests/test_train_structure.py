"""The Ascend-faithful training structure computes what LeRobot's plain model computes.

Layer-pair FSDP units, vision units kept for both cameras, one checkpointing level, the fused
joint attention and the detached expert lm_head change where and when things run, not the
math: two optimizer steps give the losses of the unsharded LeRobot model with eager attention.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import default_collate
from train_fixtures import inputs_dir

from pisft.model.pi05.construction import prepare_for_training
from pisft.train import fsdp, optim
from pisft.model.pi05.attention import fused_joint_attention
from pisft.train.policy_task import PolicyTask


pytestmark = pytest.mark.usefixtures("one_process_group")  # gloo, world size 1 (conftest)


def _losses(root, *, structured: bool, steps: int = 2) -> list[float]:
    from pisft.data.dataset import load_split, load_stats
    from pisft.model.policy import load_policy, make_processors

    policy = load_policy(root / "base_model", dtype="float32")
    pre, _ = make_processors(policy, root / "base_model", load_stats(root / "dataset"))
    ds = load_split(root / "dataset", "train", chunk_size=policy.config.chunk_size)
    if structured:
        prepare_for_training(policy, checkpointing=True)
        fsdp.shard(policy, init_device_mesh("cpu", (1,)), "fp32")
    opt = optim.build_optimizer(policy.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    task = PolicyTask(policy, pre, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    b, d = policy.config.chunk_size, policy.config.max_action_dim
    losses = []
    policy.train()
    for step in range(steps):
        batch = task.prepare(default_collate([ds[i] for i in range(4 * step, 4 * step + 4)]))
        rand = {"noise": torch.randn(4, b, d, generator=g), "time": torch.rand(4, generator=g) * 0.9 + 0.05}
        with fused_joint_attention(structured):  # the recompute in backward runs it again
            loss = task.loss(policy, batch, rand)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


@pytest.mark.integration  # ~15 s: two models trained side by side
def test_losses_equal_the_plain_lerobot_model(tmp_path_factory):
    root = inputs_dir(tmp_path_factory)
    plain = _losses(root, structured=False)
    structured = _losses(root, structured=True)
    assert structured == pytest.approx(plain, rel=1e-5)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_forward_prefetch_and_no_gather_after_a_units_backward(tmp_path_factory, monkeypatch, checkpointing):
    """Each unit prefetches the next in forward. A checkpointed block recomputes its function in
    backward, not the unit's forward method (pisft.train.blocks), so the recompute prefetches
    nothing: no decoder pair is gathered again after its own backward (LeRobot's parts-hooked
    layers did gather the next pair there, 4.5 GiB per device for pi0.5 on 8 cards)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from pisft.introspect.synthetic import synthetic_batch
    from pisft.model.policy import load_policy

    policy = load_policy(inputs_dir(tmp_path_factory) / "base_model", dtype="float32")
    prepare_for_training(policy, checkpointing=checkpointing)
    units = fsdp.shard(policy, init_device_mesh("cpu", (1,)), "fp32")
    prefetching = [u.name for u in units if u.modules[0]._get_fsdp_state()._states_to_forward_prefetch]
    assert prefetching == [u.name for u in units[:-1]]
    events: list[tuple[str, int]] = []
    for name in ("unshard", "post_backward"):
        real = getattr(FSDPParamGroup, name)

        def record(self, *args, _real=real, _name=name, **kwargs):
            if _name == "post_backward" or (self._all_gather_result is None and not self.is_unsharded):
                events.append((_name, id(self)))  # a real gather (a call on a gathered unit is a no-op)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(FSDPParamGroup, name, record)
    batch, rand = synthetic_batch(policy, 2, torch.device("cpu"), seed=0)
    policy.train()
    with fused_joint_attention():
        task = PolicyTask(policy, None, torch.device("cpu"))
        loss = task.loss(policy, batch, rand)
        forward_events = len(events)
        loss.backward()
    blocks = {id(u.modules[0]._get_fsdp_state()._fsdp_param_group) for u in units if u.anchors}
    done: set[int] = set()
    for event, group in events[forward_events:]:
        assert not (event == "unshard" and group in done), "a block's unit gathered again after its backward"
        if event == "post_backward" and group in blocks:
            done.add(group)
    assert done == blocks  # every block's gradients were reduced
