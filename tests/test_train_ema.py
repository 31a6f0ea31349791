"""The EMA of the trained weights (train.ema_decay) against a hand computation, through the real
loop and checkpoints (gloo, world size 1, the toy module sharded by FSDP2 as in test_train_loop)."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_train_loop import _manager, toy_model, train
from torch.distributed.tensor import DTensor

from pisft import config as config_mod
from pisft.train import checkpoint as ckpt_mod
from pisft.train import run_folders
from pisft.train import optim
from pisft.train.ema import WeightsEMA, ema_record, make_ema

pytestmark = pytest.mark.usefixtures("one_process_group")  # gloo, world size 1 (conftest)

DECAY = 0.9


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _trained(model) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}


def _fresh(steps, seed=0):
    model, _ = toy_model(seed)
    opt = optim.build_optimizer(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    sched = optim.build_scheduler(opt, lr=1e-2, warmup_steps=2, decay_lr=1e-3, steps=steps)
    return model, opt, sched


def test_ema_follows_openpi_from_the_loaded_weights_step_by_step():
    """openpi's scripts/train.py: ema starts as the params, then ema = d * ema + (1 - d) * new after
    every step (the first included). The weights after each step are recorded; the average is
    computed by hand from them and compared with the one the loop kept."""
    model, opt, sched = _fresh(5)
    w0 = _trained(model)
    ema = WeightsEMA(model, DECAY)
    assert all(_full(ema.shadow[n]).dtype == torch.float32 for n in w0)
    after: list[dict[str, torch.Tensor]] = []
    train(micro=4, steps=5, model=model, opt=opt, sched=sched, ema=ema,
          on_step=lambda record: after.append(_trained(model)))
    assert len(after) == 5
    expected = {n: w.double() for n, w in w0.items()}
    for step, w in enumerate(after):
        expected = {n: DECAY * expected[n] + (1 - DECAY) * w[n].double() for n in expected}
        if step == 0:  # the first step: 0.9 * w0 + 0.1 * w1, nothing skipped or warmed up
            first = {n: 0.9 * w0[n].double() + 0.1 * w[n].double() for n in w0}
            for n in w0:
                torch.testing.assert_close(expected[n], first[n], rtol=0, atol=1e-12)
    for n, value in expected.items():
        got = _full(ema.shadow[n]).double()
        torch.testing.assert_close(got, value, rtol=0, atol=1e-6)
        assert not torch.allclose(got, after[-1][n].double(), atol=1e-6), n  # an average, not the last
    ema.copy_to(model)  # the export: the average in the weights
    for n, p in _trained(model).items():
        assert torch.equal(p, _full(ema.shadow[n]).to(p.dtype))


def test_a_skipped_step_leaves_the_average_and_frozen_parameters_are_not_averaged():
    model, _ = toy_model()
    first = next(iter(model.parameters()))
    first.requires_grad_(False)  # frozen (as train.trainable would freeze a part)
    ema = WeightsEMA(model, DECAY)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert list(ema.shadow) == names and len(names) == len(list(model.parameters())) - 1
    before = {n: _full(e) for n, e in ema.shadow.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(torch.tensor(False))  # a non-finite step: parameters untouched, average too
    assert all(torch.equal(_full(ema.shadow[n]), before[n]) for n in names)
    ema.update(torch.tensor(True))
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(_full(ema.shadow[n]), before[n] + (1 - DECAY) * 1.0)
    assert ema.numel_local() == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_ema_is_checkpointed_and_resumed_exactly(tmp_path):
    root = tmp_path / "ckpt"
    model, opt, sched = _fresh(9)
    ema = WeightsEMA(model, DECAY)
    train(micro=4, steps=9, model=model, opt=opt, sched=sched, ema=ema,
          save=lambda step: _manager(root).save(step, model, opt, sched, ema=ema))
    shutil.rmtree(root / "step_000009")
    found = ckpt_mod.latest_complete(root)
    assert found.step == 6
    import torch.distributed.checkpoint as dcp
    keys = dcp.FileSystemReader(str(found.path / "dcp")).read_metadata().state_dict_metadata
    assert {f"ema.{n}" for n in ema.shadow} <= set(keys)

    model2, opt2, sched2 = _fresh(9, seed=123)  # everything must come from the checkpoint
    ema2 = WeightsEMA(model2, DECAY)
    _manager(root).load(found, model2, opt2, sched2, ema=ema2)
    train(micro=4, steps=9, start=6, model=model2, opt=opt2, sched=sched2, ema=ema2)
    for n, e in ema.shadow.items():
        assert torch.equal(_full(ema2.shadow[n]), _full(e)), n


def test_ema_decay_key_fingerprint_and_record(tmp_path):
    cfg = config_mod.from_dict({"results_dir": str(tmp_path)})
    assert cfg.train.ema_decay == 0.0 and make_ema(toy_model()[0], cfg.train.ema_decay) is None
    assert config_mod.from_dict({"train": {"ema_decay": None}}).train.ema_decay is None
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(config_mod.ConfigError, match="train.ema_decay"):
            config_mod.from_dict({"train": {"ema_decay": bad}})
    on = config_mod.from_dict({"results_dir": str(tmp_path), "train": {"ema_decay": 0.999}})
    assert run_folders.run_fingerprint(on)["train.ema_decay"] == 0.999
    assert run_folders.checkpoint_root(on) != run_folders.checkpoint_root(cfg)  # another run folder
    assert ema_record(None) == {"kind": "last_step"}
    assert ema_record(WeightsEMA(toy_model()[0], 0.999)) == {"kind": "ema", "ema_decay": 0.999}
