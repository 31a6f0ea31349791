"""Training processes of one CPU host load and shard the model one at a time (`job.in_turns`):
under real torchrun with 2 gloo processes, the second process's load starts after the first's
ended; on an accelerator every process loads at once (no barrier)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from pisft import device as devices
from pisft.config import PisftConfig
from pisft.train.job import Context, in_turns, load_turns, local_world_size

WORKER = """
import json, sys, time
import torch
import torch.distributed as dist
from pisft import device as devices
from pisft.config import PisftConfig
from pisft.train.job import Context, in_turns

dist.init_process_group("gloo")
rank = dist.get_rank()
info = devices.DeviceInfo("cpu", "gloo", torch.device("cpu"), "cpu")
ctx = Context(PisftConfig(), "train_8card", info, rank, dist.get_world_size())

def load():
    start = time.time()
    time.sleep(0.5)
    return {"rank": rank, "start": start, "end": time.time()}

got = in_turns(ctx, load)
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(got, f)
dist.destroy_process_group()
"""


def test_processes_of_one_cpu_host_load_one_after_the_other(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (first["rank"], second["rank"]) == (0, 1)  # each process keeps what it loaded itself
    assert second["start"] >= first["end"]


def test_accelerator_processes_load_at_once_and_one_process_needs_no_turns():
    """No process group exists here: a turn (a barrier) would raise."""
    calls = []
    for kind, world in (("npu", 8), ("cuda", 8), ("cpu", 1)):
        info = devices.DeviceInfo(kind, "gloo", torch.device("cpu"), kind)
        ctx = Context(PisftConfig(), "train_8card", info, 0, world)
        assert load_turns(ctx) == 1
        assert in_turns(ctx, lambda k=kind: calls.append(k) or k) == kind
    assert calls == ["npu", "cuda", "cpu"]


def test_local_world_size_is_torchruns_else_the_whole_world():
    assert local_world_size(16, {"LOCAL_WORLD_SIZE": "8"}) == 8
    assert local_world_size(2, {}) == 2
    assert local_world_size(2, {"LOCAL_WORLD_SIZE": "x"}) == 2
