"""The convert benchmark runs end to end (tiny sizes) and reports comparable figures."""

from __future__ import annotations

import pytest

from pisft.bench import convert_bench


@pytest.mark.integration  # ~1-2 min: builds inputs, runs three converters and two child conversions
def test_convert_bench_reports_all_paths(tmp_path):
    out = convert_bench.run(tmp_path, episodes_per_task=1, length=6, image_size=32, recorder_episodes=1)
    assert out["input"]["frames"] == 60 and out["input"]["image_size"] == 32
    for path in ("pisft", "pisft_1_worker", "lerobot_v21_to_v30"):
        assert out[path]["frames"] == 60, path
        assert out[path]["frames_per_s"] > 0
    assert out["lerobot_v21_to_v30"]["has_q01"]
    assert out["lerobot_recorder"]["frames"] == 6
    assert out["ratio_pisft_vs_lerobot_v21_to_v30"] > 0
    assert out["profile"]["decode_ms_per_image"] > 0
    assert (tmp_path / "pisft_out" / "meta" / "info.json").is_file()
    # scale: RLinf's complete output at two sizes 4x apart, each converted in a fresh process
    scale = out["scaling"]
    assert scale["small"]["frames"] == 60 and scale["large"]["frames"] == 240 and scale["episodes_ratio"] == 4
    for name in ("small", "large"):
        assert scale[name]["frames_per_s"] > 0
        assert scale[name]["peak_rss_mb"] >= scale[name]["rss_after_imports_mb"] > 0
    # RSS is information here (it depends on the CPU's kernels and malloc); the bound that keeps
    # memory flat in the number of episodes is tested directly:
    # test_data_convert.py::test_decoded_episodes_in_memory_are_bounded_by_the_window
    assert scale["peak_rss_ratio"] > 0
    assert (tmp_path / "lerobot" / "bench_recap" / "meta" / "stats.json").is_file()
