"""`python -m pisft bench --only device`: the accelerator figures of issue 54 in one command, at most
`BUDGET_S` (6 minutes) on one card.

    python -m pisft bench --only device              # on a GPU or NPU host; on the CPU it says there is none
    python -m pisft.bench.device_bench               # the same, standalone (scripts/gpu-host-bench.sh)
    python -m pisft.bench.device_bench --check       # the plumbing with the tiny model on the CPU (no
                                                     # accelerator figure: every row says `check`)

What runs, each measurement as a process of its own with its own timeout (a failure or a hang is one
row, `failed` or `timed out`, and the rest still run), one after the other on the device:

  gpu_infer_openpi     pi0.5 bf16 in openpi's layout, batch 1, 8, 32, eager then compiled
                       (`pisft.bench.gpu_infer --runs openpi_bf16`)
  gpu_infer_lerobot    the same in LeRobot's bf16 layout, eager (`--runs lerobot_bf16_eager`)
  gpu_step_<mode>_<c>  the training step at real size, trainable `all` and `expert`, micro batch 16
                       and 32, checkpointing on, `train.compile` off (eager) and layers (compiled)
                       (`pisft.bench.gpu_step`)
  smoke_gate           the real `smoke_1card` stage on this device with the device's profile
                       (config/profiles/cuda-8gpu.yaml or ascend-8card.yaml: its train.* and smoke.*)
                       and `train.compile: auto`, pi0.5 with random weights (`model.source: random`)
                       on the embedded demo data; its report.json is kept whole, whatever fields it
                       has, and the table shows every field but the bulky ones (`SMOKE_BULK`)

The smoke gate's inputs (fetch_base writing pi0.5's random weights, demo_recap, convert_recap) are
prepared on the host's CPU from the start, beside the device jobs, on `PREP_THREADS` threads, so
that the gate itself is the only part of it inside the device's time; the output says so.

Each job's timeout is its own (`TIMEOUTS_S`, `--timeout JOB=S`) and at most what is left of the
budget: whatever runs, the command ends within `BUDGET_S` plus the time to stop a job. The bounds are
first guesses (no accelerator was lent when this was written: docs/what-has-run-where.md); a job
cut short by the budget says so.

Output: `device.json` (every job's status, wall time and raw result, the targets of issue 54) and
`device.md` (the tables) in `--out` (results/bench), each job's own JSON and log in `--out`/device/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

BUDGET_S = 360.0
PREP_THREADS = 2
# Each job's own bound (seconds), before the budget's: first guesses, from the H200 run of 2026-12
# (gpu_step 30-70 s a mode at micro 4-64; a pi0.5 compile of the chunk is a minute or more per bucket).
TIMEOUTS_S = {"gpu_infer_openpi": 110.0, "gpu_infer_lerobot": 40.0, "gpu_step_all_off": 45.0,
              "gpu_step_expert_off": 35.0, "gpu_step_all_layers": 70.0, "gpu_step_expert_layers": 60.0,
              "smoke_gate": 150.0}
CHECK_TIMEOUT_S = 600.0  # --check on a loaded 2-core host: the tiny model, every job
# The smoke report's fields left out of device.md's table (bulky, or not a decision: the config, the
# environment, the estimate's breakdown, per-step series); device.json keeps the whole report.
SMOKE_BULK = ("pisft_config", "environment", "estimate", "losses", "grad_norms", "host_ops", "stage")
# issue 54's targets on an H200
TARGETS = {"all_micro32_samples_per_s": 45.0, "expert_micro32_samples_per_s": 100.0,
           "device_busy_fraction_from_micro16": 0.85, "chunk_batch1_ms": 30.0, "chunk_batch32_ms": 150.0}
NO_ACCELERATOR = ("no accelerator here: neither a CUDA GPU nor an Ascend NPU is visible, so nothing was measured "
                  "(no figure of this part comes from the CPU). On a GPU or NPU host run `python -m pisft bench "
                  "--only device`; on an offline GPU host scripts/gpu-host-bench.sh; `python -m "
                  "pisft.bench.device_bench --check` runs its plumbing with the tiny model on the CPU")


@dataclass(frozen=True)
class Job:
    name: str
    argv: tuple[str, ...]  # run as `python -m ...`
    timeout_s: float
    cwd: str | None = None


def accelerator() -> str | None:
    """The accelerator kind here (cuda, npu), or None."""
    from pisft import device as devices

    kind = devices.resolve_kind("auto")
    return kind if devices.row(kind).accelerator else None


def plan(kind: str, jobs_dir: Path, *, check: bool) -> list[Job]:
    """The device jobs in the order they run (module docstring); `check`: the tiny model on the CPU."""
    dev = "cpu" if check else kind
    infer = ["pisft.bench.gpu_infer", "--device", dev]
    infer += (["--preset", "tiny", "--batches", "1,2", "--chunks", "1", "--warmup", "0", "--denoising-steps", "2",
               "--compile-backend", "eager", "--no-profile"] if check
              else ["--batches", "1,8,32", "--chunks", "10", "--warmup", "2"])
    step = ["pisft.bench.gpu_step", "--device", dev, "--checkpointing", "on"]
    step += (["--preset", "tiny", "--micro", "2", "--max-micro", "4", "--steps", "1", "--warmup", "0"] if check
             else ["--micro", "16", "--max-micro", "32", "--steps", "3", "--warmup", "1"])

    def bound(name: str) -> float:
        return CHECK_TIMEOUT_S if check else TIMEOUTS_S[name]

    jobs = [Job("gpu_infer_openpi", (*infer, "--runs", "openpi_bf16", "--out", str(jobs_dir / "gpu_infer_openpi.json")),
                bound("gpu_infer_openpi")),
            Job("gpu_infer_lerobot", (*infer, "--runs", "lerobot_bf16_eager",
                                      "--out", str(jobs_dir / "gpu_infer_lerobot.json")), bound("gpu_infer_lerobot"))]
    for compile_mode in ("off", "layers"):
        for mode in ("all", "expert"):
            name = f"gpu_step_{mode}_{compile_mode}"
            jobs.append(Job(name, (*step, "--trainable", mode, "--compile", compile_mode,
                                   "--out", str(jobs_dir / f"{name}.json")), bound(name)))
    smoke = jobs_dir / "smoke"
    jobs.append(Job("smoke_gate", ("pisft", "launch", "smoke_1card", "--config", str(smoke / "config.yaml")),
                    bound("smoke_gate"), cwd=str(smoke)))
    return jobs


def smoke_config(kind: str, *, check: bool) -> tuple[dict[str, Any], str | None]:
    """The smoke gate's config on this device (module docstring), a partial config (the rest is the
    embedded default), and the profile its train.* and smoke.* come from."""
    if check:
        return {"device": "cpu", "train": {"compile": "auto"}, "smoke": {"steps": 2}}, None
    import yaml

    from pisft import device as devices

    profile = Path(__file__).resolve().parents[3] / "config" / "profiles" / devices.row(kind).bench_profile
    raw = yaml.safe_load(profile.read_text()) if profile.is_file() else {}
    train = dict(raw.get("train") or {})
    # pi0.5 with random weights cannot take a first AdamW step at the profile's 5e-5 (its loss rises, and
    # the gate fails, rightly): 1e-6 decaying to 1e-7, as config/profiles/pi05-cpu.yaml trains random weights
    train.update(compile="auto", lr=1e-6, decay_lr=1e-7, warmup_steps=1)
    cfg = {"device": kind, "model": {"source": "random", "preset": "pi05"}, "train": train,
           "smoke": {**(raw.get("smoke") or {}), "steps": 3}}
    return cfg, str(profile) if profile.is_file() else None


def prepare_smoke(smoke: Path, kind: str, *, check: bool) -> subprocess.Popen:
    """Write the smoke gate's config and start preparing its inputs (fetch_base, demo_recap,
    convert_recap, one after the other) in the background, on `PREP_THREADS` CPU threads (none of
    them touches the device)."""
    import yaml

    smoke.mkdir(parents=True, exist_ok=True)
    cfg, _ = smoke_config(kind, check=check)
    (smoke / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    steps = " && ".join(f"{sys.executable} -m pisft {stage} --config config.yaml"
                        for stage in ("fetch_base", "demo_recap", "convert_recap"))
    env = {**_env(), "OMP_NUM_THREADS": str(PREP_THREADS)}
    with (smoke / "prepare.log").open("w") as log:
        return subprocess.Popen(["bash", "-c", steps], cwd=smoke, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    src = str(Path(__file__).resolve().parents[2])  # the jobs import this checkout's pisft
    env["PYTHONPATH"] = os.pathsep.join([src, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


def _stop(proc: subprocess.Popen) -> None:
    """End a job's process group (the job and what it started): TERM, then KILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_job(job: Job, timeout_s: float, log_path: Path) -> dict[str, Any]:
    """Run one job in a process group of its own: its status (ok, failed, timed out), wall time, log tail."""
    start = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", *job.argv], cwd=job.cwd, env=_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout_s)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            _stop(proc)
            status = f"timed out after {timeout_s:g} s"
    wall = time.monotonic() - start
    text = log_path.read_text(errors="replace")
    return {"status": status, "wall_s": round(wall, 1), "timeout_s": round(timeout_s, 1),
            "log": str(log_path), "log_tail": text[-1500:] if status != "ok" else ""}


def _json_lines(text: str) -> list[dict[str, Any]]:
    """The one-line JSON objects a job printed as it went (gpu_step prints each run's)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def collect(job: Job, record: dict[str, Any], jobs_dir: Path) -> None:
    """The job's raw result into `record["result"]`: its JSON, or what it printed before it stopped."""
    if job.name == "smoke_gate":
        report = Path(job.cwd or "") / "results" / "smoke" / "report.json"
        if not report.is_file():
            report = Path(job.cwd or "") / "results" / "logs" / "smoke_1card" / "report.json"
        if report.is_file():
            record["result"] = json.loads(report.read_text())
            record["report"] = str(report)
        return
    out = jobs_dir / f"{job.name}.json"
    if out.is_file():
        record["result"] = json.loads(out.read_text())
        return
    partial = [r for r in _json_lines(Path(record["log"]).read_text(errors="replace")) if "micro_batch_size" in r]
    if partial:  # gpu_step's finished runs, before it failed or ran out of time
        record["result"] = {"runs": partial, "partial": True}


def smoke_decisions(report: dict[str, Any]) -> dict[str, Any]:
    """What the smoke report decided and what that rests on: every field but `SMOKE_BULK`, as it is."""
    return {k: v for k, v in report.items() if k not in SMOKE_BULK}


def targets(results: dict[str, dict]) -> dict[str, Any]:
    """issue 54's targets against what was measured (None: not measured)."""
    runs = [r for name, j in results.items() if name.startswith("gpu_step") for r in
            (j.get("result") or {}).get("runs", []) if not r.get("oom")]

    def best(mode: str, micro: int) -> float | None:
        values = [r["samples_per_s"] for r in runs if r.get("trainable") == mode and r["micro_batch_size"] == micro]
        return max(values) if values else None

    busy = [r["device_busy_fraction"] for r in runs if r["micro_batch_size"] >= 16 and "device_busy_fraction" in r]
    infer = (results.get("gpu_infer_openpi", {}).get("result") or {}).get("runs", {}).get("openpi_bf16", {})

    def chunk_ms(batch: str) -> float | None:
        values = [v for v in (infer.get("p50_ms", {}).get(batch) or {}).values() if v is not None]
        return min(values) if values else None

    measured = {"all_micro32_samples_per_s": best("all", 32), "expert_micro32_samples_per_s": best("expert", 32),
                "device_busy_fraction_from_micro16": min(busy) if busy else None,
                "chunk_batch1_ms": chunk_ms("1"), "chunk_batch32_ms": chunk_ms("32")}
    out = {}
    for name, goal in TARGETS.items():
        value = measured[name]
        met = None if value is None else (value <= goal if name.startswith("chunk") else value >= goal)
        out[name] = {"target": goal, "measured": value, "met": met}
    return out


def run_all(kind: str | None, out_dir: Path, *, check: bool = False, only: list[str] | None = None,
            timeouts: dict[str, float] | None = None, budget_s: float | None = None) -> dict[str, Any]:
    """The jobs of `plan` within the budget; the record written to `out_dir`/device.json and device.md."""
    if kind is None and not check:
        print(f"bench device: {NO_ACCELERATOR}", flush=True)
        return {"skipped": NO_ACCELERATOR}
    kind = kind or "cpu"
    budget = budget_s if budget_s is not None else (len(TIMEOUTS_S) * CHECK_TIMEOUT_S if check else BUDGET_S)
    jobs_dir = out_dir / "device"
    jobs_dir.mkdir(parents=True, exist_ok=True)
    jobs = [j for j in plan(kind, jobs_dir, check=check) if not only or j.name in only]
    unknown = sorted(set(only or ()) - {j.name for j in plan(kind, jobs_dir, check=check)})
    if unknown:
        raise ValueError(f"unknown job(s) {', '.join(unknown)}; one of {', '.join(TIMEOUTS_S)}")
    start = time.monotonic()
    smoke_job = next((j for j in jobs if j.name == "smoke_gate"), None)
    prep = prepare_smoke(Path(smoke_job.cwd or ""), kind, check=check) if smoke_job else None
    from pisft import device as devices

    out: dict[str, Any] = {
        "device_kind": kind, "check": check, "budget_s": budget,
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "note": ("check mode: the tiny model on the CPU, the plumbing only; no figure here is an accelerator's"
                 if check else f"one {kind} device; each job a process of its own, at most the budget left"),
        "jobs": {}}
    try:
        import torch

        out["device"] = devices.device_name(kind, devices.row(kind).torch_device(0))
        out["torch"] = torch.__version__
    except Exception as exc:  # noqa: BLE001 - the name is a label; the jobs say what fails
        out["device"] = f"unknown ({type(exc).__name__}: {exc})"
    try:
        for job in jobs:
            left = budget - (time.monotonic() - start)
            if left <= 1:
                out["jobs"][job.name] = {"status": f"not run: the {budget:.0f} s budget was spent"}
                continue
            if job is smoke_job and prep is not None:
                prep_status = _wait_prep(prep, left)
                out["smoke_preparation"] = {"status": prep_status, "log": str(Path(job.cwd or "") / "prepare.log"),
                                            "config": smoke_config(kind, check=check)[0],
                                            "profile": smoke_config(kind, check=check)[1],
                                            "note": f"fetch_base, demo_recap, convert_recap on the CPU "
                                                    f"({PREP_THREADS} threads), beside the device jobs before it"}
                if prep_status != "ok":
                    out["jobs"][job.name] = {"status": f"not run: its inputs were not prepared ({prep_status})"}
                    continue
                left = budget - (time.monotonic() - start)
            timeout = min((timeouts or {}).get(job.name, job.timeout_s), left)
            cut = " (cut to the budget left)" if timeout < (timeouts or {}).get(job.name, job.timeout_s) else ""
            print(f"bench device: {job.name} (at most {timeout:.0f} s{cut})", flush=True)
            record = run_job(job, timeout, jobs_dir / f"{job.name}.log")
            record["cut_to_budget"] = bool(cut)
            collect(job, record, jobs_dir)
            out["jobs"][job.name] = record
            print(f"bench device: {job.name}: {record['status']} in {record['wall_s']:.0f} s", flush=True)
    finally:
        if prep is not None and prep.poll() is None:
            _stop(prep)
    out["wall_s"] = round(time.monotonic() - start, 1)
    out["targets"] = targets(out["jobs"])
    (out_dir / "device.json").write_text(json.dumps(out, indent=2) + "\n")
    (out_dir / "device.md").write_text(markdown(out))
    print(f"bench device: wrote {out_dir / 'device.json'} and {out_dir / 'device.md'}", flush=True)
    return out


def _wait_prep(prep: subprocess.Popen, left: float) -> str:
    try:
        rc = prep.wait(max(left, 0.0))
    except subprocess.TimeoutExpired:
        _stop(prep)
        return "not finished within the budget"
    return "ok" if rc == 0 else f"failed (exit {rc})"


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.{digits}g}"
    return str(value)


def markdown(out: dict[str, Any]) -> str:
    """device.json as tables (module docstring); the raw figures are device.json's."""
    jobs = out["jobs"]
    head = "check mode (tiny model, CPU): plumbing only, no accelerator figure" if out["check"] else out.get("device")
    lines = [f"# `python -m pisft bench --only device`: {head}", "",
             f"{out['started']}, torch {out.get('torch', '?')}, {out['wall_s']:.0f} s of a {out['budget_s']:.0f} s "
             f"budget. Raw figures: device.json beside this file; each job's JSON and log in device/.", "",
             "| job | status | wall s | timeout s |", "|---|---|---|---|"]
    for name, rec in jobs.items():
        lines.append(f"| {name} | {rec['status']} | {_fmt(rec.get('wall_s'))} | {_fmt(rec.get('timeout_s'))} |")
    lines += ["", "## Training step (`pisft.bench.gpu_step`, checkpointing on)", "",
              "| trainable | compile | micro | step s | samples/s | MFU | device busy | peak GiB | first step s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, rec in jobs.items():
        if not name.startswith("gpu_step"):
            continue
        for r in (rec.get("result") or {}).get("runs", []):
            if r.get("oom"):
                lines.append(f"| {r.get('trainable')} | {r.get('compile')} | {r['micro_batch_size']} | out of memory "
                             f"| | | | | |")
                continue
            lines.append(f"| {r.get('trainable')} | {r.get('compile')} | {r['micro_batch_size']} | "
                         f"{_fmt(r.get('step_time_s'))} | {_fmt(r.get('samples_per_s'))} | {_fmt(r.get('mfu'))} | "
                         f"{_fmt(r.get('device_busy_fraction'))} | {_fmt(r.get('peak_memory_gib'))} | "
                         f"{_fmt(r.get('first_step_s'))} |")
    lines += ["", "## Action chunk (`pisft.bench.gpu_infer`, bf16), ms per chunk (p50)", "",
              "| layout | batch | eager | compiled | compile s | compiled − eager | tolerance |",
              "|---|---|---|---|---|---|---|"]
    for name in ("gpu_infer_openpi", "gpu_infer_lerobot"):
        for run_name, r in ((jobs.get(name, {}).get("result") or {}).get("runs") or {}).items():
            for batch, p50 in r.get("p50_ms", {}).items():
                lines.append(f"| {run_name} | {batch} | {_fmt(p50.get('eager'))} | {_fmt(p50.get('compiled'))} | "
                             f"{_fmt(r.get('compile_s', {}).get(batch))} | "
                             f"{_fmt(r.get('actions_max_abs_diff', {}).get(batch))} | {_fmt(r.get('actions_atol'))} |")
    lines += ["", "## Smoke gate (`smoke_1card`, `train.compile: auto`): what its report decided", "",
              "| field | value |", "|---|---|"]
    smoke = smoke_decisions((jobs.get("smoke_gate") or {}).get("result") or {})
    for key, value in smoke.items():
        text = json.dumps(value) if isinstance(value, (dict, list)) else _fmt(value)
        lines.append(f"| {key} | {text.replace('|', '/')} |")
    lines += ["", "## issue 54's targets", "", "| target | goal | measured | met |", "|---|---|---|---|"]
    for name, t in out["targets"].items():
        lines.append(f"| {name} | {_fmt(t['target'])} | {_fmt(t['measured'])} | {_fmt(t['met'])} |")
    return "\n".join(lines) + "\n"


def run(cfg) -> dict[str, Any]:
    """The `bench --only device` part: the jobs on this host's accelerator; none here: says so, measures nothing."""
    from pisft import layout

    return run_all(accelerator(), layout.bench_report(cfg).parent)


def _timeouts(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, _, seconds = item.partition("=")
        out[name] = float(seconds)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pisft.bench.device_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true",
                   help="the plumbing with the tiny model on the CPU (no accelerator figure)")
    p.add_argument("--only", default="", help=f"jobs to run, comma-separated (default: all of {', '.join(TIMEOUTS_S)})")
    p.add_argument("--timeout", action="append", default=[], metavar="JOB=S", help="a job's own bound in seconds")
    p.add_argument("--budget-s", type=float, default=None, help=f"the whole run's bound (default {BUDGET_S:g} s)")
    p.add_argument("--out", type=Path, default=Path("results/bench"))
    args = p.parse_args(argv)
    kind = None if args.check else accelerator()
    out = run_all(kind, args.out, check=args.check, only=[x for x in args.only.split(",") if x] or None,
                  timeouts=_timeouts(args.timeout), budget_s=args.budget_s)
    if "skipped" in out:
        print(f"error: {out['skipped']}", file=sys.stderr)
        return 2
    return 0 if all(r["status"] == "ok" for r in out["jobs"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
