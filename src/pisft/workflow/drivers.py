"""What a stage does for the driver that started it, so Snakemake and DVC agree
(docs/workflow.md, "Both drivers agree").

dvc.yaml runs each stage's command through this module (`python -m pisft.workflow.drivers dvc
<stage> -- <the rule's command>`), which
- as `config_check`, the stage DVC runs before any other when a key of the config's shape
  changed (pisft.workflow.dvc_yaml), and again before each stage (`dvc repro -s` runs one alone),
  checks that dvc.yaml was generated for this config's shape (whether the model comes from a
  local folder, the closed-loop stage, the RECAP stages, the device's lock, the data sources);
  if not, it regenerates dvc.yaml and stops with one line;
- after the stage succeeds writes the rule's benchmark file (`results/benchmarks/<stage>.tsv`,
  in Snakemake's format) and Snakemake's record of the job (`snakemake <stage> --touch
  --forcerun <stage>`: the job's params, code and inputs in .snakemake/metadata), so that
  `snakemake -n` after `dvc repro` has nothing to do and a key changed later still reruns
  exactly its readers under Snakemake.
The other way round, a Snakemake run ends with `dvc commit` of its stages
(`snakemake_support.record_in_dvc`).

Under either driver, a non-training stage takes its CPU thread count from the one place the
training launcher uses (`device.threads_per_process`; PISFT_NUM_THREADS to choose): Snakemake
exports OMP_NUM_THREADS=<the rule's threads>, DVC nothing (`pin_threads`).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from pisft import layout
from pisft.config import PisftConfig
from pisft.errors import PisftError
from pisft.stages import DVC_WRAPPER

WRAPPER = DVC_WRAPPER  # the stage table's (pisft.stages)
BENCHMARK_COLUMNS = ("s", "h:m:s", "max_rss", "max_vms", "max_uss", "max_pss", "io_in", "io_out",
                     "mean_load", "cpu_time")


def pin_threads() -> int:
    """CPU threads of a non-training stage: the same under both drivers."""
    from pisft import device

    threads = device.threads_per_process(1)
    os.environ.update({var: str(threads) for var in device.THREAD_VARS})
    import torch

    torch.set_num_threads(threads)
    return threads


def _shape_difference(written: str | None, wanted: str) -> str:
    """The parts of two shapes that differ (`key old -> new`), or both whole."""
    if written is None:
        return f"dvc.yaml has no shape line; config/config.yaml is shaped '{wanted}'"
    old = dict(part.split("=", 1) for part in written.split() if "=" in part)
    new = dict(part.split("=", 1) for part in wanted.split() if "=" in part)
    diff = [f"{k} {old.get(k, '(none)')} -> {new.get(k, '(none)')}" for k in dict.fromkeys([*old, *new])
            if old.get(k) != new.get(k)]
    return "; ".join(diff) or f"'{written}' -> '{wanted}'"


def check_dvc_shape(cfg: PisftConfig, dvc_file: Path = Path("dvc.yaml"), *, removed: str | None = None) -> None:
    """Under DVC: stop (with dvc.yaml regenerated) when dvc.yaml has another shape than the config.
    `removed`: the stage whose outputs DVC removed before this check (None: config_check, which
    runs before any stage, so none were)."""
    from pisft.workflow import dvc_yaml

    written = dvc_yaml.shape_of(dvc_file.read_text()) if dvc_file.is_file() else None
    wanted = dvc_yaml.shape(cfg)
    if written == wanted:
        return
    what = f"dvc.yaml was generated for another config ({_shape_difference(written, wanted)})"
    kept = ("nothing ran and no output was removed" if removed is None else
            f"`dvc checkout {removed}` restores the outputs DVC removed before this check")
    with open(os.devnull, "w") as quiet:
        old, sys.stdout = sys.stdout, quiet
        try:
            dvc_yaml.main(output=str(dvc_file))
        except Exception as exc:  # noqa: BLE001 - e.g. the Snakefile refuses the config
            raise PisftError(f"{what}; regenerating it failed ({exc}): fix that, run `python -m pisft dvc-yaml`, "
                             f"then `dvc repro` ({kept})") from None
        finally:
            sys.stdout = old
    raise PisftError(f"{what}; dvc.yaml has been regenerated for it (`python -m pisft dvc-yaml`): run `dvc repro` "
                     f"again and commit dvc.yaml ({kept})")


def run_check(config_file: str) -> int:
    """config_check (dvc_yaml.CHECK_STAGE): before any stage, the config valid and dvc.yaml of its
    shape; then the file every stage depends on."""
    from pisft import config as pisft_config
    from pisft.io import write_text_atomic
    from pisft.workflow import dvc_yaml

    try:
        cfg = pisft_config.load(config_file)
        check_dvc_shape(cfg)
    except PisftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        write_text_atomic(Path(cfg.results_dir, dvc_yaml.CHECK_FILE), dvc_yaml.CHECK_TEXT)
    except OSError as exc:
        print(f"error: {dvc_yaml.CHECK_STAGE}: {_disk_text(exc)}; nothing ran: free space there (or set "
              "results_dir to a larger disk) and run `dvc repro` again", file=sys.stderr)
        return 1
    return 0


def write_benchmark(path: Path, started: float) -> None:
    """One row in Snakemake's benchmark format: wall seconds and peak memory (MB) of the stage."""
    seconds = time.time() - started
    rss_kib = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    hms = time.strftime("%H:%M:%S", time.gmtime(seconds))
    row = [f"{seconds:.4f}", hms, f"{rss_kib / 1024:.2f}"] + ["NA"] * (len(BENCHMARK_COLUMNS) - 3)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\t".join(BENCHMARK_COLUMNS) + "\n" + "\t".join(row) + "\n")


def record_for_snakemake(stage: str) -> bool:
    """Snakemake's record of the job DVC just ran (metadata, timestamps); False with a line if not."""
    exe = Path(sys.executable).with_name("snakemake")
    cmd = [str(exe), stage, "--touch", "--cores", "1", "--forcerun", stage]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        print(f"{stage}: not recorded for Snakemake ({lines[-1] if lines else 'no message'}); "
              f"`snakemake {stage} --touch --forcerun {stage}` records it", file=sys.stderr)
        return False
    return True


def _config_of(cmd: list[str]) -> PisftConfig | None:
    from pisft import config as pisft_config

    path = cmd[cmd.index("--config") + 1] if "--config" in cmd[:-1] else str(pisft_config.DEFAULT_CONFIG)
    try:
        return pisft_config.load(path)
    except PisftError:
        return None  # the stage itself refuses the config, with its message


def _run_forwarding_termination(cmd: list[str]) -> int:
    """Run the stage; a SIGTERM or SIGHUP to this wrapper is passed on to it (which then removes
    its temporary output and exits), instead of ending the wrapper and leaving the stage running
    unwatched. SIGINT is not passed on: Ctrl-C reaches the whole process group already."""
    proc = subprocess.Popen(cmd)

    def forward(signum, _frame):
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_dvc_stage(stage: str, cmd: list[str]) -> int:
    """Run one stage for DVC: shape check, the command, then the benchmark and Snakemake's record."""
    cfg = _config_of(cmd)
    if cfg is not None:
        try:
            check_dvc_shape(cfg, removed=stage)
        except PisftError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    started = time.time()
    code = _run_forwarding_termination(cmd)
    if code != 0 or cfg is None:
        return code
    try:
        write_benchmark(layout.benchmark(cfg, stage), started)
    except OSError as exc:  # the stage's outputs are complete; its wall-time row is not essential
        print(f"{stage}: benchmark row not written ({_disk_text(exc)}); the stage's outputs are complete",
              file=sys.stderr)
    record_for_snakemake(stage)
    return 0


def _disk_text(exc: OSError) -> str:
    from pisft import disk_space

    where = exc.filename or "results_dir"
    if disk_space.is_full_disk(exc):
        return f"{where}: {disk_space.MARK}, {disk_space.human(disk_space.free_bytes(where))} free"
    return f"{where}: {exc.strerror or exc}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 4 or argv[0] != "dvc" or argv[2] != "--":
        print("usage: python -m pisft.workflow.drivers dvc <stage> -- <command>", file=sys.stderr)
        return 2
    from pisft.workflow.dvc_yaml import CHECK_STAGE

    if argv[1] == CHECK_STAGE:
        return run_check(argv[3])
    return run_dvc_stage(argv[1], argv[3:])


if __name__ == "__main__":
    raise SystemExit(main())
