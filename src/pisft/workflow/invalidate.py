"""A stage that starts removes the outputs derived from its previous outputs.

Why: when a job fails, Snakemake deletes its outputs; Snakemake 9 then treats the missing
intermediate files like temporary ones and reports "Nothing to be done" for `all` as long as
the downstream outputs (e.g. an old evaluation) still exist, so a stale evaluation would
survive a failed retraining. Removing downstream outputs when a stage starts makes the next
`snakemake --cores all` or `dvc repro` rerun the failed stage and everything after it.

The DAG comes from dvc.yaml, which is generated from the Snakemake rules and checked for
staleness by a test. Persistent outputs (training checkpoints) are never removed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml


def _out_paths(entries: list) -> list[tuple[str, bool]]:
    paths = []
    for entry in entries or []:
        if isinstance(entry, str):
            paths.append((entry, False))
        else:
            for path, opts in entry.items():
                paths.append((path, bool((opts or {}).get("persist", False))))
    return paths


def load_dag(dvc_yaml: Path) -> dict[str, dict]:
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    dag = {}
    for name, stage in stages.items():
        outs = _out_paths(stage.get("outs", [])) + _out_paths(stage.get("metrics", [])) + _out_paths(
            stage.get("plots", [])
        )
        dag[name] = {"deps": list(stage.get("deps", [])), "outs": outs}
    return dag


def downstream_outputs(stage: str, dag: dict[str, dict]) -> list[str]:
    """Non-persistent outputs of every stage that (transitively) depends on `stage`."""
    produced_by = {path: name for name, st in dag.items() for path, _ in st["outs"]}
    children: dict[str, set[str]] = {name: set() for name in dag}
    for name, st in dag.items():
        for dep in st["deps"]:
            if dep in produced_by:
                children[produced_by[dep]].add(name)
    seen: set[str] = set()
    todo = [stage]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return sorted(path for name in seen for path, persist in dag[name]["outs"] if not persist)


def _results_dir_of(dag: dict[str, dict]) -> str | None:
    """The results folder dvc.yaml was generated for (where fetch_base writes base_model)."""
    for path, _ in dag.get("fetch_base", {}).get("outs", []):
        if Path(path).name == "base_model":
            return str(Path(path).parent)
    return None


def invalidate_downstream(stage: str, results_dir: str | Path = "results",
                          dvc_yaml: str | Path = "dvc.yaml") -> list[str]:
    """Remove the downstream outputs of `stage` under `results_dir`; return what was removed.

    dvc.yaml names outputs under the results folder it was generated for; a run with another
    `results_dir` (e.g. `--set results_dir=...`) has them rebased there, and nothing outside
    the run's own results folder is ever touched.
    """
    dvc_yaml = Path(dvc_yaml)
    if not dvc_yaml.is_file():
        return []
    dag = load_dag(dvc_yaml)
    generated_for = _results_dir_of(dag)
    if stage not in dag or generated_for is None:
        return []
    removed = []
    for path in downstream_outputs(stage, dag):
        rel = Path(path).relative_to(generated_for) if Path(path).is_relative_to(generated_for) else None
        if rel is None:
            continue
        p = Path(results_dir) / rel
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        else:
            continue
        removed.append(str(p))
    if removed:
        print(f"{stage}: removed outputs derived from its previous run: {', '.join(removed)}", flush=True)
    return removed
