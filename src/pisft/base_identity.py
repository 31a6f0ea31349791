"""Which model a set of trained tensors applies to: the identity of a model folder.

A model's identity is what it is, not the config that wrote it: the sha256 of its files as its
MANIFEST.json lists them (weights, config.json, tokenizer, pisft_model.json, normalisation
statistics), less the records of how it was made, and where its weights came from (SOURCE.json's
source fields, `model_identity`). The records are left out because they change with keys that
change nothing in the model: `pisft_config.json` holds the whole resolved config of the run that
wrote the folder, and the manifest itself names the command that ran (`written_by`); hashing
them made a `fetch_base` rerun after an unrelated config change another base model, and so a
fresh training run (issue 56).

Two readers use it:
- the run fingerprint (`pisft.train.run_folders.inputs_fingerprint`): a checkpoint resumes only
  a run that starts from the same model;
- `base_record`: a trainable-only checkpoint (`pisft.train.checkpoint`) and a value model saved
  without its frozen backbone (`pisft.recap.value_model`) hold only what trained; the rest is
  read from the model they started from, and the record says which model that was, so that a
  reader refuses another one under the same path (fetch_base rerun with other weights, policy
  k-1 retrained).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pisft.io import MANIFEST_FILE, sha256_file

# A model folder's records of how it was made, not part of what it is (see the module docstring).
RECORD_FILES = frozenset({"pisft_config.json", "SOURCE.json"})
# SOURCE.json's fields that say where the weights came from (`pisft.model.fetch`: the source as
# model.source names it, its kind, a hub repository and the revision it resolved to, the seed a
# built model was drawn from). Paths on this host (`directory`, `files.*.from`) and notes are
# left out: the same bytes read from a moved folder are the same model.
SOURCE_FIELDS = ("source", "kind", "repo_id", "revision", "init_seed")
# Without a manifest, these files are hashed here (a folder pisft did not write).
UNLISTED_FILES = ("config.json", "model.safetensors")
# The keys of a `base_record` a stored record is compared on, best first (older records hold
# only one of the last two).
IDENTITY_KEYS = ("identity_sha256", "manifest_sha256", "files_sha256")


def model_identity(model_dir: str | Path) -> dict[str, Any] | None:
    """What the model in `model_dir` is: {"files": {relpath: sha256}, "source": {...}}. The files
    are MANIFEST.json's, the records (`RECORD_FILES`) left out, their sha256 as the manifest holds
    them (every reader checks the folder against it, `pisft.integrity.verify_read`); without a
    manifest, `UNLISTED_FILES` hashed here. "source": SOURCE.json's `SOURCE_FIELDS`, when it has
    one (fetch_base's output). None: no model there."""
    model_dir = Path(model_dir)
    manifest = model_dir / MANIFEST_FILE
    if manifest.is_file():
        listed = json.loads(manifest.read_text()).get("files", {})
        files = {rel: entry.get("sha256") if isinstance(entry, dict) else entry
                 for rel, entry in listed.items() if rel not in RECORD_FILES}
    else:
        files = {name: sha256_file(model_dir / name) for name in UNLISTED_FILES if (model_dir / name).is_file()}
    source_file = model_dir / "SOURCE.json"
    source = json.loads(source_file.read_text()) if source_file.is_file() else {}
    identity: dict[str, Any] = {"files": files}
    if source:
        identity["source"] = {key: source.get(key) for key in SOURCE_FIELDS}
    return identity if files or source else None


def identity_sha256(model_dir: str | Path) -> str | None:
    """The sha256 of `model_identity` (None: no model there)."""
    identity = model_identity(model_dir)
    if identity is None:
        return None
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def base_record(base_dir: Path) -> dict[str, Any]:
    """The model's directory and its identity's sha256, with the sha256 a record written before
    the identity held (of its MANIFEST.json, or of its config.json and model.safetensors when it
    has no manifest), so that a checkpoint or value model saved then is still compared."""
    base_dir = Path(base_dir)
    record: dict[str, Any] = {"dir": str(base_dir), "identity_sha256": identity_sha256(base_dir)}
    manifest = base_dir / MANIFEST_FILE
    if manifest.is_file():
        record["manifest_sha256"] = sha256_file(manifest)
    else:
        files = [base_dir / n for n in UNLISTED_FILES if (base_dir / n).is_file()]
        record["files_sha256"] = {f.name: sha256_file(f) for f in files}
    return record


def same_base(stored: dict[str, Any], current: dict[str, Any]) -> bool:
    """The same model (wherever its directory is now): compared on the identity when both records
    hold it, else on the older sha256 both hold; no common key: not the same."""
    for key in IDENTITY_KEYS:
        if key in stored and key in current:
            return stored[key] == current[key]
    return False


def base_id(record: dict[str, Any]) -> str:
    """A record in a few words, for messages."""
    if record.get("identity_sha256"):
        return f"model sha256 {record['identity_sha256'][:16]}… (its files and source)"
    if "manifest_sha256" in record:
        return f"MANIFEST.json sha256 {record['manifest_sha256'][:16]}…"
    return "sha256 " + ", ".join(f"{k} {v[:16]}…" for k, v in sorted(record.get("files_sha256", {}).items()))
