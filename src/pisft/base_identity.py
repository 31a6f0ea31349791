"""Which model a set of trained tensors applies to: the identity of a frozen base.

A trainable-only checkpoint (`pisft.train.checkpoint`) and a value model saved without its frozen
backbone (`pisft.recap.value_model`) hold only what trained; the rest is read from the model they
started from. `base_record` says which model that was, so that a reader refuses another one
under the same path (fetch_base rerun with other weights, policy k-1 retrained).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pisft.io import sha256_file


def base_record(base_dir: Path) -> dict[str, Any]:
    """The model's directory and the sha256 of its MANIFEST.json (which holds the sha256 of every
    file of it: weights, config, tokenizer), or of its config.json and model.safetensors when it
    has no manifest."""
    base_dir = Path(base_dir)
    manifest = base_dir / "MANIFEST.json"
    if manifest.is_file():
        return {"dir": str(base_dir), "manifest_sha256": sha256_file(manifest)}
    files = [base_dir / n for n in ("config.json", "model.safetensors") if (base_dir / n).is_file()]
    return {"dir": str(base_dir), "files_sha256": {f.name: sha256_file(f) for f in files}}


def same_base(stored: dict[str, Any], current: dict[str, Any]) -> bool:
    """The same model's bytes (wherever its directory is now)."""
    return {k: v for k, v in stored.items() if k != "dir"} == {k: v for k, v in current.items() if k != "dir"}


def base_id(record: dict[str, Any]) -> str:
    """A record in a few words, for messages."""
    if "manifest_sha256" in record:
        return f"MANIFEST.json sha256 {record['manifest_sha256'][:16]}…"
    return "sha256 " + ", ".join(f"{k} {v[:16]}…" for k, v in sorted(record.get("files_sha256", {}).items()))
