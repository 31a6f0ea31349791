"""Read the workflow's rules through Snakemake's own parser (the DAG's single source of truth)."""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

SNAKEFILE = Path("workflow/Snakefile")


@dataclass
class RuleSpec:
    name: str
    cmd: str
    inputs: list[str]
    outputs: dict[str, str]  # output name (or its path when unnamed) -> path
    directories: set[str]
    tracked_keys: list[str]
    config_file: str
    code: list[str] = field(default_factory=list)  # source folders/files and lock (params.code)
    benchmark: str | None = None  # Snakemake's benchmark file of the rule


@dataclass
class Workflow:
    """The rules, and the config they were parsed with (a plain dict, as Snakemake holds it)."""

    rules: list[RuleSpec]
    config: dict


def _under(path: str, entries: list[str]) -> bool:
    return any(path == e or path.startswith(e.rstrip("/") + "/") for e in entries)


def _format_shell(template: str, params: dict, log: list[str]) -> str:
    def repl(match: re.Match) -> str:
        key = match.group(1)
        if key == "log":
            return " ".join(log)
        if key.startswith("params."):
            return str(params[key.split(".", 1)[1]])
        raise ValueError(f"shell command uses {{{key}}}, which dvc-yaml cannot translate")

    return re.sub(r"\{([a-zA-Z_.]+)\}", repl, template)


def specs_of(workflow) -> list[RuleSpec]:
    """The shell rules of a parsed Snakemake workflow (also the live one, in an onsuccess hook)."""
    specs: list[RuleSpec] = []
    for rule in workflow.rules:
        if not rule.shellcmd:
            continue
        params = dict(rule.params.items())
        names = {i: name for name, (i, _end) in rule.output._names.items()}  # noqa: SLF001
        outputs: dict[str, str] = {}
        directories: set[str] = set()
        for i, out in enumerate(rule.output):
            outputs[names.get(i, str(out))] = str(out)
            if getattr(out, "flags", {}).get("directory"):
                directories.add(str(out))
        code = [str(c) for c in params.get("code", [])]
        specs.append(
            RuleSpec(
                name=rule.name,
                cmd=_format_shell(rule.shellcmd, params, [str(x) for x in rule.log]),
                # code files are Snakemake's view of params.code; DVC gets the folders
                inputs=[str(x) for x in rule.input if not _under(str(x), code)],
                outputs=outputs,
                directories=directories,
                tracked_keys=list(params.get("tracked", {}).keys()),
                config_file=str(params["config"]),
                code=code,
                benchmark=str(rule.benchmark) if rule.benchmark else None,
            )
        )
    return specs


def load_workflow(snakefile: Path = SNAKEFILE, workdir: Path = Path(".")) -> Workflow:
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import (
        ConfigSettings,
        OutputSettings,
        ResourceSettings,
        StorageSettings,
    )

    with contextlib.redirect_stdout(io.StringIO()), SnakemakeApi(OutputSettings(quiet=None)) as api:
        workflow_api = api.workflow(
            resource_settings=ResourceSettings(cores=1),
            config_settings=ConfigSettings(),
            storage_settings=StorageSettings(),
            snakefile=snakefile,
            workdir=workdir,
        )
        workflow = workflow_api._workflow  # noqa: SLF001 - pinned Snakemake; guarded by tests
        return Workflow(rules=specs_of(workflow), config=dict(workflow.config))


def load_rules(snakefile: Path = SNAKEFILE, workdir: Path = Path(".")) -> list[RuleSpec]:
    return load_workflow(snakefile, workdir).rules
