"""Where base weights and tokenizers come from: `tiny`, a local directory, or the Hugging Face hub.

`model.source`:
  tiny                        built locally (random init from model.init_seed, own tokenizer)
  random                      built locally at model.preset's size (any preset, pi05 too): every
                              matrix drawn from normal(0, 0.02) with model.init_seed, vectors 0,
                              pisft's small tokenizer (its ids fit any embedding); for running the
                              real-size pipeline where real weights cannot be fetched
  /path/to/dir                a local directory: LeRobot layout (config.json with "type": "pi05"
                              + model.safetensors, as `lerobot/pi05_base`), an openpi checkpoint
                              converted to PyTorch (config.json with `paligemma_variant` and
                              `action_horizon`, model.safetensors, optional
                              assets/<asset_id>/norm_stats.json; openpi
                              examples/convert_jax_model_to_pytorch.py), or an RLinf FSDP
                              checkpoint (actor/model_state_dict/full_weights.pt or
                              model_state_dict/full_weights.pt, optional <asset_id>/norm_stats.json;
                              RLinf rlinf/models/embodiment/openpi/__init__.py)
  hf://<repo_id>[@revision]   downloaded with huggingface_hub into its cache (HF_ENDPOINT,
                              HF_TOKEN, HF_HUB_OFFLINE honoured), then read as a local directory

Weights in safetensors may be one `model.safetensors` or shards with `model.safetensors.index.json`
(what `save_pretrained` writes above its shard size).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from pisft.errors import ModelLoadError

HF_PREFIX = "hf://"
# Files fetched from a hub model repository (weights, configs, tokenizer, openpi assets).
HF_MODEL_PATTERNS = ["*.json", "*.safetensors", "*.model", "tokenizer*", "assets/**",
                     "actor/model_state_dict/full_weights.pt", "model_state_dict/full_weights.pt"]
HF_TOKENIZER_PATTERNS = ["*.json", "*.model", "*.txt", "tokenizer*"]

LEROBOT = "lerobot"
OPENPI = "openpi"
RLINF = "rlinf"
BARE = "safetensors without config.json"

WEIGHTS_FILE = "model.safetensors"  # a LeRobot model folder's weights (pisft.model.policy, recap.value_model)
# The index `save_pretrained` / huggingface_hub write beside sharded safetensors.
INDEX_FILE = "model.safetensors.index.json"
# RLinf's FSDP checkpoints: `<model_path>/actor/model_state_dict/full_weights.pt` (a runner's
# checkpoint, global_step_N/) or `<model_path>/model_state_dict/full_weights.pt` (its actor/);
# RLinf rlinf/models/embodiment/openpi/__init__.py, get_model.
RLINF_WEIGHTS = ("actor/model_state_dict/full_weights.pt", "model_state_dict/full_weights.pt")


@dataclasses.dataclass(frozen=True)
class Source:
    kind: str  # "tiny" | "random" | "local" | "hf"
    text: str  # as written in the config
    path: Path | None = None
    repo_id: str | None = None
    revision: str | None = None


NAMED = ("tiny", "random")  # sources that are names, not paths (pisft makes the model itself)


def parse_source(text: str) -> Source:
    text = text.strip()
    if text in NAMED:
        return Source(kind=text, text=text)
    if text.startswith(HF_PREFIX):
        spec = text[len(HF_PREFIX):]
        repo_id, _, revision = spec.partition("@")
        if repo_id.count("/") != 1 or not all(repo_id.split("/")):
            raise ModelLoadError(f"model.source '{text}': expected hf://<owner>/<name>[@revision], "
                                 f"e.g. hf://lerobot/pi05_base")
        problem = repo_id_problem(repo_id)
        if problem:
            raise ModelLoadError(f"'{text}': '{repo_id}' is not a valid Hugging Face repository id ({problem}); "
                                 "an id is <owner>/<name> of letters, digits, '-', '_' and '.', not starting or "
                                 "ending with '-' or '.', without '--' or '..', at most 96 characters, e.g. "
                                 "hf://lerobot/pi05_base. Correct model.source (or model.tokenizer)")
        if spec.endswith("@"):
            raise ModelLoadError(f"'{text}': an empty revision after '@'; give a branch, tag or commit "
                                 f"(hf://{repo_id}@main) or leave out the '@'")
        return Source(kind="hf", text=text, repo_id=repo_id, revision=revision or None)
    if not text:
        raise ModelLoadError("model.source is empty; use 'tiny', 'random', a local directory or hf://<repo_id>")
    return Source(kind="local", text=text, path=Path(text).expanduser())


def repo_id_problem(repo_id: str) -> str | None:
    """Why the hub would refuse `repo_id` as an id (huggingface_hub's own check), else None: said
    as such, not later as a cache miss or an unreachable hub."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        return str(exc).rstrip(".")
    return None


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


def _cached_snapshots(repo_id: str) -> list[Path]:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots"
    return sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def _is_commit(revision: str | None) -> bool:
    return bool(revision) and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)


def _snapshot_without_ref(repo_id: str, revision: str | None, what: str) -> tuple[Path, str] | None:
    """A cached snapshot to use when huggingface_hub found none: `hf download --revision <sha>`
    fills snapshots/<sha>/ without writing refs/main, so a source without @revision misses it."""
    snapshots = _cached_snapshots(repo_id)
    if not snapshots:
        return None
    shas = [p.name for p in snapshots]
    if _is_commit(revision) and revision in shas:
        return snapshots[shas.index(revision)], f"the hub was not reached; using the cached snapshot {revision}"
    if revision is None and len(snapshots) == 1:
        return snapshots[0], (f"the Hugging Face cache holds snapshot {shas[0]} of {repo_id} but no refs/main "
                              f"(what `hf download --revision` leaves); using it. Pass "
                              f"hf://{repo_id}@{shas[0]} to name it")
    if _is_commit(revision):
        raise ModelLoadError(
            f"{what}: the Hugging Face cache holds snapshot(s) {', '.join(shas)} of {repo_id}, not {revision}, "
            f"and the hub could not be reached. Pass hf://{repo_id}@<sha> with one of them, or make the hub "
            f"reachable.")
    raise ModelLoadError(
        f"{what}: the Hugging Face cache holds {len(shas)} snapshot(s) of {repo_id} ({', '.join(shas)}) but no "
        f"ref for '{revision or 'main'}', and the hub could not be asked which one that is. Pass "
        f"hf://{repo_id}@<sha> with one of them.")


def hf_snapshot(repo_id: str, revision: str | None, patterns: list[str], what: str) -> tuple[Path, str | None]:
    """Download (or reuse from the cache) a hub snapshot: (its local directory, a note or None)."""
    import huggingface_hub
    from huggingface_hub import errors as hf_errors

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
        refused = (hf_errors.GatedRepoError, hf_errors.RepositoryNotFoundError, hf_errors.RevisionNotFoundError)
        found = None if isinstance(exc, refused) else _snapshot_without_ref(repo_id, revision, what)
        if found is None:
            raise _hub_error(what, exc) from None
        return found
    return Path(path), None


def materialise(source: Source) -> tuple[Path, str | None]:
    """(the local directory holding a non-tiny source, a note or None), downloading it if on the hub."""
    if source.kind == "local":
        assert source.path is not None
        if not source.path.is_dir():
            hint = (" (model.source is the checkpoint's directory; for RLinf, the one holding "
                    "actor/model_state_dict/full_weights.pt)" if source.path.is_file() else "")
            raise ModelLoadError(f"model.source '{source.text}': directory not found{hint}")
        return source.path, None
    if source.kind == "hf":
        assert source.repo_id is not None
        return hf_snapshot(source.repo_id, source.revision, HF_MODEL_PATTERNS, f"model.source '{source.text}'")
    raise ValueError(f"source kind {source.kind!r} has no directory")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What a source directory holds: its layout, where its weights are and in which form."""

    layout: str  # LEROBOT | OPENPI | RLINF | BARE
    weights: Path  # model.safetensors, model.safetensors.index.json or full_weights.pt
    weights_form: str  # "safetensors" | "sharded safetensors" | "torch state dict"
    config: Path | None  # config.json; None only for an RLinf checkpoint without one
    config_form: str | None  # LEROBOT | OPENPI | None (how config.json is written)


def _config_form(config_path: Path) -> str:
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


def detect_checkpoint(directory: Path, what: str) -> Checkpoint:
    """The checkpoint a directory holds; a clear error for anything else."""
    config_path = directory / "config.json"
    present = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    forms = [(directory / WEIGHTS_FILE, "safetensors"), (directory / INDEX_FILE, "sharded safetensors")]
    forms += [(directory / rel, "torch state dict") for rel in RLINF_WEIGHTS]
    found = [(path, form) for path, form in forms if path.is_file()]
    if len(found) > 1:
        raise ModelLoadError(
            f"{what}: {directory} holds weights in more than one form ("
            + ", ".join(str(p.relative_to(directory)) for p, _ in found)
            + "); which one is the checkpoint is ambiguous: move the others out of the directory")
    if not found:
        hint = ""
        if (directory / "full_weights.pt").is_file():
            hint = (" This looks like RLinf's model_state_dict/ folder: point model.source at the directory "
                    "above it (RLinf's model_path).")
        elif any(name.endswith((".bin", ".pt", ".pth", ".ckpt")) for name in present):
            hint = (" Pickled weights (.bin/.pt) are never loaded, except RLinf's "
                    "actor/model_state_dict/full_weights.pt (read with weights_only=True): convert them to "
                    "safetensors.")
        elif (directory / "params").is_dir():
            hint = (" This looks like an openpi JAX checkpoint: convert it with openpi's "
                    "examples/convert_jax_model_to_pytorch.py first.")
        missing = ["model.safetensors (or model.safetensors.index.json with its shards, or RLinf's "
                   "actor/model_state_dict/full_weights.pt)"]
        if not config_path.is_file():
            missing.insert(0, "config.json")
        raise ModelLoadError(f"{what}: {directory} lacks {', '.join(missing)} "
                             f"(found: {', '.join(present) or 'nothing'}).{hint}")
    weights, form = found[0]
    # Without config.json (RLinf's checkpoints; folders RLinf loads by its own config_name), the
    # settings come from model.preset, as fetch_base prints and records.
    config_form = _config_form(config_path) if config_path.is_file() else None
    layout = RLINF if form == "torch state dict" else (config_form or BARE)
    return Checkpoint(layout, weights, form, config_path if config_form else None, config_form)


# Files of a local source whose change must rerun fetch_base. Kept in this light module (no
# torch, no LeRobot) because the Snakefile calls it at parse time.
LOCAL_SOURCE_FILES = ("config.json", "model.safetensors", "pisft_model.json",
                      "normalization_stats.safetensors", INDEX_FILE, *RLINF_WEIGHTS)


def local_input_files(source_text: str, tokenizer_text: str = "") -> list[str]:
    source = parse_source(source_text)
    found: list[str] = []
    if source.kind == "local" and source.path is not None:
        found.extend(str(source.path / n) for n in LOCAL_SOURCE_FILES if (source.path / n).is_file())
        if source.path.is_dir():
            # shards (model-00001-of-00003.safetensors) and norm stats (openpi's assets/<asset_id>/,
            # RLinf's <asset_id>/, asset ids up to two levels deep), which fetch_base reads
            found.extend(str(p) for p in sorted(source.path.glob("*-of-*.safetensors")))
            found.extend(str(p) for pattern in ("*/norm_stats.json", "*/*/norm_stats.json",
                                                "assets/*/norm_stats.json", "assets/*/*/norm_stats.json")
                         for p in sorted(source.path.glob(pattern)) if p.is_file() and str(p) not in found)
    if tokenizer_text and not tokenizer_text.startswith(HF_PREFIX):
        path = Path(tokenizer_text).expanduser()
        if path.is_dir():
            found.extend(str(p) for p in sorted(path.iterdir()) if p.is_file())
        elif path.is_file():
            found.append(str(path))
    return found
