"""The smoke gate's memory estimates, kept between processes.

The smoke stage (`smoke_1card`) estimates the step's memory for 1 device and for the run's world
size (pisft.introspect.estimate): in its own process before that joins its process group (the
estimate needs a fake group of its own), or, asked inside the group, in a fresh process. Either
runs the whole training step on fake tensors: about as long as the smoke steps themselves on the
embedded default, and the same answer every time the same step is estimated. So the answer is
kept, one small JSON file per estimate, and a later smoke run of the same step reads it instead of
simulating again.

What makes it the same step, all in the key (`key`):
- the config, less where its results and data lie (`results_dir`, `data.recap_dir`): every key the
  estimate reads and more (a key that cannot change the estimate only costs a miss);
- the world size;
- the bytes of the base model's config and pisft_model.json when the estimate builds the model
  from them (pisft.introspect.estimate: the fetched base of the config's preset), else the preset;
- the code that computes it: a digest of every `.py` file of the pisft package as it lies on disk
  (what the estimating process imports), torch's and LeRobot's versions, Python's.

Only the smoke stage's estimates are kept (`pisft.introspect.estimate.estimate_before_process_group`
and `_simulate_elsewhere`): `estimate_memory` asked in a process without a group (`python -m pisft
estimate`, the tests) always simulates, so code patched in memory is never answered from a file.

The folder: `$PISFT_ESTIMATE_CACHE` ("off": always simulate), default
`$XDG_CACHE_HOME/pisft/estimates`, else `~/.cache/pisft/estimates`. A file that cannot be read is
a miss; a folder that cannot be written is skipped.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from pisft import io

CACHE_ENV = "PISFT_ESTIMATE_CACHE"  # a folder, or "off"
FORMAT = 1  # of a cache file; another is a miss


@functools.cache
def code_digest() -> str:
    """sha256 over the pisft package's Python files (relative path and bytes, in order)."""
    return io.sha256_sources(Path(__file__).resolve().parents[1])


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def key(raw_config: dict[str, Any], world: int, model_files: list[Path], model_label: str) -> str:
    """The cache key of one estimate (the module's docstring says what enters it)."""
    import torch

    config = json.loads(json.dumps(raw_config))  # a copy
    config.pop("results_dir", None)
    if isinstance(config.get("data"), dict):
        config["data"].pop("recap_dir", None)
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT, "config": config, "world_size": world,
                         "model": model_label if not model_files else "base",
                         "torch": torch.__version__, "lerobot": _version("lerobot"),
                         "python": sys.version, "code": code_digest()}, sort_keys=True).encode())
    for path in model_files:
        h.update(path.name.encode() + b"\0")
        h.update(path.read_bytes() if path.is_file() else b"(absent)")
        h.update(b"\0")
    return h.hexdigest()


def _file(cache_key: str) -> Path | None:
    folder = io.user_cache_dir(CACHE_ENV, "estimates")
    return None if folder is None else folder / f"{cache_key}.json"


def read(cache_key: str) -> dict[str, Any] | None:
    """The kept estimate, or None (no cache, no file, unreadable, another format)."""
    path = _file(cache_key)
    if path is None:
        return None
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != cache_key:
        return None
    estimate = entry.get("estimate")
    return estimate if isinstance(estimate, dict) else None


def write(cache_key: str, estimate: dict[str, Any]) -> None:
    path = _file(cache_key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        io.write_json_atomic(path, {"format": FORMAT, "key": cache_key, "estimate": estimate})
    except OSError:
        pass  # a read-only or full home: the next smoke run simulates again
