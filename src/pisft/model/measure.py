"""Measure the real peak memory of one training step on CPU, to check the estimate against.

`python -m pisft.model.measure [--preset tiny] [--micro-batch N] [--checkpointing] [--json]`

Runs in its own process (start it with MALLOC_MMAP_THRESHOLD_=65536 so freed tensors go back to
the OS; `measure_in_subprocess` does). After a warm-up step (optimizer state allocated, gradients
freed), the kernel's peak-RSS counter is reset (`/proc/self/clear_refs`, Linux) and one full step
(preprocess, forward, backward, AdamW step) runs; the peak RSS above the pre-step RSS is the
step's own memory: activations, temporaries and gradients. Parameters and optimizer state are
counted exactly from the tensors.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(preset: str, micro_batch: int, checkpointing: bool, seed: int = 0) -> dict:
    import tempfile

    import numpy as np
    import torch

    from pisft.model.policy import build_policy, make_processors, save_model
    from pisft.model.tokenizer import save_tiny_tokenizer

    torch.manual_seed(seed)
    policy = build_policy(preset, seed=seed)
    if checkpointing:
        policy.model.gradient_checkpointing_enable()
    stats = {"observation.state": {"q01": np.full(8, -1, np.float32), "q99": np.ones(8, np.float32)},
             "action": {"q01": np.full(7, -1, np.float32), "q99": np.ones(7, np.float32)}}
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_tokenizer(Path(tmp, "tokenizer"))
        save_model(policy, tmp, tokenizer_dir=Path(tmp, "tokenizer"))
        pre, _ = make_processors(policy, tmp, stats)
    cfg = policy.config
    res = 64

    def batch():
        b = {k: torch.rand(micro_batch, 3, res, res) for k in
             ("observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb")}
        b["observation.state"] = torch.rand(micro_batch, 8) * 2 - 1
        b["action"] = torch.rand(micro_batch, cfg.chunk_size, 7) * 2 - 1
        b["task"] = ["put both moka pots on the stove"] * micro_batch
        return b

    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4, foreach=False)
    policy.train()

    def step():
        loss, _ = policy(pre(batch()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    step()  # warm-up: optimizer state exists from here on
    gc.collect()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    step()
    peak = _status_kib("VmHWM")
    params = sum(p.numel() * p.element_size() for p in policy.parameters())
    opt_state = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                    for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return {"preset": preset, "micro_batch_size": micro_batch, "activation_checkpointing": checkpointing,
            "step_peak_bytes": (peak - before) * 1024, "params_bytes": params,
            "optimizer_bytes": opt_state, "rss_before_step_bytes": before * 1024}


def measure_in_subprocess(preset: str = "tiny", micro_batch: int = 32, checkpointing: bool = False) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pisft.model.measure", "--preset", preset, "--micro-batch", str(micro_batch),
           "--json"] + (["--checkpointing"] if checkpointing else [])
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pisft.model.measure", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.preset, args.micro_batch, args.checkpointing)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:<26} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
