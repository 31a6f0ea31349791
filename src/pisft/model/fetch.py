"""The `fetch_base` stage: base weights + tokenizer into `results/base_model/`, strictly checked.

Output (LeRobot layout, written atomically): config.json, model.safetensors, tokenizer/,
pisft_model.json, optional normalization_stats.safetensors, SOURCE.json (where everything came
from and how it was checked), pisft_config.json, MANIFEST.json (sha256 + size of every file).

A large weights file is linked (hard link, else symbolic link), never copied a second time.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from pisft.config import PisftConfig, write_resolved
from pisft.errors import ModelLoadError
from pisft.io import atomic_dir, verify_manifest, write_json_atomic, write_manifest
from pisft.model import policy as policy_mod
from pisft.model import sources, weights
from pisft.model.lerobot_internals import vlm_embedding_pair
from pisft.model.norm_stats import STATS_FILE, import_openpi_norm_stats, save_stats
from pisft.model.tokenizer import load_tokenizer, save_tiny_tokenizer

# Files at least this large are linked into results/ instead of copied.
LINK_THRESHOLD = 64 << 20
# Weights up to this size are fully loaded (strictly) as a final check; larger ones are checked
# by names and shapes here (no data read) and loaded strictly by the training stages.
FULL_LOAD_LIMIT = 1 << 30


def source_files(cfg: PisftConfig) -> list[str]:
    """Local files whose change must rerun fetch_base (for the workflow's inputs)."""
    return sources.local_input_files(cfg.model.source, cfg.model.tokenizer)


def link_or_copy(src: Path, dst: Path) -> str:
    """Place `src` at `dst`: hard link, else symlink for big files; copy for small ones."""
    real = src.resolve()
    if real.stat().st_size < LINK_THRESHOLD:
        shutil.copyfile(real, dst)
        return "copy"
    try:
        os.link(real, dst)
        return "hardlink"
    except OSError:
        os.symlink(real, dst)
        return "symlink"


def _preset_mismatch(cfg: PisftConfig, found: str, where: str) -> ModelLoadError:
    return ModelLoadError(
        f"{where}: holds a '{found}' model but model.preset is '{cfg.model.preset}'; "
        f"set model.preset: {found}, or point model.source at a {cfg.model.preset} model"
    )


def _fetch_tiny(cfg: PisftConfig, out: Path) -> dict[str, Any]:
    if cfg.model.preset != "tiny":
        raise _preset_mismatch(cfg, "tiny", "model.source 'tiny'")
    if cfg.model.tokenizer:
        raise ModelLoadError("model.tokenizer: must be empty with model.source 'tiny' (the tiny "
                             "model's embedding is sized to its own locally built tokenizer)")
    policy = policy_mod.build_policy("tiny", seed=cfg.model.init_seed)
    save_tiny_tokenizer(out / policy_mod.TOKENIZER_DIR)
    policy_mod.save_model(policy, out, tokenizer_dir=out / policy_mod.TOKENIZER_DIR)
    return {"source": "tiny", "kind": "tiny", "init_seed": cfg.model.init_seed,
            "files": {policy_mod.WEIGHTS_FILE: {"how": "written"}}}


def _tokenizer_source(cfg: PisftConfig, directory: Path) -> tuple[Path, str]:
    spec = cfg.model.tokenizer
    if spec.startswith(sources.HF_PREFIX):
        parsed = sources.parse_source(spec)
        path = sources.hf_snapshot(parsed.repo_id or "", parsed.revision, sources.HF_TOKENIZER_PATTERNS,
                                   f"model.tokenizer '{spec}'")
        return path, spec
    if spec:
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise ModelLoadError(f"model.tokenizer '{spec}': directory not found")
        return path, spec
    if (directory / policy_mod.TOKENIZER_DIR).is_dir():
        return directory / policy_mod.TOKENIZER_DIR, "source tokenizer/"
    if any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return directory, "source directory"
    raise ModelLoadError(
        f"model.source '{cfg.model.source}' has no tokenizer (no tokenizer/ and no tokenizer files); "
        f"set model.tokenizer to a local copy of the PaliGemma tokenizer or to "
        f"hf://google/paligemma-3b-pt-224"
    )


def _openpi_config(directory: Path, preset: str):
    raw = json.loads((directory / "config.json").read_text())
    variants = (raw.get("paligemma_variant"), raw.get("action_expert_variant"))
    if variants != ("gemma_2b", "gemma_300m"):
        raise ModelLoadError(f"{directory / 'config.json'}: openpi variants {variants} are not pi0.5's "
                             f"('gemma_2b', 'gemma_300m')")
    config = policy_mod.make_config(preset)
    horizon = int(raw["action_horizon"])
    config.chunk_size = horizon
    config.n_action_steps = horizon
    return config


def _openpi_stats(directory: Path) -> tuple[dict | None, str]:
    # openpi: assets/<asset_id>/norm_stats.json, asset_id e.g. "physical-intelligence/libero"
    assets = directory / "assets"
    found = sorted(assets.rglob("norm_stats.json")) if assets.is_dir() else []
    if not found:
        return None, "no assets/**/norm_stats.json"
    if len(found) > 1:
        ids = ", ".join(str(p.parent.relative_to(assets)) for p in found)
        return None, f"several norm_stats.json ({ids}): none imported"
    try:
        return import_openpi_norm_stats(found[0]), f"imported {found[0].relative_to(directory)}"
    except ModelLoadError as exc:
        return None, f"not imported: {exc}"


def _fetch_directory(cfg: PisftConfig, source: sources.Source, out: Path) -> dict[str, Any]:
    directory = sources.materialise(source)
    what = f"model.source '{source.text}'"
    if (directory / "MANIFEST.json").is_file():
        problems = verify_manifest(directory)
        if problems:
            raise ModelLoadError(f"{what}: the directory does not match its MANIFEST.json:\n  "
                                 + "\n  ".join(problems[:12]))
    layout = sources.detect_layout(directory, what)
    ignored: list[str] = []
    # pisft_model.json (written by pisft) gives the sizes; without it, LeRobot's pi0.5 sizes.
    info = policy_mod.read_model_info(directory)
    if layout == sources.LEROBOT:
        config, ignored = policy_mod.read_config(directory / "config.json", tolerate_unknown=True)
    else:
        config = _openpi_config(directory, info["preset"])
    if info["preset"] != cfg.model.preset:
        raise _preset_mismatch(cfg, info["preset"], what)
    original_features = {
        "input": {k: list(v.shape) for k, v in config.input_features.items()},
        "output": {k: list(v.shape) for k, v in config.output_features.items()},
    }
    config.input_features, config.output_features = policy_mod._split_features(  # noqa: SLF001
        policy_mod.LIBERO_FEATURES)
    config.device = "cpu"

    # Strict check of names and shapes against the preset, without reading any tensor data.
    skeleton = policy_mod.policy_from_config(config, info, device="meta")
    weights_path = directory / policy_mod.WEIGHTS_FILE
    provided = {weights.lerobot_name(k): v for k, v in weights.file_shapes(weights_path).items()}
    _, missing, unexpected, misshaped = weights.compare(
        weights.expected_shapes(skeleton), provided, weights.tied_groups(skeleton))
    weights.raise_if_not_strict(f"{what} ({weights_path})", missing, unexpected, misshaped)

    tokenizer_src, tokenizer_from = _tokenizer_source(cfg, directory)
    tokenizer = load_tokenizer(tokenizer_src)
    rows = vlm_embedding_pair(skeleton)[1].num_embeddings
    if len(tokenizer) > rows:
        raise ModelLoadError(f"tokenizer from {tokenizer_from} ({tokenizer_src}) has {len(tokenizer)} "
                             f"tokens; the model's embedding has {rows} rows: wrong tokenizer")
    tokenizer.save_pretrained(str(out / policy_mod.TOKENIZER_DIR))

    policy_mod.write_config(config, out / policy_mod.CONFIG_FILE)
    (out / policy_mod.MODEL_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    files = {policy_mod.WEIGHTS_FILE: {"how": link_or_copy(weights_path, out / policy_mod.WEIGHTS_FILE),
                                       "from": str(weights_path.resolve())}}
    stats_note = "none"
    if layout == sources.LEROBOT and (directory / STATS_FILE).is_file():
        files[STATS_FILE] = {"how": link_or_copy(directory / STATS_FILE, out / STATS_FILE),
                             "from": str((directory / STATS_FILE).resolve())}
        stats_note = f"copied {STATS_FILE}"
    elif layout == sources.OPENPI:
        stats, stats_note = _openpi_stats(directory)
        if stats is not None:
            save_stats(stats, out / STATS_FILE)
    return {
        "source": source.text,
        "kind": source.kind,
        "layout": layout,
        "directory": str(directory.resolve()),
        "repo_id": source.repo_id,
        "revision": source.revision,
        "tokenizer": {"from": tokenizer_from, "path": str(tokenizer_src.resolve())},
        "ignored_config_keys": ignored,
        "original_features": original_features,
        "normalization_stats": stats_note,
        "files": files,
    }


def run(cfg: PisftConfig) -> Path:
    source = sources.parse_source(cfg.model.source)
    final = cfg.results("base_model")
    with atomic_dir(final) as out:
        if source.kind == "tiny":
            record = _fetch_tiny(cfg, out)
        else:
            record = _fetch_directory(cfg, source, out)
        size = (out / policy_mod.WEIGHTS_FILE).stat().st_size
        if size <= FULL_LOAD_LIMIT:
            policy = policy_mod.load_policy(out, preset=cfg.model.preset)
            record["verified"] = "full strict load of every tensor"
            record["params_total"] = sum(p.numel() for p in policy.parameters())
            del policy
        else:
            record["verified"] = ("strict check of every tensor name and shape (no data read); the "
                                  "training stages load the values strictly")
        record["preset"] = cfg.model.preset
        for name in ignored_warnings(record):
            print(f"fetch_base: warning: {name}")
        write_json_atomic(out / "SOURCE.json", record)
        write_resolved(cfg, out / "pisft_config.json")
        weights_sha = write_manifest(out)[policy_mod.WEIGHTS_FILE]["sha256"]
    print(f"fetch_base: {cfg.model.preset} model from {source.text} -> {final} "
          f"(model.safetensors sha256 {weights_sha[:12]}…, {record['verified']})")
    return final


def ignored_warnings(record: dict[str, Any]) -> list[str]:
    keys = record.get("ignored_config_keys") or []
    if not keys:
        return []
    return [f"config.json keys unknown to LeRobot 0.6.1 were ignored: {', '.join(keys)} "
            f"(recorded in SOURCE.json; weights are still checked strictly)"]
