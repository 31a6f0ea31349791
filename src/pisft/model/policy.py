"""Build, save and strictly load LeRobot pi0.5 policies; make their processors.

A model directory (LeRobot layout) holds:
  config.json                        PI05Config (LeRobot's draccus encoding, "type": "pi05")
  model.safetensors                  weights; tied tensors stored once (see weights.py)
  tokenizer/                         a transformers tokenizer (AutoTokenizer.from_pretrained)
  pisft_model.json                   preset name and, for sizes LeRobot does not know, the sizes;
                                     for a fine-tune, what it trained (`trainable`: train.trainable's
                                     mode, parameter counts, the LoRA preset; merged into the weights)
  normalization_stats.safetensors    (optional) the stats the model was trained with
A directory without pisft_model.json (e.g. `lerobot/pi05_base`) has LeRobot's own sizes.
"""

from __future__ import annotations

from collections.abc import Callable

import copy
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from pisft import device as devices
from pisft.errors import ModelLoadError
from pisft.model.pi05.construction import (Arch, build_on_meta, sized_construction, tie_vlm_embeddings,
                                           vlm_embedding_pair)
from pisft.model.pi05.parts import EXPERT_HEAD
from pisft.model.pi05.processors import pi05_processors
from pisft.model import weights as weights_mod
from pisft.model.pi05.presets import get_preset
from pisft.model.sources import WEIGHTS_FILE
from pisft import records
from pisft.integrity import verify_read
from pisft.model.norm_stats import STATS_FILE, Stats, check_stats, load_stats, save_stats
from pisft.model.tokenizer import load_tokenizer

CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
MODEL_INFO_FILE = "pisft_model.json"
# pisft_model.json: whether the prompt carries the discretised state (model.state_in_prompt)
STATE_IN_PROMPT_KEY = "state_in_prompt"
MODEL_INFO_VERSION = 1

IMAGE_KEYS = ("observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb")
STATE_KEY = "observation.state"
ACTION_KEY = "action"


def _libero_features() -> dict[str, Any]:
    from lerobot.configs import FeatureType, PolicyFeature

    # Images of any size are resized (with padding) to the preset's image_resolution.
    features: dict[str, Any] = {k: PolicyFeature(FeatureType.VISUAL, (3, 256, 256)) for k in IMAGE_KEYS}
    features[STATE_KEY] = PolicyFeature(FeatureType.STATE, (8,))
    features[ACTION_KEY] = PolicyFeature(FeatureType.ACTION, (7,))
    return features


# pi0.5's features for LIBERO: two RGB cameras, state float32[8], action float32[7].
LIBERO_FEATURES: dict[str, Any] = _libero_features()


def _split_features(features: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    from lerobot.configs import FeatureType

    inputs = {k: v for k, v in features.items() if v.type != FeatureType.ACTION}
    outputs = {k: v for k, v in features.items() if v.type == FeatureType.ACTION}
    return inputs, outputs


def _dtype_name(dtype: torch.dtype | str | None, default: str) -> str:
    if dtype is None:
        return default
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", "float32": "float32",
             "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
    if dtype not in names:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    return names[dtype]


def make_config(preset: str, *, device: str = "cpu", dtype: torch.dtype | str | None = None):
    """A PI05Config for `preset` with the LIBERO features."""
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    spec = get_preset(preset)
    inputs, outputs = _split_features(LIBERO_FEATURES)
    config = PI05Config(input_features=inputs, output_features=outputs, device="cpu", **spec.config)
    config.dtype = _dtype_name(dtype, config.dtype)
    config.device = device
    return config


def _construct(config, arch: Arch | None, device: str, *, init: bool):
    """PI05Policy of the given sizes on `device`; weights random (init) or left uninitialised."""
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    target = str(device)
    with sized_construction(arch):
        if target == "meta":
            policy = build_on_meta(PI05Policy, config)
        else:
            config.device = "cpu"
            if init:
                policy = PI05Policy(config)
            else:
                from transformers.initialization import no_init_weights

                with no_init_weights():
                    policy = PI05Policy(config)
    tie_vlm_embeddings(policy)
    if target != "meta" and not devices.on_host(target):
        policy.to(target)
    policy.config.device = target
    return policy


def _attach_info(policy, preset: str, arch: Arch | None,
                 state_in_prompt: bool | None = None) -> None:
    policy.pisft_model_info = {
        "format_version": MODEL_INFO_VERSION,
        "preset": preset,
        "arch": arch.to_dict() if arch is not None else None,
    }
    if state_in_prompt is not None:  # recorded by training or by the source (else LeRobot's: true)
        policy.pisft_model_info[STATE_IN_PROMPT_KEY] = bool(state_in_prompt)


def state_in_prompt_of(policy) -> bool:
    """Whether the policy's prompts carry the discretised state (its pisft_model.json
    `state_in_prompt`; absent: true, as LeRobot's pi0.5 always prompts)."""
    return bool(getattr(policy, "pisft_model_info", {}).get(STATE_IN_PROMPT_KEY, True))


def build_policy(preset: str, *, seed: int, device: str = "cpu",
                 dtype: torch.dtype | str | None = None):
    """A randomly initialised PI05Policy of `preset`, identical for the same seed.

    Initialised on CPU (so the same seed gives the same weights on any device), then moved.
    `device="meta"` builds without allocating memory (for counting parameters).
    """
    spec = get_preset(preset)
    config = make_config(preset, device="cpu", dtype=dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = _construct(config, spec.arch, device, init=True)
    _attach_info(policy, preset, spec.arch)
    return policy


def model_info(policy) -> dict[str, Any]:
    info = getattr(policy, "pisft_model_info", None)
    if info is None:
        raise ValueError("this policy was not built by pisft.model.policy (no pisft_model_info)")
    return info


def save_model(policy, out_dir: str | Path, *, tokenizer_dir: str | Path,
               dataset_stats: Stats | None = None,
               state_dict: dict[str, torch.Tensor] | None = None,
               write_weights: Any = None) -> None:
    """Write `policy` in LeRobot layout into the existing directory `out_dir`.

    `state_dict`: a full (unsharded) state dict to save instead of `policy.state_dict()`, e.g.
    gathered from an FSDP-sharded policy. `write_weights`: a callable that writes
    model.safetensors itself (its path given), e.g. streamed tensor by tensor
    (`pisft.train.export_weights`). The caller makes the directory atomic.
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise FileNotFoundError(f"{out_dir}: output directory must exist (the caller creates it atomically)")
    info = model_info(policy)
    write_config(policy.config, out_dir / CONFIG_FILE)
    if write_weights is not None:
        write_weights(out_dir / WEIGHTS_FILE)
    else:
        weights_mod.save_weights(policy, out_dir / WEIGHTS_FILE, state_dict=state_dict)
    (out_dir / MODEL_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    tokenizer_src = Path(tokenizer_dir)
    tokenizer_dst = out_dir / TOKENIZER_DIR
    if tokenizer_src.resolve() != tokenizer_dst.resolve():
        load_tokenizer(tokenizer_src)  # refuse to write a model whose tokenizer cannot load
        shutil.copytree(tokenizer_src, tokenizer_dst, dirs_exist_ok=False)
    if dataset_stats is not None:
        check_stats(dataset_stats, "dataset_stats")
        save_stats(dataset_stats, out_dir / STATS_FILE)


def write_config(config, path: str | Path) -> None:
    """config.json as LeRobot writes it (draccus encoding with "type"), device set to cpu."""
    import draccus
    from lerobot.configs import PreTrainedConfig

    config = copy.copy(config)
    config.device = "cpu"
    Path(path).write_text(json.dumps(draccus.encode(config, PreTrainedConfig), indent=4) + "\n")


def implied_model_info() -> dict[str, Any]:
    """The info of a directory without pisft_model.json: LeRobot's own pi0.5 sizes."""
    return {"format_version": MODEL_INFO_VERSION, "preset": "pi05", "arch": None}


def read_config(path: str | Path, *, tolerate_unknown: bool = False):
    """PI05Config from a LeRobot config.json. Returns (config, ignored unknown keys)."""
    import draccus
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: config.json not found (a LeRobot model directory has one)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    kind = raw.pop("type", None)
    if kind != "pi05":
        what = {"pi0": "a pi0 model", "pi0_fast": "a pi0-FAST model"}.get(kind, f"policy type {kind!r}")
        raise ModelLoadError(f"{path}: this is {what}, not pi0.5 (\"type\": \"pi05\"); pisft fine-tunes "
                             f"pi0.5 only. Point model.source at a pi0.5 checkpoint.")
    known = {f.name for f in dataclasses.fields(PI05Config) if f.init}
    unknown = sorted(set(raw) - known)
    if unknown and not tolerate_unknown:
        raise ModelLoadError(f"{path}: unknown PI05Config keys {unknown} (LeRobot 0.6.1); "
                             f"the directory was written by another version; re-run fetch_base")
    for key in unknown:
        raw.pop(key)
    device = raw.get("device")
    raw["device"] = "cpu"
    try:
        config = draccus.decode(PI05Config, raw)
    except Exception as exc:  # noqa: BLE001 - draccus raises many types for a bad config
        raise ModelLoadError(f"{path}: not a valid PI05Config ({type(exc).__name__}: {exc})") from None
    config.device = device or "cpu"
    return config, unknown


# pisft_model.json's fields and their types (`_attach_info` and the exports write them).
MODEL_INFO_FIELDS = {"format_version": int, "preset": str, "arch": (None, dict), STATE_IN_PROMPT_KEY: bool,
                     "augment": dict, "trainable": dict, "weights": dict,
                     # which steps ran under which settings (pisft.train.step_record)
                     "step_settings": list, "mixed_settings": (None, str)}


def _model_writer(model_dir: str | Path) -> str:
    from pisft.integrity import writer_of

    found = writer_of(Path(model_dir).absolute())
    return f"{found[0]} ({found[1]})" if found else "the stage that wrote this model (fetch_base, train_8card)"


def read_model_info(model_dir: str | Path) -> dict[str, Any]:
    """pisft_model.json, or the implied info of a plain LeRobot directory (LeRobot's sizes)."""
    path = Path(model_dir) / MODEL_INFO_FILE
    if not path.is_file():
        return implied_model_info()
    info = records.read(path, MODEL_INFO_FIELDS, writer=_model_writer(model_dir),
                        required=("format_version", "preset"))
    try:
        if info.get("arch") is not None:
            Arch.from_dict(info["arch"]).validate()
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: unreadable ({exc}); re-run fetch_base") from None
    if info.get("format_version") != MODEL_INFO_VERSION:
        raise ModelLoadError(f"{path}: format_version {info.get('format_version')} is not "
                             f"{MODEL_INFO_VERSION}; re-run fetch_base with this pisft")
    return info


def build_random_weights(preset: str, *, seed: int, dtype: torch.dtype | str | None = None):
    """A PI05Policy of `preset` without LeRobot's (slow, fp32) init: built uninitialised in `dtype`,
    then every matrix drawn from normal(0, 0.02) and every vector set to 0 with a generator seeded
    by `seed` (identical for the same seed; model.source 'random'). At pi0.5's size in bf16 this
    never holds the fp32 model."""
    spec = get_preset(preset)
    info = {"preset": preset, "arch": spec.arch.to_dict() if spec.arch is not None else None}
    policy = policy_from_config(make_config(preset, dtype=dtype), info, device="cpu", dtype=dtype, init=False)
    fill_random(policy, torch.Generator().manual_seed(seed))
    return policy


def fill_random(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Every matrix of `module` drawn from normal(0, 0.02) with `gen`, every vector set to 0."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.zero_()


def policy_from_config(config, info: dict[str, Any], *, device: str = "cpu",
                       dtype: torch.dtype | str | None = None, init: bool = False):
    """An (uninitialised unless `init`) policy of the given config and sizes."""
    arch = Arch.from_dict(info["arch"]) if info.get("arch") else None
    config.dtype = _dtype_name(dtype, config.dtype)
    # Build on CPU, load, then move: the weights never exist twice on the device.
    policy = _construct(config, arch, "cpu" if device != "meta" else "meta", init=init)
    _attach_info(policy, info["preset"], arch, info.get(STATE_IN_PROMPT_KEY))
    return policy


def empty_in_bf16(module: torch.nn.Module, hold: Callable[[str], bool]) -> None:
    """Replace the storage of each float32 parameter whose name `hold` picks with an empty bf16
    one, before anything is loaded into it (tied parameters once): a strict load then rounds the
    file's values into it, without the float32 copy ever being resident."""
    for name, p in module.named_parameters():
        if p.dtype == torch.float32 and hold(name):
            p.data = torch.empty_like(p, dtype=torch.bfloat16)


def load_policy(model_dir: str | Path, *, device: str = "cpu", dtype: torch.dtype | str | None = None,
                preset: str | None = None, hold_bf16: Callable[[str], bool] | None = None):
    """Load a model directory STRICTLY: any missing, unexpected or mis-shaped tensor raises.

    `preset`: if given, the directory must hold that preset (e.g. "pi05" refuses a tiny model).
    `hold_bf16(name)`: parameters held in bf16 from the start (the frozen ones of a bf16 run,
    `pisft.train.job.frozen_in_bf16`). Their storage in `dtype` is replaced by an empty bf16
    one before anything is written to it, and the file's values are copied (rounded) into that:
    the same tensors as loading in `dtype` and casting after (`trainable.hold_frozen_in`), without
    the whole model in fp32 ever being resident (pi0.5: 13.4 GB per process otherwise).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model directory not found")
    verify_read(model_dir, what=f"loading the model {model_dir}")  # its MANIFEST.json, before any byte is used
    config, _ = read_config(model_dir / CONFIG_FILE)
    info = read_model_info(model_dir)
    if preset is not None and info["preset"] != preset:
        raise ModelLoadError(f"{model_dir}: holds a '{info['preset']}' model but model.preset is "
                             f"'{preset}'; set model.preset: {info['preset']} or fetch the right model")
    policy = policy_from_config(config, info, device="cpu", dtype=dtype, init=False)
    if hold_bf16 is not None:
        empty_in_bf16(policy, hold_bf16)
    # The action expert's lm_head is never used (pisft.model.pi05 5.): a file may lack it.
    weights_mod.load_strict(policy, model_dir / WEIGHTS_FILE, rename=weights_mod.lerobot_name,
                            optional=frozenset({EXPERT_HEAD}))
    if not devices.on_host(device):
        policy.to(device)
    policy.config.device = str(device)
    return policy


def make_processors(policy, model_dir: str | Path, dataset_stats: Stats | None = None, *,
                    state_in_prompt: bool | None = None):
    """(preprocessor, postprocessor): LeRobot's pi0.5 pipelines with the model's own tokenizer.

    `preprocessor(batch)` takes a collated batch (image keys float (B,3,H,W) in [0,1], state
    (B,8), `action` (B,chunk,7), `task` list[str]) and returns what `policy.forward` and
    `policy.predict_action_chunk` take: quantile-normalised state/action, prompt tokens with
    the discretised state. `postprocessor(actions)` unnormalises predicted actions (on CPU).
    `dataset_stats` None: the stats stored in the model directory. `state_in_prompt` None: the
    policy's record (`state_in_prompt_of`), so every consumer prompts as the model was trained.
    """
    model_dir = Path(model_dir)
    tokenizer = load_tokenizer(model_dir / TOKENIZER_DIR)
    vocab_rows = vlm_embedding_pair(policy)[1].num_embeddings
    if len(tokenizer) > vocab_rows:
        raise ModelLoadError(f"{model_dir / TOKENIZER_DIR}: the tokenizer has {len(tokenizer)} tokens but "
                             f"the model's embedding has {vocab_rows} rows; wrong tokenizer for this model")
    if dataset_stats is None:
        dataset_stats = load_stats(model_dir / STATS_FILE)
    check_stats(dataset_stats, "normalisation stats")
    if state_in_prompt is None:
        state_in_prompt = state_in_prompt_of(policy)
    return pi05_processors(policy.config, dataset_stats, tokenizer,
                                     state_in_prompt=state_in_prompt)
