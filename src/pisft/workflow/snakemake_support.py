"""Helpers the Snakefile calls at parse time (kept here so the workflow files stay thin)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from pisft import config as pisft_config
from pisft.io import write_text_atomic
from pisft.workflow.stages import STAGE_KEYS, code_deps, lookup

DEFAULT_FILE = pisft_config.DEFAULT_CONFIG.as_posix()


def _source_name(workflow) -> str:
    files = [str(f) for f in getattr(workflow, "configfiles", [])] or [DEFAULT_FILE]
    return " + ".join(files)


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
            raw = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as exc:
            sys.stderr.write(f"error: {path}: not valid YAML: {exc}\n")
            raise SystemExit(2) from None
        if raw is None:
            sys.stderr.write(f"error: {path}: the config file is empty (or only comments); "
                             f"start from {DEFAULT_FILE}\n")
            raise SystemExit(2)


def validated_config(config: dict, workflow) -> tuple[pisft_config.PisftConfig, str]:
    """Validate Snakemake's merged config before any job; return it and the file to pass on.

    Stages read one config file. When Snakemake's config is exactly config/config.yaml, that
    file is passed on (the same command DVC runs). When `--configfile`/`--config` changed it,
    the merged config is written to results/config/effective.yaml (rewritten only when its
    content changes, so its timestamp does not trigger reruns) and that file is passed on.
    """
    try:
        cfg = pisft_config.from_dict(dict(config), _source_name(workflow))
    except pisft_config.ConfigError as exc:
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(2) from None
    default_path = Path(DEFAULT_FILE)
    default_raw = yaml.safe_load(default_path.read_text()) if default_path.is_file() else None
    if default_raw == dict(config):
        return cfg, DEFAULT_FILE
    effective = Path(cfg.results_dir, "config", "effective.yaml")
    text = "# written by the Snakefile: config/config.yaml merged with --configfile/--config\n"
    text += yaml.safe_dump(pisft_config.to_dict(cfg), sort_keys=False)
    if not effective.is_file() or effective.read_text() != text:
        write_text_atomic(effective, text)
    return cfg, effective.as_posix()


def tracked_params(config: dict, stage: str) -> dict:
    """The values of the config keys `stage` reads (validated config, defaults filled in)."""
    cfg = pisft_config.to_dict(pisft_config.from_dict(dict(config)))
    return {key: lookup(cfg, key) for key in STAGE_KEYS[stage]}


def accelerator_resources(cfg: pisft_config.PisftConfig, nproc: int) -> dict:
    """Resources a training rule asks for: a whole node's accelerators for the run.

    `accelerators` is what the local scheduler counts; `gres` is what a cluster executor
    (snakemake-executor-plugin-slurm) requests. On the CPU none are asked for. The launcher
    also checks that the node really shows `nproc` devices, so a smaller allocation fails
    loudly instead of shrinking the run.
    """
    kind = {"npu": "npu", "cuda": "gpu"}.get(cfg.device)
    if kind is None:
        return {"accelerators": 0}
    return {"accelerators": nproc, "gres": f"{kind}:{nproc}"}


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
