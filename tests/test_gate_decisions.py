"""The smoke gate decides `train.compile: auto` (pisft.gates.compile_trial), and
`train.micro_batch_size: auto` / `train.activation_checkpointing: auto` (pisft.gates.micro_batch), on
the run's device, and training follows the report (pisft.train.decisions), recording which steps ran
under which settings (pisft.train.step_record).

The memory decisions run on the CPU given a capacity (`device.MEMORY_CAP_ENV`, a stand-in): the
CPU's peak is the process's peak resident set size, so a cap far above it lets every candidate fit
and one below it none; the rule between is tested on a table of needs.

The trial runs in the gate's own process on the tiny model: its smoke steps eagerly, then again
compiled. On the CPU it is skipped unless forced (`compile_trial.FORCE_ENV`); the tests force it
and give the compiled blocks a backend of their own (`blocks.COMPILE_BACKENDS["inductor"]`, the CPU
row's): one that raises, one that hangs, one that changes the blocks' outputs, and dynamo's `eager` backend (the
same arithmetic through a traced graph), so no test waits for inductor.
"""

from __future__ import annotations

import dataclasses
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
        monkeypatch.setitem(blocks.COMPILE_BACKENDS, "inductor", lambda kind: backend)
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
    from pisft.train.run_folders import run_fingerprint

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


# ------------------------------------------------------------------ micro batch and checkpointing
GIB = 2**30


def _sizing(needs: dict[tuple[int, bool], float], limit_gib: float):
    """The gate's search over a table of per-device needs in GiB (state 0, one process): the rule
    alone; the measurement on the tiny model is the tests below."""
    from pisft.gates import micro_batch

    def measure(m, ckpt):
        n = needs.get((m, ckpt))
        return None if n is None else (int(n * GIB), 0)
    return micro_batch.Sizing(measure, 1, 0, int(limit_gib * GIB))


def test_auto_takes_the_largest_micro_batch_that_fits_and_checkpoints_only_where_it_must():
    from pisft.gates import micro_batch

    assert micro_batch.candidates([16], 2) == [1, 2, 4, 8]
    assert micro_batch.candidates([16, 24], 2) == [1, 2, 4]  # the value model's batch too (RECAP)
    off = {(1, False): 3, (2, False): 5, (4, False): 9, (8, False): 17}
    on = {(1, True): 2, (2, True): 3, (4, True): 5, (8, True): 8}
    sizes = [1, 2, 4, 8]
    assert micro_batch.decide("auto", False, sizes, _sizing(off, 10))["chosen"] == (4, False)
    # checkpointing auto: off while it fits, on where only it lets a larger micro batch fit
    assert micro_batch.decide("auto", "auto", sizes, _sizing({**off, **on}, 10))["chosen"] == (8, True)
    assert micro_batch.decide("auto", "auto", sizes, _sizing({**off, **on}, 20))["chosen"] == (8, False)
    assert micro_batch.decide(4, "auto", sizes, _sizing({**off, **on}, 8))["chosen"] == (4, True)
    # out of memory stops the search like a miss
    short = _sizing({(1, False): 3, (2, False): 5}, 10)
    assert micro_batch.decide("auto", False, sizes, short)["chosen"] == (2, False)


def test_an_explicit_micro_batch_that_does_not_fit_names_the_largest_that_does():
    from pisft.gates import micro_batch

    sizing = _sizing({(1, False): 3, (2, False): 5, (4, False): 9, (8, False): 17}, 10)
    result = micro_batch.decide(8, False, [1, 2, 4, 8], sizing)
    assert result["chosen"] is None and result["largest_fitting"] == 4
    entry, _ = micro_batch.entries(8, False, result, sizing, free=11 * GIB, capacity=20 * GIB, margin=GIB, hccl=0)
    assert "micro batch 8 does not fit" in entry["line"] and "the largest that fits is 4" in entry["line"]
    assert [m["need_bytes"] for m in entry["measured"]] == [17 * GIB, 3 * GIB, 5 * GIB, 9 * GIB]


def _capped_gate(ctx, monkeypatch, cap: int, **train):
    monkeypatch.setenv(devices.MEMORY_CAP_ENV, str(cap))
    report = {"estimate": None}
    run = smoke._run_steps(dataclasses.replace(ctx, cfg=decisions.with_train(ctx.cfg, **train)), report)
    return run, report[decisions.DECISIONS]


@pytest.mark.integration  # ~30-60 s on 2 cores: a step of the tiny model per candidate, then the smoke steps
def test_with_the_devices_memory_capped_auto_picks_a_micro_batch_that_fits(ctx, monkeypatch):
    """The CPU given a capacity (device.MEMORY_CAP_ENV): the gate measures each candidate's peak (the
    process's peak resident set size on the CPU) and keeps the largest whose need fits."""
    cap = 64 * GIB  # the tiny model fits at every candidate
    run, found = _capped_gate(ctx, monkeypatch, cap, micro_batch_size="auto", activation_checkpointing="auto")
    assert run.failure is None
    entry, ckpt = found[decisions.MICRO_BATCH], found[decisions.CHECKPOINTING]
    assert entry["setting"] == "auto" and entry["fits"] and entry["limit_bytes"] < cap
    assert entry["chosen"] == 8 and ckpt["chosen"] is False  # 16 over 2 processes: 8 at most, off fits
    assert all(m["need_bytes"] <= entry["limit_bytes"] for m in entry["measured"])
    assert [m["micro_batch_size"] for m in entry["measured"]] == [1, 2, 4, 8]
    assert run.ctx.cfg.train.micro_batch_size == 8 and len(run.records) == 2  # the smoke steps ran at it
    # a budget below what the process already holds: no micro batch fits, and the gate says so
    run, found = _capped_gate(ctx, monkeypatch, 2**20, micro_batch_size="auto", activation_checkpointing=False)
    assert run.failure is not None and "no micro batch fits" in run.failure and "none fits" in run.failure
    assert found[decisions.MICRO_BATCH]["chosen"] is None and not run.records  # no smoke step ran


def test_a_micro_batch_that_does_not_fit_is_refused_before_torchrun(tmp_path, monkeypatch):
    """train_8card's launcher reads the gate's failed report and stops before torchrun starts."""
    import subprocess as sp

    from pisft.gates import micro_batch
    from pisft.train import launch

    cfg = config_mod.load(CONFIG, [f"results_dir={tmp_path}", "train.micro_batch_size=8"])
    sizing = _sizing({(1, False): 3, (2, False): 5, (4, False): 9, (8, False): 17}, 10)
    entry, ckpt = micro_batch.entries(8, False, micro_batch.decide(8, False, [1, 2, 4, 8], sizing), sizing,
                                      free=11 * GIB, capacity=20 * GIB, margin=GIB, hccl=0)
    report = layout.smoke_report(cfg)
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({  # as run_smoke writes a failed fit (its failure message is the line)
        "passed": False, "messages": [smoke.failure_message(cfg, {
            "name": "fits_in_memory", "passed": False, "detail": f"{decisions.MICRO_BATCH}: {entry['line']}"})],
        "pisft_config": config_mod.resolved(cfg),
        "decisions": {decisions.COMPILE: compile_trial.as_written("auto"), decisions.MICRO_BATCH: entry,
                      decisions.CHECKPOINTING: ckpt}}))

    def no_torchrun(*args, **kwargs):
        raise AssertionError("torchrun started")

    monkeypatch.setattr(sp, "Popen", no_torchrun)
    with pytest.raises(PisftError, match="micro batch 8 does not fit.*the largest that fits is 4"):
        launch.main("train_8card", cfg, str(CONFIG), [])


def test_auto_passes_validation_and_needs_a_memory_figure(tmp_path):
    from pisft.gates import micro_batch

    cfg = config_mod.load(CONFIG, [f"results_dir={tmp_path}", "train.micro_batch_size=auto",
                                   "train.activation_checkpointing=auto"])
    assert cfg.grad_accum_steps is None and config_mod.resolved(cfg)["derived"]["grad_accum_steps"] is None
    assert "PISFT_DEVICE_MEMORY_BYTES" in micro_batch.NO_FIGURE
    with pytest.raises(config_mod.ConfigError, match="not divisible by the world size 2"):
        config_mod.load(CONFIG, [f"results_dir={tmp_path}", "train.micro_batch_size=auto",
                                 "train.global_batch_size=15"])
    with pytest.raises(config_mod.ConfigError, match="must be a number of samples or auto"):
        config_mod.load(CONFIG, [f"results_dir={tmp_path}", "train.micro_batch_size=most"])
    # training follows the gate's choice, and refuses one that does not split the global batch
    report = layout.smoke_report(cfg)
    report.parent.mkdir(parents=True)
    made = {decisions.COMPILE: compile_trial.as_written("auto"),
            decisions.MICRO_BATCH: {"setting": "auto", "chosen": 8, "line": "micro batch 8"},
            decisions.CHECKPOINTING: {"setting": "auto", "chosen": False, "line": "off fits"}}
    report.write_text(json.dumps({"passed": True, "decisions": made}))
    run_cfg = decisions.for_training(cfg, print)
    assert (run_cfg.train.micro_batch_size, run_cfg.train.activation_checkpointing, run_cfg.grad_accum_steps) == \
        (8, False, 1)
    made[decisions.MICRO_BATCH]["chosen"] = 3
    report.write_text(json.dumps({"passed": True, "decisions": made}))
    with pytest.raises(PisftError, match="train.global_batch_size: 16 is not divisible"):
        decisions.for_training(cfg, print)


def test_a_resumed_auto_run_keeps_its_micro_batch_where_it_fits():
    from pisft.train import run as run_mod

    cfg = decisions.with_train(config_mod.load(CONFIG, []), micro_batch_size=4)
    info = devices.DeviceInfo(kind="cpu", backend="gloo", device=torch.device("cpu"), name="cpu")
    ctx = Context(cfg, "train_8card", info, 1, 2)  # rank 1: no log lines
    assert run_mod._keep_micro_batch(ctx, 2, 16).cfg.train.micro_batch_size == 2  # started at 2: kept
    assert run_mod._keep_micro_batch(ctx, 8, 16).cfg.train.micro_batch_size == 4  # above the gate's: not
    assert run_mod._keep_micro_batch(ctx, 2, 12).cfg.train.micro_batch_size == 2
    assert run_mod._keep_micro_batch(ctx, 3, 16).cfg.train.micro_batch_size == 4  # 16 over 2 x 3: not
    assert run_mod._keep_micro_batch(ctx, None, 16) is ctx  # no record: the gate's


@pytest.mark.integration  # ~3-5 min on 2 cores: smoke_1card, then train_8card on 2 processes, by the launcher
def test_train_8card_runs_what_the_gate_decided(tmp_path_factory):
    """The real launcher: smoke_1card on a CPU given a capacity decides the micro batch, checkpointing
    and compile mode; train_8card's workers run them and record them."""
    import os
    import subprocess

    from train_fixtures import ROOT, launch_cmd, launch_env

    res = results_dir(tmp_path_factory, "gate_follows")
    run = ["train.steps=2", "train.save_every=2", "train.warmup_steps=1", "smoke.steps=2",
           "train.micro_batch_size=auto", "train.activation_checkpointing=auto"]
    env = {**launch_env(), devices.MEMORY_CAP_ENV: str(64 * GIB)}
    env.pop(compile_trial.FORCE_ENV, None)
    for stage in ("smoke_1card", "train_8card"):
        proc = subprocess.run(launch_cmd(stage, res, *run), cwd=ROOT, capture_output=True, text=True,
                              timeout=900, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((res / "smoke" / "report.json").read_text())
    made = {key: entry["chosen"] for key, entry in report["decisions"].items()}
    assert made == {"train.compile": "off", "train.micro_batch_size": 8, "train.activation_checkpointing": False}
    assert report["micro_batch_size"] == 8 and report["pisft_config"]["train"]["micro_batch_size"] == "auto"
    summary = json.loads((res / "train" / "train_summary.json").read_text())
    assert summary["step_settings"] == [{"first_step": 1, "last_step": 2, "train.compile": "off",
                                         "train.micro_batch_size": 8, "train.activation_checkpointing": False,
                                         "world_size": 2}]
    exported = json.loads((res / "train" / "pisft_config.json").read_text())
    assert exported["train"]["micro_batch_size"] == 8 and exported["derived"]["grad_accum_steps"] == 1
    assert os.environ.get(devices.MEMORY_CAP_ENV) is None  # the test's env only
