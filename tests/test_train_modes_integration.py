"""torchrun end to end on the tiny model in the `expert` and `lora` modes (train.trainable): frozen
weights bit-identical to the base, checkpoints holding the trained tensors only; in the lora mode
the same losses and weights at world size 1 and 2 and the exact resume from a checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_fixtures import launch, left_by_a_killed_run, read_jsonl, results_dir

pytestmark = pytest.mark.integration

MODES = {"expert": ["train.trainable=expert"],
         # openpi's preset: adapters on both Gemmas, SigLIP and the projections in full
         "lora": ["train.trainable=lora", "train.lora_targets=openpi"]}
RUN = ["train.steps=6", "train.save_every=3", "train.warmup_steps=2", "train.global_batch_size=8",
       "train.micro_batch_size=4"]
LAYER_UNITS = "train.fsdp_min_unit_params=0"  # the accelerator's layer units (see test_train_integration)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def _weights(results: Path) -> dict[str, torch.Tensor]:
    return load_file(results / "train" / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """smoke_1card with RUN and a training run's own settings, each made once: train_8card refuses a
    smoke report of other settings (the smoke row's keys: pisft.train.launch.SMOKE_MUST_MATCH)."""
    made: dict[tuple[str, ...], Path] = {}

    def made_with(*overrides: str) -> Path:
        key = tuple(sorted(overrides))
        if key not in made:
            res = results_dir(tmp_path_factory, f"modes_smoke{len(made)}")
            _ok(launch("smoke_1card", res, *RUN, *overrides, timeout=900))
            made[key] = res
        return made[key]

    return made_with


def _run(tmp_path_factory, smoke, name: str, *extra: str) -> Path:
    res = results_dir(tmp_path_factory, name)
    shutil.copytree(smoke(*extra) / "smoke", res / "smoke")
    _ok(launch("train_8card", res, *RUN, *extra, timeout=900))
    return res


@pytest.fixture(scope="module", params=list(MODES))
def runs(request, tmp_path_factory, smoke):
    """Each mode on 2 processes (FSDP2, the accelerator's layer units)."""
    mode = request.param
    if mode == "lora":
        return mode, request.getfixturevalue("lora_two")  # one run serves every lora test
    return mode, _run(tmp_path_factory, smoke, f"{mode}_two", *MODES[mode], "train.nproc_per_node=2", LAYER_UNITS)


@pytest.fixture(scope="module")
def lora_two(tmp_path_factory, smoke):
    return _run(tmp_path_factory, smoke, "lora_two", *MODES["lora"], "train.nproc_per_node=2", LAYER_UNITS)


# World-size invariance and the exact resume run in the lora mode only: its
# adapters are the sharded, checkpointed and resumed state the other modes do not have (the frozen
# base stays out of both), and `all` has both checks in tests/test_train_integration.py. The
# expert mode's runs check what freezing does (frozen weights, trained-only checkpoints).
def test_same_loss_and_weights_at_world_size_1_and_2(tmp_path_factory, smoke, lora_two):
    mode, two = "lora", lora_two
    one = _run(tmp_path_factory, smoke, "lora_one", *MODES[mode], "train.nproc_per_node=1")
    a, b = read_jsonl(one / "train" / "metrics.jsonl"), read_jsonl(two / "train" / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
    wa, wb = _weights(one), _weights(two)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-4, atol=1e-5)
    info = json.loads((two / "train" / "model" / "pisft_model.json").read_text())
    assert info["trainable"]["mode"] == mode
    assert 0 < info["trainable"]["trainable_params"] < info["trainable"]["total_params"]


def test_frozen_weights_are_the_bases_bit_for_bit_and_trained_ones_moved(runs):
    mode, two = runs
    base, out = load_file(two / "base_model" / "model.safetensors"), _weights(two)
    assert out.keys() == base.keys()  # a plain pi0.5 file (LoRA merged)
    vlm = [k for k in out if ".paligemma_with_expert.paligemma.model.language_model." in k]
    expert = [k for k in out if ".gemma_expert.model.layers." in k]
    assert vlm and expert
    norms = [k for k in vlm if "layernorm" in k]  # frozen in both modes (openpi freezes the LLM's norms)
    for key in norms:
        assert torch.equal(out[key], base[key]), key
    if mode == "expert":
        for key in vlm:
            assert torch.equal(out[key], base[key]), key
        assert any(not torch.equal(out[k], base[k]) for k in expert)
    else:  # merged adapters move the adapted weights, frozen embedding and norms stay
        q = [k for k in vlm if k.endswith("self_attn.q_proj.weight")]
        assert all(not torch.equal(out[k], base[k]) for k in q)
    assert (two / "train" / "adapter" / "adapter_config.json").is_file() == (mode == "lora")


def _checkpoint_bytes(results: Path) -> int:
    (run,) = (results / "checkpoints" / "train").glob("run-*")
    step = sorted(run.glob("step_*"))[-1]
    return sum(f.stat().st_size for f in (step / "dcp").rglob("*") if f.is_file())


def test_checkpoints_hold_the_trained_tensors_only(runs):
    mode, two = runs
    import torch.distributed.checkpoint as dcp

    (run,) = (two / "checkpoints" / "train").glob("run-*")
    step = sorted(run.glob("step_*"))[-1]
    saved = dcp.FileSystemReader(str(step / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and not any(".paligemma.model.language_model.layers." in k and ".lora_" not in k
                                  for k in model_keys)
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["base"]["dir"] == str(two / "base_model")
    total = sum(t.numel() * t.element_size() for t in _weights(two).values())
    assert _checkpoint_bytes(two) < 3 * total  # weights + 2 AdamW moments of what trains only


def test_a_rerun_resumes_from_a_checkpoint_bit_identically(tmp_path_factory, smoke, lora_two):
    """The LoRA run on 2 processes resumed from its checkpoint of step 3 (the adapters' shards and
    their AdamW moments, the frozen base from its folder), as a run killed after it leaves it
    (train_fixtures.left_by_a_killed_run; the SIGKILL and the launcher's report of it are
    test_train_integration.py's, on the same launcher and checkpoints)."""
    mode, two = "lora", lora_two
    res = results_dir(tmp_path_factory, f"{mode}_resumed")
    settings = (*MODES[mode], "train.nproc_per_node=2", LAYER_UNITS)  # lora_two's: its smoke serves
    shutil.copytree(smoke(*settings) / "smoke", res / "smoke")
    left_by_a_killed_run(two, res, 3)
    _ok(launch("train_8card", res, *RUN, *settings, timeout=900))
    summary = json.loads((res / "train" / "train_summary.json").read_text())
    assert summary["resumed_from"]["step"] == 3
    ref, got = _weights(two), _weights(res)
    for key in ref:
        assert torch.equal(got[key], ref[key]), key
    assert [r["loss"] for r in read_jsonl(res / "train" / "metrics.jsonl")] == \
        [r["loss"] for r in read_jsonl(two / "train" / "metrics.jsonl")]
