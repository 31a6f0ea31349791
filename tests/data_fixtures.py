"""Small RECAP input datasets for the data tests (built with the demo generator)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pisft.data import demo
from pisft.data.convert import Options, convert_recap
from pisft.data.libero import LIBERO_10_TASKS

_CACHE: dict[tuple, Path] = {}


def make_recap(root: Path, *, version: str = "v2.1", naming: str = "recap", video: bool = False,
               n_tasks: int = 3, per_task: int = 3, length: int = 12, size: int = 32,
               failure_fraction: float = 0.34, seed: int = 0) -> Path:
    """RLinf's finished RECAP output at `root`: its writer's collection (the demo generator),
    then its compute_returns and compute_advantages (`demo.label`, tag `demo`); copied from a
    per-session cache, so tests may then break it."""
    key = (version, naming, video, n_tasks, per_task, length, size, failure_fraction, seed)
    if key not in _CACHE:
        import tempfile

        from conftest import RUN_DIR  # the test run's folder: removed when the run ends

        cached = Path(tempfile.mkdtemp(prefix="recap-", dir=RUN_DIR)) / "recap"
        cached.mkdir()
        demo.build(cached, episodes_per_task=per_task, length=length, image_size=size,
                   failure_fraction=failure_fraction, seed=seed, version=version, naming=naming, video=video,
                   tasks=LIBERO_10_TASKS[:n_tasks], workers=1, labelled=True)
        _CACHE[key] = cached
    shutil.copytree(_CACHE[key], root)
    return root


def convert(src: Path, out: Path, **opts) -> dict:
    return convert_recap(src, out, Options(**opts))


def convert_fails(src: Path, tmp_path: Path, *patterns: str, **opts) -> str:
    """The conversion of `src` refuses it with a DataError naming every pattern, and leaves
    nothing behind (no output, no temporary folder). Returns the message."""
    import pytest

    from pisft.errors import DataError

    out = tmp_path / "results" / "dataset"
    with pytest.raises(DataError) as err:
        convert(src, out, **opts)
    msg = str(err.value)
    for p in patterns:
        assert p in msg, f"{p!r} not in: {msg}"
    assert not out.exists()
    leftovers = list(out.parent.iterdir()) if out.parent.exists() else []
    assert leftovers == [], leftovers
    return msg


def read_json(path: Path):
    return json.loads(Path(path).read_text())
