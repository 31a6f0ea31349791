"""The front page and the docs hold together (issue 25): every relative link in README.md,
docs/*.md and config/README.md resolves, #anchors included, and every command they show exists: `make` targets in the
Makefile, `python -m pisft <subcommand>` in the CLI's parser, `python -m <module>` importable and
runnable. Fast: nothing is run, the CLI module is imported only for its parser."""
from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, ROOT / "config/README.md"]  # its links point into docs/ too

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
MAKE = re.compile(r"(?:^|[\s;&|(])make\s+([a-z][\w-]*)\b(?!=)")
PYTHON_M = re.compile(r"(?:^|[\s;&|(/])python3?(?:\.\d+)?\s+-m\s+([A-Za-z_][\w.]*)(?:[ \t]+([a-z][\w-]*))?")


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans (a link there is not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def code(text: str) -> list[str]:
    """The lines of fenced code blocks and the code spans of the prose."""
    blocks = FENCE.findall(text)
    return [line for b in blocks for line in b.splitlines()] + CODE_SPAN.findall(FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (markup and link targets dropped), lower
    case, without punctuation, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text()
    found: set[str] = set(HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        found.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if SCHEME.match(target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}: ({target})"
        if not dest.exists():
            broken.append(f"{where}: no {path}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return broken


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {t for line in re.findall(r"^([\w][\w -]*?)\s*:(?!=)", text, re.M) for t in line.split()}


def pisft_subcommands() -> set[str]:
    from pisft import cli

    return {name for action in cli.build_parser()._actions
            if isinstance(action, argparse._SubParsersAction) for name in action.choices}


def runnable(module: str) -> bool:
    """`python -m module` would run: the module exists, and a package has a __main__."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return False
    if spec is None:
        return False
    if spec.submodule_search_locations is not None:
        return importlib.util.find_spec(f"{module}.__main__") is not None
    return True


def missing_commands(page: Path, targets: set[str], subcommands: set[str]) -> list[str]:
    missing = []
    where = page.relative_to(ROOT)
    for line in code(page.read_text()):
        for target in MAKE.findall(line):
            if target not in targets:
                missing.append(f"{where}: make {target} (no such target in the Makefile)")
        for module, word in PYTHON_M.findall(line):
            if not runnable(module):
                missing.append(f"{where}: python -m {module} (not importable or not runnable)")
            elif module == "pisft" and word and word not in subcommands:
                missing.append(f"{where}: python -m pisft {word} (no such subcommand)")
    return missing


# ------------------------------------------------------------------------------- the checkers

def test_the_checkers_see_a_broken_link_an_anchor_and_a_missing_command(tmp_path, monkeypatch):
    assert slug("How the training step is laid out for 8 × 910B") == "how-the-training-step-is-laid-out-for-8--910b"
    assert slug("Why MuJoCo is pinned to 3.3.2") == "why-mujoco-is-pinned-to-332"
    assert slug("Benchmarks (`make bench`)") == "benchmarks-make-bench"
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Top\n\n## Top\n\n[ok](#top-1) [bad](#nowhere) [gone](b.md) "
                                   "[web](https://example.org) `[code](x.md)`\n")
    assert broken_links(tmp_path / "a.md") == ["a.md: (#nowhere): no heading #nowhere in a.md",
                                               "a.md: (b.md): no b.md"]
    (tmp_path / "c.md").write_text("```bash\nmake run  # ok\nmake nope\npython -m pisft nosuch\n"
                                   "python -m pisft.no_such_module\n.venv/bin/python -m pytest -q\n```\n"
                                   "and `python -m pisft validate` `make DEVICE=cpu`\n")
    assert missing_commands(tmp_path / "c.md", {"run"}, {"validate"}) == [
        "c.md: make nope (no such target in the Makefile)",
        "c.md: python -m pisft nosuch (no such subcommand)",
        "c.md: python -m pisft.no_such_module (not importable or not runnable)"]


# ------------------------------------------------------------------------------- the documents

@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_shown_exists(page):
    assert missing_commands(page, make_targets(), pisft_subcommands()) == []


def test_the_readme_is_a_front_page():
    """Short, and pointing at every docs page (issue 25)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in text, f"README.md does not point at docs/{page.name}"
    for needed in ("make run", "make test", "DEVICE", "## The stages", "## Read next"):
        assert needed in text
