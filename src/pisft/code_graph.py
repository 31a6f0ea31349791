"""Which of pisft's source files a module runs: its imports, read from the source (nothing imported).

A stage's code dependencies are the files its entry point reaches through imports
(`code_deps`, from its row in `pisft.stages`), so an edit reruns the stages that run the edited file and no other,
and the list follows the code as it moves. Every `import` counts, inside functions too (a
function's import is code the stage may run); the package `__init__.py` files above a module run
when it is imported, so they count as well. The import graph is read from the files alone,
deterministically (sorted), and kept between processes by the files' content (`stored_graph`).

Imports through `importlib.import_module` are not followed: pisft uses them for the stage
function of a row (named by the row itself), optional vendor packages (torch_npu) and the
benchmarks' registry; none of them names a pisft module a stage would otherwise miss.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
from functools import cache
from pathlib import Path

from pisft import io
from pisft.stages import STAGES

SRC = Path(__file__).resolve().parents[1]  # the folder that holds the pisft package


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _files(src: Path) -> dict[str, Path]:
    return {module_name(p, src): p for p in sorted((src / "pisft").rglob("*.py")) if "__pycache__" not in p.parts}


def _imports(tree: ast.AST, name: str, is_package: bool, top_level: bool) -> set[str]:
    package = name if is_package else name.rpartition(".")[0]
    nodes = tree.body if top_level else ast.walk(tree)  # type: ignore[attr-defined]
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            found.add(base)  # `from pisft.x import y`: pisft.x runs, and y if it is a module
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


@cache
def _tree(src: Path, name: str) -> ast.Module:
    path = _files(src)[name]
    return ast.parse(path.read_text(), str(path))


def _parsed_imports(name: str, src: Path, top_level: bool) -> frozenset[str]:
    """The pisft modules `name` imports (with `top_level`, at module level only), from its source."""
    files = _files(src)

    def known(target: str) -> str | None:
        while target and target not in files:
            target = target.rpartition(".")[0]
        return target or None

    found = {known(t) for t in _imports(_tree(src, name), name, files[name].name == "__init__.py", top_level)}
    return frozenset(t for t in found if t and t != name and t.startswith("pisft"))


# The graph, kept between processes: every Snakemake parse of the workflow (a run, a dry run, a
# Slurm job's, the `--touch` after each DVC stage) and every `dvc.yaml` rendering asks for every
# stage's code dependencies, and parsing all of pisft's files with `ast` costs about 0.8 CPU s each
# time. One JSON file per content of the package (`_digest`: every file's relative path and bytes,
# this module's FORMAT and Python's version), so an edited file is a miss, never a stale answer.
# The folder: `$PISFT_CODE_GRAPH_CACHE` ("off": parse every time), default
# `$XDG_CACHE_HOME/pisft/code-graph`, else `~/.cache/pisft/code-graph`; a file that cannot be read
# is a miss, a folder that cannot be written is skipped.
CACHE_ENV = "PISFT_CODE_GRAPH_CACHE"
FORMAT = 1  # of the kept graph; bump when `_imports` or `_parsed_imports` changes what they find


def _digest(src: Path) -> str:
    return hashlib.sha256(f"{FORMAT} {sys.version} {io.sha256_sources(src / 'pisft')}".encode()).hexdigest()


@cache
def stored_graph(src: Path = SRC) -> dict[str, dict[str, frozenset[str]]]:
    """{"all": module -> imports, "top": module -> module-level imports} of `src`: read from the
    cache when these files were parsed before, else parsed now (every file) and kept."""
    folder = io.user_cache_dir(CACHE_ENV, "code-graph")
    digest = _digest(src)
    path = None if folder is None else folder / f"{digest}.json"
    if path is not None:
        try:
            kept = json.loads(path.read_text())
            if kept.get("digest") == digest and set(kept.get("graph", {})) == {"all", "top"}:
                return {form: {m: frozenset(i) for m, i in g.items()} for form, g in kept["graph"].items()}
        except (OSError, ValueError, AttributeError):
            pass  # a miss
    parsed = {form: {name: _parsed_imports(name, src, form == "top") for name in _files(src)}
              for form in ("all", "top")}
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            io.write_json_atomic(path, {"digest": digest, "graph": {
                form: {m: sorted(i) for m, i in g.items()} for form, g in parsed.items()}})
        except OSError:
            pass  # a read-only or full home: the next process parses again
    return parsed


def imports_of(name: str, src: Path = SRC, top_level: bool = False) -> frozenset[str]:
    """The pisft modules `name` imports (with `top_level`, at module level only)."""
    return stored_graph(src)["top" if top_level else "all"][name]


def graph(src: Path = SRC, top_level: bool = False) -> dict[str, frozenset[str]]:
    """module -> the pisft modules it imports (with `top_level`, at module level only)."""
    return {name: imports_of(name, src, top_level) for name in _files(src)}


def _with_packages(modules: set[str]) -> set[str]:
    """The modules and every package above them (importing pisft.a.b runs pisft/__init__ and pisft/a/__init__)."""
    out = set(modules)
    for m in modules:
        parts = m.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return out


def reach(starts: tuple[str, ...], src: Path = SRC, top_level: bool = False) -> set[str]:
    """The pisft modules `starts` run, themselves included."""
    files = _files(src)
    seen: set[str] = set()
    todo = list(_with_packages(set(starts)))
    while todo:
        m = todo.pop()
        if m in seen or m not in files:
            continue
        seen.add(m)
        todo.extend(t for t in _with_packages(set(imports_of(m, src, top_level))) if t not in seen)
    return seen


def files_of(modules: set[str], src: Path = SRC) -> list[str]:
    """The modules' source files, relative to the project root (src's parent), sorted."""
    files = _files(src)
    root = src.parent
    return sorted(files[m].relative_to(root).as_posix() for m in modules if m in files)


# The code a stage depends on (`code_deps`) is what it runs, read from the imports: its functions'
# modules (its row's `run` and `before_group`) and everything those import, inside functions too;
# what starts it (`python -m pisft`, the DVC wrapper: their module-level imports); for a training stage the
# launcher and the torchrun worker; and the dependency lock. An edit reruns exactly the stages
# whose code reaches the edited file, and the list follows the code when it moves. (Here, not in
# pisft.stages: every module may read the stage table, and no stage runs this module.)
RUNNERS = ("pisft.__main__", "pisft.cli", "pisft.workflow.drivers")  # module level: they dispatch
TRAINING_RUNNERS = ("pisft.train.launch", "pisft.train.__main__")  # what they run, whole
LOCKS = {"npu": "workflow/envs/ascend-aarch64.lock.txt"}
DEFAULT_LOCK = "workflow/envs/cpu-cuda.lock.txt"


def lock_of(device: str) -> str:
    """The dependency lock a run on `device` installs from (a code dependency of every stage)."""
    return LOCKS.get(device, DEFAULT_LOCK)


def code_modules(stage: str) -> set[str]:
    """The pisft modules `stage` runs (see RUNNERS above)."""
    row = STAGES[stage]
    named = tuple(name.partition(":")[0] for name in (row.run, row.before_group) if name)  # its row's functions
    modules = reach(named) | reach(RUNNERS, top_level=True)
    if row.training:
        modules |= reach(TRAINING_RUNNERS)
    return modules


def code_deps(stage: str, device: str) -> list[str]:
    """The source files `stage` runs (sorted, relative to the project root) and the dependency lock."""
    return [*files_of(code_modules(stage)), lock_of(device)]
