"""The RECAP value model: two-hot targets and loss by hand, the model on the tiny preset, its
returns input, save/load, the smoke steps, and the train_value stage under torchrun (2 gloo
processes) with its outputs, resume after SIGKILL, and the advantages stage on its output."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from recap_fixtures import overrides, results_with_inputs, value_inputs
from safetensors.torch import load_file
from train_fixtures import CONFIG, ROOT, launch_env, read_jsonl, kill_rank1_after_checkpoint

from pisft import config as config_mod
from pisft import layout
from pisft.data.rlinf_recap import value_target
from pisft.errors import DataError, ModelLoadError
from pisft.recap import value_model
from pisft.integrity import IntegrityError
from pisft.io import write_manifest
from pisft.recap.value_data import PromptCollate, ReturnRange, ValueFrames, read_returns
from pisft.recap.value_metrics import bin_accuracy, spearman
from pisft.recap.value_model import categorical_loss, expected_value, nearest_bin, two_hot
from pisft.recap.value_task import ValueTask


# ------------------------------------------------------------------------------ bins by hand
def test_two_hot_puts_the_target_on_its_two_neighbouring_bins():
    # 5 bins: atoms -1, -0.75, -0.5, -0.25, 0 (spacing 0.25)
    got = two_hot(torch.tensor([-0.6, -0.5, -1.0, 0.0, -1.3, 0.2, -0.1]), 5)
    want = torch.tensor([
        [0, 0.4, 0.6, 0, 0],  # -0.6 = 0.4 * -0.75 + 0.6 * -0.5
        [0, 0, 1, 0, 0],  # exactly on a bin
        [1, 0, 0, 0, 0],  # -1: the first bin
        [0, 0, 0, 0, 1],  # 0: the last bin
        [1, 0, 0, 0, 0],  # below -1: clipped
        [0, 0, 0, 0, 1],  # above 0: clipped
        [0, 0, 0, 0.4, 0.6],  # -0.1 = 0.4 * -0.25 + 0.6 * 0
    ])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert torch.allclose(got.sum(-1), torch.ones(7))
    # the expectation of the two-hot distribution is the (clipped) target
    atoms = value_model.atoms(5)
    torch.testing.assert_close((got * atoms).sum(-1), torch.tensor([-0.6, -0.5, -1, 0, -1, 0, -0.1]))


def test_categorical_loss_is_the_cross_entropy_against_the_two_hot_target():
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, -1.0], [3.0, 0.0, 0.0, 0.0, 0.0]])
    target = torch.tensor([-0.6, -1.0])
    logp = torch.log_softmax(logits, dim=-1)
    want = torch.stack([-(0.4 * logp[0, 1] + 0.6 * logp[0, 2]), -logp[1, 0]])
    torch.testing.assert_close(categorical_loss(logits, target), want)
    # by hand for the second row: log-sum-exp of (3, 0, 0, 0, 0) minus 3
    assert categorical_loss(logits, target)[1].item() == pytest.approx(math.log(math.exp(3) + 4) - 3, rel=1e-6)


def test_expected_value_and_nearest_bin():
    torch.testing.assert_close(expected_value(torch.zeros(1, 5)), torch.tensor([-0.5]))  # mean of the atoms
    torch.testing.assert_close(expected_value(torch.tensor([[0.0, 50.0, 0.0, 0.0, 0.0]])), torch.tensor([-0.75]))
    # -0.6 is 0.4 of the way from bin 1 to bin 2: nearest 2; -0.625 halfway: the lower (RLinf's acc_best)
    assert nearest_bin(torch.tensor([-0.6, -0.625, -1.0, 0.0, -0.7]), 5).tolist() == [2, 1, 0, 4, 1]
    assert bin_accuracy(np.array([2, 2, 0]), np.array([-0.6, -0.625, -1.0]), 5) == pytest.approx(2 / 3)


def test_value_target_divides_by_the_minimum_return_and_clips():
    got = value_target(np.array([-323.0, -10.0, 0.0, -400.0]), -323.0)
    np.testing.assert_allclose(got, [-1.0, -10 / 323, 0.0, -1.0])
    np.testing.assert_allclose(value_target(np.array([0.0, 0.0]), 0.0), [0.0, 0.0])  # min 0: divide by 1


def test_spearman_averages_tied_ranks():
    x, y = np.array([1.0, 2.0, 2.0, 3.0]), np.array([1.0, 3.0, 2.0, 4.0])
    rx, ry = np.array([1, 2.5, 2.5, 4]), np.array([1, 3, 2, 4.0])
    want = np.corrcoef(rx, ry)[0, 1]  # Pearson of the (tie-averaged) ranks
    assert spearman(x, y) == pytest.approx(want)
    assert spearman(np.ones(4), y) is None  # constant: undefined


# ------------------------------------------------------------------ the model on the tiny preset
@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    return value_inputs(tmp_path_factory)


@pytest.fixture(scope="module")
def pieces(inputs):
    from pisft.model.tokenizer import load_tokenizer

    returns = read_returns(inputs / "dataset")
    scale = ReturnRange.of(returns)
    model = value_model.from_base(inputs / "base_model", bins=11, preset="tiny", seed=0)
    frames = ValueFrames(inputs / "dataset", "train", returns, scale, tuple(model.policy.config.image_features))
    collate = PromptCollate(load_tokenizer(inputs / "base_model" / "tokenizer"),
                            int(model.policy.config.tokenizer_max_length))
    return model, frames, collate, scale


def test_the_value_model_is_the_policy_prefix_a_readout_token_and_a_head(pieces):
    model, frames, collate, scale = pieces
    names = [n for n, _ in model.named_parameters()]
    assert not [n for n in names if "gemma_expert" in n or "action_" in n or "time_mlp" in n]
    assert any(".vision_tower." in n for n in names) and any(".language_model.layers." in n for n in names)
    from pisft.model.pi05.construction import vlm_width

    assert model.readout.weight.shape == (1, vlm_width(model.policy)) and model.head.out_features == 11
    task = ValueTask(collate, torch.device("cpu"))
    batch = task.prepare(collate([frames[i] for i in range(3)]))
    logits = task.logits(model, batch)
    assert logits.shape == (3, 11) and logits.dtype == torch.float32
    loss = task.loss(model, batch, {})
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["readout.weight"].abs().sum() > 0 and grads["head.weight"].abs().sum() > 0
    layer = next(n for n in grads if ".language_model.layers.0.self_attn.q_proj" in n)
    assert grads[layer].abs().sum() > 0  # the backbone trains too
    model.zero_grad(set_to_none=True)
    # the prompt and the images both reach the read-out token
    with torch.no_grad():
        other = dict(batch)
        other["tokens"], other["token_mask"] = collate.tokens(["open the top drawer of the cabinet"] * 3)
        assert not torch.allclose(task.logits(model, other), logits)
        dark = {**batch, **{k: torch.zeros_like(batch[k]) for k in frames.image_keys}}
        assert not torch.allclose(task.logits(model, dark), logits)
    # parameter groups: head = read-out token + bin head; backbone = everything else
    assert len(model.head_parameters()) == 3
    assert len(model.backbone_parameters()) + 3 == len(list(model.parameters()))


def test_a_frozen_prefix_runs_once_without_grad_with_the_joint_logits_and_gradients(pieces, monkeypatch):
    """recap.value_trainable: head: the prefix runs under no_grad with its KV cache and only the
    read-out token runs with grad; logits and the read-out/head gradients equal the joint pass."""
    import dataclasses

    from pisft.model import registry
    from pisft.model.pi05 import forward as pi05_forward

    model, frames, collate, _ = pieces
    task = ValueTask(collate, torch.device("cpu"))
    batch = task.prepare(collate([frames[i] for i in range(3)]))
    widths: list[tuple[bool, int]] = []  # (grad enabled, tokens) of every VLM q_proj call
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda _m, args, _o: widths.append((torch.is_grad_enabled(), args[0].shape[1])))
        for layer in model.policy.model.paligemma_with_expert.paligemma.model.language_model.layers]
    backbone = model.backbone_parameters()
    try:
        for p in backbone:
            p.requires_grad_(False)
        assert pi05_forward.prefix_frozen(model.policy)
        runs = {}
        spec = registry.spec_of(model.policy)  # the value model reads its prefix through pi0.5's spec
        original = spec.value.readout
        for name, frozen in (("joint", False), ("split", True)):
            forced = lambda *a, _f=frozen, **k: original(*a, **{**k, "frozen_prefix": _f})  # noqa: E731
            monkeypatch.setitem(registry._REGISTRY, spec.name,  # pi0.5's entry, for this block
                                dataclasses.replace(spec, value=dataclasses.replace(spec.value, readout=forced)))
            widths.clear()
            loss = task.loss(model, batch, {})
            loss.backward()
            monkeypatch.undo()
            runs[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                         if p.grad is not None}, list(widths))
            model.zero_grad(set_to_none=True)
        (joint_loss, joint_grads, joint_widths), (split_loss, split_grads, split_widths) = runs["joint"], runs["split"]
        torch.testing.assert_close(split_loss, joint_loss, rtol=1e-5, atol=1e-6)
        assert set(split_grads) == set(joint_grads) == {"readout.weight", "head.weight", "head.bias"}
        for n in joint_grads:
            torch.testing.assert_close(split_grads[n], joint_grads[n], rtol=1e-4, atol=1e-6)
        layers = len(hooks)
        prefix_len = joint_widths[0][1] - 1
        assert joint_widths == [(True, prefix_len + 1)] * layers  # the whole prefix with grad
        assert split_widths == [(False, prefix_len)] * layers + [(True, 1)] * layers  # one token with grad
        # the same model's forward picks the split path itself, and evaluation (no grad) uses it too
        widths.clear()
        task.loss(model, batch, {})
        assert widths[layers:] == [(True, 1)] * layers
    finally:
        for h in hooks:
            h.remove()
        for p in backbone:
            p.requires_grad_(True)
    # a trainable backbone trains through the joint pass and evaluates (no grad) through the split one
    with torch.no_grad():
        evaluated = task.logits(model, batch)
    torch.testing.assert_close(evaluated, task.logits(model, batch).detach(), rtol=1e-5, atol=1e-6)


def test_a_frozen_prefix_trains_under_fsdp2_units_like_the_unsharded_model(pieces, inputs, tmp_path):
    """head mode sharded as train_value shards it (FSDP2, a unit per VLM layer, each called twice in
    a forward: the prefix without grad, then the read-out token): the same loss and head gradients
    as the unsharded model, and the frozen layers get no gradient."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pisft.train import fsdp, trainable

    _, frames, collate, _ = pieces
    task = ValueTask(collate, torch.device("cpu"))
    batch = task.prepare(collate([frames[i] for i in range(3)]))
    results = []
    try:
        for sharded in (False, True):
            model = value_model.from_base(inputs / "base_model", bins=11, preset="tiny", seed=0)
            trainable.apply_mode(model, "head", None, seed=0, value_model=True)
            if sharded:
                dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
                units = fsdp.distribute(model, init_device_mesh("cpu", (1,)), "fp32", torch.device("cpu"),
                                        keep_sharded=True, min_params=0)
                assert sum(u.group == "decoder" for u in units) == len(
                    model.policy.model.paligemma_with_expert.paligemma.model.language_model.layers)
            loss = task.loss(model, batch, {})
            loss.backward()
            grads = {n.replace("_fsdp_wrapped_module.", ""): (p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                                                              else p.grad).clone()
                     for n, p in model.named_parameters() if p.grad is not None}
            results.append((loss.detach(), grads))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (plain_loss, plain_grads), (sharded_loss, sharded_grads) = results
    torch.testing.assert_close(sharded_loss, plain_loss)
    assert set(sharded_grads) == set(plain_grads) == {"readout.weight", "head.weight", "head.bias"}
    for n in plain_grads:
        torch.testing.assert_close(sharded_grads[n], plain_grads[n])


def test_targets_follow_the_returns_file(pieces, inputs):
    _, frames, _, scale = pieces
    assert scale.max == 0.0 and scale.min == -(24 - 1) - 300  # a failed 24-frame episode
    returns = pd.read_parquet(inputs / "dataset" / "returns.parquet")
    row = 5
    ep, fr = int(frames.episode_index[row]), int(frames.frame_index[row])
    ret = float(returns[(returns.episode_index == ep) & (returns.frame_index == fr)]["return"].iloc[0])
    assert frames.target[row] == pytest.approx(ret / 323.0)
    assert "\nAdvantage" not in frames.task[row] and frames.task[row]


def test_save_and_load_give_the_same_logits(pieces, inputs, tmp_path):
    model, frames, collate, scale = pieces
    config = value_model.ValueModelConfig(base_model=str(inputs / "base_model"), preset="tiny", bins=11,
                                          return_min=scale.min, return_max=scale.max)
    out = tmp_path / "model"
    out.mkdir()
    value_model.save(model, out, config)
    loaded, got_config = value_model.load(out)
    assert got_config == config
    task = ValueTask(collate, torch.device("cpu"))
    batch = task.prepare(collate([frames[i] for i in range(2)]))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(task.logits(loaded, batch), task.logits(model, batch))
    model.train()
    stale = value_model.ValueModelConfig(**{**config.__dict__, "base_config_sha256": "0" * 64})
    (out / value_model.CONFIG_FILE).write_text(stale.to_json())
    with pytest.raises(IntegrityError, match=r"value_model.json: \d+ bytes, MANIFEST.json lists"):
        value_model.load(out)  # changed after it was written: its manifest says so
    write_manifest(out)  # as train_value writes it, from a base model whose config.json has since changed
    with pytest.raises(ModelLoadError, match="changed since the value model"):
        value_model.load(out)


def _head_only_model(inputs: Path, tmp_path: Path) -> tuple[Path, value_model.ValueModel, Path]:
    """A value model trained in `head` mode under bf16 (backbone frozen, held in bf16), saved as
    train_value saves it, from a copy of the base model (so that the test may change it)."""
    import shutil

    from pisft.model.policy import WEIGHTS_FILE
    from pisft.train import trainable
    from pisft.base_identity import base_record
    from pisft.train.export_weights import write_policy_weights

    base = Path(shutil.copytree(inputs / "base_model", tmp_path / "base_model"))
    model = value_model.from_base(base, bins=11, preset="tiny", seed=0)
    trainable.apply_mode(model, "head", None, value_model=True)
    assert trainable.hold_frozen_in(model, "bf16") > 0
    with torch.no_grad():
        for p in model.head_parameters():
            p.add_(0.05 * torch.randn_like(p))
    config = value_model.ValueModelConfig(base_model=str(base), preset="tiny", bins=11, return_min=-1.0,
                                          return_max=0.0, frozen_from=base_record(base), frozen_dtype="bfloat16")
    out = tmp_path / "value_model"
    out.mkdir()
    value_model.save(model, out, config, write_weights=lambda path: write_policy_weights(
        model, base / WEIGHTS_FILE, path, is_main=True, prefix="policy.", frozen=False))
    return out, model, base


def test_a_frozen_backbone_is_not_copied_and_is_read_from_the_model_it_came_from(pieces, inputs, tmp_path):
    """recap.value_trainable head: the value model's file holds the read-out token and the head
    (pi0.5: 6.8 GB less per iteration); loading reads the backbone from the base model, held in
    bf16 as training held it, and gives the trained model's logits exactly."""
    from safetensors import safe_open

    from pisft.model.weights import tensor_locations

    _, frames, collate, _ = pieces
    out, model, base = _head_only_model(inputs, tmp_path)
    assert set(tensor_locations(out / "model.safetensors")[0]) == {"readout.weight", "head.weight", "head.bias"}
    loaded, config = value_model.load(out)
    assert config.frozen_dtype == "bfloat16" and Path(config.frozen_from["dir"]) == base
    for name, p in loaded.named_parameters():
        want = dict(model.named_parameters())[name]
        assert p.dtype == want.dtype and torch.equal(p, want), name
    with safe_open(str(base / "model.safetensors"), "pt") as fh:  # bf16 rounding of the base's values
        stored = fh.keys()
        name = next(n for n in stored if "language_model.layers.0.mlp.up_proj" in n)
        wanted = fh.get_tensor(name).to(torch.bfloat16)
    got = next(p for n, p in loaded.named_parameters() if "language_model.layers.0.mlp.up_proj" in n)
    assert got.dtype == torch.bfloat16 and torch.equal(got, wanted)
    task = ValueTask(collate, torch.device("cpu"), "bf16")
    batch = task.prepare(collate([frames[i] for i in range(2)]))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(task.logits(loaded, batch), task.logits(model, batch), rtol=0, atol=0)


def test_a_value_model_whose_base_became_another_model_is_refused_by_name(inputs, tmp_path):
    """fetch_base rerun with other weights under the same path: the value model's frozen part
    is gone, and loading says so instead of pairing its head with another backbone."""
    from safetensors.torch import load_file, save_file

    out, _, base = _head_only_model(inputs, tmp_path)
    tensors = load_file(base / "model.safetensors")
    name = next(n for n in tensors if "language_model.layers.0.mlp.up_proj" in n)
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    write_manifest(base)  # as a new fetch_base writes it: a consistent, other model
    with pytest.raises(ModelLoadError, match=rf"read from {base}, which held model sha256 .* "
                                             r"now \(another model\); run the train_value stage again"):
        value_model.load(out)


def _write_returns(dataset: Path, table: pd.DataFrame) -> None:
    pq.write_table(pa.Table.from_pandas(table, preserve_index=False), dataset / "returns.parquet")
    write_manifest(dataset)  # as the conversion would have written it (a damaged copy is another test's)


def test_a_returns_file_that_does_not_match_the_dataset_is_refused(inputs, tmp_path):
    import shutil

    dataset = tmp_path / "dataset"
    shutil.copytree(inputs / "dataset", dataset)
    good = pd.read_parquet(dataset / "returns.parquet")
    _write_returns(dataset, good.iloc[:-3])
    with pytest.raises(DataError, match="3 frames of .* without a row"):
        read_returns(dataset)
    bad = good.copy()
    bad.loc[7, "return"] = np.nan
    _write_returns(dataset, bad)
    with pytest.raises(DataError, match="1 row\\(s\\) with a non-finite return"):
        read_returns(dataset)
    _write_returns(dataset, good.drop(columns=["reward"]))
    with pytest.raises(DataError, match="lacks column\\(s\\) \\['reward'\\]"):
        read_returns(dataset)


def test_the_value_run_folder_follows_the_iteration_and_the_returns(inputs, tmp_path):
    import shutil

    from pisft.train.run_folders import value_checkpoint_root as checkpoint_root

    loop = ["recap.iterations=1", "eval.closed_loop=true", "eval.trials_per_task=1"]
    cfg = config_mod.load(CONFIG, [*overrides(tmp_path), *loop])
    for sub in ("base_model", "dataset"):
        shutil.copytree(inputs / sub, tmp_path / sub)
    root = checkpoint_root(cfg)
    assert root.parent == tmp_path / "checkpoints" / "value"
    it1 = cfg.at_iteration(1)
    assert checkpoint_root(it1).parent == tmp_path / "recap" / "iter_1" / "checkpoints" / "value"
    returns = pd.read_parquet(tmp_path / "dataset" / "returns.parquet")
    returns.loc[0, "return"] -= 1.0
    _write_returns(tmp_path / "dataset", returns)
    assert checkpoint_root(cfg) != root  # other returns: another run, never a resume
    assert checkpoint_root(config_mod.load(CONFIG, [*overrides(tmp_path), *loop, "recap.value_lr=0.002"])) \
        != checkpoint_root(cfg)
    assert checkpoint_root(config_mod.load(CONFIG, [*overrides(tmp_path), *loop, "train.nproc_per_node=1",
                                                    "recap.value_global_batch_size=16"])) == checkpoint_root(cfg)


def test_the_value_model_starts_from_the_model_recap_value_init_names(inputs, tmp_path):
    """At iteration 1, `base` loads the base model's backbone and `previous` policy 0's (a copy of
    the base model with other weights, as a trained export has); the run fingerprint hashes the
    model that is loaded, so the two never share a run folder."""
    import os
    import shutil

    from safetensors.torch import save_file

    from pisft.errors import PisftError
    from pisft.recap.value_training import _pieces
    from pisft.train.run_folders import inputs_fingerprint
    from pisft.train.run_folders import value_checkpoint_root, value_fingerprint

    os.symlink(inputs / "base_model", tmp_path / "base_model")
    (tmp_path / "recap" / "iter_1").mkdir(parents=True)
    os.symlink(inputs / "dataset", tmp_path / "recap" / "iter_1" / "dataset")
    loop = ["recap.iterations=1", "eval.closed_loop=true", "eval.trials_per_task=1"]

    def at_1(value_init: str):
        return config_mod.load(CONFIG, [*overrides(tmp_path), *loop, f"recap.value_init={value_init}"]).at_iteration(1)

    with pytest.raises(PisftError, match=r"train/model/config.json not found \(the value model's start, "
                                          r"recap.value_init: previous\); run the `train_8card` stage first"):
        _pieces(at_1("previous"), "train_value", torch.device("cpu"))
    policy0 = tmp_path / "train" / "model"
    shutil.copytree(inputs / "base_model", policy0)
    base_weights = load_file(inputs / "base_model" / "model.safetensors")
    save_file({k: v + 0.25 if v.is_floating_point() else v for k, v in base_weights.items()},
              policy0 / "model.safetensors")
    write_manifest(policy0)
    policy0_weights = load_file(policy0 / "model.safetensors")

    roots = {}
    for value_init, start, weights in (("base", tmp_path / "base_model", base_weights),
                                       ("previous", policy0, policy0_weights)):
        cfg = at_1(value_init)
        assert layout.value_init_model(cfg) == start
        loaded = _pieces(cfg, "train_value", torch.device("cpu"))
        assert loaded.base == start
        state = loaded.model.policy.state_dict()
        compared = [k for k in weights if k in state]
        assert any(".vision_tower." in k for k in compared) and any(".language_model.layers." in k for k in compared)
        for k in compared:
            assert torch.equal(state[k].float(), weights[k].float()), (value_init, k)
        fingerprint = value_fingerprint(cfg)
        assert fingerprint["recap.value_init"] == value_init
        assert fingerprint["base_model"] == inputs_fingerprint(cfg, start)["base_model"]
        roots[value_init] = value_checkpoint_root(cfg)
    assert roots["base"] != roots["previous"]


@pytest.mark.parametrize("trainable", ["all", "head"])
def test_smoke_steps_train_the_value_model_on_one_device(inputs, tmp_path, monkeypatch, trainable):
    """The value model's first optimizer steps (for smoke_1card): loss finite and falling, on the
    run's first micro-batch as its loader gives it (data.augment: openpi, the base camera cropped);
    `head` through the frozen prefix's split pass."""
    import torch.distributed as dist

    from pisft.data import augment
    from pisft.device import DeviceInfo
    from pisft.gates.value_smoke import smoke_value_steps
    from pisft.train.job import Context

    applied = []
    real = augment.apply_openpi
    monkeypatch.setattr(augment, "apply_openpi", lambda img, p: applied.append("crop" in p) or real(img, p))
    cfg = config_mod.load(CONFIG, [*overrides(inputs), "recap.value_lr=0.001", "recap.value_head_lr=0.001",
                                   "data.augment=openpi", f"recap.value_trainable={trainable}"])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ctx = Context(cfg, "smoke_1card", DeviceInfo("cpu", "gloo", torch.device("cpu"), "cpu"), 0, 1)
        report = smoke_value_steps(ctx, steps=4)
    finally:
        dist.destroy_process_group()
    assert len(report["losses"]) == 4 and all(math.isfinite(x) for x in report["losses"])
    assert report["passed"], report
    assert report["losses"][-1] < report["losses"][0]
    assert sorted(set(applied)) == [False, True] and len(applied) == 2 * cfg.train.micro_batch_size


# ------------------------------------------------------------------ train_value under torchrun
# data.augment: the value model trains with the policy's switch (openpi's augmentation), so the
# run, its resume after a kill and the advantages hold with it on.
# The backbone frozen (recap.value_trainable head): the saved model holds only what trained, and
# advantages reads the rest from the base (the default pipeline trains a value model in mode all).
RUN = ["recap.value_steps=10", "train.save_every=5", "train.warmup_steps=2", "recap.value_bins=51",
       "recap.value_global_batch_size=16", "train.micro_batch_size=4", "train.nproc_per_node=2",
       "data.augment=openpi", "recap.value_trainable=head",
       "train.compile=off"]  # as written: no smoke_1card report to decide `auto` (pisft.train.decisions)


def _launch_cmd(results: Path, *extra: str, stage: str = "train_value") -> list[str]:
    cmd = [sys.executable, "-m", "pisft", "launch", stage, "--config", str(CONFIG)]
    for item in overrides(results, *RUN, *extra):
        cmd += ["--set", item]
    return cmd


def _gated(results: Path) -> Path:
    """results with smoke_value passed (train_value refuses to start without it), run for real."""
    _ok(subprocess.run(_launch_cmd(results, stage="smoke_value"), cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=launch_env()))
    report = json.loads((results / "value_smoke" / "report.json").read_text())
    assert report["passed"] and len(report["losses"]) >= 2, report
    return results


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def value_run(tmp_path_factory) -> Path:
    res = _gated(results_with_inputs(tmp_path_factory, "value_run"))
    _ok(subprocess.run(_launch_cmd(res), cwd=ROOT, capture_output=True, text=True, timeout=600, env=launch_env()))
    return res


@pytest.mark.integration
def test_train_value_writes_the_model_metrics_and_plot(value_run):
    out = value_run / "value"
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("spearman_heldout", "bin_accuracy_heldout", "loss_first", "loss_last", "steps", "frames_heldout"):
        assert key in metrics, key
    assert metrics["steps"] == 10 and metrics["bins"] == 51
    assert metrics["frames_heldout"] == 10 * 24  # 10 held-out episodes of 24 frames
    assert metrics["loss_last"] < metrics["loss_first"]
    assert metrics["spearman_heldout"] is None or -1 <= metrics["spearman_heldout"] <= 1
    assert 0 <= metrics["bin_accuracy_heldout"] <= 1
    assert (out / "calibration.png").stat().st_size > 1000
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 11))
    assert records[0]["lr"] < records[2]["lr"]  # warmup, then cosine
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["stage"] == "train_value"
    assert summary["augment"]["kind"] == "openpi"  # trained on augmented images, and says so
    assert json.loads((out / "pisft_config.json").read_text())["recap"]["value_steps"] == 10
    config = json.loads((out / "model" / value_model.CONFIG_FILE).read_text())
    assert config["bins"] == 51 and config["preset"] == "tiny" and config["return_min"] == -323.0
    assert Path(config["base_model"]) == value_run / "base_model"
    assert Path(config["frozen_from"]["dir"]) == value_run / "base_model" and config["frozen_dtype"] == "float32"
    assert set(load_file(out / "model" / "model.safetensors")) == {"readout.weight", "head.weight", "head.bias"}
    model, _ = value_model.load(out / "model")  # strict, the backbone from the base
    assert model.bins == 51
    runs = list((value_run / "checkpoints" / "value").glob("run-*/step_000010/COMPLETE.json"))
    assert len(runs) == 1
    assert not (value_run / "checkpoints" / "train").exists()




@pytest.mark.integration
def test_sigkill_then_rerun_resumes_the_value_run_exactly(tmp_path_factory, value_run):
    res = results_with_inputs(tmp_path_factory, "value_killed")
    shutil.copytree(value_run / "value_smoke", res / "value_smoke")  # the same settings: value_run's gate serves
    cmd = _launch_cmd(res)
    err = kill_rank1_after_checkpoint(cmd, res / "checkpoints" / "value", 5, timeout=400)
    assert "launch train_value" in err
    assert not (res / "value").exists()  # nothing that looks finished
    _ok(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=launch_env()))
    summary = json.loads((res / "value" / "train_summary.json").read_text())
    assert summary["resumed_from"]["step"] == 5
    ref, got = read_jsonl(value_run / "value" / "metrics.jsonl"), read_jsonl(res / "value" / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, 11))
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]
    wa, wb = load_file(value_run / "value" / "model" / "model.safetensors"), \
        load_file(res / "value" / "model" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@pytest.mark.integration
def test_advantages_label_the_pool_with_the_trained_value_model(value_run):
    from pisft.recap import advantages

    cfg = config_mod.load(CONFIG, overrides(value_run, *RUN))
    out = advantages.run(cfg)
    labels = pd.read_parquet(out / "labels.parquet")
    assert list(labels.columns[:4]) == ["episode_index", "frame_index", "advantage_continuous", "advantage"]
    assert {"value_current", "value_next", "reward_sum", "task_index", "source_type"} <= set(labels.columns)
    assert labels["advantage"].dtype == bool and labels["episode_index"].dtype == np.int64
    assert len(labels) == 50 * 24
    assert not labels.duplicated(["episode_index", "frame_index"]).any()
    sft = labels["source_type"] == "sft"
    assert set(labels.loc[sft, "episode_index"]) == {0, 5} and labels.loc[sft, "advantage"].all()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scope"] == "global" and summary["lookahead"] == 10
    threshold = summary["threshold"]
    assert threshold == pytest.approx(np.percentile(labels["advantage_continuous"], 70))
    by_value = labels["advantage_continuous"] >= threshold
    assert (labels["advantage"] == (by_value | sft)).all()
    assert summary["positive"] == int(labels["advantage"].sum())
    assert set(summary["per_source_type"]) == {"sft", "rollout"} and len(summary["per_task"]) == 10
    # V of the last frame's successor is 0: the last frame of every episode has value_next 0
    last = labels.groupby("episode_index").tail(1)
    assert (last["value_next"] == 0).all()


def test_train_value_needs_its_smoke_gate_passed(tmp_path):
    """The launcher refuses train_value before starting torchrun when smoke_value has not run or
    did not pass, as it refuses train_8card without smoke_1card."""
    from pisft.errors import PisftError
    from pisft.train import launch

    cfg = config_mod.load(CONFIG, [f"results_dir={tmp_path}", "recap.iterations=1"]).at_iteration(1)
    with pytest.raises(PisftError, match="run smoke_value first"):
        launch.check_gate_report(cfg, "train_value")
    report = layout.results(cfg, "value_smoke", "report.json")
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({"passed": False, "messages": ["loss_falling: first 5.6, last 5.9"]}))
    with pytest.raises(PisftError, match="did not pass:\n  - loss_falling"):
        launch.check_gate_report(cfg, "train_value")
    report.write_text(json.dumps({"passed": True}))
    assert launch.check_gate_report(cfg, "train_value")["passed"]
