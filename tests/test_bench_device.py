"""`bench --only device` (pisft.bench.device_bench): without an accelerator it says so and measures
nothing; its plumbing in check mode (the tiny model on the CPU): each job a process of its own, one
that hangs stopped at its bound while the next still runs, one JSON and a markdown table."""

from __future__ import annotations

import json

import pytest

from pisft.bench import device_bench
from pisft.bench import run as bench_run


def test_without_an_accelerator_it_says_so_and_writes_no_figure(tmp_path, capsys):
    assert bench_run.COMPONENT_BENCHES["device"] == "pisft.bench.device_bench:run"  # bench --only device
    assert device_bench.accelerator() is None  # this host: no CUDA GPU, no NPU
    assert device_bench.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr()
    assert "no accelerator here" in err.out and "nothing was measured" in err.err
    assert not list(tmp_path.iterdir())


@pytest.mark.integration  # ~15 s idle (a fresh interpreter imports LeRobot and times the tiny chunk)
def test_check_mode_runs_each_job_alone_and_a_hang_loses_nothing_else(tmp_path):
    # openpi's run given half a second: stopped mid-import, as a hang would be; LeRobot's layout,
    # measured after it in a process of its own, still runs, and only its figures are reported
    out = device_bench.run_all(None, tmp_path, check=True, only=["gpu_infer_openpi", "gpu_infer_lerobot"],
                               timeouts={"gpu_infer_openpi": 0.5})
    jobs = out["jobs"]
    assert jobs["gpu_infer_openpi"]["status"] == "timed out after 0.5 s" and "result" not in jobs["gpu_infer_openpi"]
    lerobot = jobs["gpu_infer_lerobot"]
    assert lerobot["status"] == "ok", lerobot["log_tail"]
    run = lerobot["result"]["runs"]["lerobot_bf16_eager"]
    assert set(run["p50_ms"]) == {"1", "2"} and all(v["eager"] > 0 and v["compiled"] is None
                                                    for v in run["p50_ms"].values())
    saved = json.loads((tmp_path / "device.json").read_text())
    assert saved["check"] is True and saved["jobs"].keys() == jobs.keys()
    assert saved["targets"]["chunk_batch1_ms"]["measured"] is None  # openpi's layout was not measured
    table = (tmp_path / "device.md").read_text()
    assert "check mode (tiny model, CPU)" in table and "| gpu_infer_openpi | timed out" in table
    assert "| lerobot_bf16_eager | 2 |" in table


def test_the_smoke_gates_decisions_are_every_field_of_its_report_but_the_bulky_ones():
    report = {"passed": True, "compile": "auto", "compiled": False, "compile_trial": {"chose": "off", "why": "cpu"},
              "micro_batch_size": 4, "losses": [1.0, 0.9], "environment": {"torch": "2.11"}}
    assert device_bench.smoke_decisions(report) == {"passed": True, "compile": "auto", "compiled": False,
                                                    "compile_trial": {"chose": "off", "why": "cpu"},
                                                    "micro_batch_size": 4}


def test_issue_54_targets_are_judged_on_the_measured_runs():
    step = {"runs": [{"trainable": "all", "compile": "off", "micro_batch_size": 32, "samples_per_s": 27.0,
                      "device_busy_fraction": 0.4},
                     {"trainable": "all", "compile": "layers", "micro_batch_size": 32, "samples_per_s": 46.0,
                      "device_busy_fraction": 0.9},
                     {"trainable": "all", "compile": "layers", "micro_batch_size": 64, "oom": True}]}
    infer = {"runs": {"openpi_bf16": {"p50_ms": {"1": {"eager": 70.0, "compiled": 29.0},
                                                 "32": {"eager": 400.0, "compiled": None}}}}}
    got = device_bench.targets({"gpu_step_all_layers": {"result": step}, "gpu_infer_openpi": {"result": infer}})
    assert got["all_micro32_samples_per_s"] == {"target": 45.0, "measured": 46.0, "met": True}  # the best setting
    assert got["device_busy_fraction_from_micro16"]["met"] is False  # every run from micro 16 must be busy
    assert got["chunk_batch1_ms"]["met"] is True and got["chunk_batch32_ms"] == {"target": 150.0, "measured": 400.0,
                                                                                 "met": False}
    assert got["expert_micro32_samples_per_s"]["measured"] is None  # not measured: no verdict


def test_the_smoke_gate_runs_the_device_profiles_step_with_compile_auto():
    from pisft import config as config_mod

    for kind, profile in (("cuda", "cuda-8gpu.yaml"), ("npu", "ascend-8card.yaml")):
        raw, source = device_bench.smoke_config(kind, check=False)
        cfg = config_mod.from_dict(raw)  # a config the stage accepts
        assert source.endswith(profile) and cfg.device == kind and cfg.train.compile == "auto"
        assert (cfg.model.source, cfg.model.preset, cfg.train.precision) == ("random", "pi05", "bf16")
        assert cfg.world_size == 8  # the profile's: the projection is the 8-card run's
