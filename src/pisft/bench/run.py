"""`make bench`: figures measured side by side in one run, written to results/bench/bench.json.

- stage wall times: the whole pipeline through Snakemake in a scratch copy of the project
  (Snakemake's own `benchmark:` files, one per rule);
- no-op cost: `snakemake -n` and `dvc status` right after that full run;
- component benchmarks contributed by the data and training layers, when present.
Ratios are measured in the same run on the same machine, never compared with stored numbers.

`--only NAME` (repeatable; `pipeline` or a component name) runs just those parts and updates
their sections of an existing bench.json, leaving the other sections as they were.
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pisft import layout
from pisft import config as config_mod
from pisft.errors import PisftError
from pisft.io import write_json_atomic
from pisft.stages import CLOSED_LOOP, CONVERT_RECAP
from pisft.workflow.scratch import copy_project

# name -> "module:function"; each takes (cfg, workdir) and returns a JSON-able dict.
COMPONENT_BENCHES = {
    CLOSED_LOOP.name: "pisft.bench.closed_loop_bench:run",
    CONVERT_RECAP.name: "pisft.bench.convert_bench:run",
    "train_loop": "pisft.bench.train_bench:run",
    "train_structure": "pisft.bench.train_structure:run",
    "data_loader": "pisft.bench.data_loader_bench:run",
    "real_size": "pisft.bench.real_size:run",
    "inference": "pisft.bench.inference_bench:run",
    "host_overhead": "pisft.bench.host_overhead:run",
    # the accelerator figures (issue 54), each a process of its own; without an accelerator it says so
    "device": "pisft.bench.device_bench:run",
}
PIPELINE = "pipeline"


def part_names() -> list[str]:
    return [PIPELINE, *COMPONENT_BENCHES]


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _tool(name: str) -> str:
    path = Path(sys.executable).with_name(name)
    return str(path) if path.exists() else name


def _timed(cmd: list[str], cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return elapsed, proc


def read_snakemake_benchmarks(bench_dir: Path) -> dict[str, dict]:
    stages = {}
    for tsv in sorted(bench_dir.glob("*.tsv")):
        with tsv.open() as fh:
            row = next(csv.DictReader(fh, delimiter="\t"))
        stages[tsv.stem] = {
            "wall_s": float(row["s"]),
            "max_rss_mb": float(row["max_rss"]) if row.get("max_rss") not in (None, "", "NA", "-") else None,
        }
    return stages


def stage_times_lines(bench_dir: Path) -> list[str]:
    """Each stage's wall time of its last run, from the benchmark files the rules write
    (`results/benchmarks/<stage>.tsv`: Snakemake's `benchmark:`, and the same file when DVC
    runs the stage), in the order the stages finished; for `python -m pisft summary`."""
    try:
        stages = read_snakemake_benchmarks(bench_dir)
    except (OSError, StopIteration, KeyError, ValueError) as exc:
        return [f"stage wall times: {bench_dir} unreadable ({type(exc).__name__}: {exc})"]
    if not stages:
        return [f"stage wall times: none recorded yet ({bench_dir} has no benchmark files)"]
    order = sorted(stages, key=lambda name: (bench_dir / f"{name}.tsv").stat().st_mtime)
    width = max(len(name) for name in order)
    lines = [f"stage wall times (last run of each stage; {bench_dir}):"]
    lines += [f"  {name:<{width}}  {stages[name]['wall_s']:8.1f} s" for name in order]
    lines.append(f"  {'sum':<{width}}  {sum(v['wall_s'] for v in stages.values()):8.1f} s")
    return lines


def pipeline_bench(project: Path, work: Path) -> dict:
    copy_project(project, work, git=True)
    total, _ = _timed([_tool("snakemake"), "--cores", "all", "--quiet", "all"], work)
    stages = read_snakemake_benchmarks(work / "results" / "benchmarks")
    noop_snakemake, _ = _timed([_tool("snakemake"), "-n", "--cores", "all", "--quiet", "all"], work)
    # Record Snakemake's outputs in dvc.lock without rerunning anything, then time `dvc status`.
    _timed([_tool("dvc"), "commit", "--force", "--quiet"], work)
    noop_dvc, status = _timed([_tool("dvc"), "status"], work)
    return {
        "stages": stages,
        "pipeline_wall_s": total,
        "noop": {"snakemake_dry_run_s": noop_snakemake, "dvc_status_s": noop_dvc,
                 "dvc_status_output": status.stdout.strip()},
    }


def _call_bench(func, cfg: config_mod.PisftConfig, work: Path) -> dict:
    """Component benchmarks take the config, a scratch directory, or both (by parameter name)."""
    import inspect

    kwargs = {}
    for name in inspect.signature(func).parameters:
        if name in ("cfg", "config"):
            kwargs[name] = cfg
        elif name in ("work", "workdir", "tmp", "tmp_dir", "scratch"):
            kwargs[name] = work
    return func(**kwargs)


def main(cfg: config_mod.PisftConfig, config_path: str, only: list[str] | None = None) -> int:
    unknown = sorted(set(only or ()) - set(part_names()))
    if unknown:
        raise PisftError(f"bench --only: unknown part(s) {', '.join(unknown)}; "
                         f"one of {', '.join(part_names())}")
    wanted = set(only or part_names())
    project = Path.cwd()
    path = layout.bench_report(cfg)
    out: dict = {}
    if only and path.is_file():  # a partial run updates its sections of the previous results
        try:
            out = json.loads(path.read_text())
        except json.JSONDecodeError:
            out = {}
    out.update({
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "cpus": os.cpu_count()},
        "config": config_path,
    })
    with tempfile.TemporaryDirectory(prefix="pisft-bench-") as tmp:
        tmp_path = Path(tmp)
        if PIPELINE in wanted:
            print("bench: whole pipeline through Snakemake (stage wall times)", flush=True)
            out[PIPELINE] = pipeline_bench(project, tmp_path / PIPELINE)
        for name, target in COMPONENT_BENCHES.items():
            if name not in wanted:
                continue
            module_name, func_name = target.split(":")
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError:
                out[name] = {"skipped": f"{module_name} not available"}
                continue
            print(f"bench: {name}", flush=True)
            work = tmp_path / name
            work.mkdir()
            out[name] = _call_bench(getattr(module, func_name), cfg, work)
    write_json_atomic(path, out)
    shown = out if not only else {k: out[k] for k in out if k in wanted}
    print(json.dumps(shown, indent=2))
    print(f"bench: wrote {path}")
    return 0
