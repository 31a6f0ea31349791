"""Helpers the Snakefile calls at parse time (kept here so the workflow files stay thin)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from pisft import layout
from pisft import config as pisft_config
from pisft.io import WORKFLOW_MARKERS, write_text_atomic
from pisft.stages import DATA_SOURCES, MODEL_SOURCE, STAGES, Read, Stage, StartModel, rules
from pisft.code_graph import code_deps

DEFAULT_FILE = pisft_config.DEFAULT_CONFIG.as_posix()


def _source_name(workflow) -> str:
    files = [str(f) for f in getattr(workflow, "configfiles", [])] or [DEFAULT_FILE]
    entries = _config_entries(workflow)
    return " + ".join(files) + (f" + --config {' '.join(entries)}" if entries else "")


def _config_entries(workflow) -> list[str]:
    """The `--config KEY=VALUE` entries as typed (Snakemake 9 keeps them, `ConfigSettings.config_args`,
    to pass on to the jobs it spawns); [] when there are none, or when the config was given through
    Snakemake's API as values rather than typed (then `config_args` is Snakemake's repr of them)."""
    settings = getattr(workflow, "config_settings", None)
    entries = getattr(settings, "config_args", None)
    if not entries or not isinstance(entries, list | tuple) or not all(isinstance(e, str) for e in entries):
        return []
    from snakemake.cli import parse_config

    try:
        typed = parse_config(entries) == dict(settings.config)
    except Exception:  # noqa: BLE001 - not entries Snakemake's command line would take
        return []
    return list(entries) if typed else []


def workflow_config(config: dict, workflow) -> dict:
    """Snakemake's merged config (`config`: config.yaml, `--configfile`, `--config`) with the
    `--config` values read as config.yaml and `--set` read theirs (`pisft.config.command_line_values`).
    Snakemake reads a nested `--config` value with PyYAML's BaseLoader (snakemake/cli.py
    `parse_config`, Snakemake 9.27.1), which keeps every scalar as text: `eval={perturbations: [{name:
    camera, strength: 5}]}` gave the strength '5', and `eval={compile: null}` the text 'null'. Read
    again from the entries as typed and merged on top, as Snakemake merges them."""
    entries = _config_entries(workflow)
    if not entries:
        return dict(config)
    import copy

    return pisft_config.merge_into(copy.deepcopy(dict(config)),
                                   pisft_config.command_line_values(entries, "--config"))


def check_config_files(workflow, default: str = DEFAULT_FILE) -> None:
    """Before Snakemake reads them: a YAML syntax error named with its line, an empty file refused.

    Snakemake's own message for a broken config file ("Config file is not valid JSON or YAML")
    names neither the line nor the problem; pisft's loader does.
    """
    files = [default, *(str(f) for f in getattr(workflow, "configfiles", []) or [])]
    for path in dict.fromkeys(files):
        if not Path(path).is_file():
            continue
        try:
            raw = pisft_config.read_yaml(path, missing="not found")
        except pisft_config.ConfigError as exc:
            sys.stderr.write(f"error: {exc}\n")
            raise SystemExit(2) from None
        if raw is None:
            sys.stderr.write(f"error: {path}: the config file is empty (or only comments); "
                             f"start from {DEFAULT_FILE}\n")
            raise SystemExit(2)


def validated_config(config: dict, workflow) -> tuple[pisft_config.PisftConfig, str]:
    """Validate Snakemake's merged config once per parse; return it and the file stages read.

    Stages read one config file. When Snakemake's config is exactly config/config.yaml, that
    file is passed on (the same command DVC runs). When `--configfile`/`--config` changed it,
    the stages read results/config/effective.yaml, the merged config, which `write_effective_config`
    writes when the run starts (`onstart`: nothing is written by `snakemake -n` or `--lint`).
    """
    try:
        config = workflow_config(config, workflow)
        cfg = pisft_config.from_dict(config, _source_name(workflow))
    except pisft_config.ConfigError as exc:
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(2) from None
    if _is_default(config):
        return cfg, DEFAULT_FILE
    return cfg, _effective_path(cfg).as_posix()


def _is_default(config: dict) -> bool:
    default_path = Path(DEFAULT_FILE)
    return default_path.is_file() and yaml.safe_load(default_path.read_text()) == dict(config)


def _effective_path(cfg: pisft_config.PisftConfig) -> Path:
    return layout.effective_config(cfg)


def write_effective_config(cfg: pisft_config.PisftConfig, config: dict) -> None:
    """At the start of a real run: the merged config the stages read (rewritten only when its
    content changes, so its timestamp does not trigger reruns)."""
    if _is_default(config):
        return
    effective = _effective_path(cfg)
    text = "# written by the Snakefile: config/config.yaml merged with --configfile/--config\n"
    text += yaml.safe_dump(pisft_config.to_dict(cfg), sort_keys=False)
    if not effective.is_file() or effective.read_text() != text:
        write_text_atomic(effective, text)


def tracked_params(config: dict, stage: str, k: int = 0) -> dict:
    """The values of the config keys `stage` reads (at iteration k), from the validated config as
    a mapping (`pisft_config.to_dict`, defaults filled in), so the config is validated once per parse."""
    values = {}
    for key in STAGES[stage].keys_at(k):
        node = config
        for part in key.split("."):
            node = node[part]
        values[key] = node
    return values


def stage_rules(cfg: pisft_config.PisftConfig, values: dict) -> list[tuple[Stage, int]]:
    """The rules of this config (`values`: the same as a mapping, `pisft.config.to_dict`) as (stage,
    iteration), in order (`pisft.stages.rules`), less the ones it switches off (`Stage.sft_only_if`:
    iteration 0's closed loop without eval.closed_loop)."""
    return [(stage, k) for stage, k in rules(cfg.recap.iterations) if not stage.switched_off(k, values)]


def stage_inputs(cfg: pisft_config.PisftConfig, values: dict, stage: Stage, k: int) -> list[str]:
    """What iteration k's rule of `stage` reads besides its code, as paths, from its row: its
    reads in order (another stage's outputs at the iterations `Read.at` names, the data sources,
    the model it starts from), then its gate's report. `values`: the config as a mapping
    (`pisft.config.to_dict`, made once per parse: it takes tens of milliseconds)."""
    paths: list[str] = []
    for read in stage.reads_at(k):
        if read == MODEL_SOURCE:
            paths.extend(model_source_inputs(cfg))
        elif read == DATA_SOURCES:
            paths.extend(source_inputs(cfg))
        elif isinstance(read, StartModel):
            paths.append(str(layout.start_model(cfg.at_iteration(k), pisft_config.lookup(values, read.key))))
        else:
            assert isinstance(read, Read), read
            writer = STAGES[read.stage]
            for j in read.iterations(k, cfg.recap.iterations):
                if not (writer.shared or writer.runs_at(j)):
                    raise ValueError(f"{stage.rule(k)} reads {writer.name} at iteration {j}, where it does not run "
                                     "(the stage table, pisft.stages)")
                if not writer.switched_off(j, values):  # an optional stage the config leaves out
                    paths.append(str(layout.output(cfg, writer, read.output, j)))
    if stage.gate:
        paths.append(str(layout.output(cfg, STAGES[stage.gate], k=k)))
    return paths


def shard_folders(cfg: pisft_config.PisftConfig, stage: Stage, k: int, n: int) -> list[str]:
    """What the merge of a stage scattered over n shards reads: the shards' folders."""
    return [str(layout.iteration(cfg, k).shard(stage.name, i, n)) for i in range(1, n + 1)]


def every_output(workflow) -> list[str]:
    """Every stage's outputs, for `rule all`: a missing intermediate (e.g. the model a failed
    training left out) is requested itself, so it is rebuilt with everything after it."""
    return [str(out) for rule in workflow.rules if rule.name != "all" for out in rule.output]


def _dvc_say(message: str) -> None:
    print(f"dvc.lock: {message}", file=sys.stderr, flush=True)


def record_in_dvc(workflow, config_file: str) -> list[str]:
    """After a Snakemake run: `dvc commit` the stages Snakemake ran or found up to date.

    Then `dvc status` agrees with Snakemake and `dvc push` carries every output (docs/workflow.md,
    "Both drivers agree"). Only the stages in this run's DAG are recorded (a stage outside it may be
    out of date); nothing is recorded after `--touch` (an assertion, not a run), inside a DVC
    stage, when the stages read another config than dvc.yaml's (`--configfile`), or when
    dvc.yaml does not describe these rules.
    """
    release_dvc_lock()  # held since onstart (`hold_dvc_lock`): dvc commit takes it
    if workflow.touch or os.environ.get("DVC_STAGE") or not Path(".dvc").is_dir():
        return []
    if config_file != DEFAULT_FILE:
        _dvc_say(f"not updated: this run's stages read {config_file} (--configfile/--config), "
                 f"DVC's read {DEFAULT_FILE}; to run a profile under both tools use "
                 "`python -m pisft profile FILE` (docs/workflow.md, Profiles)")
        return []
    from pisft.workflow import dvc_yaml
    from pisft.workflow.snakemake_rules import specs_of

    config = workflow_config(dict(workflow.config), workflow)
    dvc_file = Path("dvc.yaml")
    if not dvc_file.is_file() or dvc_file.read_text() != dvc_yaml.render(specs_of(workflow), config):
        _dvc_say("not updated: dvc.yaml does not match the workflow rules; run `python -m pisft dvc-yaml`")
        return []
    dag = workflow.dag
    stages = set(yaml.safe_load(dvc_file.read_text()).get("stages", {}))
    done = sorted({job.rule.name for job in dag.jobs if dag.noneedrun_finished(job)} & stages)
    if not done:
        return []
    if dvc_yaml.CHECK_STAGE in stages:  # dvc.yaml matches these rules and this config (checked above)
        cfg = pisft_config.from_dict(config)
        write_text_atomic(Path(cfg.results_dir, dvc_yaml.CHECK_FILE), dvc_yaml.CHECK_TEXT)
        done = [dvc_yaml.CHECK_STAGE, *done]
    dvc = Path(sys.executable).with_name("dvc")
    exe = str(dvc) if dvc.exists() else shutil.which("dvc")
    if exe is None:
        _dvc_say("not updated: the dvc command was not found")
        return []
    # Not --quiet: it silences DVC's ERROR line too, and that line is what the user needs
    proc = subprocess.run([exe, "commit", "--force", *done], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else
                   f"dvc commit exited {proc.returncode} without a message")
        _dvc_say(f"not updated ({why}); run `dvc commit {' '.join(done)}` to record these outputs")
        return []
    names = ", ".join(done)
    _dvc_say(f"recorded {names}" if len(names) <= 120 else f"recorded the {len(done)} stages this run finished")
    return done


# One run writes results/ at a time. `dvc repro` holds DVC's repository lock (.dvc/tmp/lock, a
# zc.lockfile, dvc/lock.py) except while a stage's command runs (dvc/stage/run.py `unlocked_repo`),
# when its entries in DVC's rwlock file (.dvc/tmp/rwlock, dvc/rwlock.py: {"write": {path: {pid,
# cmd}}, "read": {path: [{pid, cmd}]}}) name the stage's outputs and inputs; DVC 3.67.1. A
# Snakemake run takes the repository lock when its jobs start (onstart) and keeps it until its own
# `dvc commit` (record_in_dvc). So a `dvc repro` started beside a running Snakemake stops at once
# with DVC's lock message, before it removes or writes anything, and a Snakemake started beside a
# running `dvc repro` (holding the lock, or running a stage) stops before its first job, naming it.
DVC_LOCK = Path(".dvc/tmp/lock")
DVC_RWLOCK = Path(".dvc/tmp/rwlock")
_HELD: list = []


def _dvc_stage_running() -> str | None:
    """The command of a DVC stage running now (a live pid in DVC's rwlock file), or None."""
    import json

    try:
        entries = json.loads(DVC_RWLOCK.read_text())
    except (OSError, ValueError):
        return None
    infos = [*(entries.get("write") or {}).values(),
             *(info for infos in (entries.get("read") or {}).values() for info in infos)]
    for info in infos:
        try:
            os.kill(int(info["pid"]), 0)
        except (ProcessLookupError, KeyError, TypeError, ValueError):
            continue
        except PermissionError:
            pass
        return f"pid {info['pid']}: {info.get('cmd', '?')}"
    return None


def hold_dvc_lock(workflow) -> None:
    """At the start of a real run (onstart): take DVC's lock, or stop naming the DVC run that has
    it. Not for `--touch` (a DVC stage records its job that way while DVC runs) nor inside a DVC
    stage."""
    if workflow.touch or os.environ.get("DVC_STAGE") or not Path(".dvc").is_dir() or _HELD:
        return
    import zc.lockfile

    DVC_LOCK.parent.mkdir(parents=True, exist_ok=True)
    try:
        _HELD.append(zc.lockfile.LockFile(str(DVC_LOCK), content_template="{pid} snakemake"))
        running = _dvc_stage_running()
    except zc.lockfile.LockError:
        running = f"pid {(DVC_LOCK.read_text().split() or ['?'])[0] if DVC_LOCK.is_file() else '?'}"
    if running is None:
        return
    release_dvc_lock()
    sys.stderr.write(f"error: a DVC run is working on this checkout ({running}): one run writes results/ at a "
                     "time; nothing was run or removed: wait for it to end (or stop it), then run Snakemake "
                     "again\n")
    sys.stderr.flush()
    raise SystemExit(1)  # before any job


def release_dvc_lock() -> None:
    while _HELD:
        _HELD.pop().close()


# The gres name a Slurm site declares for each device kind (gres.conf, `--gres=<name>:<count>`):
# `gpu` is Slurm's own for NVIDIA GPUs; for Ascend NPUs `npu` is the name most sites declare. A
# site with another name overrides `gres` per rule in its profile (profiles/slurm/config.yaml).
SLURM_GRES = {"npu": "npu", "cuda": "gpu"}


def accelerator_resources(cfg: pisft_config.PisftConfig, nproc: int) -> dict:
    """Resources a training rule asks for: a whole node's accelerators for the run.

    `accelerators` is what the local scheduler counts; `gres` is what a cluster executor
    (snakemake-executor-plugin-slurm) requests. On the CPU none are asked for. The launcher
    also checks that the node really shows `nproc` devices, so a smaller allocation fails
    loudly instead of shrinking the run.
    """
    kind = SLURM_GRES.get(cfg.device)
    if kind is None:
        return {"accelerators": 0}
    resources = {"accelerators": nproc, "gres": f"{kind}:{nproc}"}
    if kind == "gpu":
        # The plugin adds --ntasks-per-gpu=1 to a gpu gres request unless told 0: 8 tasks of
        # cpus_per_task each, where the launcher is one task that starts torchrun's 8 workers.
        resources["tasks_per_gpu"] = 0
    return resources


def node_resources(cfg: pisft_config.PisftConfig, stage: Stage) -> dict:
    """Resources a training rule asks for beyond one node: with `train.nnodes` N > 1 and
    `train.rdzv_endpoint` empty, one Slurm job of N nodes and one task per node, its launcher
    starting a torchrun on each through srun (`pisft.train.slurm_nodes`). `mpi` tells
    snakemake-executor-plugin-slurm (2.6.1) that the rule's command starts its own tasks: sbatch gets
    `--ntasks=N` (`submit_string.get_submit_command`), and the job's Snakemake runs the command in
    the batch step on the first node (jobstep 0.6.1, `run_job`) instead of inside a one-task srun
    step, which would hold that node's cores and memory against the launcher's srun. The smoke gate
    and a by-hand rendezvous (`train.rdzv_endpoint` set: a run per node) ask for none."""
    t = cfg.train
    if stage.one_process or t.nnodes <= 1 or t.rdzv_endpoint:
        return {}
    return {"nodes": t.nnodes, "tasks": t.nnodes, "mpi": "srun"}


def source_inputs(cfg: pisft_config.PisftConfig) -> list[str]:
    """The data sources the conversion (convert_recap) reads, as Snakemake inputs: a folder a rule
    of this config writes (the demo, a stage's output: `rule_folders`) as the folder, which ties
    the conversion to that rule; any other folder as every file in it, wherever it lies, inside
    results_dir or not. Snakemake compares a folder by its own time stamp, which a changed or
    added file deep inside does not move: a source whose data changed was "Nothing to be done",
    and the run's `dvc commit` (`record_in_dvc`) then recorded the changed source as converted,
    so DVC did not see it either (issue 56: a source placed inside results/ was taken for a
    stage's output by where it lay)."""
    written = rule_folders(cfg)
    inputs: list[str] = []
    for source in pisft_config.data_sources(cfg):
        folder = Path(source.path)
        # `results/../data` and a link into results/: where they lead
        files = [] if folder.resolve() in written or not folder.is_dir() else sorted(
            p.as_posix() for p in folder.rglob("*") if p.is_file() and p.name not in WORKFLOW_MARKERS)
        inputs.extend(files or [source.path])
    return inputs


def rule_folders(cfg: pisft_config.PisftConfig) -> set[Path]:
    """Every folder output of this config's rules (`pisft.stages.rules`), resolved."""
    return {path.resolve() for stage, k in rules(cfg.recap.iterations)
            for out, path in layout.outputs(cfg, stage, k) if out.folder}


def model_source_inputs(cfg: pisft_config.PisftConfig) -> list[str]:
    """A local model source's files: a changed source reruns fetch_base, an unchanged one not."""
    from pisft.model.sources import local_input_files

    return local_input_files(cfg.model.source, cfg.model.tokenizer)


def stage_code(cfg: pisft_config.PisftConfig, stage: str) -> list[str]:
    """What `stage` runs (package folders, shared modules, lock): DVC deps, via `params.code`."""
    return code_deps(stage, cfg.device)


def stage_code_files(cfg: pisft_config.PisftConfig, stage: str) -> list[str]:
    """The same as files (Snakemake compares file timestamps; a folder's does not follow edits)."""
    files: list[str] = []
    for entry in code_deps(stage, cfg.device):
        path = Path(entry)
        if path.is_dir():
            files.extend(p.as_posix() for p in sorted(path.rglob("*.py")) if "__pycache__" not in p.parts)
        else:
            files.append(entry)
    return files
