"""torchrun end to end with the blocks compiled (`train.compile: layers`, inductor on the CPU):
the same losses and weights on 1 and on 2 processes, and a rerun that resumes from a checkpoint
bit-identically, both runs compiled (issue #45). The eager runs' versions of both are in
tests/test_train_integration.py; the compiled step against the eager one, in one process, is in
tests/test_train_compile.py.

The resumed run is one process: what compiling adds to a resume (the compiled blocks recompiled
or loaded by the rerun, then stepping on from the restored state) is the same on one process, and
each process of a compiled launch compiles (or loads) every block, the cost of these tests. It
resumes from the finished run's checkpoint of step 6, in a fresh results folder, as a run killed
after that checkpoint leaves it (train_fixtures.left_by_a_killed_run). The SIGKILL itself and the
launcher's report of it are test_train_integration.py's (test_sigkill_then_rerun_resumes_bit_identically),
resuming sharded state on 2 processes that test's and test_train_modes_integration.py's.

The run on 2 processes is `make test-all`'s only (marked extended, docs/development.md "Tiers"):
what it adds to `make test` is a second witness of three behaviours held there, the compiled step
equal to the eager one under FSDP2 (test_train_compile.py), the eager runs' world-size invariance
(test_train_integration.py::test_world_size_invariance) and a torchrun launch that compiles (the
resumed run's smoke report and summary, below).

The runs use the test run's inductor cache (tests/conftest.py): the first process compiles each
block, later ones load it, as a rerun of the same stage would."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from train_fixtures import launch, left_by_a_killed_run, read_jsonl, results_dir

pytestmark = pytest.mark.integration

# 12 steps, a checkpoint every 6: the rerun resumes from step 6's and runs 6 compiled steps
RUN = ["train.steps=12", "train.save_every=6", "train.warmup_steps=2", "train.global_batch_size=8",
       "train.micro_batch_size=4", "train.compile=layers"]
ONE = ("train.nproc_per_node=1",)
TWO = ("train.nproc_per_node=2", "train.fsdp_min_unit_params=0")  # FSDP2 with the accelerator's units


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def _weights(results):
    return load_file(results / "train" / "model" / "model.safetensors")


def _trained(tmp_path_factory, name: str, settings: tuple[str, ...]):
    res = results_dir(tmp_path_factory, name)
    _ok(launch("smoke_1card", res, *RUN, *settings, timeout=900))
    _ok(launch("train_8card", res, *RUN, *settings, timeout=900))
    return res


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    return _trained(tmp_path_factory, "compiled_one", ONE)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _trained(tmp_path_factory, "compiled_two", TWO)


@pytest.mark.extended  # held in `make test` by the tests the module's docstring names
def test_compiled_runs_agree_on_1_and_2_processes(one, two):
    report = json.loads((two / "smoke" / "report.json").read_text())
    assert report["passed"] is True and report["compile_s"] > 0  # the smoke gate reports the compilation
    a, b = read_jsonl(one / "train" / "metrics.jsonl"), read_jsonl(two / "train" / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 13))
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
    wa, wb = _weights(one), _weights(two)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-4, atol=1e-5)


def test_a_compiled_run_resumes_from_a_checkpoint_bit_identically(tmp_path_factory, one):
    # the launch compiled: the smoke gate timed the compilation, training ran the compiled blocks
    report = json.loads((one / "smoke" / "report.json").read_text())
    assert report["passed"] is True and report["compiled"] is True and report["compile_s"] > 0
    settings = json.loads((one / "train" / "train_summary.json").read_text())["step_settings"]
    assert [s["train.compile"] for s in settings] == ["layers"]
    res = results_dir(tmp_path_factory, "compiled_resumed")
    shutil.copytree(one / "smoke", res / "smoke")
    left_by_a_killed_run(one, res, 6)
    _ok(launch("train_8card", res, *RUN, *ONE, timeout=900))
    summary = json.loads((res / "train" / "train_summary.json").read_text())
    assert summary["resumed_from"]["step"] == 6
    assert {s["train.compile"] for s in summary["step_settings"]} == {"layers"}  # before the resume and after
    assert [r["loss"] for r in read_jsonl(res / "train" / "metrics.jsonl")] == \
        [r["loss"] for r in read_jsonl(one / "train" / "metrics.jsonl")]
    ref, got = _weights(one), _weights(res)
    for key in ref:
        assert torch.equal(got[key], ref[key]), key
