"""pisft.introspect.estimate_cache: the smoke gate's estimate is read back only for the same step and
code, and a damaged cache file is a miss (the estimate is simulated again)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pisft import config as config_mod
from pisft.introspect import estimate, estimate_cache

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config" / "config.yaml"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "estimates"
    monkeypatch.setenv(estimate_cache.CACHE_ENV, str(folder))
    return folder


def _raw(tmp_path, *sets: str) -> dict:
    return config_mod.to_dict(config_mod.load(CONFIG, [f"results_dir={tmp_path}/results", *sets]))


def test_the_key_follows_the_step_not_the_folders(tmp_path):
    base = _raw(tmp_path)
    same = estimate_cache.key(_raw(tmp_path / "elsewhere"), 2, [], "preset tiny")
    assert estimate_cache.key(base, 2, [], "preset tiny") == same  # another results folder: the same step
    assert estimate_cache.key(base, 1, [], "preset tiny") != same
    assert estimate_cache.key(_raw(tmp_path, "train.micro_batch_size=2"), 2, [], "preset tiny") != same
    assert estimate_cache.key(base, 2, [], "preset small") != same
    model = tmp_path / "config.json"
    model.write_text("{}")
    with_base = estimate_cache.key(base, 2, [model], str(tmp_path))
    model.write_text('{"x": 1}')  # other base bytes: another model
    assert estimate_cache.key(base, 2, [model], str(tmp_path)) != with_base != same


def test_a_kept_estimate_is_read_back_and_a_damaged_file_is_a_miss(cache):
    key = estimate_cache.key({"train": {}}, 1, [], "preset tiny")
    assert estimate_cache.read(key) is None
    estimate_cache.write(key, {"total_bytes": 123, "model": "preset tiny"})
    assert estimate_cache.read(key) == {"total_bytes": 123, "model": "preset tiny"}
    path = cache / f"{key}.json"
    path.write_text(path.read_text()[:-3])  # a torn write
    assert estimate_cache.read(key) is None
    entry = {"format": estimate_cache.FORMAT, "key": "0" * 64, "estimate": {"total_bytes": 1}}
    path.write_text(json.dumps(entry))  # a file under another key's name
    assert estimate_cache.read(key) is None


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(estimate_cache.CACHE_ENV, "off")
    key = estimate_cache.key({"train": {}}, 1, [], "preset tiny")
    estimate_cache.write(key, {"total_bytes": 1})
    assert estimate_cache.read(key) is None


def test_the_smoke_path_reads_the_kept_estimate_without_a_subprocess(tmp_path, cache, monkeypatch):
    """What the estimating subprocess wrote is what the next smoke run of the same step gets, with
    its own model folder as `model`; nothing is simulated (the subprocess is never started)."""
    cfg = config_mod.load(CONFIG, [f"results_dir={tmp_path}/results"])
    raw = json.loads(json.dumps(config_mod.to_dict(cfg)))
    for world in (1, cfg.world_size):
        estimate_cache.write(estimate_cache.key(raw, world, [], f"preset {cfg.model.preset}"),
                             {"total_bytes": 1000 + world, "model": "elsewhere"})
    monkeypatch.setattr(estimate, "_ELSEWHERE", {})

    def no_subprocess(*_args, **_kwargs):
        raise AssertionError("simulated again although the estimate was kept")
    monkeypatch.setattr(estimate.subprocess, "run", no_subprocess)
    got = estimate._simulate_elsewhere(cfg, cfg.world_size)
    assert got == {"total_bytes": 1000 + cfg.world_size, "model": f"preset {cfg.model.preset}"}
