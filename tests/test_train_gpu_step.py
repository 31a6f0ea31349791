"""The GPU step benchmark's code path, dry-run on CPU with the tiny preset: bf16 mixed precision
with and without activation checkpointing through FSDP2 (the Ascend/GPU training settings)."""

from __future__ import annotations

import math

from pisft.bench import gpu_step


def test_bf16_step_with_and_without_activation_checkpointing(tmp_path):
    args = gpu_step.parse(["--device", "cpu", "--preset", "tiny", "--micro", "2", "--max-micro", "2",
                           "--steps", "2", "--warmup", "0", "--out", str(tmp_path / "g.json")])
    result = gpu_step.run(args)
    runs = result["runs"]
    assert [r["activation_checkpointing"] for r in runs] == [False, True]
    for r in runs:
        assert r["micro_batch_size"] == 2 and not r.get("oom")
        assert all(math.isfinite(x) for x in r["losses"])
        assert r["step_time_s"] > 0 and r["flops_per_sample"] > 0
        assert r["mfu"] is None  # no peak figure for CPU
    # same weights, same batch: checkpointing changes memory, not the numbers
    assert runs[0]["losses"][0] == runs[1]["losses"][0]
    assert result["largest_micro_batch"] == {"False": 2, "True": 2}
