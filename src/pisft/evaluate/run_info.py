"""How the run was made: versions, device, world size, and the wall time of every stage.

Reads what exists and requires nothing: Snakemake's benchmark files
(`results/benchmarks/<rule>.tsv`), `results/bench/bench.json`, the smoke report and the
resolved configs that every stage writes next to its output.
"""

from __future__ import annotations

import csv
import importlib.metadata
import json
import platform
import sys
from pathlib import Path

from pisft import layout
from pisft.config import PisftConfig

PACKAGES = ("pisft", "torch", "lerobot", "transformers", "numpy", "safetensors", "snakemake", "dvc")


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    if "torch_npu" in sys.modules:  # never imported here; only reported when already loaded
        out["torch_npu"] = getattr(sys.modules["torch_npu"], "__version__", "?")
    return out


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def stage_wall_times(benchmarks: Path) -> dict[str, float]:
    """rule -> wall seconds, from Snakemake benchmark files (`s` column, first row) in
    `benchmarks` (`layout.benchmarks`) or ./benchmarks."""
    out: dict[str, float] = {}
    for bench_dir in (benchmarks, Path("benchmarks")):
        if not bench_dir.is_dir():
            continue
        for tsv in sorted(bench_dir.glob("*.tsv")):
            try:
                with tsv.open() as fh:
                    row = next(csv.DictReader(fh, delimiter="\t"), None)
                if row and row.get("s"):
                    out.setdefault(tsv.stem, float(row["s"]))
            except (OSError, ValueError):
                continue
    return out


def training_run(train_dir: Path) -> dict:
    """Device, world size, batch geometry and wall time of the training run in `train_dir` (its
    resolved config and, when the train stage wrote one, its `train_summary.json`)."""
    cfg = _read_json(train_dir / "pisft_config.json")
    if not cfg:
        return {}
    train = cfg.get("train", {})
    derived = cfg.get("derived", {})
    info = {
        "device": cfg.get("device"),
        "world_size": derived.get("world_size"),
        "grad_accum_steps": derived.get("grad_accum_steps"),
        "micro_batch_size": train.get("micro_batch_size"),
        "global_batch_size": train.get("global_batch_size"),
        "steps": train.get("steps"),
        "precision": train.get("precision"),
        "model_preset": cfg.get("model", {}).get("preset"),
        "model_source": cfg.get("model", {}).get("source"),
    }
    done = _read_json(train_dir / "train_summary.json") or {}
    device = done.get("device") if isinstance(done.get("device"), dict) else {}
    for key, value in (("device_name", device.get("name")), ("backend", device.get("backend")),
                       ("wall_time_s", done.get("wall_time_s")), ("resumed_from", done.get("resumed_from"))):
        if key in ("device_name", "backend", "wall_time_s") and value is None:
            continue
        info[key] = value
    return info


def collect(cfg: PisftConfig) -> dict:
    """What the evaluation report says of the run (of cfg's iteration)."""
    here = layout.iteration(cfg)
    # the stage outputs whose resolved config is listed, by folder name
    stage_dirs = {"base_model": layout.base_model(cfg), "dataset": here.dataset, "smoke": layout.smoke(cfg),
                  "train": here.train, "eval": here.eval}
    info: dict = {
        "versions": package_versions(),
        "host": {"platform": platform.platform(), "machine": platform.machine()},
        "training": training_run(here.train),
        "stage_wall_time_s": stage_wall_times(layout.benchmarks(cfg)),
        "stage_configs": sorted(name for name, folder in stage_dirs.items()
                                if (folder / "pisft_config.json").is_file()),
    }
    smoke = _read_json(layout.smoke_report(cfg))
    if smoke is not None:
        info["smoke"] = {k: v for k, v in smoke.items() if not isinstance(v, (dict, list))}
    bench = _read_json(layout.bench_report(cfg))
    if bench is not None:
        info["bench"] = bench
    return info
