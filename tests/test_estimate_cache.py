"""pisft.introspect.estimate_cache: the smoke gate's estimate is read back only for the same step and
code, and a damaged cache file is a miss (the estimate is simulated again). And the smoke stage's
estimates made in its own process before its process group (pisft.introspect.estimate), answered
inside the group without a fresh process."""

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


@pytest.fixture
def no_process(monkeypatch) -> None:
    """Starting a process fails the test: the estimates are answered without the fresh one."""
    def started(*_args, **_kwargs):
        raise AssertionError("a process was started for an estimate already made or kept")

    monkeypatch.setattr(estimate.subprocess, "run", started)


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


def test_the_smoke_path_reads_the_kept_estimate_without_a_subprocess(tmp_path, cache, monkeypatch, no_process):
    """What the estimating subprocess wrote is what the next smoke run of the same step gets, with
    its own model folder as `model`; nothing is simulated (the subprocess is never started)."""
    cfg = config_mod.load(CONFIG, [f"results_dir={tmp_path}/results"])
    raw = json.loads(json.dumps(config_mod.to_dict(cfg)))
    for world in (1, cfg.world_size):
        estimate_cache.write(estimate_cache.key(raw, world, [], f"preset {cfg.model.preset}"),
                             {"total_bytes": 1000 + world, "model": "elsewhere"})
    monkeypatch.setattr(estimate, "_KEPT", {})
    got = estimate._simulate_elsewhere(cfg, cfg.world_size)
    assert got == {"total_bytes": 1000 + cfg.world_size, "model": f"preset {cfg.model.preset}"}


@pytest.mark.integration  # about 11 s: four simulations; the fast tier keeps the next test's hook check
def test_estimates_made_before_the_process_group_are_answered_inside_it(tmp_path, cache, monkeypatch, no_process):
    """smoke_1card's way (the stage table's `before_group`, pisft.gates.smoke.estimate_before_group):
    both world sizes simulated in this process before it holds a group, then asked for inside one,
    where no process is started; torch's generator as it was; both kept for a later smoke run."""
    import torch
    import torch.distributed as dist

    cfg = config_mod.load(CONFIG, [f"results_dir={tmp_path}/results", "train.micro_batch_size=4"])
    assert cfg.world_size == 2  # the embedded default's: two estimates
    monkeypatch.setattr(estimate, "_KEPT", {})
    rng = torch.get_rng_state()
    estimate.estimate_before_process_group(cfg)
    assert torch.equal(torch.get_rng_state(), rng)
    made = {w: estimate.estimate_memory(cfg, world_size=w) for w in (1, 2)}  # here: no group, simulated again
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already holds a process group"):
            estimate.estimate_before_process_group(cfg)
        inside = {w: estimate.estimate_memory(cfg, world_size=w) for w in (1, 2)}
    finally:
        dist.destroy_process_group()
    assert inside == made
    assert len(list(cache.glob("*.json"))) == 2  # kept for the next smoke run of the same step


def test_smoke_1card_estimates_before_it_joins_its_process_group(tmp_path, cache, monkeypatch, no_process):
    """The stage table's `before_group` runs before the group is made (pisft.train.job.setup_process),
    and the smoke gate's hook fills what its report asks for later, `auto` settings included
    (`_estimated`): the report's estimates come without a process started."""
    import torch.distributed as dist

    from pisft.gates import smoke
    from pisft.stages import STAGES, resolve
    from pisft.train import job

    hook = resolve(STAGES["smoke_1card"].before_group)  # as the torchrun worker finds it
    assert hook is smoke.estimate_before_group
    cfg = config_mod.load(CONFIG, [f"results_dir={tmp_path}/results", "train.micro_batch_size=auto"])
    order: list[str] = []
    monkeypatch.setattr(estimate, "_KEPT", {})
    with pytest.MonkeyPatch.context() as group:  # a stand-in for torch.distributed's group, then the real one
        group.setattr(job.dist, "init_process_group", lambda **_kw: order.append("group"))
        group.setattr(job.dist, "get_rank", lambda: 0)
        group.setattr(job.dist, "get_world_size", lambda: 1)
        job.setup_process(cfg, "smoke_1card", 1, lambda _cfg: order.append("before_group"))
    assert order == ["before_group", "group"]
    hook(cfg)  # in the worker, where "before_group" stands (its simulation makes a fake group of its own)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        reported = smoke._estimate(smoke._estimated(cfg))  # what _report_head records
    finally:
        dist.destroy_process_group()
    assert set(reported) == {"1", "2"} and all("total_bytes" in e for e in reported.values()), reported
