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

from pisft import layout
from pisft.config import PisftConfig
from pisft.errors import ModelLoadError
from pisft.integrity import manifest_files, stage_output
from pisft.io import verify_manifest, write_json_atomic
from pisft.model import policy as policy_mod
from pisft.model import sources, weights
from pisft.model.pi05.construction import vlm_embedding_pair
from pisft.model.norm_stats import STATS_FILE, find_norm_stats, import_openpi_norm_stats, save_stats, stats_equal
from pisft.model.tokenizer import open_tokenizer, save_tiny_tokenizer

# Files at least this large are linked into results/ instead of copied.
LINK_THRESHOLD = 64 << 20
# Weights up to this size are fully loaded (strictly) as a final check; larger ones are checked
# by names and shapes here (no data read) and loaded strictly by the training stages.
FULL_LOAD_LIMIT = 1 << 30
# Settings a source decides rather than the config (printed and recorded in SOURCE.json).
SOURCE_SETTINGS = ("chunk_size", "n_action_steps", "max_state_dim", "max_action_dim", "dtype",
                   "tokenizer_max_length", "image_resolution")
# big_vision's SentencePiece file, as openpi downloads it (gs://big_vision/paligemma_tokenizer.model).
SENTENCEPIECE_FILE = "paligemma_tokenizer.model"
# model.* keys read with getattr (a default until the config declares them).
ASSET_ID_KEY = "asset_id"  # str: the asset id whose norm_stats.json to carry into the base model
FOLLOW_CHUNK_KEY = "follow_source_chunk_size"  # bool: accept a source chunk size other than the preset's


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


def _fetch_random(cfg: PisftConfig, out: Path) -> dict[str, Any]:
    """model.source 'random': model.preset's sizes, random weights from model.init_seed, in bf16
    (LeRobot's `to_bfloat16_for_selected_params` keeps the vision path and norms in fp32), written
    in LeRobot layout like any fetched model (sources.py)."""
    if cfg.model.tokenizer:
        raise ModelLoadError("model.tokenizer: must be empty with model.source 'random' (the random model "
                             "uses pisft's small tokenizer, whose ids fit any embedding)")
    policy = policy_mod.build_random_weights(cfg.model.preset, seed=cfg.model.init_seed, dtype="bfloat16")
    save_tiny_tokenizer(out / policy_mod.TOKENIZER_DIR)
    policy_mod.save_model(policy, out, tokenizer_dir=out / policy_mod.TOKENIZER_DIR)
    return {"source": "random", "kind": "random", "init_seed": cfg.model.init_seed,
            "init": "normal(0, 0.02) matrices, zero vectors", "dtype": "bfloat16",
            "files": {policy_mod.WEIGHTS_FILE: {"how": "written"}}}


def _tokenizer_source(cfg: PisftConfig, directory: Path) -> tuple[Path, str, str | None]:
    """(path, where it came from, a note or None): model.tokenizer, else the source's own."""
    spec = cfg.model.tokenizer
    if spec.startswith(sources.HF_PREFIX):
        parsed = sources.parse_source(spec)
        path, note = sources.hf_snapshot(parsed.repo_id or "", parsed.revision, sources.HF_TOKENIZER_PATTERNS,
                                         f"model.tokenizer '{spec}'")
        return path, spec, note
    if spec:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelLoadError(f"model.tokenizer '{spec}': not found (it takes big_vision's "
                                 f"paligemma_tokenizer.model file or a Hugging Face tokenizer directory)")
        return path, spec, None
    if (directory / policy_mod.TOKENIZER_DIR).is_dir():
        return directory / policy_mod.TOKENIZER_DIR, "source tokenizer/", None
    if any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return directory, "source directory", None
    if (directory / SENTENCEPIECE_FILE).is_file():
        return directory / SENTENCEPIECE_FILE, f"source {SENTENCEPIECE_FILE}", None
    raise ModelLoadError(
        f"model.source '{cfg.model.source}' has no tokenizer (no tokenizer/, no tokenizer files, no "
        f"{SENTENCEPIECE_FILE}; lerobot/pi05_base, openpi's conversions and RLinf's checkpoints ship none). "
        f"Set model.tokenizer to big_vision's {SENTENCEPIECE_FILE} (openpi downloads it to "
        f"~/.cache/openpi/big_vision/{SENTENCEPIECE_FILE}), to a local copy of the Hugging Face PaliGemma "
        f"tokenizer, or to hf://google/paligemma-3b-pt-224 (gated: accept its terms and set HF_TOKEN)"
    )


def _setting(config, name: str):
    value = getattr(config, name)
    return list(value) if isinstance(value, tuple) else value


def _source_config(cfg: PisftConfig, ckpt: sources.Checkpoint, what: str):
    """(PI05Config, settings, ignored config.json keys). `settings`: each setting the source
    decides, its value and where it came from (the source's file, or the preset where the source
    says nothing)."""
    preset = cfg.model.preset
    reference = policy_mod.make_config(preset)
    settings: dict[str, dict[str, Any]] = {}
    ignored: list[str] = []
    if ckpt.config_form == sources.LEROBOT:
        assert ckpt.config is not None
        config, ignored = policy_mod.read_config(ckpt.config, tolerate_unknown=True)
        for name in SOURCE_SETTINGS:
            settings[name] = {"value": _setting(config, name), "from": f"config.json {name}"}
    elif ckpt.config_form == sources.OPENPI:
        assert ckpt.config is not None
        raw = json.loads(ckpt.config.read_text())
        variants = (raw.get("paligemma_variant"), raw.get("action_expert_variant"))
        if variants != ("gemma_2b", "gemma_300m"):
            raise ModelLoadError(f"{ckpt.config}: openpi variants {variants} are not pi0.5's "
                                 f"('gemma_2b', 'gemma_300m')")
        config = policy_mod.make_config(preset)
        try:
            horizon = int(raw["action_horizon"])
            action_dim = int(raw.get("action_dim", config.max_action_dim))
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{ckpt.config}: action_horizon/action_dim are not integers ({exc})") from None
        config.chunk_size = config.n_action_steps = horizon
        # openpi pads state and actions to the model's action_dim (transforms.PadStatesAndActions).
        config.max_action_dim = config.max_state_dim = action_dim
        for name in SOURCE_SETTINGS:
            settings[name] = {"value": _setting(config, name), "from": f"model.preset '{preset}'"}
        for name in ("chunk_size", "n_action_steps"):
            settings[name]["from"] = "openpi config.json action_horizon"
        settings["max_action_dim"]["from"] = "openpi config.json action_dim"
        settings["max_state_dim"]["from"] = "openpi config.json action_dim (openpi pads the state to it)"
        if "discrete_state_input" in raw:  # openpi's Pi0Config: the state in the prompt (pi05: True)
            settings["state_in_prompt"] = {"value": bool(raw["discrete_state_input"]),
                                           "from": "openpi config.json discrete_state_input"}
        if "precision" in raw:
            settings["dtype"]["from"] = (f"model.preset '{preset}' (openpi config.json precision "
                                         f"'{raw['precision']}' is how the weights are stored)")
    else:
        config = policy_mod.make_config(preset)
        for name in SOURCE_SETTINGS:
            settings[name] = {"value": _setting(config, name),
                              "from": f"model.preset '{preset}' (the source has no config.json; RLinf's "
                                      f"openpi config_name decided its training's action horizon)"}
    source_chunk, config_chunk = int(config.chunk_size), int(reference.chunk_size)
    if source_chunk != config_chunk:
        origin = settings["chunk_size"]["from"]
        if not getattr(cfg.model, FOLLOW_CHUNK_KEY, False):
            raise ModelLoadError(
                f"{what}: its chunk size is {source_chunk} ({origin}) but model.preset '{preset}' has "
                f"{config_chunk}. An openpi conversion carries its training config's action_horizon (10 for "
                f"pi05_libero; lerobot/pi05_base has 50). Set model.{FOLLOW_CHUNK_KEY}: true to train and "
                f"predict {source_chunk}-step chunks, or convert the checkpoint with a config whose "
                f"action_horizon is {config_chunk}.")
        settings["chunk_size"]["note"] = (f"differs from model.preset '{preset}' ({config_chunk}); kept because "
                                          f"model.{FOLLOW_CHUNK_KEY} is true")
    return config, settings, ignored


def _weight_dtypes(ckpt: sources.Checkpoint, state_dict) -> dict[str, int]:
    from safetensors import safe_open

    counts: dict[str, int] = {}
    if state_dict is not None:
        for tensor in state_dict.values():
            name = str(tensor.dtype).removeprefix("torch.")
            counts[name] = counts.get(name, 0) + 1
        return counts
    _, where = weights.tensor_locations(ckpt.weights)
    for file in sorted(set(where.values())):
        with safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is no mapping
                dtype = fh.get_slice(name).get_dtype()
                counts[dtype] = counts.get(dtype, 0) + 1
    return counts


def _choose_stats(cfg: PisftConfig, directory: Path, out: Path) -> tuple[dict[str, Any], str]:
    """Carry the source's normalisation stats into `out` (or not): (record, one-line summary)."""
    asset_id = str(getattr(cfg.model, ASSET_ID_KEY, "") or "")
    candidates = find_norm_stats(directory)
    listed = [c.describe(directory) for c in candidates]
    own = directory / STATS_FILE
    record: dict[str, Any] = {"found": listed, "asset_id": asset_id or None}
    if own.is_file() and not asset_id:
        how = link_or_copy(own, out / STATS_FILE)
        record.update(used=STATS_FILE, how=how)
        extra = f"; not used: {', '.join(listed)} (model.{ASSET_ID_KEY} picks one instead)" if listed else ""
        return record, f"copied the source's {STATS_FILE}{extra}"
    if asset_id:
        chosen = [c for c in candidates if c.asset_id == asset_id.strip("/")]
        if not chosen:
            raise ModelLoadError(
                f"model.{ASSET_ID_KEY} '{asset_id}': no norm_stats.json for it in {directory} (openpi keeps them "
                f"in assets/<asset_id>/, RLinf in <asset_id>/); found: {', '.join(listed) or 'none'}")
    elif len({c.asset_id for c in candidates}) == 1:
        chosen = candidates
    else:
        record["used"] = None
        if not candidates:
            return record, "none in the source"
        return record, (f"NOT imported: the source holds several ({'; '.join(listed)}) and model.{ASSET_ID_KEY} "
                        f"names none. Set model.{ASSET_ID_KEY} to one of "
                        f"{', '.join(sorted({c.asset_id for c in candidates}))} to carry it into the base model")
    try:
        imported = [import_openpi_norm_stats(c.path) for c in chosen]
    except ModelLoadError as exc:
        if asset_id:
            raise
        record.update(used=None, error=str(exc))
        return record, f"NOT imported: {chosen[0].describe(directory)} is unusable here ({exc})"
    if any(not stats_equal(imported[0], other) for other in imported[1:]):
        raise ModelLoadError(f"{directory}: asset '{chosen[0].asset_id}' has differing norm_stats.json files: "
                             f"{', '.join(c.describe(directory) for c in chosen)}; remove the stale one")
    save_stats(imported[0], out / STATS_FILE)
    why = f"model.{ASSET_ID_KEY}" if asset_id else "the only one in the source"
    record.update(used=str(chosen[0].path.relative_to(directory)), how="imported", asset_id=chosen[0].asset_id)
    return record, f"imported {chosen[0].describe(directory)} ({why}) into {STATS_FILE}"


def _fetch_directory(cfg: PisftConfig, source: sources.Source, out: Path) -> dict[str, Any]:
    directory, hub_note = sources.materialise(source)
    what = f"model.source '{source.text}'"
    if hub_note:
        print(f"fetch_base: note: {hub_note}")
    if (directory / "MANIFEST.json").is_file():
        problems = verify_manifest(directory)
        if problems:
            raise ModelLoadError(f"{what}: the directory does not match its MANIFEST.json:\n  "
                                 + "\n  ".join(problems[:12]))
    ckpt = sources.detect_checkpoint(directory, what)
    # pisft_model.json (written by pisft) gives the sizes; without it, LeRobot's pi0.5 sizes.
    info = policy_mod.read_model_info(directory)
    if info["preset"] != cfg.model.preset:
        raise _preset_mismatch(cfg, info["preset"], what)
    config, settings, ignored = _source_config(cfg, ckpt, what)
    if "state_in_prompt" in settings:  # recorded: training and every consumer follow it
        info[policy_mod.STATE_IN_PROMPT_KEY] = settings["state_in_prompt"]["value"]
    original_features = {
        "input": {k: list(v.shape) for k, v in config.input_features.items()},
        "output": {k: list(v.shape) for k, v in config.output_features.items()},
    }
    config.input_features, config.output_features = policy_mod._split_features(  # noqa: SLF001
        policy_mod.LIBERO_FEATURES)
    config.device = "cpu"

    # Strict check of names and shapes against the preset, without reading any tensor data.
    skeleton = policy_mod.policy_from_config(config, info, device="meta")
    state_dict = weights.read_torch_state_dict(ckpt.weights) if ckpt.weights_form == "torch state dict" else None
    raw_shapes = ({k: tuple(v.shape) for k, v in state_dict.items()} if state_dict is not None
                  else weights.file_shapes(ckpt.weights))
    provided = {weights.lerobot_name(k): v for k, v in raw_shapes.items()}
    if len(provided) != len(raw_shapes):
        raise ModelLoadError(f"{what} ({ckpt.weights}): two tensor names map to one model name "
                             f"(with and without the `model.` prefix)")
    _, missing, unexpected, misshaped = weights.compare(
        weights.expected_shapes(skeleton), provided, weights.tied_groups(skeleton))
    hint = ""
    if any(n.startswith(("model.value_head.", "model.noise_head.")) for n in unexpected):
        hint = ("  value_head.* / noise_head.* are RLinf's RL heads (add_value_head, flow_noise): not part of "
                "pi0.5's policy; give an SFT checkpoint, or one saved without them; nothing was loaded.")
    weights.raise_if_not_strict(f"{what} ({ckpt.weights})", missing, unexpected, misshaped, hint=hint)
    settings["weights_dtypes"] = {"value": _weight_dtypes(ckpt, state_dict),
                                  "from": str(ckpt.weights.relative_to(directory))}

    tokenizer_src, tokenizer_from, tokenizer_note = _tokenizer_source(cfg, directory)
    if tokenizer_note:
        print(f"fetch_base: note: {tokenizer_note}")
    tokenizer, tokenizer_kind = open_tokenizer(tokenizer_src)
    rows = vlm_embedding_pair(skeleton)[1].num_embeddings
    if len(tokenizer) > rows:
        raise ModelLoadError(f"tokenizer from {tokenizer_from} ({tokenizer_src}) has {len(tokenizer)} "
                             f"tokens; the model's embedding has {rows} rows: wrong tokenizer for this model "
                             f"(pi0.5's PaliGemma embedding has 257152 rows, PaliGemma's SentencePiece "
                             f"vocabulary as many)")
    tokenizer.save_pretrained(str(out / policy_mod.TOKENIZER_DIR))

    policy_mod.write_config(config, out / policy_mod.CONFIG_FILE)
    (out / policy_mod.MODEL_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    target = out / policy_mod.WEIGHTS_FILE
    if ckpt.weights_form == "safetensors":
        how = link_or_copy(ckpt.weights, target)
    elif ckpt.weights_form == "sharded safetensors":
        how = f"merged from {weights.merge_shards(ckpt.weights, target)} shards (bytes unchanged)"
    else:
        assert state_dict is not None
        weights.write_safetensors(target, state_dict, state_dict.__getitem__)
        how = "converted from a torch state dict read with weights_only=True (bytes unchanged)"
        del state_dict
    if how not in ("copy", "hardlink", "symlink") and weights.file_shapes(target) != raw_shapes:
        raise ModelLoadError(f"{target}: the written weights do not list the source's tensors and shapes")
    files = {policy_mod.WEIGHTS_FILE: {"how": how, "from": str(ckpt.weights.resolve())}}
    stats_record, stats_summary = _choose_stats(cfg, directory, out)
    if stats_record.get("how") in ("copy", "hardlink", "symlink"):
        files[STATS_FILE] = {"how": stats_record["how"], "from": str((directory / STATS_FILE).resolve())}
    uses = ("these" if (out / STATS_FILE).is_file()
            else "the dataset's (serve: --dataset)")
    print(f"fetch_base: normalisation statistics: {stats_summary}. Fine-tuning normalises with the dataset's "
          f"own statistics (results/dataset); evaluating or serving this base model uses {uses}.")
    shown = ", ".join(f"{k} {v['value']} ({v['from']})" for k, v in settings.items() if k != "weights_dtypes")
    print(f"fetch_base: {ckpt.layout} checkpoint, {ckpt.weights_form} ({ckpt.weights.relative_to(directory)}); "
          f"settings from the source: {shown}; stored dtypes {settings['weights_dtypes']['value']}")
    print(f"fetch_base: tokenizer: {tokenizer_from} ({tokenizer_kind}, {len(tokenizer)} tokens; embedding rows {rows})")
    return {
        "source": source.text,
        "kind": source.kind,
        "layout": ckpt.layout,
        "weights_form": ckpt.weights_form,
        "directory": str(directory.resolve()),
        "repo_id": source.repo_id,
        "revision": source.revision if not hub_note else directory.name,
        "hub_note": hub_note,
        "tokenizer": {"from": tokenizer_from, "path": str(tokenizer_src.resolve()), "form": tokenizer_kind,
                      "vocabulary": len(tokenizer), "embedding_rows": rows, "note": tokenizer_note},
        "settings": settings,
        "ignored_config_keys": ignored,
        "original_features": original_features,
        "normalization_stats": stats_summary,
        "normalization_stats_detail": stats_record,
        "files": files,
    }


def run(cfg: PisftConfig) -> Path:
    source = sources.parse_source(cfg.model.source)
    final = layout.base_model(cfg)
    with stage_output(final, cfg) as out:
        if source.kind == "tiny":
            record = _fetch_tiny(cfg, out)
        elif source.kind == "random":
            record = _fetch_random(cfg, out)
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
    weights_sha = manifest_files(final)[policy_mod.WEIGHTS_FILE]["sha256"]
    print(f"fetch_base: {cfg.model.preset} model from {source.text} -> {final} "
          f"(model.safetensors sha256 {weights_sha[:12]}…, {record['verified']})")
    return final


def ignored_warnings(record: dict[str, Any]) -> list[str]:
    keys = record.get("ignored_config_keys") or []
    if not keys:
        return []
    return [f"config.json keys unknown to LeRobot 0.6.1 were ignored: {', '.join(keys)} "
            f"(recorded in SOURCE.json; weights are still checked strictly)"]
