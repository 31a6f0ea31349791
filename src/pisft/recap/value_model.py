"""The distributional value model of RECAP: V(o, task) in [-1, 0] as a distribution over bins.

As in the pi*0.6 paper (arXiv 2511.14759, Sec. IV-A and Appendix: a value function over 201
bins of the normalised return, trained with cross-entropy) and RLinf's critic
(`rlinf/models/embodiment/value_model/modeling_critic.py`, `ValueHead`,
`_compute_categorical_loss`, `_compute_value_from_hidden`):

- bins: `bins` atoms evenly spaced on [-1, 0] (recap.value_bins, 201);
- target: the normalised return (`pisft.data.rlinf_recap.value_target`: return / |minimum
  return|, clipped to [-1, 0]) projected onto its two neighbouring atoms ("two-hot": weight
  1 - d on the lower atom and d on the upper, d the fractional position between them; a target
  exactly on an atom puts all its weight there);
- loss: cross-entropy between that two-hot distribution and the softmax of the logits;
- V = the expectation of the atoms under the softmax.

Backbone: the policy's own vision-language prefix (PaliGemma: SigLIP image embeddings and the
language tokens through the Gemma VLM), loaded from the base model (or, with `recap.value_init:
previous`, from policy k-1: `pisft.layout.value_init_model`), without the action expert
(`pi05.construction.strip_to_vlm_prefix`, `vlm_prefix_readout`): a learned read-out token
(RLinf's `cls_embedding`, initialised N(0, 0.02)) is appended to the prefix, attends to all of
it, and its final hidden state feeds a linear bin head. (RLinf routes its read-out token through
a separate small Gemma expert; here it goes through the VLM itself, so the value model is the
policy's prefix plus two small tensors.) With the prefix frozen (recap.value_trainable: head,
RLinf's freeze_vlm) or no gradient wanted, the prefix runs once without grad into the VLM's KV
cache and only the read-out token runs with grad (`vlm_prefix_readout`'s `frozen_prefix`): the
same logits, and the backward runs through one token per layer instead of the whole prefix. The
prompt is the plain task text (any advantage label stripped), tokenised as LeRobot tokenises
pi0.5's prompt (same tokenizer, max length, right padding); the robot state is not part of it.

A saved value model (`save` / `load`) is a directory with `model.safetensors` (the value model's weights:
read-out token, head, and what of the backbone trained) and `value_model.json` (`ValueModelConfig`:
the base model directory whose architecture and tokenizer it uses, the preset, bins, the return
range of its training data, the prompt). The backbone's frozen tensors are not copied into it
(pi0.5 with recap.value_trainable head: 6.8 GB a copy): `frozen_from` names the model they come
from (the base model, or policy k-1 with recap.value_init previous) and the sha256 of its
MANIFEST.json, which `load` checks before it reads them from that model's file, held in the dtype
training held them in (`frozen_dtype`: bf16 under train.precision bf16, as
`pisft.train.trainable.hold_frozen_in` holds them). A model saved whole (`frozen_from` null)
loads from its own file alone.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pisft.errors import ModelLoadError
from pisft.model.registry import spec_of
from pisft.model.sources import WEIGHTS_FILE
from pisft.stages import TRAIN_VALUE

V_MIN, V_MAX = -1.0, 0.0
CONFIG_FILE = "value_model.json"
FORMAT_VERSION = 2  # 2: frozen tensors read from `frozen_from`'s file (1: every tensor in the model's own)
READABLE_VERSIONS = (1, 2)
TOKENS_KEY = "tokens"
TOKEN_MASK_KEY = "token_mask"
TARGET_KEY = "target"


# ------------------------------------------------------------------------------ the bin arithmetic
def atoms(bins: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The `bins` values of the bins, evenly spaced on [V_MIN, V_MAX]."""
    return torch.linspace(V_MIN, V_MAX, bins, device=device)


def _position(target: torch.Tensor, bins: int) -> torch.Tensor:
    """The target's fractional bin index in [0, bins - 1] (clipped to [V_MIN, V_MAX])."""
    delta = (V_MAX - V_MIN) / (bins - 1)
    return (target.float().clamp(V_MIN, V_MAX) - V_MIN) / delta


def two_hot(target: torch.Tensor, bins: int) -> torch.Tensor:
    """(B, bins): each target's weight on its two neighbouring bins (RLinf's projection)."""
    b = _position(target, bins)
    lower = b.floor().long().clamp(0, bins - 1)
    upper = (lower + 1).clamp(max=bins - 1)
    frac = b - lower.float()  # 0 on a bin (then `upper` gets nothing)
    out = torch.zeros(*target.shape, bins, dtype=torch.float32, device=target.device)
    out.scatter_add_(-1, lower.unsqueeze(-1), (1.0 - frac).unsqueeze(-1))
    out.scatter_add_(-1, upper.unsqueeze(-1), frac.unsqueeze(-1))
    return out


def nearest_bin(target: torch.Tensor, bins: int) -> torch.Tensor:
    """The bin nearest each target; halfway between two bins: the lower one (RLinf's `acc_best`)."""
    b = _position(target, bins)
    lower = b.floor()
    return torch.where(b - lower > 0.5, lower + 1, lower).long().clamp(0, bins - 1)


def categorical_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(B,): cross-entropy of the softmax of `logits` (B, bins) against the two-hot targets."""
    bins = logits.shape[-1]
    return -(two_hot(target, bins) * F.log_softmax(logits.float(), dim=-1)).sum(dim=-1)


def expected_value(logits: torch.Tensor) -> torch.Tensor:
    """(B,): V = sum over bins of softmax(logits) * atom."""
    probs = F.softmax(logits.float(), dim=-1)
    return (probs * atoms(logits.shape[-1], logits.device)).sum(dim=-1)


# ------------------------------------------------------------------------------------- the model
class ValueModel(nn.Module):
    """pi0.5's VLM prefix + a learned read-out token + a linear head over `bins` bins."""

    def __init__(self, policy: nn.Module, bins: int) -> None:
        super().__init__()
        if bins < 2:
            raise ValueError(f"a distribution over bins needs at least 2 bins, got {bins}")
        spec = spec_of(policy)
        if spec.value is None:
            raise ValueError(f"model {spec.name!r} has no VLM prefix for the value model (its ModelSpec.value is "
                             f"None): RECAP's value model is built on a model that names one")
        spec.value.strip(policy)
        self.policy = policy
        width = spec.value.width(policy)
        self.bins = bins
        self.readout = nn.Embedding(1, width)
        nn.init.normal_(self.readout.weight, std=0.02)  # RLinf's cls_embedding
        self.head = nn.Linear(width, bins)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        """Logits (B, bins) of a prepared batch: camera images (B, 3, H, W) in [0, 1],
        `tokens` (B, L) and `token_mask` (B, L) of the prompt."""
        tokens = batch[TOKENS_KEY]
        images, img_masks = self.policy._preprocess_images(batch)  # noqa: SLF001 - LeRobot's resize + [-1, 1]
        # An embedding lookup, not `.weight`: FSDP2 gathers parameters in a module's forward hooks.
        ids = torch.zeros(tokens.shape[0], 1, dtype=torch.long, device=tokens.device)
        # A frozen prefix (recap.value_trainable: head, or no gradient wanted) runs once without
        # grad; only the read-out token runs with it (pi05.forward.vlm_prefix_readout).
        spec = spec_of(self.policy)
        frozen = not torch.is_grad_enabled() or spec.prefix_frozen(self.policy)
        hidden = spec.value.readout(self.policy, images, img_masks, tokens,
                                    batch[TOKEN_MASK_KEY], self.readout(ids), frozen_prefix=frozen)
        return self.head(hidden[:, 0]).float()

    def backbone_parameters(self) -> list[nn.Parameter]:
        head = {id(p) for p in self.head_parameters()}
        return [p for p in self.parameters() if id(p) not in head]

    def head_parameters(self) -> list[nn.Parameter]:
        return [*self.readout.parameters(), *self.head.parameters()]

    def fsdp_units(self) -> list:
        """FSDP2 units (`pisft.train.fsdp.choose_units`), as the model's spec lists them for its
        prefix (pi0.5's: `pisft.model.pi05.units.value_units`): the read-out token and the head
        stay in the root."""
        return spec_of(self.policy).value.fsdp_units(self, "policy.")


# ------------------------------------------------------------------------------- save and load
@dataclass(frozen=True)
class ValueModelConfig:
    base_model: str  # the base model directory: architecture (config.json) and tokenizer
    preset: str
    bins: int
    return_min: float  # the return range of the training data (the value target's scale)
    return_max: float
    base_config_sha256: str = ""  # of the base model's config.json when the model was trained
    prompt: str = "task"  # the plain task text, advantage label stripped
    # The model the frozen tensors are read from (`pisft.base_identity.base_record`: its
    # directory and identity); None: every tensor is in the model's own file.
    frozen_from: dict[str, Any] | None = None
    frozen_dtype: str = "float32"  # what training held the frozen tensors in (bfloat16 or float32)
    v_min: float = V_MIN
    v_max: float = V_MAX
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def read(cls, path: Path) -> ValueModelConfig:
        if not path.is_file():
            raise ModelLoadError(f"{path}: not found; {path.parent} is not a value model directory "
                                 "(run the train_value stage)")
        from pisft import records
        from pisft.integrity import writer_of

        found = writer_of(path.parent.absolute())
        writer = f"{found[0]} ({found[1]})" if found else TRAIN_VALUE.name
        raw = records.read(path, records.fields_of(cls), writer=writer,
                           required=tuple(f.name for f in fields(cls) if f.default is MISSING))
        known = {f.name for f in fields(cls)}
        config = cls(**{k: v for k, v in raw.items() if k in known})
        if config.format_version not in READABLE_VERSIONS:
            raise ModelLoadError(f"{path}: format_version {config.format_version} is not one this pisft reads "
                                 f"({', '.join(map(str, READABLE_VERSIONS))}); run the train_value stage again "
                                 "with this pisft")
        if config.frozen_dtype not in ("float32", "bfloat16"):
            raise ModelLoadError(f"{path}: frozen_dtype {config.frozen_dtype!r} is neither float32 nor bfloat16; "
                                 "run the train_value stage again")
        return config


def from_base(base_dir: Path, *, bins: int, preset: str | None, seed: int, hold_bf16=None) -> ValueModel:
    """A value model whose backbone is that of the model in `base_dir` (the base model or policy
    k-1, loaded strictly), read-out token and head freshly initialised from `seed` (identical on
    every process). `hold_bf16`: as `load_policy`'s (the frozen parameters of a bf16 run loaded
    straight into bf16)."""
    from pisft.model.policy import load_policy

    policy = load_policy(base_dir, device="cpu", dtype="float32", preset=preset, hold_bf16=hold_bf16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ValueModel(policy, bins)


def save(model: ValueModel, out_dir: Path, config: ValueModelConfig,
         state_dict: dict[str, torch.Tensor] | None = None, write_weights: Any = None) -> None:
    """Write `model` (or a full `state_dict` of it, e.g. gathered from FSDP; or through
    `write_weights(path)`, e.g. streamed with LoRA adapters merged and, with `config.frozen_from`,
    the frozen tensors left out) into the existing directory `out_dir` (the caller makes it atomic)."""
    from pisft.io import write_manifest
    from pisft.model.weights import save_weights

    if write_weights is not None:
        write_weights(out_dir / WEIGHTS_FILE)
    else:
        save_weights(model, out_dir / WEIGHTS_FILE, state_dict=state_dict)
    (out_dir / CONFIG_FILE).write_text(config.to_json())
    write_manifest(out_dir)


def load(model_dir: Path, *, device: str | torch.device = "cpu") -> tuple[ValueModel, ValueModelConfig]:
    """A saved value model, loaded strictly (every tensor, no other), in eval mode on `device`."""
    from pisft.io import sha256_file
    from pisft.model.policy import CONFIG_FILE as POLICY_CONFIG
    from pisft.model.policy import policy_from_config, read_config, read_model_info
    from pisft.model.weights import load_strict

    from pisft.integrity import verify_read

    model_dir = Path(model_dir)
    verify_read(model_dir, what=f"loading the value model {model_dir}", required=True, stage=TRAIN_VALUE.name)
    config = ValueModelConfig.read(model_dir / CONFIG_FILE)
    base = Path(config.base_model)
    if not (base / POLICY_CONFIG).is_file():
        raise ModelLoadError(f"{model_dir / CONFIG_FILE}: its base model {base} has no {POLICY_CONFIG}; "
                             "the value model needs the base model it was trained from (run fetch_base)")
    if config.base_config_sha256 and sha256_file(base / POLICY_CONFIG) != config.base_config_sha256:
        raise ModelLoadError(f"{base / POLICY_CONFIG} changed since the value model in {model_dir} was "
                             "trained from it; run the train_value stage again")
    policy_config, _ = read_config(base / POLICY_CONFIG)
    policy = policy_from_config(policy_config, read_model_info(base), device="cpu", dtype="float32", init=False)
    model = ValueModel(policy, config.bins)
    if config.frozen_from is None:
        load_strict(model, model_dir / WEIGHTS_FILE)
    else:
        _load_with_frozen_part(model, model_dir, config, base)
    model.to(device)
    model.policy.config.device = str(device)
    model.eval()
    return model, config


def _load_with_frozen_part(model: ValueModel, model_dir: Path, config: ValueModelConfig, base: Path) -> None:
    """The tensors of `model_dir`'s own file from it, every other one from `base`'s file (the model
    `config.frozen_from` names, checked to be the same one), each strictly and once."""
    from pisft.integrity import verify_read
    from pisft.model import weights
    from pisft.base_identity import base_id, base_record, same_base
    from pisft.model.policy import empty_in_bf16

    current = base_record(base)
    if not same_base(config.frozen_from, current):
        raise ModelLoadError(
            f"{model_dir}: its frozen weights are read from {base}, which held {base_id(config.frozen_from)} "
            f"when it was trained but holds {base_id(current)} now (another model); run the train_value "
            "stage again (snakemake --cores all --forcerun train_value_<k>)")
    verify_read(base, what=f"loading the frozen weights of the value model {model_dir}")
    own = set(weights.tensor_locations(model_dir / WEIGHTS_FILE)[0])
    for group in weights.tied_groups(model):  # a tied tensor is written once, under one name
        if own & set(group):
            own |= set(group)
    frozen = frozenset(set(weights.expected_shapes(model)) - own)
    if config.frozen_dtype == "bfloat16":  # as training held them (pisft.train.trainable.hold_frozen_in)
        keep_fp32 = spec_of(model).trainable.keep_fp32  # what training keeps in float32 though frozen
        empty_in_bf16(model, lambda name: name in frozen and not any(k in name for k in keep_fp32))
    weights.load_strict(model, base / WEIGHTS_FILE, rename=lambda n: "policy." + weights.lerobot_name(n),
                        only=frozen)
    weights.load_strict(model, model_dir / WEIGHTS_FILE, only=frozenset(own))
