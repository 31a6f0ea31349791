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

from pisft.model import lerobot_internals as internals
from pisft.train import fsdp, optim
from pisft.train.attention import fused_joint_attention
from pisft.train.policy_task import PolicyTask


pytestmark = pytest.mark.usefixtures("one_process_group")  # gloo, world size 1 (conftest)


def _losses(root, *, structured: bool, steps: int = 2) -> list[float]:
    from pisft.data.dataset import load_split, load_stats
    from pisft.model.policy import load_policy, make_processors

    policy = load_policy(root / "base_model", dtype="float32")
    pre, _ = make_processors(policy, root / "base_model", load_stats(root / "dataset"))
    ds = load_split(root / "dataset", "train", chunk_size=policy.config.chunk_size)
    if structured:
        internals.prepare_for_training(policy, checkpointing=True)
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
def test_forward_prefetch_only_without_recompute(tmp_path_factory, checkpointing):
    """A checkpointed layer's recompute would prefetch the next pair, whose backward is done."""
    from pisft.model.policy import load_policy

    policy = load_policy(inputs_dir(tmp_path_factory) / "base_model", dtype="float32")
    internals.prepare_for_training(policy, checkpointing=checkpointing)
    units = fsdp.shard(policy, init_device_mesh("cpu", (1,)), "fp32")
    prefetching = [u.name for u in units
                   if u.modules[0]._get_fsdp_state()._states_to_forward_prefetch]
    assert prefetching == ([] if checkpointing else [u.name for u in units[:-1]])
