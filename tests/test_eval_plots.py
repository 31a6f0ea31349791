"""The evaluation plots draw the training log's values, labelled in words and in one unit."""

from __future__ import annotations

import json

import pytest

from pisft.evaluate import plots, train_log

GIB = 2**30


def _records() -> list[dict]:
    """Two steps of a 2-rank training log as pisft.train.loop writes it (bytes, per rank and max)."""
    per_rank = [[1.30e9, 1.25e9], [1.32e9, 1.27e9]]
    reserved = [[1.50e9, 1.45e9], [1.52e9, 1.47e9]]
    return [{"step": s + 1, "samples_per_s": 40.0 + s, "step_time_s": 0.5 - 0.1 * s, "data_wait_s": 0.01,
             "peak_memory_bytes": max(per_rank[s]), "peak_memory_bytes_per_rank": per_rank[s],
             "peak_reserved_bytes": max(reserved[s]), "peak_reserved_bytes_per_rank": reserved[s]}
            for s in range(2)]


def _lines(ax) -> dict:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_memory_panel_draws_every_rank_in_gib_with_words(tmp_path):
    records = _records()
    fig = plots.throughput_and_memory_figure(records)
    throughput, time, memory = fig.axes
    assert memory.get_ylabel() == "peak memory per device (GiB)"
    assert memory.get_xlabel() == "optimizer step"
    lines = _lines(memory)
    # one line per rank and kind, named in words; the maximum over ranks is not drawn a second time
    assert set(lines) == {"allocated, rank 0", "allocated, rank 1", "reserved, rank 0", "reserved, rank 1"}
    for what, key in (("allocated", "peak_memory_bytes_per_rank"), ("reserved", "peak_reserved_bytes_per_rank")):
        for rank in (0, 1):
            steps, gib = lines[f"{what}, rank {rank}"]
            assert steps == [r["step"] for r in records]
            assert gib == pytest.approx([r[key][rank] / GIB for r in records])
    assert {t.get_text() for t in memory.get_legend().get_texts()} == set(lines)
    assert _lines(throughput)["samples per second"][1] == [r["samples_per_s"] for r in records]
    assert _lines(time)["optimizer step time"][1] == [r["step_time_s"] for r in records]
    # the PNG is written from the same figure
    path = plots.throughput_and_memory(records, tmp_path / "throughput.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_keys_in_other_units_land_in_gib_and_unknown_units_are_named():
    records = [{"step": 1, "peak_memory_gb": 2.0, "peak_mem_mib": [512.0, 1024.0], "peak_memory": 7},
               {"step": 2, "peak_memory_gb": 3.0, "peak_mem_mib": {"npu:0": 2048.0}, "peak_memory": 8}]
    curves, skipped = plots.memory_curves(records)
    got = {label: (steps, gib) for label, steps, gib in curves}
    assert skipped == ["peak_memory"]  # no unit: not drawn beside GiB values
    # per-device values of the allocated kind exist, so the scalar (their maximum) is not drawn
    assert got == {"allocated, rank 0": ([1], [0.5]), "allocated, rank 1": ([1], [1.0]),
                   "allocated, npu:0": ([2], [2.0])}
    only_scalar = [{"step": 1, "peak_memory_gb": 2.0}]
    assert plots.memory_curves(only_scalar)[0] == [("allocated", [1], [pytest.approx(2e9 / GIB)])]
    fig = plots.throughput_and_memory_figure(records)
    assert "peak_memory" in " ".join(t.get_text() for t in fig.axes[0].texts)


def test_a_real_training_log_plots_its_values(tmp_path):
    """The log read back from disk (a resumed step logged twice: the later record wins)."""
    log = tmp_path / "metrics.jsonl"
    records = _records()
    stale = {**records[0], "peak_memory_bytes_per_rank": [9e9, 9e9]}  # the run before the resume
    log.write_text("".join(json.dumps(r) + "\n" for r in [stale, records[0], records[1]]))
    read = train_log.read_metrics(log)
    lines = _lines(plots.throughput_and_memory_figure(read).axes[-1])
    assert lines["allocated, rank 1"] == ([1, 2], pytest.approx([1.25e9 / GIB, 1.27e9 / GIB]))


def test_nothing_to_plot_is_none(tmp_path):
    assert plots.throughput_and_memory([{"step": 1, "loss": 1.0}], tmp_path / "t.png") is None
    assert not (tmp_path / "t.png").exists()
