"""A scratch copy of the project's workflow files, for benchmarks and tests.

The library comes from the installed package; the copy holds what Snakemake and DVC read.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

PROJECT_FILES = ("workflow", "config", "profiles", "dvc.yaml", ".dvc/config", ".dvcignore",
                 "src/pisft")  # the source: stages depend on it (workflow/rules, dvc.yaml deps)


def copy_project(src: Path, dest: Path, *, git: bool = False) -> Path:
    """Copy the workflow files from `src` to `dest`; with `git`, make it a one-commit repository."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in PROJECT_FILES:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (src / name).is_dir():
            shutil.copytree(src / name, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(src / name, target)
    (dest / ".gitignore").write_text("/results/\n/.snakemake/\n")
    if git:
        who = ["-c", "user.email=scratch@pisft.invalid", "-c", "user.name=pisft"]
        for cmd in (["git", "init", "-q"], ["git", *who, "add", "-A"],
                    ["git", *who, "commit", "-qm", "scratch copy"]):
            subprocess.run(cmd, cwd=dest, check=True, capture_output=True)
    return dest
