"""torchrun end to end on the tiny model: world-size invariance, real sharding, multi-node,
SIGKILL + automatic exact resume, resume on another number of processes. The runs keep an EMA of
the weights (train.ema_decay) and export it, and augment the images (data.augment: openpi, drawn
per sample from (seed, step, position)), so each of these holds for the EMA and the augmentation
too: the same at any world size, resumed bit-identically after a kill, resharded on another
number of processes."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pisft.ports import held_port
from train_fixtures import (ROOT, kill_rank1_after_checkpoint, launch, launch_cmd, launch_env, left_by_a_killed_run,
                            read_jsonl, results_dir)

pytestmark = pytest.mark.integration

RUN = ["train.steps=10", "train.save_every=5", "train.warmup_steps=2", "train.global_batch_size=16",
       "train.micro_batch_size=4", "train.ema_decay=0.9", "data.augment=openpi"]
# The layer units an accelerator trains with, not the CPU's merged units. Bit-identical results
# need the same layout: another unit layout (other gathered buffers, other BLAS paths) agrees to
# the tolerances of test_world_size_invariance, not to the bit.
LAYER_UNITS = "train.fsdp_min_unit_params=0"
METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "step_time_s", "samples_per_s", "data_wait_s",
               "peak_memory_bytes", "mfu"}


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
            res = results_dir(tmp_path_factory, f"smoke{len(made)}")
            _ok(launch("smoke_1card", res, *RUN, *overrides))
            made[key] = res
        return made[key]

    return made_with


def _with_smoke(tmp_path_factory, name: str, smoke, *overrides: str) -> Path:
    res = results_dir(tmp_path_factory, name)
    shutil.copytree(smoke(*overrides) / "smoke", res / "smoke")
    return res


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, smoke):
    res = _with_smoke(tmp_path_factory, "one", smoke, "train.nproc_per_node=1")
    _ok(launch("train_8card", res, *RUN, "train.nproc_per_node=1"))
    return res


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, smoke):
    """2 nodes x 1 process on localhost: world size 2, rendezvous at node 0."""
    res = _with_smoke(tmp_path_factory, "two", smoke, "train.nproc_per_node=1", LAYER_UNITS)
    with held_port() as port:  # node 0's torchrun binds it for the rendezvous; nothing else can meanwhile
        procs = [subprocess.Popen(
            launch_cmd("train_8card", res, *RUN, "train.nproc_per_node=1", "train.nnodes=2", LAYER_UNITS,
                       f"train.node_rank={node}", f"train.rdzv_endpoint=127.0.0.1:{port}"),
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=launch_env())
            for node in (0, 1)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return res


def test_smoke_report(smoke):
    report = json.loads((smoke("train.nproc_per_node=2", LAYER_UNITS) / "smoke" / "report.json").read_text())
    assert report["passed"] is True
    assert report["last_loss"] < report["first_loss"]
    assert report["capacity_bytes"] is None and report["memory_headroom"] is None
    assert report["projected_wall_time_s"]["1"] > report["projected_wall_time_s"]["2"] > 0
    assert report["peak_memory_bytes"] > 0 and report["step_time_s"] > 0


def test_world_size_invariance(one_process, two_nodes):
    """1 process x accumulation 4 and 2 processes x accumulation 2: same losses, same weights."""
    a, b = read_jsonl(one_process / "train" / "metrics.jsonl"), read_jsonl(two_nodes / "train" / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 11))
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
        assert set(ra) >= METRIC_KEYS
    assert a[-1]["loss"] < a[0]["loss"]
    wa, wb = _weights(one_process), _weights(two_nodes)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-4, atol=1e-5)
    assert all(len(r["peak_memory_bytes_per_rank"]) == 2 for r in b)
    summary = json.loads((two_nodes / "train" / "train_summary.json").read_text())
    assert summary["world_size"] == 2
    # the export is the EMA, and says so
    info = json.loads((two_nodes / "train" / "model" / "pisft_model.json").read_text())
    assert info["weights"] == summary["weights"] == {"kind": "ema", "ema_decay": 0.9}
    # trained on augmented images, and says so
    assert info["augment"] == summary["augment"] and summary["augment"]["kind"] == "openpi"
    assert summary["augment"]["cropped_and_rotated"] == ["observation.images.base_0_rgb"]
    # which steps ran under which settings: train.compile: auto as the gate decided it on the CPU
    assert info["step_settings"] == summary["step_settings"] == [
        {"first_step": 1, "last_step": 10, "train.compile": "off", "train.micro_batch_size": 4,
         "train.activation_checkpointing": False, "world_size": 2}]
    assert summary["mixed_settings"] is None and info["mixed_settings"] is None
    config = json.loads((two_nodes / "train" / "pisft_config.json").read_text())
    assert config["train"]["compile"] == "off"  # what ran, not `auto`


def test_each_rank_holds_half_and_units_cover_the_model(two_nodes):
    from pisft.model.policy import load_policy

    sharding = json.loads((two_nodes / "train" / "train_summary.json").read_text())["sharding_rank0"]
    assert sharding["all_params_sharded"] is True
    assert sharding["params_local_fraction"] == pytest.approx(0.5, abs=0.02)
    assert sharding["optimizer_state_local_fraction"] == pytest.approx(0.5, abs=0.02)
    assert {"vision", "decoder", "action"} <= set(sharding["units_by_group"])
    load_policy(two_nodes / "train" / "model")  # the export loads strictly
    # The expert lm_head was not trained (detached) and comes back unchanged from the base model.
    from safetensors import safe_open

    from pisft.model.pi05.parts import EXPERT_HEAD
    with safe_open(str(two_nodes / "train" / "model" / "model.safetensors"), "pt") as out, \
            safe_open(str(two_nodes / "base_model" / "model.safetensors"), "pt") as base:
        assert torch.equal(out.get_tensor(EXPERT_HEAD), base.get_tensor(EXPERT_HEAD))




def test_sigkill_then_rerun_resumes_bit_identically(tmp_path_factory, smoke, two_nodes):
    res = _with_smoke(tmp_path_factory, "killed", smoke, "train.nproc_per_node=2", LAYER_UNITS)
    cmd = launch_cmd("train_8card", res, *RUN, "train.nproc_per_node=2", LAYER_UNITS)
    kill_rank1_after_checkpoint(cmd, res / "checkpoints" / "train", 5, timeout=240)
    assert not (res / "train").exists()  # nothing that looks finished

    _ok(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=launch_env()))
    summary = json.loads((res / "train" / "train_summary.json").read_text())
    assert summary["resumed_from"]["step"] == 5
    import torch.distributed.checkpoint as dcp
    (step5,) = (res / "checkpoints" / "train").glob("run-*/step_000005")
    saved = dcp.FileSystemReader(str(step5 / "dcp")).read_metadata().state_dict_metadata
    assert any(k.startswith("ema.") for k in saved)  # the average is in the checkpoint
    ref, got = _weights(two_nodes), _weights(res)  # the exported EMA: resumed exactly
    for key in ref:
        assert torch.equal(got[key], ref[key]), key
    metrics = read_jsonl(res / "train" / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, 11))
    assert [r["loss"] for r in metrics] == [r["loss"] for r in read_jsonl(two_nodes / "train" / "metrics.jsonl")]


def test_resume_on_a_different_number_of_processes(tmp_path_factory, smoke, two_nodes):
    res = _with_smoke(tmp_path_factory, "reshard", smoke, "train.nproc_per_node=1")
    step5 = left_by_a_killed_run(two_nodes, res, 5)  # same settings but the world size: same run folder
    _ok(launch("train_8card", res, *RUN, "train.nproc_per_node=1"))
    summary = json.loads((res / "train" / "train_summary.json").read_text())
    assert summary["resumed_from"] == {"path": str(step5), "step": 5, "world_size": 2}
    # the steps before the resume ran on 2 processes: recorded, and said in one line
    assert [(e["first_step"], e["last_step"], e["world_size"]) for e in summary["step_settings"]] == [(1, 5, 2),
                                                                                                    (6, 10, 1)]
    assert "this run mixes settings: steps 1-5: " in summary["mixed_settings"]
    ref = read_jsonl(two_nodes / "train" / "metrics.jsonl")
    got = read_jsonl(res / "train" / "metrics.jsonl")
    steps = [r["step"] for r in ref]
    assert [r["step"] for r in got] == steps == list(range(1, len(ref) + 1))  # none lost, none twice
    for ra, rb in zip(ref[5:], got[5:], strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
    wa, wb = _weights(two_nodes), _weights(res)
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-4, atol=1e-5)


def test_a_changed_setting_after_a_finished_run_trains_afresh(tmp_path_factory, smoke, one_process):
    """A finished run's checkpoints are not resumed by a run of another fingerprint (issue 11: fp32
    -> bf16 resumed the fp32 checkpoints). Which keys enter the fingerprint, train.precision among
    them, is tests/test_config_marks.py's; here a key the smoke gate does not share (train.steps),
    so the finished run's gate serves and only training runs."""
    res = _with_smoke(tmp_path_factory, "afresh", smoke, "train.nproc_per_node=1")
    shutil.copytree(one_process / "checkpoints", res / "checkpoints")
    (finished,) = (res / "checkpoints" / "train").glob("run-*")
    proc = launch("train_8card", res, *RUN, "train.nproc_per_node=1", "train.steps=12")
    _ok(proc)
    out = proc.stdout + proc.stderr  # the workers' output comes through torchrun's stdout
    assert "starting from step 0" in out and "resuming from" not in out, out[-3000:]
    assert "1 earlier run(s) this one cannot resume (other settings, inputs or parameter layout" in out
    summary = json.loads((res / "train" / "train_summary.json").read_text())
    assert summary["resumed_from"] is None
    runs = sorted((res / "checkpoints" / "train").glob("run-*"))
    assert len(runs) == 2 and finished in runs
    assert [r["step"] for r in read_jsonl(res / "train" / "metrics.jsonl")] == list(range(1, 13))
