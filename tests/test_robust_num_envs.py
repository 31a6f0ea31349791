"""Issue 22, item 10: `eval.num_envs: 0` (one per core) also fits the host's memory and says what it chose."""

from __future__ import annotations

import pytest

from pisft import rollout
from pisft import config as C
from pisft import device

GIB = 1 << 30


def test_one_per_core_as_far_as_memory_holds(monkeypatch):
    per_env = rollout.ENV_MEMORY_BYTES
    assert per_env >= int(3.2e9)  # the measured peak of one LIBERO environment process
    assert rollout.auto_num_envs(cores=16, available=64 * GIB)[0] == 16
    n, why = rollout.auto_num_envs(cores=16, available=10 * GIB)
    assert n == 10 * GIB // per_env == 2
    assert "16 available cores, 10.0 GiB of memory available" in why and "the memory holds 2" in why
    n, why = rollout.auto_num_envs(cores=16, available=1 * GIB)
    assert n == 1 and "less than one environment needs" in why
    monkeypatch.setattr(device, "available_memory", lambda: None)  # no /proc/meminfo
    assert rollout.auto_num_envs(cores=4) == (4, "4 (one per available core; the available memory is unknown)")


def test_the_stage_says_what_it_chose(monkeypatch, capsys):
    monkeypatch.setattr(device, "usable_cores", lambda: 16)
    monkeypatch.setattr(device, "available_memory", lambda: 10 * GIB)
    cfg = C.from_dict({"eval": {"closed_loop": True, "num_envs": 0}})
    assert rollout.Settings.from_config(cfg, stage="closed_loop").num_envs == 2
    out = capsys.readouterr().out
    assert out.startswith("closed_loop: eval.num_envs 0 -> 2 (16 available cores, 10.0 GiB")
    assert "set eval.num_envs" in out
    assert rollout.Settings.from_config(C.from_dict({"eval": {"num_envs": 5}}), stage="closed_loop").num_envs == 5
    assert capsys.readouterr().out == ""  # a number given is used as given, silently


def test_available_memory_reads_meminfo_and_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemAvailable:   20971520 kB\n")  # 20 GiB
    cg = tmp_path / "cg"
    cg.mkdir()
    assert device.available_memory(meminfo, cg) == 20 * GIB
    (cg / "memory.max").write_text(f"{8 * GIB}\n")
    (cg / "memory.current").write_text(f"{3 * GIB}\n")
    assert device.available_memory(meminfo, cg) == 5 * GIB  # the job's limit, less what it uses
    (cg / "memory.max").write_text("max\n")
    assert device.available_memory(meminfo, cg) == 20 * GIB
    real = device.available_memory()
    assert real is None or real > 0


@pytest.mark.parametrize("bad", [-1, -4])
def test_a_negative_count_is_refused(bad):
    with pytest.raises(Exception, match="eval.num_envs: must be 0"):
        rollout.resolve_num_envs(bad)
