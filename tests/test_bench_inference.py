"""The inference benchmarks' code paths: `bench --only inference`'s measurement and the prepared GPU
script (`python -m pisft.bench.gpu_infer`), dry-run on the CPU with the tiny preset and dynamo's
`eager` backend (the chunk captured as on an accelerator, run as captured: inductor's code
generation is tests/test_policy_compiled.py's), 2 denoising steps instead of 10."""

from __future__ import annotations

import json

import pytest

from pisft.bench import gpu_infer


@pytest.mark.integration  # ~20-60 s: two tiny models, ten chunks, two captures
def test_the_gpu_script_dry_runs_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "gpu_infer.json"
    assert gpu_infer.main(["--device", "cpu", "--preset", "tiny", "--batches", "1,3", "--chunks", "1",
                           "--warmup", "0", "--denoising-steps", "2", "--compile-backend", "eager", "--no-profile",
                           "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result == json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    before, ours = result["runs"]["lerobot_bf16_eager"], result["runs"]["openpi_bf16"]
    for batch in ("1", "3"):  # the names a check relies on
        assert before["p50_ms"][batch]["eager"] > 0 and before["p50_ms"][batch]["compiled"] is None
        assert ours["p50_ms"][batch]["eager"] > 0 and ours["p50_ms"][batch]["compiled"] > 0
        assert ours["p99_ms"][batch]["compiled"] >= ours["p50_ms"][batch]["compiled"]
        assert ours["compile_s"][batch] > 0 and ours["actions_max_abs_diff"][batch] <= ours["actions_atol"]
    assert ours["actions_atol"] == 2.0 ** -6 and ours["actions_match"] and ours["fell_back"] is None
    assert ours["compile"]["backend"] == "eager"  # the dry run's; on cuda inductor with reduce-overhead
    # openpi's layout keeps fewer parameters in float32 than LeRobot's (SigLIP's encoder, the projector)
    assert ours["float32_parameters"] < before["float32_parameters"]
    assert set(result["targets"]) == {"batch1_p50_ms_le_80", "compiled_actions_within_tolerance"}


def test_gpu_script_defaults_are_issue_46s_setting():
    args = gpu_infer.parse([])
    assert (args.device, args.preset, args.batches, args.profile) == ("cuda", "pi05", [1, 8, 32], True)
    assert gpu_infer.TARGETS_MS == {"1": 80.0, "32": 300.0}


def test_the_runs_are_names_of_the_table(capsys):
    assert gpu_infer.parse(["--runs", " openpi_bf16 ,lerobot_bf16_eager"]).runs == ["openpi_bf16", "lerobot_bf16_eager"]
    with pytest.raises(SystemExit):
        gpu_infer.parse(["--runs", "openpi_bf16,fast"])
    assert "'openpi_bf16,fast': each run one of lerobot_bf16_eager, openpi_bf16" in capsys.readouterr().err
