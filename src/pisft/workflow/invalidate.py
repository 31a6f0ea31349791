"""A stage that starts removes the outputs derived from its previous outputs.

Which case still needs this: a downstream rule named as Snakemake's target after a failure.
When a job fails, Snakemake deletes its outputs, and Snakemake 9 then treats a missing
intermediate like a temporary file: `snakemake evaluate` (or any target whose own outputs
exist) reports "Nothing to be done" while the evaluation of the previous model is still there.
The plain `snakemake --cores all` does not need this (its `rule all` asks for every stage's
outputs, so the missing model is itself requested and everything after it reruns), nor does
DVC, which compares content hashes. Removing the downstream outputs when a stage starts covers
the named-target case, and leaves no stale evaluation beside a failed training.

The DAG comes from dvc.yaml, which is generated from the Snakemake rules and checked for
staleness by a test; its outputs are `${results_dir}/...` templates, filled in with the run's
results_dir. Persistent outputs (training checkpoints) are never removed, nor anything outside
the run's results_dir.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml

from pisft.stages import FETCH_BASE


def _out_paths(entries: list) -> list[tuple[str, bool]]:
    paths = []
    for entry in entries or []:
        if isinstance(entry, str):
            paths.append((entry, False))
        else:
            for path, opts in entry.items():
                paths.append((path, bool((opts or {}).get("persist", False))))
    return paths


def _filled(text: str, dvc_yaml: Path, results_dir: str | Path) -> str:
    """dvc.yaml's templates filled in as DVC does (from its vars file), results_dir the run's."""
    text = text.replace("${results_dir}", str(results_dir).rstrip("/"))
    vars_files = (yaml.safe_load(text) or {}).get("vars", [])
    values: dict = {}
    for name in vars_files:
        path = dvc_yaml.parent / name
        if isinstance(name, str) and path.is_file():
            values.update(yaml.safe_load(path.read_text()) or {})

    def value(match: re.Match) -> str:
        node = values
        for part in match.group(1).split("."):
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                return match.group(0)
        # a list or mapping (dvc.yaml made for another shape of the config): left as written
        return match.group(0) if isinstance(node, dict | list) else str(node)

    return re.sub(r"\$\{([a-zA-Z_.0-9]+)\}", value, text)


def load_dag(dvc_yaml: Path, results_dir: str | Path = "results") -> dict[str, dict]:
    stages = yaml.safe_load(_filled(dvc_yaml.read_text(), dvc_yaml, results_dir))["stages"]
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
            if isinstance(dep, str) and dep in produced_by:
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
    for path, _ in dag.get(FETCH_BASE.name, {}).get("outs", []):
        if Path(path).name == FETCH_BASE.folder:
            return str(Path(path).parent)
    return None


def _gone_already_is_fine(_function, _path, error: BaseException) -> None:
    """shutil.rmtree's error handler: an entry another process removed first is removed.

    Two stages that start together remove the same downstream folders (Snakemake runs independent
    jobs at once: `snakemake --forceall --cores 2` starts fetch_base and demo_recap, and both remove
    results/train/model); the one that reached an entry after the other unlinked it got
    FileNotFoundError and failed the run.
    Any other error (a permission, a busy mount) is raised as it was.
    """
    if not isinstance(error, FileNotFoundError):
        raise error


def invalidate_downstream(stage: str, results_dir: str | Path = "results",
                          dvc_yaml: str | Path = "dvc.yaml") -> list[str]:
    """Remove the downstream outputs of `stage` under `results_dir`; return what was removed.

    dvc.yaml's outputs are templates over results_dir; a dvc.yaml with literal paths (generated
    before) has them rebased onto the run's `results_dir`. Nothing outside the run's own results
    folder is ever touched.
    """
    dvc_yaml = Path(dvc_yaml)
    if not dvc_yaml.is_file():
        return []
    dag = load_dag(dvc_yaml, results_dir)
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
            shutil.rmtree(p, onexc=_gone_already_is_fine)
        elif p.exists() or p.is_symlink():
            p.unlink(missing_ok=True)
        else:
            continue
        removed.append(str(p))
    if removed:
        print(f"{stage}: removed outputs derived from its previous run: {', '.join(removed)}", flush=True)
    return removed
