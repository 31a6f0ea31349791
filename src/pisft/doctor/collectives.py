"""The doctor's `collectives` check: one process per card, the training's backend and dtypes.

FSDP2 all-gathers parameters in bf16 and reduce-scatters gradients in fp32 (bf16 when a run
reduces in bf16), the training loop all-reduces float32 sums and all-gathers int64 figures
(pisft.train.loop). Each worker checks the exact results (small integers, exact in bf16) and
writes them to `<out>/rank_<r>.json`; the parent reads them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from pisft.ports import held_port

TIMEOUT_S = 120  # init and every collective; HCCL links between 8 cards take seconds, not minutes
CPU_PROCESSES = 2  # gloo on the CPU: two processes, so the bytes really travel


def _ops(rank: int, world: int, device: torch.device) -> list[str]:
    """Run each collective; return the problems found (empty: every result exact)."""
    import torch.distributed as dist

    problems = []
    expected_sum = world * (world + 1) / 2  # ranks contribute rank + 1
    for dtype in (torch.float32, torch.int64):  # the loop's loss sums / its figures
        t = torch.full((1024,), rank + 1, dtype=dtype, device=device)
        dist.all_reduce(t)
        if not bool((t == expected_sum).all()):
            problems.append(f"all_reduce {dtype}: got {t[0].item()}, expected {expected_sum:g}")
    for dtype in (torch.float32, torch.bfloat16):  # FSDP2's gradient reduce-scatter
        full = torch.full((world * 512,), rank + 1, dtype=dtype, device=device)
        out = torch.empty(512, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(out, full)
        if not bool((out == expected_sum).all()):
            problems.append(f"reduce_scatter_tensor {dtype}: got {out[0].item()}, expected {expected_sum:g}")
    shard = torch.full((512,), rank + 1, dtype=torch.bfloat16, device=device)  # FSDP2's gathers
    gathered = torch.empty(world * 512, dtype=torch.bfloat16, device=device)
    dist.all_gather_into_tensor(gathered, shard)
    want = torch.arange(1, world + 1, dtype=torch.bfloat16, device=device).repeat_interleave(512)
    if not torch.equal(gathered, want):
        problems.append("all_gather_into_tensor bfloat16: wrong values")
    return problems


def worker(rank: int, kind: str, world: int, port: int, out_dir: str, deterministic: bool = False) -> None:
    """One rank, in its own process (`python -m pisft.doctor.collectives RANK KIND WORLD PORT OUT
    DETERMINISTIC`), set up as `pisft.train.job.setup_process` sets up a training process."""
    import torch.distributed as dist

    from pisft import device as devices

    result: dict[str, Any] = {"rank": rank, "problems": []}
    try:
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                           "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
        devices.apply_process_env(kind)  # the environment the training processes get
        device = devices.local_device(kind, rank)  # the CPU: cpu, whatever the rank
        if deterministic:  # train.deterministic: HCCL_DETERMINISTIC, before the communicator
            devices.enable_determinism(kind)
        kwargs = {"device_id": device} if devices.row(kind).init_with_device_id else {}  # as setup_process does
        dist.init_process_group(devices.backend_for(kind), rank=rank, world_size=world,
                                timeout=timedelta(seconds=TIMEOUT_S), **kwargs)
        try:
            result["backend"] = dist.get_backend()
            result["problems"] = _ops(rank, world, device)
            devices.synchronize(kind)
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        result["problems"].append(f"{type(exc).__name__}: {exc}")
        result["traceback"] = traceback.format_exc(limit=4)
    Path(out_dir, f"rank_{rank}.json").write_text(json.dumps(result))


def run(kind: str, world: int, deterministic: bool = False) -> tuple[bool, str]:
    """Start `world` worker processes (only torch and pisft.device imported: seconds); (all
    passed, a one-line summary)."""
    from pisft import device as devices

    # rank 0's init_process_group binds the rendezvous port; held until the workers are done
    with held_port() as port, tempfile.TemporaryDirectory(prefix="pisft-doctor-") as out:
        procs = [subprocess.Popen([sys.executable, "-m", "pisft.doctor.collectives", str(r), kind,
                                   str(world), str(port), out, str(int(deterministic))],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]
        deadline = time.monotonic() + 3 * TIMEOUT_S
        tails = {}
        for r, proc in enumerate(procs):
            try:
                tails[r] = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0][-500:]
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                return False, (f"{world} processes still running after {3 * TIMEOUT_S} s (a hang in a "
                               "collective? check HCCL_CONNECT_TIMEOUT and the cards' links: hccn_tool)")
        results = []
        for r in range(world):
            path = Path(out, f"rank_{r}.json")
            results.append(json.loads(path.read_text()) if path.is_file() else
                           {"rank": r, "problems": [f"wrote no result (exit {procs[r].returncode}): "
                                                    f"{tails.get(r, '').strip()[-200:]}"]})
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    backend = results[0].get("backend", devices.backend_for(kind))
    what = (f"{backend}, {world} processes: all_reduce float32/int64, reduce_scatter float32/bfloat16, "
            "all_gather bfloat16")
    if problems:
        return False, f"{what}: " + "; ".join(problems[:4])
    return True, f"{what}: exact"


if __name__ == "__main__":
    rank_, kind_, world_, port_, out_, det_ = sys.argv[1:7]
    worker(int(rank_), kind_, int(world_), int(port_), out_, det_ == "1")
