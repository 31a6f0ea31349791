"""The data loader (workers, prefetch, preprocessing in the workers) and the one-process layout."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.data import default_collate
from train_fixtures import inputs_dir

from pisft import config as config_mod
from pisft.errors import PisftError
from pisft.train import fsdp
from pisft.train.batches import (
    RAND_KEY,
    StepDataset,
    default_workers,
    make_loader,
    resolve_workers,
    split_rand,
)
from pisft.train.sampler import StepLayout, StepSampler


def _toy(n=40):
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(6, generator=g), "i": torch.tensor(i)} for i in range(n)]


def _draw(rng):
    return {"noise": rng.standard_normal(3).astype("float32")}


def _batches(workers: int, *, rank=0, world=1, start=0, end=6, prefetch=2):
    data = _toy()
    sampler = StepSampler(len(data), 7, StepLayout(8, 2, world))
    loader = make_loader(data, sampler, rank=rank, start_step=start, end_step=end, seed=7,
                         draw=_draw, num_workers=workers, prefetch_factor=prefetch)
    return [(b["i"].tolist(), b[RAND_KEY]["noise"]) for b in loader]


def test_workers_yield_the_same_batches_in_the_same_order():
    """Order and random draws depend on (seed, step) only, not on the number of workers."""
    ref = _batches(0)
    assert len(ref) == 6 * 4  # 6 steps x accumulation 4
    for workers, prefetch in ((2, 1), (3, 4)):
        got = _batches(workers, prefetch=prefetch)
        assert [i for i, _ in got] == [i for i, _ in ref]
        for (_, a), (_, b) in zip(got, ref, strict=True):
            assert torch.equal(a, b)
    # A resumed loader (start step 3) continues exactly where the full one was.
    assert [i for i, _ in _batches(2, start=3)] == [i for i, _ in ref[3 * 4:]]


def test_default_workers_from_the_cores():
    assert default_workers("cpu", 2, cores=2) == 1
    assert default_workers("npu", 8, cores=192) == 8  # 24 cores each: capped at 8
    assert default_workers("cuda", 4, cores=16) == 3  # its share (4) minus its own core
    assert default_workers("npu", 8, cores=8) == 1  # at least one
    assert resolve_workers(-1, "cpu", 2) == 1
    assert resolve_workers(0, "npu", 8) == 0 and resolve_workers(5, "npu", 8) == 5
    with pytest.raises(ValueError, match="train.num_workers"):
        resolve_workers(-2, "cpu", 1)
    with pytest.raises(ValueError, match="train.prefetch_factor"):
        _batches(1, prefetch=0)


@pytest.mark.parametrize("key, value, message", [
    ("num_workers", -2, "train.num_workers"),
    ("prefetch_factor", 0, "train.prefetch_factor"),
])
def test_bad_loader_settings_are_refused(key, value, message):
    raw = config_mod.to_dict(config_mod.load(config_mod.DEFAULT_CONFIG))
    raw["train"][key] = value
    with pytest.raises(PisftError, match=message):
        config_mod.from_dict(raw, "test")


@pytest.mark.usefixtures("one_process_group")
def test_one_process_trains_unsharded_the_smoke_keeps_the_sharded_layout(monkeypatch):
    from pisft.train import host_memory

    trims = []
    real = host_memory.return_freed_memory
    monkeypatch.setattr(host_memory, "return_freed_memory", lambda: trims.append(True) or real())

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 2048), nn.Tanh(), nn.Linear(2048, 3))

    mesh = init_device_mesh("cpu", (1,))
    plain, sharded = model(), model()
    units = fsdp.distribute(plain, mesh, "fp32", torch.device("cpu"))
    # the units an N-process run on the CPU shards: none, both layers are below
    # CPU_MIN_UNIT_PARAMS and stay in the root unit (on an accelerator: "0" and "2")
    assert [u.name for u in units] == []
    assert [u.name for u in fsdp.distribute(model(), mesh, "fp32", torch.device("meta"))] == ["0", "2"]
    assert not any(isinstance(p, DTensor) for p in plain.parameters())
    fsdp.distribute(sharded, mesh, "fp32", torch.device("cpu"), keep_sharded=True)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    assert trims == [True]  # the heap the whole tensors left is given back once (pisft.train.host_memory)
    x = torch.randn(5, 6)
    torch.testing.assert_close(plain(x), sharded(x), rtol=0, atol=0)


@pytest.mark.integration
def test_preprocessing_in_the_workers_gives_what_the_training_process_computed(tmp_path_factory):
    """PolicyTask.collate (run in a data-loader worker) + prepare == LeRobot's whole preprocessor."""
    from pisft.data.dataset import load_split, load_stats
    from pisft.model.policy import load_policy, make_processors
    from pisft.train.policy_task import PolicyTask

    root = inputs_dir(tmp_path_factory)
    policy = load_policy(root / "base_model", dtype="float32")
    pre, _ = make_processors(policy, root / "base_model", load_stats(root / "dataset"))
    train_set = load_split(root / "dataset", "train", chunk_size=policy.config.chunk_size)
    task = PolicyTask(policy, pre, torch.device("cpu"))
    ds = StepDataset(train_set, 0, task.draw)
    sampler = StepSampler(len(train_set), 0, StepLayout(3, 3, 1))
    loader = make_loader(train_set, sampler, rank=0, start_step=0, end_step=1, seed=0,
                         draw=task.draw, num_workers=1, collate=task.collate)
    (got,) = list(loader)
    got, got_rand = split_rand(got)
    got = task.prepare(got)
    want, want_rand = split_rand(default_collate([ds[r] for r in sampler.micro_batch(0, 0, 0)]))
    want = task.prepare(want)  # the whole preprocessor in this process
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key
    for key in want_rand:
        assert torch.equal(got_rand[key], want_rand[key])


def test_freed_heap_goes_back_to_the_host_where_the_c_library_can():
    """glibc's malloc_trim is found and called (this host's C library is glibc); elsewhere the
    call is skipped, never an error."""
    import platform

    from pisft.train import host_memory

    assert isinstance(host_memory.return_freed_memory(), bool)
    if platform.libc_ver()[0] == "glibc":
        assert host_memory._malloc_trim() is not None  # the lookup itself
