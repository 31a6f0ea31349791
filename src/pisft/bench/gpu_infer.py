"""pi0.5's action chunk on one accelerator: ms per chunk at batch 1, 8 and 32, eager against compiled.

    python -m pisft.bench.gpu_infer                      # cuda, pi05, bf16, batch 1 8 32
    python -m pisft.bench.gpu_infer --device npu         # the same on an Ascend card (npugraph_ex)
    python -m pisft.bench.gpu_infer --preset tiny --device cpu --batches 1,3 --chunks 1 --warmup 0 \
        --denoising-steps 2 --compile-backend eager --no-profile    # the dry run (tests/test_bench_inference.py)

The measurement of `pisft.bench.inference_bench` (`bench --only inference` on the CPU) on an
accelerator, the issue-46 setting: pi0.5 at its real size with random weights, bf16, 10 denoising
steps, chunk 50, the whole chunk through `ChunkPredictor.predict` (preprocessing, the prefix with
its KV cache, the ten expert steps, postprocessing; the actions copied to the host ends the timing).
Three runs, one model each, one after the other on the device:

  lerobot_bf16_eager   LeRobot's bf16 layout (SigLIP and the projector in float32), eager: what
                       pisft ran before (issue 46: 338 ms at batch 1 on an H200)
  openpi_bf16          float32 only where openpi keeps it (`eval.precision: bf16`), eager and then
                       compiled (`eval.compile: true`: on CUDA `torch.compile(mode="reduce-overhead")`,
                       CUDA graphs; on an NPU the `npugraph_ex` backend), `compile_s` its first call
                       per batch size (the compile and the graph capture)

`--runs` picks some of them (`bench --only device` runs each in a process of its own,
`pisft.bench.device_bench`). Each: `p50_ms`/`p99_ms` per batch size, `actions_max_abs_diff` of
compiled against eager beside the stated tolerance. With `--profile` (the default on an
accelerator), the kernels launched by one chunk at batch 1, eager and compiled (the profiler's
`cudaLaunchKernel`/`cuLaunchKernelEx` calls, or every device kernel on an NPU). `targets`
compares with issue 46's: batch 1 <= 80 ms, batch 32 <= 300 ms, compiled actions within the
tolerance. Output: JSON on stdout and in --out.

Not yet run on a GPU (docs/what-has-run-where.md); tests/test_bench_inference.py runs the dry run.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from pisft import device as devices
from pisft.bench import inference_bench
from pisft.bench.arguments import names_from

TARGETS_MS = {"1": 80.0, "32": 300.0}  # issue 46, an H200, real size, bf16
# The runs (module docstring): name -> (bf16 layout, whether the chunk is compiled after the eager timing).
RUNS = {"lerobot_bf16_eager": ("lerobot", False), "openpi_bf16": ("openpi", True)}


def count_launches(predictor, kind: str) -> int:
    """Kernels one chunk at batch 1 launches (the profiler's view, on `kind`)."""
    from torch.profiler import ProfilerActivity, profile

    raw, noise = inference_bench.synthetic_requests(predictor, 1)
    predictor.predict(raw, noise)
    row = devices.row(kind)
    activity = row.profiler_activity  # None: torch.profiler's CPU activity only (the NPU's is torch_npu's)
    activities = [ProfilerActivity.CPU] + ([getattr(ProfilerActivity, activity)] if activity else [])
    with profile(activities=activities) as prof:
        predictor.predict(raw, noise)
    if activity:  # the host's launch calls, by name
        return int(sum(e.count for e in prof.key_averages() if e.key in row.launch_calls))
    return int(sum(e.count for e in prof.key_averages() if e.device_type != torch.autograd.DeviceType.CPU))


def run(args: argparse.Namespace) -> dict[str, Any]:
    kind = devices.resolve_kind(args.device)
    dev = str(devices.local_device(kind, 0))  # the CPU: "cpu"
    out: dict[str, Any] = {"device_kind": kind, "device": devices.device_name(kind, torch.device(dev)),
                           "preset": args.preset, "torch": torch.__version__, "batches": list(args.batches),
                           "chunks": args.chunks, "runs": {}}
    for name in args.runs:
        layout, compiled = RUNS[name]
        print(f"gpu_infer: {name} on {dev}", flush=True)
        with tempfile.TemporaryDirectory(prefix="pisft-gpu-infer-") as tmp:
            predictor = inference_bench.build_predictor(args.preset, "bf16", dev, Path(tmp), layout=layout,
                                                        denoising_steps=args.denoising_steps)
            if args.profile:
                launches = {"eager": count_launches(predictor, kind)}
            result = inference_bench.measure(predictor, tuple(args.batches), chunks=args.chunks, warmup=args.warmup,
                                             compiled=compiled, kind=kind, backend=args.compile_backend)
            if args.profile and compiled:
                launches["compiled"] = count_launches(predictor, kind)
            if args.profile:
                result["kernels_per_chunk_batch1"] = launches
            result["float32_parameters"] = sum(predictor.precision["float32_parameters"].values())
            out["runs"][name] = result
            del predictor
            gc.collect()
            if devices.row(kind).profiler_activity:  # measured where torch.profiler sees the device (CUDA)
                result["peak_memory_bytes"] = devices.peak_memory_bytes(kind)
                devices.empty_cache(kind)
                devices.reset_peak_memory(kind)
    best = out["runs"].get("openpi_bf16")
    if best is None:  # only LeRobot's layout measured (--runs): no compiled figures to hold to the targets
        return out
    compiled_ms = {b: best["p50_ms"][b]["compiled"] for b in best["p50_ms"]}
    out["targets"] = {f"batch{b}_p50_ms_le_{ms:g}": compiled_ms[b] is not None and compiled_ms[b] <= ms
                      for b, ms in TARGETS_MS.items() if b in compiled_ms}
    out["targets"]["compiled_actions_within_tolerance"] = best.get("actions_match")
    return out


def _batches(text: str) -> list[int]:
    values = [int(x) for x in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes >= 1, comma-separated, got {text!r}")
    return values


def _runs(text: str) -> list[str]:
    return names_from(text, RUNS, "run")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pisft.bench.gpu_infer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "npu", "cpu"))
    p.add_argument("--preset", default="pi05")
    p.add_argument("--batches", type=_batches, default=[1, 8, 32])
    p.add_argument("--chunks", type=int, default=20, help="timed chunks per batch size")
    p.add_argument("--warmup", type=int, default=3, help="chunks before the timed ones")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                   help="count the kernels of one chunk (default: on an accelerator)")
    p.add_argument("--denoising-steps", type=int, default=None,
                   help="flow-matching steps per chunk instead of the model's (pi0.5: 10); a dry run's smaller graph")
    p.add_argument("--compile-backend", default=None,
                   help="a torch.compile backend instead of the device's (the dry run: eager, dynamo's capture "
                        "run as captured, without inductor's code generation)")
    p.add_argument("--runs", type=_runs, default=list(RUNS),
                   help=f"which runs, comma-separated, in order (default: {','.join(RUNS)}; "
                        f"`bench --only device` runs each in a process of its own)")
    p.add_argument("--out", type=Path, default=Path("results/bench/gpu_infer.json"))
    args = p.parse_args(argv)
    if args.profile is None:
        args.profile = not devices.host_only(args.device)  # `auto` profiles
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
