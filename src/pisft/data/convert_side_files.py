"""The side files of a RECAP source, checked in pass 1 of a conversion: RLinf's
`meta/advantages_<tag>.parquet` (the advantage label per frame, `data.advantage_tag`) and the
`meta/returns_<tag>.parquet` files info.json declares, each matched row for row to the frames."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pisft.data.recap_reader import RecapSource
from pisft.errors import DataError


def advantages_path(src: RecapSource, tag: str) -> Path:
    """meta/advantages_<tag>.parquet; `advantages.parquet` names RLinf's untagged file."""
    name = tag if tag.endswith(".parquet") else f"advantages_{tag}.parquet"
    return src.inside(f"meta/{name}", "data.advantage_tag's side file", src.info_path)


def _match_frames(where: str, ep: np.ndarray, fr: np.ndarray, lowdim: dict[int, dict[str, np.ndarray]]
                  ) -> tuple[np.ndarray, dict[int, tuple[int, int]]]:
    """Check that a side file has exactly one row per frame of the dataset; returns the sort
    order of its rows and episode -> (start, end) in that order."""
    order = np.lexsort((fr, ep))
    ep, fr = ep[order], fr[order]
    dup = (np.diff(ep) == 0) & (np.diff(fr) == 0)
    if dup.any():
        i = int(np.flatnonzero(dup)[0])
        raise DataError(f"{where}: episode {ep[i]}, frame_index {fr[i]} appears more than once "
                        "(columns 'episode_index', 'frame_index')")
    unknown = sorted(set(np.unique(ep).tolist()) - set(lowdim))
    if unknown:
        raise DataError(f"{where}: column 'episode_index' has rows for episode(s) {unknown[:10]} that the "
                        "dataset does not have; the side file belongs to another dataset?")
    spans: dict[int, tuple[int, int]] = {}
    starts = np.searchsorted(ep, list(lowdim), side="left")
    ends = np.searchsorted(ep, list(lowdim), side="right")
    for (idx, cols), a, b in zip(lowdim.items(), starts, ends, strict=True):
        n = len(cols["frame_index"])
        frames = fr[a:b]
        if len(frames) != n or not np.array_equal(frames, np.arange(n)):
            missing = sorted(set(range(n)) - set(frames.tolist()))
            extra = sorted(set(frames.tolist()) - set(range(n)))
            raise DataError(f"{where}: episode {idx}, column 'frame_index': {len(frames)} row(s) for {n} frames"
                            + (f"; missing frame_index {missing[:10]}" if missing else "")
                            + (f"; frame_index {extra[:10]} beyond the episode" if extra else "")
                            + "; the side file must have one row per frame")
        spans[idx] = (int(a), int(b))
    return order, spans


def _index_columns(src: RecapSource, path: Path, extra: tuple[str, ...]) -> pa.Table:
    where = src.where(path)
    try:
        names = pq.read_schema(path).names
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{where}: not a readable parquet file ({exc})") from None
    for col in ("episode_index", "frame_index", *extra):
        if col not in names:
            raise DataError(f"{where}: column '{col}' is missing (found {names})")
    table = pq.read_table(path, columns=["episode_index", "frame_index", *extra])
    for col in ("episode_index", "frame_index"):
        if table.column(col).null_count:
            raise DataError(f"{where}: column '{col}' has {table.column(col).null_count} null value(s)")
        _require_integers(where, col, table.column(col))
    return table


def _require_integers(where: str, col: str, column: pa.ChunkedArray) -> None:
    """An index column holds integers: an integer type, or floats that are all whole numbers
    (a cast would silently move a frame 1.5 to frame 1)."""
    typ = column.type
    if pa.types.is_integer(typ):
        return
    if not pa.types.is_floating(typ):
        raise DataError(f"{where}: column '{col}' is {typ}, not integers; episode and frame indices are "
                        "integers (RLinf writes int64)")
    values = column.to_numpy(zero_copy_only=False).astype(np.float64)
    bad = ~np.isfinite(values) | (values != np.round(values))
    if bad.any():
        raise DataError(f"{where}: column '{col}' has {int(bad.sum())} non-integer value(s) of {len(values)} "
                        f"(e.g. {values[bad][0]!r}); episode and frame indices are integers (RLinf writes "
                        "int64): fix the file that wrote it")


def _require_finite(where: str, table: pa.Table, columns: tuple[str, ...]) -> None:
    """Returns and advantages are finite numbers: NaN or inf would label or weight frames at random."""
    for col in columns:
        if col not in table.column_names:
            continue
        column = table.column(col)
        if not (pa.types.is_floating(column.type) or pa.types.is_integer(column.type)):
            continue
        values = column.to_numpy(zero_copy_only=False).astype(np.float64)
        bad = ~np.isfinite(values)
        if bad.any():
            raise DataError(f"{where}: column '{col}' has {int(bad.sum())} non-finite value(s) (NaN or inf) of "
                            f"{len(values)}; the returns/advantages that wrote it diverged: recompute them")


def check_returns_files(src: RecapSource, lowdim: dict[int, dict[str, np.ndarray]]) -> None:
    """The `meta/returns_<tag>.parquet` files that hold features info.json declares (RLinf's
    compute_returns output) must hold one row per frame of this dataset."""
    for path in sorted(set(src.side_features.values())):
        table = _index_columns(src, path, ())
        numeric = tuple(c for c in ("return", "reward") if c in pq.read_schema(path).names)
        _require_finite(src.where(path), pq.read_table(path, columns=list(numeric)), numeric)
        _match_frames(src.where(path), table.column("episode_index").to_numpy(zero_copy_only=False).astype(np.int64),
                      table.column("frame_index").to_numpy(zero_copy_only=False).astype(np.int64), lowdim)


def load_advantages(src: RecapSource, tag: str, lowdim: dict[int, dict[str, np.ndarray]]) -> dict[int, np.ndarray]:
    """meta/advantages_<tag>.parquet -> episode -> bool per frame; rows must match the frames."""
    path = advantages_path(src, tag)
    if not path.is_file():
        meta = src.root / "meta"
        found = sorted(p.name[len("advantages_"):-len(".parquet")] for p in meta.glob("advantages_*.parquet"))
        untagged = " and the untagged advantages.parquet (data.advantage_tag: advantages.parquet)" \
            if (meta / "advantages.parquet").is_file() else ""
        raise DataError(f"{src.where(path)}: missing (data.advantage_tag is '{tag}'); tags present: "
                        f"{found or 'none'}{untagged}")
    where = src.where(path)
    table = _index_columns(src, path, ("advantage",))
    ep = table.column("episode_index").to_numpy(zero_copy_only=False).astype(np.int64)
    fr = table.column("frame_index").to_numpy(zero_copy_only=False).astype(np.int64)
    adv_col = table.column("advantage")
    if adv_col.null_count:
        raise DataError(f"{where}: column 'advantage' has {adv_col.null_count} null value(s)")
    if not pa.types.is_boolean(adv_col.type):
        raise DataError(f"{where}: column 'advantage' is {adv_col.type}, expected bool (RLinf's "
                        "compute_advantages writes the label as bool next to 'advantage_continuous')")
    numeric = tuple(c for c in ("advantage_continuous", "return") if c in pq.read_schema(path).names)
    _require_finite(where, pq.read_table(path, columns=list(numeric)), numeric)
    adv = adv_col.to_numpy(zero_copy_only=False).astype(bool)
    order, spans = _match_frames(where, ep, fr, lowdim)
    adv = adv[order]
    return {idx: adv[a:b] for idx, (a, b) in spans.items()}
