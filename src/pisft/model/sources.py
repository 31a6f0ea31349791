"""Where base weights and tokenizers come from: `tiny`, a local directory, or the Hugging Face hub.

`model.source`:
  tiny                        built locally (random init from model.init_seed, own tokenizer)
  /path/to/dir                a local directory: LeRobot layout (config.json with "type": "pi05"
                              + model.safetensors, as `lerobot/pi05_base`) or an openpi checkpoint
                              converted to PyTorch (config.json with `paligemma_variant` and
                              `action_horizon`, model.safetensors, optional assets/*/norm_stats.json)
  hf://<repo_id>[@revision]   downloaded with huggingface_hub into its cache (HF_ENDPOINT,
                              HF_TOKEN, HF_HUB_OFFLINE honoured), then read as a local directory
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from pisft.errors import ModelLoadError

HF_PREFIX = "hf://"
# Files fetched from a hub model repository (weights, configs, tokenizer, openpi assets).
HF_MODEL_PATTERNS = ["*.json", "*.safetensors", "*.model", "tokenizer*", "assets/**"]
HF_TOKENIZER_PATTERNS = ["*.json", "*.model", "*.txt", "tokenizer*"]

LEROBOT = "lerobot"
OPENPI = "openpi"


@dataclasses.dataclass(frozen=True)
class Source:
    kind: str  # "tiny" | "local" | "hf"
    text: str  # as written in the config
    path: Path | None = None
    repo_id: str | None = None
    revision: str | None = None


def parse_source(text: str) -> Source:
    text = text.strip()
    if text == "tiny":
        return Source(kind="tiny", text=text)
    if text.startswith(HF_PREFIX):
        spec = text[len(HF_PREFIX):]
        repo_id, _, revision = spec.partition("@")
        if repo_id.count("/") != 1 or not all(repo_id.split("/")):
            raise ModelLoadError(f"model.source '{text}': expected hf://<owner>/<name>[@revision], "
                                 f"e.g. hf://lerobot/pi05_base")
        return Source(kind="hf", text=text, repo_id=repo_id, revision=revision or None)
    if not text:
        raise ModelLoadError("model.source is empty; use 'tiny', a local directory or hf://<repo_id>")
    return Source(kind="local", text=text, path=Path(text).expanduser())


def _hub_error(what: str, exc: Exception) -> ModelLoadError:
    from huggingface_hub import errors as hf_errors

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")
    name = type(exc).__name__
    if isinstance(exc, hf_errors.GatedRepoError):
        why = "the repository is gated: accept its terms on the hub and set HF_TOKEN"
    elif isinstance(exc, hf_errors.RepositoryNotFoundError):
        why = "repository not found (or private: set HF_TOKEN)"
    elif isinstance(exc, hf_errors.RevisionNotFoundError):
        why = "revision not found"
    elif offline or isinstance(exc, (hf_errors.OfflineModeIsEnabled, hf_errors.LocalEntryNotFoundError)):
        why = (f"not in the local Hugging Face cache and the hub cannot be used "
               f"({'HF_HUB_OFFLINE is set' if offline else f'{endpoint} is unreachable'})")
    else:
        why = f"the hub at {endpoint} could not be reached or refused ({name}: {exc})"
    return ModelLoadError(
        f"{what}: {why}. Either make the hub reachable (HF_ENDPOINT={endpoint}; a mirror works), "
        f"or download the files elsewhere and set model.source (or model.tokenizer) to that local "
        f"directory."
    )


def hf_snapshot(repo_id: str, revision: str | None, patterns: list[str], what: str) -> Path:
    """Download (or reuse from the cache) a hub snapshot; its local directory."""
    import huggingface_hub

    try:
        path = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=patterns,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
            token=os.environ.get("HF_TOKEN") or None,
            local_files_only=os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False"),
        )
    except Exception as exc:  # noqa: BLE001 - network, auth, cache: every failure becomes one clear message
        raise _hub_error(what, exc) from None
    return Path(path)


def materialise(source: Source) -> Path:
    """The local directory holding a non-tiny source (downloading it if on the hub)."""
    if source.kind == "local":
        assert source.path is not None
        if not source.path.is_dir():
            raise ModelLoadError(f"model.source '{source.text}': directory not found")
        return source.path
    if source.kind == "hf":
        assert source.repo_id is not None
        return hf_snapshot(source.repo_id, source.revision, HF_MODEL_PATTERNS, f"model.source '{source.text}'")
    raise ValueError(f"source kind {source.kind!r} has no directory")


def detect_layout(directory: Path, what: str) -> str:
    """LEROBOT or OPENPI, from config.json; a clear error for anything else."""
    config_path = directory / "config.json"
    weights = directory / "model.safetensors"
    present = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if not config_path.is_file() or not weights.is_file():
        missing = [p.name for p in (config_path, weights) if not p.is_file()]
        hint = ""
        if any(name.endswith((".bin", ".pt", ".pth", ".ckpt")) for name in present):
            hint = " Pickled weights (.bin/.pt) are never loaded: convert them to safetensors."
        elif (directory / "params").is_dir():
            hint = (" This looks like an openpi JAX checkpoint: convert it with openpi's "
                    "examples/convert_jax_model_to_pytorch.py first.")
        raise ModelLoadError(f"{what}: {directory} lacks {', '.join(missing)} "
                             f"(found: {', '.join(present) or 'nothing'}).{hint}")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path}: expected a JSON object")
    if "type" in raw:
        return LEROBOT
    if "paligemma_variant" in raw and "action_horizon" in raw:
        return OPENPI
    raise ModelLoadError(f"{config_path}: neither a LeRobot policy config (no \"type\") nor an openpi "
                         f"converted config (no \"paligemma_variant\"/\"action_horizon\")")



# Files of a local source whose change must rerun fetch_base. Kept in this light module (no
# torch, no LeRobot) because the Snakefile calls it at parse time.
LOCAL_SOURCE_FILES = ("config.json", "model.safetensors", "pisft_model.json",
                      "normalization_stats.safetensors")


def local_input_files(source_text: str, tokenizer_text: str = "") -> list[str]:
    source = parse_source(source_text)
    found: list[str] = []
    if source.kind == "local" and source.path is not None:
        found.extend(str(source.path / n) for n in LOCAL_SOURCE_FILES if (source.path / n).is_file())
    if tokenizer_text and not tokenizer_text.startswith(HF_PREFIX) and Path(tokenizer_text).is_dir():
        found.extend(str(p) for p in sorted(Path(tokenizer_text).iterdir()) if p.is_file())
    return found
