"""The smoke gate decides `train.compile: auto` on the run's device (pisft.gates.compile_trial), and
training follows the report (pisft.train.decisions).

The trial runs in the gate's own process on the tiny model: its smoke steps eagerly, then again
compiled. On the CPU it is skipped unless forced (`compile_trial.FORCE_ENV`); the tests force it
and give the compiled blocks a backend of their own (`blocks.COMPILE_BACKENDS["cpu"]`): one that
raises, one that hangs, one that changes the blocks' outputs, and dynamo's `eager` backend (the
same arithmetic through a traced graph), so no test waits for inductor.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
from train_fixtures import CONFIG, overrides, results_dir

from pisft import config as config_mod
from pisft import device as devices
from pisft import layout
from pisft.errors import PisftError
from pisft.gates import compile_trial, smoke
from pisft.train import blocks, decisions
from pisft.train.job import Context


@pytest.fixture
def ctx(tmp_path_factory):
    res = results_dir(tmp_path_factory, "gate_decisions")
    cfg = config_mod.load(CONFIG, overrides(res, "smoke.steps=2", "train.micro_batch_size=1"))
    store = dist.FileStore(str(res / "pg_store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    info = devices.DeviceInfo(kind="cpu", backend="gloo", device=torch.device("cpu"), name="cpu")
    yield Context(cfg, "smoke_1card", info, 0, 1)
    dist.destroy_process_group()
    from torch import _dynamo

    _dynamo.reset()


def _gate(ctx, monkeypatch, backend=None, bound=None):
    """The gate's steps (no estimate: the CPU has no capacity to check) with the trial forced; the
    report's compile decision."""
    monkeypatch.setenv(compile_trial.FORCE_ENV, "1")
    if bound is not None:
        monkeypatch.setenv(compile_trial.BOUND_ENV, str(bound))
    if backend is not None:
        monkeypatch.setitem(blocks.COMPILE_BACKENDS, "cpu", lambda kind: backend)
    report = {"estimate": None}
    run = smoke._run_steps(ctx, report)
    assert run.failure is None
    return report[decisions.DECISIONS][decisions.COMPILE], run


@pytest.mark.integration  # ~20-60 s on 2 cores: the tiny model's smoke steps, eager then compiled
def test_a_compile_that_fails_chooses_eager_in_one_line(ctx, monkeypatch):
    def broken(gm, example_inputs):
        raise RuntimeError("inductor: no kernel for this op\nsecond line of the trace")

    entry, run = _gate(ctx, monkeypatch, broken)
    assert entry["chosen"] == "off" and entry["setting"] == "auto"
    assert "\n" not in entry["line"] and "failed" in entry["line"] and "no kernel for this op" in entry["line"]
    assert entry["trial"]["compiled"] is None and entry["trial"]["eager"]["losses"]
    assert not run.built.compiler.enabled  # the gate's remaining measurement runs eagerly
    assert "forward" not in vars(run.built.model)


@pytest.mark.integration  # ~20-60 s on 2 cores: the tiny model's smoke steps, eager then compiled
def test_a_compile_that_hangs_past_its_bound_chooses_eager(ctx, monkeypatch):
    def stuck(gm, example_inputs):
        time.sleep(60)
        return gm.forward

    entry, _ = _gate(ctx, monkeypatch, stuck, bound=1)
    assert entry["chosen"] == "off"
    assert "hung past its bound" in entry["line"] and "1 s" in entry["line"]


@pytest.mark.integration  # ~20-60 s on 2 cores: the tiny model's smoke steps, eager then compiled
def test_a_compile_that_disagrees_chooses_eager(ctx, monkeypatch):
    def off_by_a_percent(gm, example_inputs):
        def run(*args):
            out = gm(*args)
            return type(out)(o * 1.01 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out) \
                if isinstance(out, tuple | list) else out * 1.01
        return run

    entry, run = _gate(ctx, monkeypatch, off_by_a_percent)
    trial = entry["trial"]
    assert entry["chosen"] == "off" and not trial["agree"]
    assert "disagrees" in entry["line"] and "\n" not in entry["line"]
    assert trial["max_rel_loss"] > trial["tolerance"]["loss"] or \
        trial["max_rel_grad_norm"] > trial["tolerance"]["grad_norm"]
    assert len(trial["compiled"]["losses"]) == len(trial["eager"]["losses"]) == 2
    assert run.records[0]["loss"] == trial["eager"]["losses"][0]  # the report's figures: eager's


@pytest.mark.integration  # ~20-60 s on 2 cores: the tiny model's smoke steps, eager then compiled
def test_a_compile_that_agrees_is_timed_and_chosen_by_its_speed(ctx, monkeypatch):
    """dynamo's `eager` backend: the blocks traced into graphs and run as they are: both runs start
    from the same weights, so the losses agree; the faster one is chosen, by the stated rule."""
    entry, run = _gate(ctx, monkeypatch, "eager")
    trial = entry["trial"]
    assert trial["agree"], entry["line"]
    assert trial["compiled"]["losses"] == pytest.approx(trial["eager"]["losses"], rel=1e-6)
    te, tc = trial["eager"]["step_time_s"], trial["compiled"]["step_time_s"]
    assert entry["chosen"] == ("layers" if tc < te * (1 - compile_trial.MIN_GAIN) else "off")
    assert run.built.compiler.enabled == (entry["chosen"] == "layers")


def test_auto_on_the_cpu_skips_the_trial_and_says_why(monkeypatch):
    monkeypatch.delenv(compile_trial.FORCE_ENV, raising=False)
    assert not compile_trial.wants_trial("auto", "cpu")
    assert compile_trial.as_written("auto") == {"setting": "auto", "chosen": "off", "line": compile_trial.CPU_SKIP,
                                                "trial": None}
    monkeypatch.setenv(compile_trial.FORCE_ENV, "1")
    assert compile_trial.wants_trial("auto", "cpu")


def test_an_explicit_setting_runs_as_written_without_a_trial():
    assert not compile_trial.wants_trial("layers", "cuda") and not compile_trial.wants_trial("off", "npu")
    assert compile_trial.wants_trial("auto", "cuda")
    assert compile_trial.as_written("layers")["chosen"] == "layers"
    assert compile_trial.first_mode("layers") == "layers" and compile_trial.first_mode("auto") == "off"


def test_training_follows_the_reports_choice(tmp_path):
    cfg = config_mod.load(CONFIG, [f"results_dir={tmp_path}"])
    with pytest.raises(PisftError, match="run smoke_1card first"):
        decisions.for_training(cfg, print)
    report = layout.smoke_report(cfg)
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({"passed": True}))
    with pytest.raises(PisftError, match="records no decisions"):
        decisions.resolved_compile(cfg)
    entry = compile_trial.judge({"losses": [1.0, 0.9], "grad_norms": [2.0, 1.5], "step_time_s": 1.0},
                                {"losses": [1.0, 0.9], "grad_norms": [2.0, 1.5], "step_time_s": 0.5}, "fp32")
    report.write_text(json.dumps({"passed": True, "decisions": {decisions.COMPILE: entry}}))
    lines: list[str] = []
    run_cfg = decisions.for_training(cfg, lines.append)
    assert run_cfg.train.compile == "layers" and cfg.train.compile == "auto"
    assert len(lines) == 1 and "auto -> layers" in lines[0]
    explicit = config_mod.load(CONFIG, [f"results_dir={tmp_path}", "train.compile=off"])
    assert decisions.for_training(explicit, print) is explicit  # as written: the report is not asked
    with pytest.raises(ValueError, match="resolved"):
        blocks.compiler_for("auto", "cuda", tmp_path, print)


def _report_choosing(cfg, chosen: str) -> None:
    report = layout.smoke_report(cfg)
    report.parent.mkdir(parents=True, exist_ok=True)
    entry = compile_trial.as_written(chosen)
    entry["setting"] = "auto"
    report.write_text(json.dumps({"passed": True, "decisions": {decisions.COMPILE: entry}}))


def test_the_compile_mode_a_run_executes_is_its_identity(tmp_path):
    """A finished eager run is not resumed by a compiled one (issue 56): the mode the steps run in,
    `auto` as the gate decided it, is in the run fingerprint, hence the run folder."""
    from pisft.train import run_folders
    from pisft.train.checkpoint import run_fingerprint

    auto = config_mod.load(CONFIG, [f"results_dir={tmp_path}"])
    off = config_mod.load(CONFIG, [f"results_dir={tmp_path}", "train.compile=off"])
    layers = config_mod.load(CONFIG, [f"results_dir={tmp_path}", "train.compile=layers"])
    folder = {name: run_folders.stage_checkpoint_root("train_8card", c)
              for name, c in (("off", off), ("layers", layers))}
    assert folder["off"] != folder["layers"]
    assert run_fingerprint(layers)["train.compile"] == "layers"
    _report_choosing(auto, "off")
    assert run_folders.stage_checkpoint_root("train_8card", auto) == folder["off"]
    assert run_fingerprint(decisions.for_training(auto, print))["train.compile"] == "off"
    _report_choosing(auto, "layers")
    assert run_folders.stage_checkpoint_root("train_8card", auto) == folder["layers"]


def test_a_resume_under_other_settings_is_recorded_and_said_in_one_line():
    from pisft.train import step_record

    cfg = config_mod.load(CONFIG, [])
    four = step_record.settings(cfg, 2, "off")
    assert step_record.before(None, 0) == [] and step_record.mixed_line([], four, 0) is None
    first = step_record.upto([], four, 0, 50)
    assert first == [{"first_step": 1, "last_step": 50, **four}]
    same = step_record.before({"step_settings": first}, 50)
    assert step_record.mixed_line(same, four, 50) is None
    assert step_record.upto(same, four, 50, 150)[-1] == {"first_step": 51, "last_step": 150, **four}
    eight = step_record.settings(decisions.with_train(cfg, micro_batch_size=8), 1, "off")
    line = step_record.mixed_line(same, eight, 50)
    assert line is not None and "\n" not in line
    assert "steps 1-50: " in line and "train.micro_batch_size 4" in line and "train.micro_batch_size 8" in line
    record = step_record.upto(same, eight, 50, 150)
    assert [(e["first_step"], e["last_step"], e["train.micro_batch_size"]) for e in record] == [
        (1, 50, 4), (51, 150, 8)]
    # a checkpoint written before the record: its steps are said to be unrecorded
    old = step_record.before({"step": 50}, 50)
    assert old == [{"first_step": 1, "last_step": 50, "recorded": False}]
    assert "not recorded" in step_record.mixed_line(old, four, 50)
