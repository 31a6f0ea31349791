"""The tree is clean under the project's pinned ruff (configured in pyproject.toml [tool.ruff])."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")


def _pinned() -> str:
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    return next(d.split("==")[1] for d in dev if d.startswith("ruff=="))


def test_the_pinned_ruff_is_installed_from_the_lock():
    assert RUFF.is_file(), f"{RUFF} is missing: run `make setup` (the lock pins ruff)"
    version = subprocess.run([str(RUFF), "--version"], capture_output=True, text=True, check=True).stdout
    assert version.split()[-1] == _pinned(), f"installed {version.strip()}, pyproject.toml pins {_pinned()}"
    lock = (ROOT / "workflow/envs/cpu-cuda.lock.txt").read_text()
    assert re.search(rf"^ruff=={re.escape(_pinned())}$", lock, re.M), "the lock must pin the same ruff"


def test_ruff_finds_nothing():
    check = subprocess.run([str(RUFF), "check", "--no-cache", "--output-format", "concise",
                            "src", "tests", "workflow"], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, f"ruff check src tests workflow:\n{check.stdout}{check.stderr}"


def test_ruff_reports_a_finding(tmp_path):
    """The check can fail: the project's configuration flags an unused import and a blind except."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\ntry:\n    pass\nexcept Exception:\n    pass\n")
    check = subprocess.run([str(RUFF), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                            "--output-format", "concise", str(bad)], capture_output=True, text=True)
    assert check.returncode == 1
    assert "F401" in check.stdout and "BLE001" in check.stdout


# A document cited by path: the project's own top-level ones (README.md, ...) and anything under
# docs/, notes/ or config/. (Ascend's op-plugin repository has a docs/zh/ tree of its own.)
CITED_DOC = re.compile(r"(?<![\w./-])((?:docs|notes|config)/[\w./-]+\.md|[A-Z][A-Z_]*\.md)\b")


def test_every_cited_document_is_in_the_project():
    missing = []
    for folder in ("src", "tests", "workflow", "docs", "config", "scripts"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".md", ".smk", ".yaml", ".sh", ".txt") or "__pycache__" in path.parts:
                continue
            for doc in CITED_DOC.findall(path.read_text(errors="replace")):
                if not doc.startswith("docs/zh/") and not (ROOT / doc).is_file():
                    missing.append(f"{path.relative_to(ROOT)}: {doc}")
    for top in ("README.md", "Makefile", "Snakefile"):
        if (ROOT / top).is_file():
            missing += [f"{top}: {d}" for d in CITED_DOC.findall((ROOT / top).read_text())
                        if not (ROOT / d).is_file()]
    assert not missing, "cited but not in the project:\n" + "\n".join(missing)


MAX_LINES = 700  # issue 58: a module over it holds more than one concern (docs/development.md, Layout)


def test_no_source_file_is_over_700_lines():
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "src").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concern (at most {MAX_LINES} lines each): {long}"
