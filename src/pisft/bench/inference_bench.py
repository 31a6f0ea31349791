"""`python -m pisft bench --only inference`: milliseconds per action chunk, eager against compiled.

One model with random weights (the action chunk costs the same as with trained ones), its chunk
through `ChunkPredictor.predict` (the path every stage runs: preprocessor, `predict_action_chunk`,
postprocessor) on synthetic LIBERO requests (two cameras at the model's resolution, the state, a
prompt padded to the tokenizer's full length), at each batch size: `warmup` chunks, then `chunks`
timed ones, eager first; then the same with the chunk compiled (`pisft.policy.compiled`: its first
call per bucket is the compile, and on CUDA the capture, `compile_s`), from the same noise:

  p50_ms[B]["eager"|"compiled"], p99_ms[B][...]   ms per chunk at batch B (a chunk of B requests)
  compile_s[B]                                     the first compiled call (compile + capture)
  actions_max_abs_diff[B]                          compiled against eager, normalised action units,
                                                   beside `actions_atol` (the stated tolerance)

`run` (the bench part) measures the tiny model (fp32, as the default pipeline runs it) at batch
1, 8 and 32, and pi0.5 at its real size (bf16, `eval.precision: bf16`'s layout) in a process of
its own, at batch 1 only on this CPU by default (`--batches`): a real-size chunk of batch 8 or 32
takes minutes here (the output says how long batch 1 took, and why the others were not run).
`pisft.bench.gpu_infer` is the same measurement on an accelerator.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

BATCHES = (1, 8, 32)
CAMERAS = ("observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb")
PROMPT = "put both the alphabet soup and the tomato sauce in the basket"
REAL_SIZE_TIMEOUT_S = 3600


def build_predictor(preset: str, precision: str, device: str, work: Path, *, seed: int = 0,
                    layout: str = "openpi", denoising_steps: int | None = None):
    """A `ChunkPredictor` of `preset` with random weights in `precision` ("bf16": `layout`'s, openpi's
    or LeRobot's; "fp32"), eager, with pisft's small tokenizer and unit stats written to `work`;
    `denoising_steps`: instead of the preset's (a dry run's smaller graph)."""
    from pisft.bench.closed_loop_bench import tiny_stats
    from pisft.model import policy as model_policy
    from pisft.model.tokenizer import save_tiny_tokenizer
    from pisft.policy import precision as precision_mod
    from pisft.policy.predictor import ChunkPredictor

    choice = precision_mod.choose(precision, "cpu", "float32", layout=layout)
    if preset == "tiny" and choice.dtype == "float32":
        policy = model_policy.build_policy("tiny", seed=seed)  # as fetch_base builds it
    else:
        policy = model_policy.build_random_weights(preset, seed=seed, dtype=choice.dtype)
    if denoising_steps:
        policy.config.num_inference_steps = denoising_steps
    model_dir = Path(work) / f"{preset}_model"
    save_tiny_tokenizer(model_dir / model_policy.TOKENIZER_DIR)
    from pisft import device as device_mod

    if not device_mod.on_host(device):
        policy.to(device)
        policy.config.device = str(device)
    pre, post = model_policy.make_processors(policy, model_dir, tiny_stats(), state_in_prompt=True)
    return ChunkPredictor.of_policy(policy, pre, post, device=device, model_dir=model_dir, precision=choice,
                                    compiled=False)


def synthetic_requests(predictor, batch: int, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """A raw batch of `batch` LIBERO requests at the model's image resolution, and their noise."""
    from pisft.policy.predictor import frame_noise

    g = torch.Generator().manual_seed(seed)
    h, w = predictor.policy.config.image_resolution
    raw: dict[str, Any] = {k: torch.rand(batch, 3, h, w, generator=g) for k in CAMERAS}
    raw["observation.state"] = torch.rand(batch, 8, generator=g) * 2 - 1
    raw["task"] = [PROMPT] * batch
    noise = frame_noise([(seed, i) for i in range(batch)], seed=seed, chunk_size=predictor.chunk_size,
                        max_action_dim=predictor.max_action_dim)
    return raw, noise


def _sync(device: str) -> None:
    from pisft import device as device_mod

    device_mod.synchronize(str(device).split(":")[0])  # the current device; nothing on the CPU


def time_chunks(predictor, raw: dict, noise: torch.Tensor, *, chunks: int, warmup: int) -> tuple[list[float], Any]:
    """Milliseconds of each of `chunks` timed chunks (after `warmup`), and the last chunk's actions."""
    out = None
    for _ in range(warmup):
        out = predictor.predict(raw, noise)
    times = []
    for _ in range(chunks):
        _sync(predictor.device)
        start = time.perf_counter()
        out = predictor.predict(raw, noise)  # its actions reach the host: the chunk has ended
        times.append(1000.0 * (time.perf_counter() - start))
    return times, out


def percentile(times: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(times), q)) if times else None


def measure(predictor, batches: tuple[int, ...], *, chunks: int, warmup: int, compiled: bool = True,
            kind: str = "cpu", backend: str | None = None) -> dict[str, Any]:
    """The figures of the module docstring for `predictor` (eager), then compiled on it (`backend`:
    another torch.compile backend than the device's, e.g. `aot_eager` for a quick dry run)."""
    from pisft.policy import compiled as compiled_mod
    from pisft.policy.rtc import normalized

    out: dict[str, Any] = {"p50_ms": {}, "p99_ms": {}, "compile_s": {}, "actions_max_abs_diff": {},
                           "chunks": chunks, "warmup": warmup, "threads": torch.get_num_threads()}
    eager_actions = {}
    for b in batches:
        raw, noise = synthetic_requests(predictor, b)
        times, actions = time_chunks(predictor, raw, noise, chunks=chunks, warmup=warmup)
        eager_actions[b] = actions
        out["p50_ms"][str(b)] = {"eager": percentile(times, 50), "compiled": None}
        out["p99_ms"][str(b)] = {"eager": percentile(times, 99), "compiled": None}
        print(f"bench inference: batch {b} eager: p50 {out['p50_ms'][str(b)]['eager']:.1f} ms", flush=True)
    if not compiled:
        return out
    choice = compiled_mod.choose(True, kind)
    if backend is not None:
        choice = dataclasses.replace(choice, backend=backend, mode=None, why=f"{choice.why}; backend {backend}")
    out["compile"] = choice.record()
    chunk = compiled_mod.install(predictor.policy, choice)
    predictor.compiled_chunk, predictor.compile_choice = chunk, choice
    out["actions_atol"] = compiled_mod.tolerance(predictor.policy)
    for b in batches:
        raw, noise = synthetic_requests(predictor, b)
        start = time.perf_counter()
        first = predictor.predict(raw, noise)
        out["compile_s"][str(b)] = time.perf_counter() - start
        times, actions = time_chunks(predictor, raw, noise, chunks=chunks, warmup=max(warmup - 1, 0))
        out["p50_ms"][str(b)]["compiled"] = percentile(times, 50)
        out["p99_ms"][str(b)]["compiled"] = percentile(times, 99)
        diff = (normalized(predictor, first) - normalized(predictor, eager_actions[b])).abs().max()
        out["actions_max_abs_diff"][str(b)] = float(diff)
        print(f"bench inference: batch {b} compiled: compile {out['compile_s'][str(b)]:.1f} s, p50 "
              f"{out['p50_ms'][str(b)]['compiled']:.1f} ms, |compiled - eager| {float(diff):.2e}", flush=True)
    out["fell_back"] = chunk.fallen_back if chunk is not None else None
    out["actions_match"] = all(d <= out["actions_atol"] for d in out["actions_max_abs_diff"].values())
    return out


def measure_model(preset: str, precision: str, batches: tuple[int, ...], *, chunks: int, warmup: int,
                  device: str = "cpu", compiled: bool = True, threads: int | None = None,
                  layout: str = "openpi") -> dict[str, Any]:
    """`measure` on a fresh random-weights model of `preset` (module docstring), on `threads` CPU
    threads (None: torch's default, every core)."""
    from pisft import device as device_mod

    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="pisft-infer-") as tmp:
        start = time.perf_counter()
        predictor = build_predictor(preset, precision, device, Path(tmp), layout=layout)
        built_s = time.perf_counter() - start
        result = measure(predictor, batches, chunks=chunks, warmup=warmup, compiled=compiled,
                         kind=device_mod.resolve_kind(str(device).split(":")[0]))
    float32 = predictor.precision["float32_parameters"]
    return {"model": f"{preset} (random weights)", "precision": precision, "layout": predictor.precision["layout"],
            "device": str(device),
            "chunk_size": predictor.chunk_size, "denoising_steps": int(predictor.policy.config.num_inference_steps),
            "build_s": built_s, "float32_parameters": sum(float32.values()),
            "float32_parts": float32, **result}


def real_size_in_subprocess(batches: tuple[int, ...], *, chunks: int, timeout_s: float) -> dict[str, Any]:
    """pi0.5 at its real size, bf16, in a process of its own (several GB; one at a time)."""
    cmd = [sys.executable, "-m", "pisft.bench.inference_bench", "--preset", "pi05", "--precision", "bf16",
           "--batches", ",".join(map(str, batches)), "--chunks", str(chunks), "--warmup", "1"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return {"skipped": f"not finished within {timeout_s:.0f} s"}
    if proc.returncode != 0:
        return {"skipped": f"failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run() -> dict[str, Any]:
    """The `bench --only inference` part: the tiny model at batch 1, 8, 32; pi0.5 at batch 1."""
    from pisft.policy.replicas import policy_threads

    # the tiny model on the closed loop's policy threads (1: the environments take the cores)
    out = measure_model("tiny", "fp32", BATCHES, chunks=10, warmup=2, threads=policy_threads())
    real = real_size_in_subprocess((1,), chunks=3, timeout_s=REAL_SIZE_TIMEOUT_S)
    eager_s = (real.get("p50_ms", {}).get("1", {}) or {}).get("eager")
    if eager_s is not None:
        real["not_run"] = {str(b): f"not run on this CPU: batch 1 took {eager_s / 1000:.0f} s a chunk eager, so "
                                   f"batch {b} would take about {b * eager_s / 60000:.0f} min a chunk, "
                                   f"eager and compiled, {real['chunks'] + 1} chunks each"
                           for b in BATCHES if b != 1}
    out["real_size"] = real
    return out


def _batches(text: str) -> tuple[int, ...]:
    values = tuple(int(x) for x in text.split(","))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes >= 1, comma-separated, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pisft.bench.inference_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--batches", type=_batches, default=BATCHES)
    p.add_argument("--chunks", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--eager-only", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: every core)")
    args = p.parse_args(argv)
    result = measure_model(args.preset, args.precision, args.batches, chunks=args.chunks, warmup=args.warmup,
                           compiled=not args.eager_only, threads=args.threads or None)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
