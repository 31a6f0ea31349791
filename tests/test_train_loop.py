"""The loop and the checkpoints, in one process (gloo, world size 1), with a small module."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from pisft.train import checkpoint as ckpt_mod
from pisft.train import step as train_step_mod
from pisft.train import fsdp, loop, optim
from pisft.train.checkpoint import CheckpointManager, CheckpointMismatch
from pisft.train.batches import make_loader
from pisft.train.sampler import StepLayout, StepSampler

METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "step_time_s", "samples_per_s", "data_wait_s",
               "peak_memory_bytes", "mfu"}


pytestmark = pytest.mark.usefixtures("one_process_group")  # gloo, world size 1 (conftest)


class ToyTask:
    """Regression with per-sample input noise drawn from the sample's (seed, step, position)."""

    def draw(self, rng):
        return {"noise": rng.standard_normal(6).astype(np.float32)}

    def prepare(self, batch):
        return batch

    def loss(self, model, batch, rand):
        return ((model(batch["x"] + 0.1 * rand["noise"]) - batch["y"]) ** 2).mean()

    def flops_per_sample(self, batch):
        return 1000.0


def toy_data(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    w = torch.randn(6, 3, generator=g)
    return [{"x": x[i], "y": torch.tanh(x[i] @ w)} for i in range(n)]


def toy_model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    units = fsdp.shard(model, init_device_mesh("cpu", (1,)), "fp32")
    return model, units


def train(micro, steps, *, start=0, model=None, opt=None, sched=None, save=None, lr=1e-2,
          log_every=1, fused=False, on_step=None, ema=None):
    data = toy_data()
    if model is None:
        model, _ = toy_model()
        opt = optim.build_optimizer(model.parameters(), lr=lr, weight_decay=0.01, fused=fused)
        sched = optim.build_scheduler(opt, lr=lr, warmup_steps=2, decay_lr=1e-3, steps=steps)
    layout = StepLayout(8, micro, 1)
    sampler = StepSampler(len(data), 0, layout)
    loader = make_loader(data, sampler, rank=0, start_step=start, end_step=steps, seed=0,
                         draw=ToyTask().draw, num_workers=0)
    s = loop.LoopSettings(steps=steps, accum=layout.accum, global_batch=8, grad_clip=1.0, kind="cpu",
                          device=torch.device("cpu"), world_size=1, rank=0, peak_flops=1e9,
                          save_every=3, log_every=log_every)
    records = loop.run(model, opt, sched, ToyTask(), iter(loader), s, start_step=start, save=save,
                       on_step=on_step, ema=ema)
    return model, opt, sched, records


def weights(model):
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def test_loop_learns_and_records_every_metric():
    _, _, _, records = train(micro=8, steps=12)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert set(records[0]) >= METRIC_KEYS
    assert records[0]["peak_memory_bytes_per_rank"] == [records[0]["peak_memory_bytes"]]
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(math.isfinite(r["grad_norm"]) for r in records)
    assert records[0]["mfu"] == pytest.approx(1000.0 * records[0]["samples_per_s"] / 1e9)


def test_accumulation_gives_the_same_training():
    """micro 8 x accum 1 and micro 2 x accum 4: same losses and weights (same global batch)."""
    m1, _, _, r1 = train(micro=8, steps=6)
    m4, _, _, r4 = train(micro=2, steps=6)
    for a, b in zip(r1, r4):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    for k, v in weights(m1).items():
        torch.testing.assert_close(weights(m4)[k], v, rtol=1e-5, atol=1e-6)


def test_non_finite_loss_stops_the_loop():
    class Bad(ToyTask):
        def loss(self, model, batch, rand):
            return super().loss(model, batch, rand) * float("nan")

    model, _ = toy_model()
    opt = optim.build_optimizer(model.parameters(), lr=1e-2, weight_decay=0.0, fused=False)
    sched = optim.build_scheduler(opt, lr=1e-2, warmup_steps=0, decay_lr=1e-3, steps=2)
    data = toy_data()
    sampler = StepSampler(len(data), 0, StepLayout(8, 8, 1))
    loader = make_loader(data, sampler, rank=0, start_step=0, end_step=2, seed=0, draw=Bad().draw,
                         num_workers=0)
    s = loop.LoopSettings(steps=2, accum=1, global_batch=8, grad_clip=1.0, kind="cpu",
                          device=torch.device("cpu"), world_size=1, rank=0)
    before = weights(model)
    with pytest.raises(loop.NonFiniteError, match="step 1"):
        loop.run(model, opt, sched, Bad(), iter(loader), s, start_step=0)
    for k, v in before.items():  # the optimizer step was skipped
        assert torch.equal(weights(model)[k], v)


def test_values_fetched_every_log_every_steps_one_record_per_step():
    seen = []
    _, _, _, every = train(micro=4, steps=7, fused=True)
    model, _, _, sparse = train(micro=4, steps=7, fused=True, log_every=4, on_step=seen.append)
    assert [r["step"] for r in sparse] == list(range(1, 8)) == [r["step"] for r in seen]
    assert [r["loss"] for r in sparse] == [r["loss"] for r in every]
    assert [r["grad_norm"] for r in sparse] == [r["grad_norm"] for r in every]
    assert {"peak_reserved_bytes", "peak_reserved_bytes_per_rank"} <= set(sparse[0])
    # the run's first step is fetched alone (its own time: a compiled run's compilation); steps
    # 2-4 share their interval's mean time (log_every=4), 5-7 theirs (the last)
    times = [r["step_time_s"] for r in sparse]
    assert times[1] == times[2] == times[3] and times[4] == times[5] == times[6] and len(set(times)) == 3


HOST_SYNCS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__")


def test_no_host_sync_inside_an_optimizer_step(monkeypatch):
    """Between two fetches the loop never asks the device for a value (fused AdamW path)."""
    state = {"counting": False, "syncs": []}
    real_run, real_fetch = loop.run, loop._fetch

    def switched(fn, value):
        def wrapper(*args, **kwargs):
            before, state["counting"] = state["counting"], value
            try:
                return fn(*args, **kwargs)
            finally:
                state["counting"] = before
        return wrapper

    def counting(name):
        real = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            if state["counting"]:
                state["syncs"].append(name)
            return real(self, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(loop, "run", switched(real_run, True))
    monkeypatch.setattr(loop, "_fetch", switched(real_fetch, False))
    for name in HOST_SYNCS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    _, _, _, records = train(micro=4, steps=5, fused=True, log_every=100)
    assert len(records) == 5
    assert state["syncs"] == []


def test_non_finite_step_is_skipped_on_the_device_with_fused_adamw():
    class NanAtStep2(ToyTask):
        calls = 0

        def loss(self, model, batch, rand):
            NanAtStep2.calls += 1
            value = super().loss(model, batch, rand)
            return value * float("nan") if NanAtStep2.calls == 2 else value

    model, _ = toy_model()
    opt = optim.build_optimizer(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    sched = optim.build_scheduler(opt, lr=1e-2, warmup_steps=0, decay_lr=1e-3, steps=3)
    data = toy_data()
    sampler = StepSampler(len(data), 0, StepLayout(8, 8, 1))
    loader = iter(make_loader(data, sampler, rank=0, start_step=0, end_step=3, seed=0,
                              draw=ToyTask().draw, num_workers=0))
    s = loop.LoopSettings(steps=3, accum=1, global_batch=8, grad_clip=1.0, kind="cpu",
                          device=torch.device("cpu"), world_size=1, rank=0, stop_on_nonfinite=False,
                          log_every=10)
    snapshots = []
    records = loop.run(model, opt, sched, NanAtStep2(), loader, s, start_step=0,
                       on_step=lambda r: snapshots.append(r))
    assert [math.isfinite(r["grad_norm"]) for r in records] == [True, False, True]
    step_counts = {int(v["step"]) for v in opt.state.values()}
    assert step_counts == {2}  # the NaN step did not count as an AdamW step
    assert all(torch.isfinite(v).all() for v in weights(model).values())


class IgnoresFoundInf(torch.optim.AdamW):
    """Stand-in for torch_npu's fused AdamW, which takes found_inf but never reads it
    (Ascend/op-plugin op_plugin/ops/opapi/FusedAdamWKernelNpuOpApi.cpp)."""

    def step(self, closure=None):
        self.__dict__.pop("found_inf", None)
        return super().step(closure)


@pytest.mark.parametrize("kind", ["cpu", "npu"])
def test_a_nan_gradient_never_reaches_the_weights(kind):
    model = nn.Linear(4, 3)
    params = list(model.parameters())
    make = IgnoresFoundInf if kind == "npu" else torch.optim.AdamW
    opt = make(params, lr=0.1, fused=True)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # a normal first step: moments exist
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    train_step_mod.skip_if_nonfinite_step(opt, torch.tensor(False), kind, params)
    assert all(torch.isfinite(p).all() for p in params)
    assert all(torch.isfinite(v).all() for st in opt.state.values() for v in st.values())
    if kind == "cpu":  # found_inf honoured: the step did not happen at all
        assert all(torch.equal(a, p) for a, p in zip(before, params))


def _manager(root: Path, fingerprint=None, keep_last=2):
    return CheckpointManager(root, keep_last=keep_last, rank=0, world_size=1,
                             fingerprint=fingerprint or {"train.lr": 0.01},
                             config={"train": {"lr": 0.01}}, log=lambda m: None)


def test_checkpoint_resume_is_bit_identical(tmp_path):
    """Train 9 steps saving every 3; resume from step 6 in a fresh model: identical end state."""
    root = tmp_path / "ckpt"
    holder = {}

    def save(step):
        _manager(root).save(step, holder["m"], holder["o"], holder["s"])

    model, _ = toy_model()
    opt = optim.build_optimizer(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    sched = optim.build_scheduler(opt, lr=1e-2, warmup_steps=2, decay_lr=1e-3, steps=9)
    holder.update(m=model, o=opt, s=sched)
    _, _, _, full = train(micro=4, steps=9, model=model, opt=opt, sched=sched, save=save)
    assert [f.step for f in ckpt_mod.list_checkpoints(root)] == [6, 9]  # keep_last=2
    # drop the final checkpoint to resume from step 6
    import shutil
    shutil.rmtree(root / "step_000009")
    found = ckpt_mod.latest_complete(root)
    assert found.step == 6
    files = json.loads((found.path / "COMPLETE.json").read_text())["files"]
    assert {"dcp/.metadata", "trainer_state.json", "pisft_config.json",
            "rng/rank_00000.json"} <= set(files)

    model2, _ = toy_model(seed=123)  # different init: everything must come from the checkpoint
    opt2 = optim.build_optimizer(model2.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    sched2 = optim.build_scheduler(opt2, lr=1e-2, warmup_steps=2, decay_lr=1e-3, steps=9)
    state = _manager(root).load(found, model2, opt2, sched2)
    assert state["step"] == 6
    _, _, _, rest = train(micro=4, steps=9, start=6, model=model2, opt=opt2, sched=sched2)
    assert [r["loss"] for r in rest] == [r["loss"] for r in full[6:]]
    assert [r["lr"] for r in rest] == [r["lr"] for r in full[6:]]
    for k, v in weights(model).items():
        assert torch.equal(weights(model2)[k], v), k


def test_incomplete_and_truncated_checkpoints_are_skipped(tmp_path):
    root = tmp_path / "ckpt"
    model, _ = toy_model()
    opt = optim.build_optimizer(model.parameters(), lr=1e-2, weight_decay=0.0, fused=False)
    sched = optim.build_scheduler(opt, lr=1e-2, warmup_steps=0, decay_lr=1e-3, steps=10)
    mgr = _manager(root, keep_last=5)
    for step in (2, 4, 6):
        mgr.save(step, model, opt, sched)
    # step 6: truncate a data file; step 4: remove the completeness marker (a save cut short)
    data_file = next(p for p in (root / "step_000006" / "dcp").iterdir() if p.suffix == ".distcp")
    data_file.write_bytes(data_file.read_bytes()[:-7])
    (root / "step_000004" / "COMPLETE.json").unlink()
    (root / ".step_000008.tmp").mkdir()  # a save that died before the rename
    skipped = []
    found = ckpt_mod.latest_complete(root, log=skipped.append)
    assert found.step == 2
    assert "truncated" in skipped[0] and "step_000006" in skipped[0]
    assert "did not finish" in skipped[1] and "step_000004" in skipped[1]
    mgr.prune()
    assert not (root / ".step_000008.tmp").exists()


def test_checkpoint_of_another_configuration_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    model, _ = toy_model()
    opt = optim.build_optimizer(model.parameters(), lr=1e-2, weight_decay=0.0, fused=False)
    sched = optim.build_scheduler(opt, lr=1e-2, warmup_steps=0, decay_lr=1e-3, steps=10)
    _manager(root, fingerprint={"train.lr": 0.01}).save(2, model, opt, sched)
    other = _manager(root, fingerprint={"train.lr": 0.02})
    with pytest.raises(CheckpointMismatch, match=r"(?s)train.lr: checkpoint 0.01, now 0.02.*delete"):
        other.load(other.find_resume(), model, opt, sched)


def test_checkpoint_folder_follows_the_run_settings_not_the_world_size(tmp_path):
    from pisft import config as config_mod
    from pisft.train.run_folders import checkpoint_root, other_runs

    def cfg(**train):
        return config_mod.from_dict({"results_dir": str(tmp_path), "train": train})

    base = checkpoint_root(cfg())
    assert base.parent == tmp_path / "checkpoints" / "train" and base.name.startswith("run-")
    assert checkpoint_root(cfg(nproc_per_node=1, global_batch_size=16)) == base  # resumes on any world size
    longer = checkpoint_root(cfg(steps=300))
    assert longer != base  # another schedule: a fresh run, the old one is kept
    base.mkdir(parents=True)
    assert other_runs(cfg(steps=300)) == [base]


def _zero_64k_in_a_shard(step_dir: Path) -> Path:
    """64 KiB of zeros written into a DCP shard, size unchanged (issue 11's silent damage)."""
    shard = max((p for p in (step_dir / "dcp").iterdir() if p.suffix == ".distcp"),
                key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    assert size > 64 * 1024 + 4096
    with shard.open("r+b") as fh:
        fh.seek(4096)
        fh.write(b"\0" * 64 * 1024)
    assert shard.stat().st_size == size
    return shard


def _big_toy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 3))
    fsdp.shard(model, init_device_mesh("cpu", (1,)), "fp32")
    opt = optim.build_optimizer(model.parameters(), lr=1e-2, weight_decay=0.0, fused=False)
    sched = optim.build_scheduler(opt, lr=1e-2, warmup_steps=0, decay_lr=1e-3, steps=10)
    return model, opt, sched


def test_checkpoint_damaged_in_place_is_skipped_for_the_previous_one(tmp_path):
    root = tmp_path / "ckpt"
    model, opt, sched = _big_toy()
    mgr = _manager(root, keep_last=5)
    for step in (2, 4):
        mgr.save(step, model, opt, sched)
    meta = json.loads((root / "step_000004" / "COMPLETE.json").read_text())
    assert "dcp/.metadata" in meta["files"] and "sha256" not in meta  # MANIFEST.json's record
    assert all(set(entry) == {"sha256", "size"} for entry in meta["files"].values())
    assert ckpt_mod.verify(root / "step_000004") is None
    shard = _zero_64k_in_a_shard(root / "step_000004")
    skipped = []
    found = CheckpointManager(root, keep_last=5, rank=0, world_size=1, fingerprint={"train.lr": 0.01},
                              config={}, log=skipped.append).find_resume()
    assert found.step == 2  # the previous complete one
    assert len(skipped) == 1 and "step_000004" in skipped[0] and "content damaged" in skipped[0]
    assert shard.relative_to(root / "step_000004").as_posix() in skipped[0]
    # sizes alone do not see it: that is why the content is hashed
    assert ckpt_mod.verify(root / "step_000004", content=False) is None



def test_the_marker_holds_the_manifest_record_and_its_writer(tmp_path, monkeypatch):
    """COMPLETE.json's files are MANIFEST.json's record (pisft.io.build_manifest's), plus the step and the
    stage writing it; the folder is compared with it by the function MANIFEST.json's readers use."""
    from pisft import io as io_mod

    monkeypatch.setenv(io_mod.STAGE_ENV, "train")
    monkeypatch.setenv(io_mod.COMMAND_ENV, "python -m pisft launch train")
    root = tmp_path / "ckpt"
    model, opt, sched = _big_toy()
    step_dir = _manager(root).save(2, model, opt, sched)
    meta = json.loads((step_dir / "COMPLETE.json").read_text())
    assert meta["step"] == 2
    assert meta["written_by"] == {"stage": "train", "command": "python -m pisft launch train"}
    assert meta["files"] == io_mod.build_manifest(step_dir, exclude=("COMPLETE.json",))
    assert io_mod.compare_files(step_dir, meta["files"], sha256=lambda rel: io_mod.sha256_file(step_dir / rel)) == []
    shard = _zero_64k_in_a_shard(step_dir)
    rel = shard.relative_to(step_dir).as_posix()
    assert io_mod.compare_files(step_dir, meta["files"], sha256=lambda r: io_mod.sha256_file(step_dir / r)) == [
        io_mod.FileProblem(rel, "sha256")]


def _to_the_earlier_layout(step_dir: Path) -> None:
    """Rewrite a checkpoint's COMPLETE.json as pisft wrote it before issue 48 (files: relpath -> size,
    sha256: relpath -> hex), as a checkpoint saved by that code holds it."""
    marker = step_dir / "COMPLETE.json"
    meta = json.loads(marker.read_text())
    marker.write_text(json.dumps({"step": meta["step"],
                                  "files": {rel: e["size"] for rel, e in meta["files"].items()},
                                  "sha256": {rel: e["sha256"] for rel, e in meta["files"].items()}},
                                 indent=2, sort_keys=True) + "\n")


# One short training process as a stage starts it (`pisft.train.job.setup_process`: the process
# group, the run's seeds), three AdamW steps on a small model, one checkpoint saved.
_SHORT_RUN = """
import sys
import torch
from pisft import config
from pisft.train import optim
from pisft.train.checkpoint import CheckpointManager
from pisft.train.job import setup_process

root, seed = sys.argv[1], int(sys.argv[2])
cfg = config.from_dict({"device": "cpu", "results_dir": root, "train": {"seed": seed, "nproc_per_node": 1}})
ctx = setup_process(cfg, "train_8card", 1)
torch.manual_seed(seed)  # as job.build does
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
opt = optim.build_optimizer(model.parameters(), lr=1e-2, weight_decay=0.01, fused=False)
sched = optim.build_scheduler(opt, lr=1e-2, warmup_steps=1, decay_lr=1e-3, steps=3)
x = torch.linspace(-1, 1, 24).reshape(4, 6)
for _ in range(3):
    model(x).square().mean().backward()
    opt.step(); sched.step(); opt.zero_grad()
CheckpointManager(root + "/ckpt", keep_last=1, rank=ctx.rank, world_size=1, fingerprint={"train.seed": seed},
                  config={"train": {"seed": seed}}, log=lambda _m: None).save(3, model, opt, sched)
"""


def _short_runs(tmp_path: Path, seeds: list[int]) -> list[dict[str, bytes]]:
    """`_SHORT_RUN` once per seed, each a fresh process (whose unseeded generators start from the
    OS's entropy), side by side; each checkpoint's files by relative path."""
    import os
    import socket
    import subprocess
    import sys

    procs = []
    for i, seed in enumerate(seeds):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
               "LOCAL_RANK": "0", "WORLD_SIZE": "1", "PISFT_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", _SHORT_RUN, str(tmp_path / f"run{i}"), str(seed)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    runs = []
    for i in range(len(seeds)):
        step = tmp_path / f"run{i}" / "ckpt" / ckpt_mod.step_dir_name(3)
        runs.append({p.relative_to(step).as_posix(): p.read_bytes() for p in sorted(step.rglob("*")) if p.is_file()})
    return runs


def test_two_identical_short_runs_write_byte_identical_checkpoints(tmp_path):
    """Issue 56: Python's and NumPy's generators were never seeded, so the RNG states a checkpoint
    saves (rng/rank_XXXXX.json) differed between two identical runs; DCP's .metadata held a
    random save id and the temporary folder's path. Now every file is the same bytes."""
    first, second = _short_runs(tmp_path, [0, 0])
    assert {"rng/rank_00000.json", "dcp/.metadata", "trainer_state.json", "COMPLETE.json"} <= set(first)
    assert [name for name in first if first[name] != second.get(name)] == [] and set(first) == set(second)
    # the states come from the seed, per rank
    states = []
    for seed, rank in ((0, 0), (0, 0), (1, 0), (0, 1)):
        ckpt_mod.seed_host_generators(seed, rank)
        states.append(ckpt_mod._rng_state())  # what a checkpoint saves
    assert states[0] == states[1] and states[0]["numpy"] != states[2]["numpy"] != states[3]["numpy"]
    assert states[0]["python"] != states[2]["python"] != states[3]["python"]


def test_a_checkpoint_with_the_earlier_marker_is_verified_and_resumed(tmp_path):
    root = tmp_path / "ckpt"
    model, opt, sched = _big_toy()
    mgr = _manager(root, keep_last=5)
    for step in (2, 4, 6):
        mgr.save(step, model, opt, sched)
    for step in (2, 4, 6):
        _to_the_earlier_layout(root / ckpt_mod.step_dir_name(step))
    assert "sha256" in json.loads((root / "step_000006" / "COMPLETE.json").read_text())
    assert all(ckpt_mod.verify(f.path) is None for f in ckpt_mod.list_checkpoints(root))
    # damage is still seen in it: altered bytes at step 6, a truncated file at step 4
    shard = _zero_64k_in_a_shard(root / "step_000006")
    meta4 = root / "step_000004" / "trainer_state.json"
    meta4.write_text(meta4.read_text()[:-3])
    skipped = []
    found = CheckpointManager(root, keep_last=5, rank=0, world_size=1, fingerprint={"train.lr": 0.01},
                              config={}, log=skipped.append).find_resume()
    assert found.step == 2
    assert "content damaged" in skipped[0] and shard.relative_to(root / "step_000006").as_posix() in skipped[0]
    assert "trainer_state.json has" in skipped[1] and "truncated" in skipped[1]
    # and it resumes: the model, optimizer and scheduler of step 2
    model2, opt2, sched2 = _big_toy()
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)
    state = _manager(root, keep_last=5).load(found, model2, opt2, sched2)
    assert state["step"] == 2
    for k, v in weights(model).items():
        assert torch.equal(weights(model2)[k], v), k
    # a marker of the oldest layout (sizes only): complete, but its content cannot be checked
    marker = root / "step_000002" / "COMPLETE.json"
    meta = json.loads(marker.read_text())
    marker.write_text(json.dumps({"step": 2, "files": meta["files"]}))
    assert ckpt_mod.verify(root / "step_000002", content=False) is None
    assert "no content checksums" in ckpt_mod.verify(root / "step_000002")
    # pruning counts the earlier layouts' checkpoints as complete (step 4, truncated, is not: kept as it is)
    _manager(root, keep_last=1).prune()
    assert [f.step for f in ckpt_mod.list_checkpoints(root)] == [4, 6]

def test_run_stops_when_every_checkpoint_is_damaged(tmp_path):
    root = tmp_path / "ckpt"
    model, opt, sched = _big_toy()
    mgr = _manager(root, keep_last=5)
    for step in (2, 4):
        mgr.save(step, model, opt, sched)
    (root / ".step_000006.tmp").mkdir()  # an unfinished save is not damage
    for step in (2, 4):
        _zero_64k_in_a_shard(root / ckpt_mod.step_dir_name(step))
    with pytest.raises(ckpt_mod.CheckpointsDamaged, match=r"step_000004: content damaged.*"
                                                        r"step_000002: content damaged.*delete") as err:
        mgr.find_resume()
    assert "\n" not in str(err.value)  # one line: which files, what to do
    # only unfinished saves (no COMPLETE.json): nothing to resume, start from step 0
    for step in (2, 4):
        (root / ckpt_mod.step_dir_name(step) / "COMPLETE.json").unlink()
    assert mgr.find_resume() is None


MATH_CHANGES = [  # every setting that changes what training computes -> a fresh run folder
    ("train", {"precision": "bf16"}), ("train", {"steps": 300}), ("train", {"seed": 1}),
    ("train", {"lr": 2e-3}), ("train", {"warmup_steps": 3}), ("train", {"decay_lr": 1e-5}),
    ("train", {"weight_decay": 0.0}), ("train", {"grad_clip": 0.5}),
    ("train", {"global_batch_size": 32}),
    ("model", {"preset": "pi05", "source": "/models/pi05_base"}), ("model", {"source": "/models/other"}),
    ("model", {"init_seed": 1}), ("model", {"tokenizer": "/models/tok"}),
    ("data", {"success_only": True}), ("data", {"unconditional_prob": 0.3}),
    ("data", {"eval_fraction": 0.3}), ("data", {"split_seed": 1}), ("data", {"image_size": 32}),
]
NOT_MATH = [  # how the same computation is split, observed or saved: the run resumes
    ("train", {"nproc_per_node": 1}), ("train", {"micro_batch_size": 2}),
    ("train", {"log_every": 1}), ("train", {"save_every": 7}), ("train", {"keep_last": 5}),
    ("train", {"num_workers": 1}), ("train", {"tensorboard": True}), ("train", {"peak_flops": 1e12}),
    ("train", {"activation_checkpointing": True}), ("train", {"deterministic": True}),
    ("eval", {"batch_size": 3}), ("smoke", {"steps": 2}),
]


def _cfg_with(tmp_path, section=None, values=None):
    from pisft import config as config_mod

    raw = {"results_dir": str(tmp_path)}
    if section:
        raw[section] = values
    return config_mod.from_dict(raw)


@pytest.mark.parametrize("section, values", MATH_CHANGES, ids=lambda v: str(v))
def test_a_setting_that_changes_the_math_starts_a_fresh_run(tmp_path, section, values):
    from pisft.train.run_folders import checkpoint_root

    assert checkpoint_root(_cfg_with(tmp_path, section, values)) != checkpoint_root(_cfg_with(tmp_path))


@pytest.mark.parametrize("section, values", NOT_MATH, ids=lambda v: str(v))
def test_a_setting_that_keeps_the_math_resumes(tmp_path, section, values):
    from pisft.train.run_folders import checkpoint_root

    assert checkpoint_root(_cfg_with(tmp_path, section, values)) == checkpoint_root(_cfg_with(tmp_path))


def test_changed_input_content_starts_a_fresh_run(tmp_path):
    from pisft.train.run_folders import checkpoint_root

    cfg = _cfg_with(tmp_path)
    base, data = tmp_path / "base_model", tmp_path / "dataset"
    weights = '{"files": {"model.safetensors": {"sha256": "%s", "size": 1}}}'
    for f, text in ((base / "MANIFEST.json", weights % "a"), (data / "split.json", "{}"),
                    (data / "meta" / "prompt_conditioning.json", '{"p": 0.1}'),
                    (data / "data" / "chunk-000" / "file-000.parquet", "x" * 10)):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    roots = {checkpoint_root(cfg)}
    (data / "meta" / "prompt_conditioning.json").write_text('{"p": 0.2}')
    roots.add(checkpoint_root(cfg))
    (data / "data" / "chunk-000" / "file-000.parquet").write_text("x" * 11)
    roots.add(checkpoint_root(cfg))
    (base / "MANIFEST.json").write_text(weights % "b")  # another weights file
    roots.add(checkpoint_root(cfg))
    assert len(roots) == 4
