"""Checks on one episode's non-image columns; each failure names file, episode and column."""

from __future__ import annotations

import numpy as np

from pisft.data.recap_reader import EpisodeRef, RecapSource
from pisft.errors import DataError


def check_episode(src: RecapSource, ep: EpisodeRef, cols: dict[str, np.ndarray]) -> None:
    where = f"{src.where(ep.data_file)}: episode {ep.episode_index}"
    n = len(cols["frame_index"])
    names = src.names

    if ep.length is not None and ep.length != n:
        raise DataError(f"{where}: has {n} frames but {src.episodes_path.name} says length {ep.length}; "
                        "fix the metadata or restore the data")

    epi = cols["episode_index"]
    if (epi != ep.episode_index).any():
        other = int(epi[np.flatnonzero(epi != ep.episode_index)[0]])
        raise DataError(f"{where}, column 'episode_index': holds episode_index {other}; a data file must hold "
                        "only its own episode (duplicated or misplaced episode_index)")

    fi = cols["frame_index"]
    expected = np.arange(n)
    if not np.array_equal(fi, expected):
        bad = int(np.flatnonzero(fi != expected)[0])
        raise DataError(f"{where}, column 'frame_index': gap or disorder at row {bad} (value {int(fi[bad])}, "
                        f"expected {bad}); frame_index must run 0, 1, ..., {n - 1}")

    ts = cols["timestamp"].astype(np.float64)
    if n > 1:
        step = np.diff(ts)
        if (step <= 0).any():
            bad = int(np.flatnonzero(step <= 0)[0]) + 1
            raise DataError(f"{where}, column 'timestamp': does not increase at frame {bad} "
                            f"({ts[bad - 1]:.4f} s -> {ts[bad]:.4f} s); timestamps must be frame_index / fps; "
                            "repair or remove the episode")
        dt = 1.0 / src.fps
        off = np.abs(step - dt) > max(1e-3, 0.05 * dt)
        if off.any():
            bad = int(np.flatnonzero(off)[0]) + 1
            raise DataError(f"{where}, column 'timestamp': step {step[bad - 1]:.4f} s at frame {bad}, but fps "
                            f"{src.fps} means {dt:.4f} s (dropped or duplicated frames?); repair or remove the episode")

    for canon in ("state", "actions"):
        values = cols[canon]
        finite = np.isfinite(values)
        if not finite.all():
            frame, dim = (int(x) for x in np.argwhere(~finite)[0])
            kind = "NaN" if np.isnan(values[frame, dim]) else "inf"
            raise DataError(f"{where}, column '{names[canon]}': {kind} at frame {frame}, dimension {dim}; "
                            "remove or repair the episode")

    tasks = np.unique(cols["task_index"])
    unknown = [int(t) for t in tasks if int(t) not in src.tasks]
    if unknown:
        raise DataError(f"{where}, column 'task_index': task_index {unknown} not in "
                        f"{src.where(src.tasks_path)} (known: {sorted(src.tasks)[:20]}); "
                        "add the task there or fix the column")
