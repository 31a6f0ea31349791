"""The stage table (pisft.stages) feeds the CLI, the torchrun worker and the rules; the
package's imports flow one way (no module imports itself back through others)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from pisft import layout
from pisft import cli
from pisft.train import __main__ as train_main
from pisft.stages import STAGES, TRAINING_STAGES

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

# Lowest first: a module may import modules of its own layer or of a lower one. Entry points
# (what a user or torchrun starts) sit on top (docs/development.md, "Layout").
LAYERS = (
    ("pisft", "pisft.errors", "pisft.io", "pisft.integrity", "pisft.disk_space", "pisft.logs", "pisft.device",
     "pisft.config", "pisft.layout", "pisft.stages", "pisft.code_graph", "pisft.records",
     "pisft.tensors", "pisft.ports"),
    ("pisft.data", "pisft.model"),
    ("pisft.policy", "pisft.rollout"),  # the inference wing and the rollout engine on it
    ("pisft.train", "pisft.evaluate", "pisft.serve"),
    # Tools that study the training step (memory estimate, its measurement, the collective audit,
    # their synthetic inputs), built on it.
    ("pisft.introspect",),
    ("pisft.recap",),  # the RECAP loop's stages: built on training, evaluation and the simulator
    # The go/no-go gates (smoke_1card, smoke_value): above what they gate and the estimate they carry.
    ("pisft.gates",),
    ("pisft.workflow",),
    ("pisft.bench", "pisft.cli", "pisft.__main__", "pisft.train.__main__", "pisft.doctor"),
)


def test_the_cli_offers_exactly_the_stages_of_the_table(tmp_path):
    parser = cli.build_parser()
    for name, stage in STAGES.items():
        if stage.training:
            assert parser.parse_args(["launch", name]).stage == name
            with pytest.raises(SystemExit):  # started through the launcher only
                parser.parse_args([name])
        else:
            assert parser.parse_args([name, "--config", "c.yaml"]).command == name
            with pytest.raises(SystemExit):
                parser.parse_args(["launch", name])
    assert train_main._parse(["--stage", TRAINING_STAGES[0], "--config", "c.yaml"]).stage
    with pytest.raises(SystemExit):
        train_main._parse(["--stage", "fetch_base", "--config", "c.yaml"])


def test_every_stage_names_a_function_that_exists():
    """Read, not imported: the stage modules pull in torch and LeRobot."""
    import importlib.util

    for name, stage in STAGES.items():
        module, func = stage.run.split(":")
        tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert func in defined, f"{name}: {stage.run}"


def test_the_rules_run_the_tables_commands_and_write_its_outputs(tmp_path):
    """Every stage (closed_loop enabled, two RECAP iterations) against the rules Snakemake parses
    from workflow/rules: iteration k's rule runs the stage with `--iteration k` and writes its
    outputs in results/recap/iter_<k>/."""
    import yaml

    from pisft.config import from_dict
    from pisft.workflow.scratch import copy_project
    from pisft.workflow.snakemake_rules import load_rules
    from pisft.stages import rule_name, rule_names, stage_of

    project = copy_project(ROOT, tmp_path / "project")
    config_file = project / "config" / "config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["eval"]["closed_loop"] = True
    config["recap"]["iterations"] = 2
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    cfg = from_dict(config)
    rules = {r.name: r for r in load_rules(project / "workflow" / "Snakefile", project)}
    assert list(rules) == rule_names(2)
    assert {stage_of(r)[0] for r in rules} == set(STAGES)
    for name in rules:
        stage, k = stage_of(name)
        rule = rules[name]
        assert name == rule_name(stage, k)
        log = f"results/logs/{name}.log"
        assert rule.cmd == STAGES[stage].command_at(k).replace("{params.config}", rule.config_file).replace(
            "{log}", log)
        assert sorted(rule.outputs.values()) == sorted(str(layout.results(cfg.at_iteration(k), o.path))
                                                       for o in STAGES[stage].outputs), name


# ---------------------------------------------------------------------------------- imports
def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """module -> the pisft modules it imports, anywhere in it (inside functions too)."""
    files = {module_name(p, src): p for p in sorted(src.rglob("*.py"))}

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets.update(known(f"{base}.{a.name}") for a in node.names)
        graph[name] = {t for t in targets if t and t != name and t.startswith("pisft")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int:
    """The layer of the longest entry that is the module or a package above it."""
    best, depth = -1, -1
    for i, layer in enumerate(LAYERS):
        for entry in layer:
            if (module == entry or module.startswith(entry + ".")) and entry.count(".") > depth:
                best, depth = i, entry.count(".")
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
                  for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m))


def test_the_checks_see_a_cycle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert upward_imports({"pisft.model.policy": {"pisft.train.fsdp"}}) == [
        "pisft.model.policy (layer 1) imports pisft.train.fsdp (layer 3)"]


def test_pisft_modules_import_no_cycle_and_only_down_the_layers():
    graph = import_graph()
    assert "pisft.train.job" in graph["pisft.gates.smoke"]  # the graph sees real imports
    assert all(layer_of(m) >= 0 for m in graph), [m for m in graph if layer_of(m) < 0]
    assert cycles(graph) == []
    assert upward_imports(graph) == []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_launcher_finds_checkpoints_without_the_training_code():
    """`python -m pisft launch` reports the latest checkpoint after a failure: through
    train/checkpoint.py (run folder, fingerprint, verification), not the trainer's modules."""
    graph = import_graph()
    reached = reachable(graph, "pisft.train.launch")
    assert "pisft.train.checkpoint" in reached
    training = {"pisft.train.job", "pisft.train.run", "pisft.train.loop", "pisft.train.fsdp",
                "pisft.gates.smoke"}
    assert not reached & training and not any(m.startswith("pisft.model") for m in reached), reached


def test_every_gate_is_a_one_process_training_stage_that_writes_one_report():
    """What the launcher reads from the rows: a gated stage's gate runs as one process and writes
    the report it checks; only stages that checkpoint resume."""
    gated = {n: s.gate for n, s in STAGES.items() if s.gate}
    assert gated == {"train_8card": "smoke_1card", "train_value": "smoke_value"}
    for gate in gated.values():
        row = STAGES[gate]
        assert row.training and row.one_process and row.outputs[0].path.endswith("report.json"), gate
    assert {n for n, s in STAGES.items() if s.one_process} == set(gated.values())
    assert {n for n, s in STAGES.items() if s.resumable} == set(gated)


THROWAWAY_ROW = '''
THROWAWAY = _row(Stage(
    "throwaway", "pisft.evaluate.throwaway:run", ("eval.seed",),
    (file("throwaway/summary.json", "metrics", metric=True),), "a throwaway stage (tests)",
    reads=(Read("evaluate", "metrics"),)))
'''
THROWAWAY_FUNCTION = '''"""A throwaway stage (tests): how many figures the evaluation wrote."""
import json

from pisft import layout
from pisft.stages import STAGES


def run(cfg):
    figures = json.loads(layout.iteration(cfg).eval_metrics.read_text())
    out = layout.output(cfg, STAGES["throwaway"], "metrics")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"figures": len(figures)}))
'''


@pytest.mark.integration
def test_a_new_stage_is_one_row_and_one_function(tmp_path):
    """docs/development.md, "Adding a stage", followed on a copy of the project: a row in the table
    and a function, nothing else; the CLI runs it, and Snakemake and DVC both plan it after the
    evaluation it reads, with its key, its metric and its command."""
    import os
    import subprocess
    import sys

    import yaml

    from pisft.workflow.scratch import copy_project

    project = copy_project(ROOT, tmp_path / "project", git=True)
    table = project / "src" / "pisft" / "stages.py"
    text = table.read_text()
    assert text.count("\nTRAINING_STAGES = ") == 1
    table.write_text(text.replace("\nTRAINING_STAGES = ", THROWAWAY_ROW + "TRAINING_STAGES = "))
    (project / "src" / "pisft" / "evaluate" / "throwaway.py").write_text(THROWAWAY_FUNCTION)

    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PYTHONPATH": str(project / "src"),
           "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])}

    def run(*cmd: str) -> str:
        proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr

    run(sys.executable, "-m", "pisft", "dvc-yaml")
    stage = yaml.safe_load((project / "dvc.yaml").read_text())["stages"]["throwaway"]
    assert stage["cmd"].endswith("python -m pisft throwaway --config config/config.yaml "
                                 "--log ${results_dir}/logs/throwaway.log")
    assert "${results_dir}/eval/metrics.json" in stage["deps"]
    assert "src/pisft/evaluate/throwaway.py" in stage["deps"]
    assert stage["params"] == [{"config/config.yaml": ["eval.seed"]}]
    assert stage["metrics"] == ["${results_dir}/throwaway/summary.json"]

    plan = run(str(bin_dir / "snakemake"), "throwaway", "-n", "--quiet", "rules")
    assert re.search(r"^throwaway\s+1$", plan, re.M) and re.search(r"^evaluate\s+1$", plan, re.M), plan
    assert "throwaway" in run(str(bin_dir / "dvc"), "status")

    # the CLI runs it by its name, on an evaluation it reads
    metrics = project / "results" / "eval" / "metrics.json"
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps({"a": 1, "b": 2}))
    run(sys.executable, "-m", "pisft", "throwaway", "--config", "config/config.yaml")
    assert json.loads((project / "results" / "throwaway" / "summary.json").read_text()) == {"figures": 2}
