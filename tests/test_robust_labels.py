"""Issue 22, item 9: advantage labels that cannot train are refused with the count and the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_fixtures import convert_fails as fails
from data_fixtures import convert, make_recap


ADV = "meta/advantages_demo.parquet"


@pytest.fixture
def src(tmp_path) -> Path:
    return make_recap(tmp_path / "in", n_tasks=2, per_task=2, length=8, size=16)


def edit(path: Path, column: str, fn) -> None:
    table = pq.read_table(path)
    i = table.schema.get_field_index(column)
    array = fn(table.column(column).to_numpy(zero_copy_only=False))
    table = table.set_column(i, pa.field(column, pa.array(array).type), pa.array(array))
    pq.write_table(table, path)




def test_labels_without_a_positive_frame_are_refused(src, tmp_path):
    edit(src / ADV, "advantage", lambda a: np.zeros(len(a), dtype=bool))
    n = pq.read_metadata(src / ADV).num_rows
    fails(src, tmp_path, str(src / ADV), f"{n} converted frames have 0 positive and {n} negative",
          "no positive frame", advantage_tag="demo")


def test_labels_without_a_negative_frame_are_refused_where_every_frame_carries_its_label(src, tmp_path):
    edit(src / ADV, "advantage", lambda a: np.ones(len(a), dtype=bool))
    n = pq.read_metadata(src / ADV).num_rows
    fails(src, tmp_path, f"{n} positive and 0 negative", "no negative frame", "positive_only_conditional: false",
          advantage_tag="demo", positive_only_conditional=False)
    # positive-only conditioning trains negative frames unlabelled: all-positive labels (RLinf's sft) pass
    report = convert(src, tmp_path / "ok", advantage_tag="demo", positive_only_conditional=True)
    assert report["advantage_labels"]["negative"] == 0 and report["advantage_labels"]["positive"] == n


@pytest.mark.parametrize("column", ["episode_index", "frame_index"])
def test_non_integer_indices_are_refused(src, tmp_path, column):
    def shift(a):
        a = a.astype(np.float64)
        a[[1, 3]] += 0.5
        return a

    edit(src / ADV, column, shift)
    fails(src, tmp_path, str(src / ADV), f"column '{column}' has 2 non-integer value(s)", advantage_tag="demo")


def test_whole_number_float_indices_are_read_as_integers(src, tmp_path):
    edit(src / ADV, "frame_index", lambda a: a.astype(np.float64))
    assert convert(src, tmp_path / "ok", advantage_tag="demo")["advantage_labels"]["positive"] > 0


@pytest.mark.parametrize(("column", "value"), [("advantage_continuous", np.nan), ("return", np.inf)])
def test_non_finite_advantages_and_returns_are_refused(src, tmp_path, column, value):
    def spoil(a):
        a = a.astype(np.float64)
        a[[0, 2, 4]] = value
        return a

    assert column in pq.read_schema(src / ADV).names
    edit(src / ADV, column, spoil)
    fails(src, tmp_path, str(src / ADV), f"column '{column}' has 3 non-finite value(s)", advantage_tag="demo")


def test_non_finite_returns_in_the_returns_side_file_are_refused(src, tmp_path):
    returns = sorted((src / "meta").glob("returns*.parquet"))
    assert returns
    edit(returns[0], "return", lambda a: np.where(np.arange(len(a)) == 5, np.nan, a.astype(np.float64)))
    fails(src, tmp_path, str(returns[0]), "column 'return' has 1 non-finite value(s)")


def test_the_conversion_report_counts_positive_and_negative_frames_per_task(src, tmp_path):
    report = convert(src, tmp_path / "ok", advantage_tag="demo")
    labels = report["advantage_labels"]
    table = pq.read_table(src / ADV)
    adv = table.column("advantage").to_numpy(zero_copy_only=False)
    assert labels["positive"] == int(adv.sum()) and labels["negative"] == int((~adv).sum())
    assert len(labels["per_task"]) == 2
    assert sum(t["positive"] for t in labels["per_task"].values()) == labels["positive"]
    assert sum(t["negative"] for t in labels["per_task"].values()) == labels["negative"]
    assert convert(src, tmp_path / "plain")["advantage_labels"] is None  # no labels asked for
