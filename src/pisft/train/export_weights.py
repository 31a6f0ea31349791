"""The exported weights, written one tensor at a time: a plain LeRobot pi0.5 file, and the LoRA adapter alone.

`write_policy_weights` writes `model.safetensors` in LeRobot's layout (the names of a plain
PI05Policy; tied tensors once, `pisft.model.weights`), whatever `train.trainable` was:
- a trained parameter: gathered from its FSDP2 shards (`DTensor.full_tensor`, a collective every
  rank joins in the same order), written by rank 0, dropped before the next;
- a frozen parameter: copied from the base model's file, bytes unchanged (bit-identical to the
  base, in the base's dtype; what training held of it in bf16 is not used);
- a LoRA-adapted weight: merged, W + (alpha / r) · B · A (W from the base file, A and B gathered;
  peft's `lora.Linear.get_delta_weight` without fan_in_fan_out), in float32;
- the action expert's lm_head (detached for training): the base file's.
Host memory on rank 0 is one tensor at a time (and the base file's pages through mmap), not the
model gathered whole (`get_model_state_dict(full_state_dict=True)` held every tensor at once, then
safetensors' `save_file` a second copy of its bytes).

`write_adapter` writes the adapter alone in PEFT's layout, what `PeftModel.from_pretrained` and
LeRobot's `use_peft` loading (`lerobot/rollout/context.py` `_load_pretrained_policy`) read:
`adapter_config.json` (the LoraConfig, `base_model_name_or_path` the base model directory, the
fully trained modules as `modules_to_save`) and `adapter_model.safetensors` (`base_model.model.
<module>.lora_A.weight` / `lora_B.weight`, and the fully trained modules' tensors under their own
names, as peft's `save_pretrained` names them), plus LeRobot's `config.json` with `use_peft: true`.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pisft.model import weights as weights_mod
from pisft.model.registry import spec_of
from pisft.model.sources import WEIGHTS_FILE

_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>A|B)\.default\.weight$")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass
class Source:
    kind: str  # trained | frozen | merged | buffer
    tensor: Any = None  # the model's parameter or buffer (trained, buffer; merged: the base_layer weight)
    file_name: str | None = None  # the base file's tensor name (frozen, merged)
    lora: tuple[Any, Any, float] | None = None  # merged: A, B, scaling
    rows: tuple[int, int] | None = None  # trained: these rows of a fused parameter (pisft.model.pi05 12.)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for an FSDP2 DTensor), on the CPU."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu")


def base_specs(where: dict[str, Path]) -> dict[str, tuple[str, list[int]]]:
    """file tensor name -> (safetensors dtype, shape), read from the headers of the base's files."""
    out: dict[str, tuple[str, list[int]]] = {}
    for file in sorted(set(where.values())):
        with open(file, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name != "__metadata__" and where.get(name) == file:
                out[name] = (entry["dtype"], list(entry["shape"]))
    return out


def _lora_scalings(model: torch.nn.Module) -> dict[str, float]:
    """module name -> peft's scaling (alpha / r) of its default adapter."""
    return {name: float(m.scaling["default"]) for name, m in model.named_modules()
            if isinstance(getattr(m, "scaling", None), dict) and "default" in m.scaling}


def policy_sources(model: torch.nn.Module, base_weights: Path,
                   prefix: str = "") -> tuple[dict[str, Source], dict[str, Path]]:
    """Every tensor of the plain LeRobot file -> where its value comes from (same on every rank).
    `prefix`: where the policy sits in `model` (the RECAP value model's `policy.`)."""
    _, where = weights_mod.tensor_locations(base_weights)
    in_base = {prefix + weights_mod.lerobot_name(n): n for n in where}
    state = model.state_dict(keep_vars=True)
    params = {id(p) for p in model.parameters()}
    scalings = _lora_scalings(model)
    lora = {}
    for name, t in state.items():
        m = _LORA.match(name)
        if m:
            lora.setdefault(m["module"], {})[m["ab"]] = t
    tied_drop = {n for group in weights_mod.tied_groups(model) for n in group[1:]}
    sources: dict[str, Source] = {}
    model_spec = spec_of(model)
    modules = dict(model.named_modules())
    for name, t in state.items():
        if name in tied_drop or _LORA.match(name):
            continue
        parts = model_spec.fused_rows(lambda n: modules[n.rsplit(".", 1)[0]], name)
        if parts is not None:  # a fused projection: LeRobot's separate tensors, each its rows
            for plain, start, end in parts:
                frozen = not t.requires_grad and plain in in_base
                sources[plain] = (Source("frozen", None, in_base[plain]) if frozen
                                  else Source("trained", t, rows=(start, end)))
            continue
        plain = name.replace(".base_layer.", ".")
        module = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        if module is not None and plain.endswith(".weight") and module in lora:
            ab = lora[module]
            sources[plain] = Source("merged", t, in_base.get(plain), (ab["A"], ab["B"], scalings[module]))
        elif id(t) not in params:
            sources[plain] = Source("buffer", t)
        elif not t.requires_grad and plain in in_base:
            sources[plain] = Source("frozen", None, in_base[plain])
        else:
            sources[plain] = Source("trained", t)
    head = model_spec.detached_weight
    if head is not None and not prefix and head not in sources and head in in_base:  # detached for training
        sources[head] = Source("frozen", None, in_base[head])
    return sources, where


_TORCH_TO_ST = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL", torch.uint8: "U8"}


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling · B · A in float32 (W: out x in, A: r x in, B: out x r)."""
    return w.float() + scaling * (b.float() @ a.float())


def _spec(source: Source, specs: dict[str, tuple[str, list[int]]]) -> tuple[str, list[int]]:
    if source.kind == "frozen":
        return specs[source.file_name]
    if source.kind == "merged":
        return "F32", list(source.tensor.shape)
    shape = list(source.tensor.shape)
    if source.rows is not None:
        shape[0] = source.rows[1] - source.rows[0]
    return _TORCH_TO_ST[source.tensor.dtype], shape


def _write_collectively(path: Path | None, names: list[str], specs: dict[str, tuple[str, list[int]]],
                        value: Callable[[str], torch.Tensor | None], is_main: bool) -> None:
    """Rank 0 writes `names` (sorted, one tensor in memory at a time); every rank calls `value`
    for each name in the same order (gathers are collectives)."""
    names = sorted(names)
    if is_main:
        weights_mod.write_safetensors(path, names, value, specs=specs)
    else:
        for name in names:
            value(name)


def write_policy_weights(model: torch.nn.Module, base_weights: Path, out: Path | None, *,
                         is_main: bool, prefix: str = "", frozen: bool = True) -> dict[str, int]:
    """`out` (model.safetensors of a plain PI05Policy, or of the value model with `prefix`
    `policy.`) written from `model` and the base file. Collective. `frozen` False: the frozen
    tensors are left out (the file holds what differs from the base; its reader takes the rest
    from the base file, as `value_model.load` does). Returns the count of tensors of each kind
    (frozen, trained, merged, buffer), written or not."""
    sources, where = policy_sources(model, base_weights, prefix)
    counts: dict[str, int] = {}
    for s in sources.values():
        counts[s.kind] = counts.get(s.kind, 0) + 1
    if not frozen:
        sources = {n: s for n, s in sources.items() if s.kind != "frozen"}
    file_specs = base_specs(where)
    specs = {n: _spec(s, file_specs) for n, s in sources.items()}

    _write_collectively(out, list(sources), specs, lambda name: _value(sources[name], where, is_main), is_main)
    return counts


def _value(s: Source, where: dict[str, Path], is_main: bool) -> torch.Tensor | None:
    """What `s` writes (rank 0; None elsewhere). Collective for a sharded tensor."""
    if s.kind == "frozen":
        return _read_base(where, s.file_name) if is_main else None
    if s.kind == "merged":
        a, b, scaling = s.lora
        a_full, b_full = _full(a), _full(b)
        w = _read_base(where, s.file_name) if s.file_name is not None else None
        w = w if w is not None else _full(s.tensor)
        return merged_weight(w, a_full, b_full, scaling) if is_main else None
    t = _full(s.tensor)
    if s.rows is not None:
        t = t[s.rows[0]:s.rows[1]]
    return t.contiguous() if is_main else None


def _read_base(where: dict[str, Path], file_name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(where[file_name]), "pt") as fh:
        return fh.get_tensor(file_name)


# --------------------------------------------------------------------------------- the adapter
def adapter_sources(model: torch.nn.Module, spec) -> dict[str, Source]:
    """PEFT's adapter file names -> where each value comes from: LoRA A/B and the fully trained
    modules, a fused projection of one (rlinf's expert) as LeRobot's separate tensors (its rows)."""
    model_spec = spec_of(model)
    modules = dict(model.named_modules())
    out: dict[str, Source] = {}
    for name, p in model.named_parameters():
        if _LORA.match(name):
            out[PEFT_PREFIX + name.replace(".default.weight", ".weight")] = Source("trained", p)
        elif spec.trains_in_full(name):
            parts = model_spec.fused_rows(lambda n: modules[n.rsplit(".", 1)[0]], name)
            for plain, start, end in parts or [(name, None, None)]:
                out[PEFT_PREFIX + plain] = Source("trained", p, rows=None if parts is None else (start, end))
    return out


def write_adapter(model: torch.nn.Module, spec, base_dir: Path, out_dir: Path | None, *,
                  is_main: bool, policy_config: Any = None) -> int:
    """The adapter alone in PEFT's layout under `out_dir` (rank 0). Collective. Returns the tensors written."""
    sources = adapter_sources(model, spec)
    _, where = weights_mod.tensor_locations(Path(base_dir) / WEIGHTS_FILE)
    # A fully trained expert (rlinf) is saved whole (PEFT's modules_to_save), its lm_head too, which
    # training detached (never used, never trained): the base's tensor, as the merged export carries it.
    in_base = {weights_mod.lerobot_name(n): n for n in where}
    head = spec_of(model).detached_weight
    if (head is not None and spec.trains_in_full(head) and PEFT_PREFIX + head not in sources
            and head in in_base):
        sources[PEFT_PREFIX + head] = Source("frozen", None, in_base[head])
    file_specs = base_specs(where)
    specs = {n: _spec(s, file_specs) for n, s in sources.items()}

    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        config = spec.peft_config()
        config.base_model_name_or_path = str(Path(base_dir).resolve())
        config.modules_to_save = list(spec.full_modules) or None
        config.inference_mode = True
        config.save_pretrained(str(out_dir))
        if policy_config is not None:  # LeRobot's config.json, marked as an adapter (use_peft)
            import copy

            from pisft.model.policy import write_config

            marked = copy.copy(policy_config)
            marked.use_peft = True
            write_config(marked, out_dir / "config.json")
    _write_collectively(out_dir / ADAPTER_WEIGHTS if is_main else None, list(sources), specs,
                        lambda name: _value(sources[name], where, is_main), is_main)
    return len(sources)
