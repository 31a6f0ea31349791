"""Generate dvc.yaml from the Snakemake rules, so the two drivers share one DAG.

Each rule becomes a stage with the same command, its inputs as deps, the config keys it
tracks as params, and its outputs as outs. Outputs are cached (so `dvc push`/`dvc pull` carry
them) except where a rule says otherwise. Conventions read from the rules:
- an output named `metrics` ending in `.json` is a DVC metric;
- an output ending in `.png`, or a `.csv` table, is a DVC plot (DVC cannot plot JSON lines, so
  evaluate writes CSV tables for plots);
- `params.dvc_uncached` outputs are outs with `cache: false` (base weights linked from a local
  multi-GB source: the source is the copy of record, DVC's cache would be a second copy);
- `params.dvc_plots` gives the x/y columns and template of CSV plots (top-level `plots:`);
- `params.code` (the source folders, shared modules and lock a stage runs) are deps; the
  rules' inputs under them (Snakemake's file-by-file view of the same code) are left out;
- training checkpoints (results/checkpoints/) are no DVC output at all: DVC neither deletes nor
  caches what it does not track, a rerun resumes from them, and a fresh clone (which has none)
  is not "changed" for want of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from pisft.workflow.snakemake_rules import RuleSpec, load_rules

HEADER = (
    "# Generated from workflow/rules/*.smk by `python -m pisft dvc-yaml`; do not edit by hand.\n"
    "# A test fails when this file is stale.\n"
)


def stage_for(rule: RuleSpec) -> dict:
    stage: dict = {"cmd": rule.cmd}
    if rule.inputs or rule.code:
        stage["deps"] = [*rule.inputs, *rule.code]
    if rule.tracked_keys:
        stage["params"] = [{rule.config_file: list(rule.tracked_keys)}]
    outs: list = []
    metrics: list = []
    plots: list = []
    for name, path in rule.outputs.items():
        if name == "metrics" and path.endswith(".json"):
            metrics.append(path)
        elif path.endswith((".png", ".csv")):
            plots.append(path)
        elif rule.uncached and path in rule.uncached:
            outs.append({path: {"cache": False}})
        else:
            outs.append(path)
    if outs:
        stage["outs"] = outs
    if metrics:
        stage["metrics"] = metrics
    if plots:
        stage["plots"] = plots
    return stage


def top_level_plots(rules: list[RuleSpec]) -> list:
    """How `dvc plots show` draws each table (x, y columns, template), from the rules' params."""
    return [{path: props} for rule in rules for path, props in rule.plot_props.items()]


def render(rules: list[RuleSpec]) -> str:
    doc: dict = {"stages": {rule.name: stage_for(rule) for rule in rules}}
    plots = top_level_plots(rules)
    if plots:
        doc["plots"] = plots
    return HEADER + yaml.safe_dump(doc, sort_keys=False, width=120)


def main(check: bool = False, output: str = "dvc.yaml") -> int:
    text = render(load_rules())
    path = Path(output)
    if check:
        current = path.read_text() if path.is_file() else ""
        if current != text:
            print(
                f"{path} is stale: it differs from what the workflow rules generate. "
                "Run `python -m pisft dvc-yaml` and commit the result.",
                file=sys.stderr,
            )
            return 1
        print(f"{path} matches the workflow rules")
        return 0
    path.write_text(text)
    print(f"wrote {path} from the workflow rules")
    return 0
