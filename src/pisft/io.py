"""Atomic outputs and manifests: a failed stage leaves nothing that looks finished."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def follow_umask(path: str | Path) -> None:
    """Give a file written by a library with private modes (0600) the user's usual mode."""
    os.chmod(path, 0o666 & ~_umask())


def _tmp_prefix(final: Path) -> str:
    return f".{final.name}.tmp-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear_stale_tmp(final: str | Path) -> list[Path]:
    """Remove the temporary folders of `final` (`.<name>.tmp-<pid>@<host>-*`) left by a process
    of this host that no longer runs (a kill -9, a power cut); those of running processes and
    of other hosts (a shared filesystem) are kept. Returns what was removed."""
    final = Path(final)
    host = socket.gethostname()
    removed = []
    if not final.parent.is_dir():
        return removed
    for path in final.parent.glob(_tmp_prefix(final) + "*"):
        owner = path.name[len(_tmp_prefix(final)):].rsplit("-", 1)[0]  # mkdtemp's suffix has no '-'
        pid, _, where = owner.partition("@")
        if not pid.isdigit() or where != host or _pid_alive(int(pid)):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `final` in one rename.

    On any exception — KeyboardInterrupt (SIGINT) and `pisft.errors.Terminated` (SIGTERM, when
    the process called `stop_on_termination`, as every stage does) included — the temporary
    directory is removed and `final` is left untouched (an older complete output stays; no
    half-written one appears). The folder is named `.<name>.tmp-<pid>@<host>-*`, so the next
    run removes one whose process died without cleaning up (`clear_stale_tmp`).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    clear_stale_tmp(final)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_tmp_prefix(final)}{os.getpid()}@{socket.gethostname()}-",
                                dir=final.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes 0700; outputs follow the user's umask
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def dir_bytes(root: str | Path) -> int:
    """Bytes of the files under root (links followed); 0 when it does not exist."""
    root = Path(root)
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0


def user_cache_dir(env: str, leaf: str) -> Path | None:
    """A cache folder of pisft's: `$<env>` when set ("off": None, no cache), else
    `$XDG_CACHE_HOME/pisft/<leaf>`, else `~/.cache/pisft/<leaf>`."""
    where = os.environ.get(env)
    if where and where.strip().lower() == "off":
        return None
    if where:
        return Path(where)
    return Path(os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")) / "pisft" / leaf


def sha256_sources(package: Path) -> str:
    """sha256 over the Python files under `package` (each one's path relative to it and its bytes,
    in path order): what a process importing the package runs."""
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


# Snakemake touches this file in every directory() output after the job; it is not content, so
# a model folder made by the workflow still matches its manifest when used as a model source.
WORKFLOW_MARKERS = frozenset({".snakemake_timestamp"})
MANIFEST_FILE = "MANIFEST.json"  # a stage output's files record (`write_manifest`)


def listed_files(root: str | Path, exclude: tuple[str, ...] = (MANIFEST_FILE,)) -> set[str]:
    """The relative paths of the files under root (links followed) that a manifest lists: all
    but `exclude` (relative paths) and Snakemake's directory markers (`WORKFLOW_MARKERS`)."""
    root = Path(root)
    return {rel for path in root.rglob("*")
            if not path.is_dir() and (rel := path.relative_to(root).as_posix()) not in exclude
            and path.name not in WORKFLOW_MARKERS}


def build_manifest(root: str | Path, exclude: tuple[str, ...] = (MANIFEST_FILE,)) -> dict[str, dict]:
    """sha256 and size of every file under root (links followed), keyed by relative path;
    Snakemake's directory markers (`WORKFLOW_MARKERS`) are left out."""
    root = Path(root)
    return {rel: {"sha256": sha256_file(root / rel), "size": (root / rel).stat().st_size}
            for rel in sorted(listed_files(root, exclude))}


@dataclass(frozen=True)
class FileProblem:
    """One way a folder differs from a files record, worded by its reader (`manifest_problem` for a
    MANIFEST.json, `pisft.train.checkpoint` for a checkpoint marker)."""

    rel: str  # the file, relative to the folder
    kind: str  # "unlisted" (present, not recorded), "missing", "size" or "sha256"
    size: int | None = None  # kind "size": the file's size now
    recorded: int | None = None  # kind "size": the size recorded


def compare_files(root: str | Path, recorded: Mapping[str, Mapping[str, Any]], *,
                  sha256: Mapping[str, str] | Callable[[str], str | None] | None = None,
                  present: Iterable[str] | None = None) -> list[FileProblem]:
    """How the files under root differ from `recorded` (relative path -> {"sha256", "size"}: the
    `files` of a MANIFEST.json and of a training checkpoint's COMPLETE.json); empty: they match.

    The one comparison of a folder with its record (`verify_manifest`, `pisft.integrity.verify_read`,
    `pisft.train.checkpoint.verify`). In order: the files of `present` (those found under root,
    `listed_files`; None: not checked) that are not recorded, sorted; then, for each recorded
    file in sorted order, the first of: missing, another size than recorded (a record without
    a size skips that), another sha256. Content is compared only when `sha256` is given, and
    only for the files present with their recorded size: a mapping relative path -> sha256
    (computed by the caller, e.g. by a checkpoint's ranks together) or a callable returning the
    sha256 of one relative path (which may answer from a verdict cache). A recorded file
    without a sha256 differs in content.
    """
    root = Path(root)
    problems = [FileProblem(rel, "unlisted") for rel in sorted(set(present or ()) - recorded.keys())]
    for rel, entry in sorted(recorded.items()):
        try:
            size = (root / rel).stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            problems.append(FileProblem(rel, "missing"))
            continue
        if entry.get("size", size) != size:
            problems.append(FileProblem(rel, "size", size=size, recorded=entry["size"]))
            continue
        if sha256 is None:
            continue
        actual = sha256.get(rel) if isinstance(sha256, Mapping) else sha256(rel)
        if actual is None or actual != entry.get("sha256"):
            problems.append(FileProblem(rel, "sha256"))
    return problems


def manifest_problem(root: str | Path, problem: FileProblem) -> str:
    """One way `root` differs from its MANIFEST.json, in words (`verify_manifest`,
    `pisft.integrity.verify_read`)."""
    return f"{Path(root) / problem.rel}: " + {
        "unlisted": f"present but not listed in {MANIFEST_FILE}",
        "missing": f"listed in {MANIFEST_FILE} but missing",
        "size": f"{problem.size} bytes, {MANIFEST_FILE} lists {problem.recorded}",
        "sha256": f"sha256 differs from {MANIFEST_FILE} (same size: damaged or changed in place)",
    }[problem.kind]


# The rule whose command runs in this process and the command (set by `python -m pisft` through
# `pisft.integrity.writing_as`, inherited by torchrun's workers): recorded in every manifest.
STAGE_ENV = "PISFT_STAGE"
COMMAND_ENV = "PISFT_STAGE_COMMAND"


def current_writer() -> dict[str, str] | None:
    """The rule and command running in this process (`written_by` of what it writes), or None
    outside a stage."""
    rule = os.environ.get(STAGE_ENV)
    if not rule:
        return None
    return {"stage": rule, "command": os.environ.get(COMMAND_ENV, "")}


def write_manifest(root: str | Path) -> dict[str, dict]:
    """Write root/MANIFEST.json: every file's sha256 and size, and the rule and command writing it
    (`written_by`, when a stage runs: `pisft.integrity`, which checks it where it is read)."""
    files = build_manifest(root)
    manifest: dict[str, Any] = {"files": files}
    if writer := current_writer():
        manifest["written_by"] = writer
    write_json_atomic(Path(root, MANIFEST_FILE), manifest)
    return files


def verify_manifest(root: str | Path) -> list[str]:
    """Problems found comparing root with its MANIFEST.json (empty list: all good): the files
    that differ (`compare_files`), then those not listed."""
    root = Path(root)
    manifest_path = root / MANIFEST_FILE
    if not manifest_path.is_file():
        return [f"{manifest_path}: missing"]
    expected = json.loads(manifest_path.read_text())["files"]
    found = compare_files(root, expected, sha256=lambda rel: sha256_file(root / rel), present=listed_files(root))
    return [manifest_problem(root, p) for p in sorted(found, key=lambda p: p.kind == "unlisted")]
