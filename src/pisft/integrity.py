"""Verify what a stage reads against the MANIFEST.json it was written with.

Every directory a stage writes for another to read carries a sha256 `MANIFEST.json`
(`pisft.io.write_manifest`): the exported policy (`train/model`), the value model
(`recap/iter_K/value/model`), the base model copy (`base_model`), the converted datasets
(`dataset`, `recap/iter_K/dataset`), the collected rollouts (`recap/iter_K/rollouts`), the
advantage labels (`recap/iter_K/advantages`) and the demo data (`demo_recap`). `verify_read` is
the one check every reader calls before it uses one (`load_policy`, `value_model.load`, the
dataset readers, the pool's conversion, the labels' reader, `serve`): a file that is missing,
unlisted, of another size or of another sha256 stops the reader with one line naming the file,
the stage that wrote it (recorded in the manifest as `written_by`) and the command that
rebuilds it. Same-size damage (zeros written over the middle of a file by a partial copy or a
bad sector) changes the sha256, so it is caught.

Why a verdict cache. pi0.5's weights are 7-13 GB: one sha256 pass costs seconds from the page
cache and a minute or more from a network file system, and every reader would pay it (each of
the 8 training processes, each evaluation, each `serve`). So a file's verdict is remembered
against its identity: (device, inode, size, mtime_ns, ctime_ns). Any write to a file changes
its mtime and ctime, and the kernel sets ctime to the current time on every change (a user can
put mtime back with `touch -d`, never ctime), so a file whose identity is unchanged holds the
bytes it held when it was hashed; a changed identity is hashed again. What the cache cannot see
is damage that bypasses the file system (a failing disk returning other bytes for the same
unchanged inode): set `PISFT_VERIFY_CACHE=off` to hash every file on every read.

The cache is one small JSON file per verified directory, in `$PISFT_VERIFY_CACHE` (default
`$XDG_CACHE_HOME/pisft/verified`, else `~/.cache/pisft/verified`), never beside the files: a
file added to an output directory would change DVC's hash of that output and make the
directory differ from its own manifest. It is keyed by host and path, and an entry only counts
for the same manifest bytes; a cache that cannot be written is skipped (every read hashes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pisft import io, layout
from pisft.config import write_resolved
from pisft.errors import PisftError
# STAGE_ENV, COMMAND_ENV: the names the manifests' writer is read from (`pisft.io.current_writer`)
from pisft.io import (COMMAND_ENV, MANIFEST_FILE, STAGE_ENV, atomic_dir, compare_files, listed_files,
                      manifest_problem, write_manifest)

CACHE_ENV = "PISFT_VERIFY_CACHE"  # a folder, or "off"


class IntegrityError(PisftError):
    """A directory a stage reads differs from the MANIFEST.json it was written with."""


@contextlib.contextmanager
def stage_output(final: str | Path, cfg: Any = None) -> Iterator[Path]:
    """A stage's output folder, written whole or not at all: the caller fills a temporary sibling
    (`pisft.io.atomic_dir`); on success the run's resolved config goes in beside what it wrote
    (`pisft_config.json`, when `cfg` is given), then `MANIFEST.json`, which lists both and names the
    rule and command writing it (`written_by`) and which every reader checks (`verify_read`), then
    the folder replaces `final` in one rename. On an error nothing of it is left."""
    with atomic_dir(final) as tmp:
        yield tmp
        if cfg is not None:
            write_resolved(cfg, tmp / "pisft_config.json")
        write_manifest(tmp)


def manifest_files(root: str | Path) -> dict[str, dict]:
    """The files `root`'s MANIFEST.json lists: name -> {"sha256", "size"}."""
    return json.loads(Path(root, MANIFEST_FILE).read_text())["files"]


@contextlib.contextmanager
def writing_as(rule: str, command: str) -> Iterator[None]:
    """Within: this process's environment (so torchrun's workers inherit it) names the rule and
    command running, and the manifests they write record them. Restored on exit."""
    before = {key: os.environ.get(key) for key in (STAGE_ENV, COMMAND_ENV)}
    os.environ[STAGE_ENV] = rule
    os.environ[COMMAND_ENV] = command
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def cache_dir() -> Path | None:
    return io.user_cache_dir(CACHE_ENV, "verified")


def _cache_file(root: Path) -> Path | None:
    folder = cache_dir()
    if folder is None:
        return None
    key = hashlib.sha256(f"{socket.gethostname()}:{root}".encode()).hexdigest()[:40]
    return folder / f"{key}.json"


def _read_cache(path: Path | None, manifest_sha: str) -> dict[str, list[int]]:
    if path is None:
        return {}
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(entry, dict) or entry.get("manifest_sha256") != manifest_sha:
        return {}
    files = entry.get("files")
    return files if isinstance(files, dict) else {}


def _write_cache(path: Path | None, root: Path, manifest_sha: str, files: dict[str, list[int]]) -> None:
    if path is None:
        return
    from pisft.io import write_json_atomic

    try:
        write_json_atomic(path, {"root": str(root), "manifest_sha256": manifest_sha, "files": files})
    except OSError:
        pass  # a read-only or full home: the next read hashes again


def writer_of(root: Path) -> tuple[str, str] | None:
    """(rule, command) of the stage whose output `root` is, from where it lies under results_dir
    (`recap/iter_K/value/model` -> train_value_K; the stage table's outputs, `pisft.layout.writer_of`):
    for a manifest that is missing or does not say."""
    found = layout.writer_of(root)
    if found is None:
        return None
    stage, k = found
    return stage.rule(k), stage.invocation(k)


def _writer_text(manifest: dict[str, Any], root: Path, stage: str | None) -> tuple[str, str]:
    """(who wrote root, how to rebuild it)."""
    written = manifest.get("written_by") if isinstance(manifest.get("written_by"), dict) else None
    inferred = writer_of(root) if not written else None
    rule = (written or {}).get("stage") or (inferred[0] if inferred else stage)
    command = (written or {}).get("command") or (inferred[1] if inferred else None)
    if not rule:
        return (f"the stage that wrote {root}",
                "rerun that stage (snakemake --cores all --forcerun <its rule>)")
    how = f"snakemake --cores all --forcerun {rule} (or dvc repro --force {rule}"
    how += f", or {command} --config FILE)" if command else ")"
    return rule, how


def verify_read(root: str | Path, *, what: str, required: bool | None = None, stage: str | None = None) -> None:
    """Stop (IntegrityError) unless every file of `root` is the one its MANIFEST.json lists.

    `what`: the reader, named in the message ("loading the value model DIR"). `required` True: a
    missing MANIFEST.json is an error; False: nothing is checked then (a directory from
    elsewhere, e.g. the user's own data); None (the default): required when the directory holds
    `pisft_config.json`, which every stage writes into its outputs (so a directory pisft wrote
    never goes unchecked for want of its manifest). `stage`: the rule that writes `root`, for a
    manifest that does not record it.
    """
    root = Path(root).absolute()
    manifest_path = root / MANIFEST_FILE
    if not manifest_path.is_file():
        if required is None:
            required = (root / "pisft_config.json").is_file()
        if not root.is_dir() or not required:
            return
        rule, how = _writer_text({}, root, stage)
        raise IntegrityError(f"{what}: {manifest_path} is missing, so {root} cannot be checked before it is used; "
                             f"it is written by {rule}: rebuild it: {how}")
    raw = manifest_path.read_bytes()
    try:
        manifest = json.loads(raw)
        expected: dict[str, dict] = manifest["files"]
        assert isinstance(expected, dict)
    except (ValueError, KeyError, TypeError, AssertionError):
        rule, how = _writer_text({}, root, stage)
        raise IntegrityError(f"{what}: {manifest_path} is unreadable (not pisft's manifest); "
                             f"it is written by {rule}: rebuild it: {how}") from None
    rule, how = _writer_text(manifest, root, stage)
    manifest_sha = hashlib.sha256(raw).hexdigest()
    cache_path = _cache_file(root)
    cached = _read_cache(cache_path, manifest_sha)
    good: dict[str, list[int]] = {}

    def content(rel: str) -> str:  # the file's sha256, or the recorded one when its verdict is cached
        path = root / rel
        ident = _identity(path.stat())
        if cached.get(rel) == ident:
            good[rel] = ident
            return expected[rel].get("sha256")
        digest = io.sha256_file(path)  # looked up at the call (tests count the hashing)
        if digest == expected[rel].get("sha256"):
            good[rel] = ident
        return digest

    listed = listed_files(root, exclude=(MANIFEST_FILE,))
    problems = [manifest_problem(root, p) for p in compare_files(root, expected, sha256=content, present=listed)]
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:4])})" if len(problems) > 1 else ""
        raise IntegrityError(f"{what}: {problems[0]}{more}; {root} is not what {rule} wrote, so it is not used; "
                             f"rebuild it: {how}")
    if good != cached:
        _write_cache(cache_path, root, manifest_sha, good)
