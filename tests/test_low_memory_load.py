"""Frozen parameters of a bf16 run are loaded straight into bf16 (`load_policy(hold_bf16=)`): the
same tensors as loading in fp32 and casting after (`trainable.hold_frozen_in`), and model.source
'random' writes a model of any preset that loads strictly."""

from __future__ import annotations

import torch

from pisft.config import from_dict
from pisft.model import fetch
from pisft.model.policy import load_policy
from pisft.train import trainable
from pisft.train.job import frozen_in_bf16


def test_frozen_parameters_load_straight_into_bf16(tmp_path):
    cfg = from_dict({"results_dir": str(tmp_path / "results"),
                     "train": {"precision": "bf16", "trainable": "expert"}})
    base = fetch.run(cfg)
    cast_after = load_policy(base, dtype="float32")
    trainable.apply_mode(cast_after, "expert")
    trainable.hold_frozen_in(cast_after, "bf16")
    direct = load_policy(base, dtype="float32", hold_bf16=frozen_in_bf16(cfg))
    trainable.apply_mode(direct, "expert")
    assert trainable.hold_frozen_in(direct, "bf16") == 0  # nothing left to cast
    a, b = dict(cast_after.named_parameters()), dict(direct.named_parameters())
    assert a.keys() == b.keys()
    held = 0
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
        held += a[name].dtype == torch.bfloat16
    assert held > 0
    assert frozen_in_bf16(from_dict({"train": {"precision": "fp32", "trainable": "expert"}})) is None
    assert frozen_in_bf16(from_dict({"train": {"precision": "bf16", "trainable": "all"}})) is None


def test_the_random_source_builds_the_preset_in_bf16_and_loads_strictly(tmp_path):
    cfg = from_dict({"results_dir": str(tmp_path / "results"), "model": {"source": "random", "init_seed": 3}})
    base = fetch.run(cfg)
    record = (base / "SOURCE.json").read_text()
    assert '"random"' in record
    policy = load_policy(base, preset="tiny")
    again = fetch.run(from_dict({"results_dir": str(tmp_path / "again"),
                                 "model": {"source": "random", "init_seed": 3}}))
    other = load_policy(again, preset="tiny")
    for (n, p), (_, q) in zip(policy.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(p, q), n  # the same seed, the same weights
    dtypes = {p.dtype for p in policy.parameters()}
    assert torch.bfloat16 in dtypes  # written in bf16 (LeRobot keeps the vision path in fp32)
