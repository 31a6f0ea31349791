"""Strict weight loading and saving (safetensors only, never unpickled).

Strict means: every tensor the model has is in the file (up to tied aliases, see below), the file
has no tensor the model lacks, and every shape matches. Otherwise `ModelLoadError` lists the
missing, unexpected and mis-shaped names. LeRobot's `from_pretrained` is never used for weights:
it falls back to random initialisation on a failed load with only a printed warning.

Tied tensors (several names, one Parameter, e.g. PaliGemma's `lm_head.weight` and
`embed_tokens.weight`) are saved once, under the alphabetically first name (safetensors'
`save_model` convention, which is also what openpi's converter and `lerobot/pi05_base` hold). On
load, any one name of a tied group satisfies the group; if a file holds several names of one
group, the name the forward pass reads (not an `lm_head`) wins, and the difference is reported.

A checkpoint's tensors may be in one safetensors file, in shards listed by
`model.safetensors.index.json` (what `save_pretrained` and huggingface_hub write above their shard
size: `{"metadata": {...}, "weight_map": {tensor name: shard file name}}`), or, for RLinf's FSDP
checkpoints, in a torch file holding a plain state dict (`full_weights.pt`), which is read with
`torch.load(weights_only=True)` only: tensors and containers, never an arbitrary pickle.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from pisft.errors import ModelLoadError
from pisft.io import follow_umask

LIST_LIMIT = 12  # names shown per list in an error message


def read_json(path: Path, *, missing: str, hint: str = "") -> Any:
    """The JSON document of a checkpoint's file, or a ModelLoadError naming the file: `missing`
    when it is absent, the parser's message (and `hint`) when it is not valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: {missing}") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})" + (f"; {hint}" if hint else "")) from None

def lerobot_name(name: str) -> str:
    """A file's tensor name as the policy's state dict names it.

    openpi's converted PyTorch checkpoints name tensors as LeRobot does but without the policy's
    `model.` prefix; LeRobot's own loader adds it the same way. A one-to-one rename: two file
    names that map to one model name are an error (see `load_strict`).
    """
    return name if name.startswith("model.") else f"model.{name}"


def tied_groups(module: torch.nn.Module) -> list[list[str]]:
    """Groups (size > 1) of state-dict names that are one and the same tensor in `module`."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    for name, buf in module.named_buffers(remove_duplicate=False):
        by_tensor.setdefault(id(buf), []).append(name)
    return [sorted(names) for names in by_tensor.values() if len(names) > 1]


def _loader_preference(names: list[str]) -> list[str]:
    """Order in which a tied group's names are taken from a file: not-an-lm_head first."""
    return sorted(names, key=lambda n: ("lm_head" in n, n))


def expected_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in module.state_dict(keep_vars=True).items()}


def _fmt(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = names[:LIST_LIMIT]
    more = f"\n      ... and {len(names) - LIST_LIMIT} more" if len(names) > LIST_LIMIT else ""
    return "".join(f"\n      {n}" for n in shown) + more


def compare(
    expected: dict[str, tuple[int, ...]],
    provided: dict[str, tuple[int, ...]],
    groups: list[list[str]],
) -> tuple[dict[str, str], list[str], list[str], list[str]]:
    """Match a file's names/shapes against the model's.

    Returns (plan, missing, unexpected, mis-shaped): plan maps each model name to the file name
    it is read from; the three lists are what makes a load non-strict.
    """
    alias_of: dict[str, list[str]] = {}
    for group in groups:
        for name in group:
            alias_of[name] = group
    plan: dict[str, str] = {}
    missing: list[str] = []
    for name in expected:
        if name in plan:
            continue
        group = alias_of.get(name, [name])
        source = next((n for n in _loader_preference(group) if n in provided), None)
        if source is None:
            missing.append(name if len(group) == 1 else " = ".join(group))
            for n in group:
                plan.pop(n, None)
            continue
        for n in group:
            plan[n] = source
    missing = sorted(set(missing))
    unexpected = sorted(set(provided) - set(expected))
    misshaped = sorted(
        f"{name}: file {list(provided[src])}, model {list(expected[name])}"
        for name, src in plan.items()
        if provided[src] != expected[name]
    )
    return plan, missing, unexpected, misshaped


def raise_if_not_strict(source: str, missing: list[str], unexpected: list[str], misshaped: list[str],
                        hint: str = "") -> None:
    if not (missing or unexpected or misshaped):
        return
    parts = [f"{source}: the weights do not match the model architecture (strict loading):"]
    if missing:
        parts.append(f"  missing from the file ({len(missing)}):{_fmt(missing)}")
    if unexpected:
        parts.append(f"  in the file but not in the model ({len(unexpected)}):{_fmt(unexpected)}")
    if misshaped:
        parts.append(f"  wrong shape ({len(misshaped)}):{_fmt(misshaped)}")
    pi0_names = [n for n in unexpected if ".state_proj." in f".{n}" or "action_time_mlp_" in n]
    if pi0_names:
        parts.append(f"  {pi0_names[0]} is a pi0 tensor (pi0 has state_proj and action_time_mlp_*; "
                     f"pi0.5 has time_mlp_* and adaRMS norms): this is a pi0 checkpoint, not pi0.5.")
    parts.append(hint or "  Check that model.preset matches the checkpoint (pi0.5, not pi0) and that the "
                         "checkpoint is complete; nothing was loaded.")
    raise ModelLoadError("\n".join(parts))


def _single_file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}  # noqa: SIM118 - safe_open has no `in`
    except Exception as exc:  # noqa: BLE001 - safetensors raises many types for a damaged file
        raise ModelLoadError(
            f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc}); "
            f"re-download or re-export it"
        ) from None


def _shard_like(name: str) -> bool:
    # `model-00001-of-00003.safetensors`, as save_pretrained / huggingface_hub name shards
    stem = name.removesuffix(".safetensors")
    parts = stem.rsplit("-", 3)
    return (name.endswith(".safetensors") and len(parts) == 4 and parts[2] == "of"
            and parts[1].isdigit() and parts[3].isdigit())


def tensor_locations(path: str | Path) -> tuple[dict[str, tuple[int, ...]], dict[str, Path]]:
    """(shapes, file of each tensor) of one safetensors file or of the shards an index lists.

    An index is checked strictly: every shard it names exists, every shard holds exactly the
    tensors the index assigns to it, no tensor is in two shards, and no shard-named file beside
    the index is left out of it (any of these would silently drop or shadow tensors).
    """
    path = Path(path)
    if not path.name.endswith(".index.json"):
        shapes = _single_file_shapes(path)
        return shapes, {name: path for name in shapes}
    raw = read_json(path, missing="safetensors index not found",
                    hint="re-download or re-export the checkpoint")
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ModelLoadError(f"{path}: no \"weight_map\" of tensor name -> shard file (the layout "
                             f"save_pretrained writes); re-download or re-export the checkpoint")
    directory = path.parent
    by_shard: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, set()).add(name)
    missing_files = sorted(s for s in by_shard if not (directory / s).is_file())
    if missing_files:
        raise ModelLoadError(f"{path}: shards named by the index are missing: {', '.join(missing_files)} "
                             f"(download every model-*-of-*.safetensors file)")
    stray = sorted(p.name for p in directory.iterdir() if _shard_like(p.name) and p.name not in by_shard)
    problems: list[str] = []
    if stray:
        problems.append(f"shard files the index does not list (left over from another save?): {', '.join(stray)}")
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, Path] = {}
    for shard in sorted(by_shard):
        shard_shapes = _single_file_shapes(directory / shard)
        absent = sorted(by_shard[shard] - set(shard_shapes))
        unlisted = sorted(set(shard_shapes) - by_shard[shard])
        if absent:
            problems.append(f"{shard} lacks {len(absent)} tensor(s) the index puts there:{_fmt(absent)}")
        if unlisted:
            problems.append(f"{shard} holds {len(unlisted)} tensor(s) the index does not list "
                            f"there:{_fmt(unlisted)}")
        for name, shape in shard_shapes.items():
            if name in by_shard[shard]:
                shapes[name] = shape
                where[name] = directory / shard
    if problems:
        raise ModelLoadError(f"{path}: the shards do not match their index:\n  " + "\n  ".join(problems)
                             + "\n  Re-download or re-export the checkpoint; nothing was loaded.")
    return shapes, where


def file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a safetensors file, or of the shards an index lists."""
    return tensor_locations(path)[0]


class _PreadTensors:
    """The tensors of one safetensors file, each read with `pread` into a tensor of its own.

    safetensors' `safe_open` maps the whole file and copies each tensor out of the mapping; every
    page it touched stays in the process's resident set until the file is closed, so loading a
    model held its weights twice at the end of the load (pi0.5: 8.4 GB of file pages beside the
    13.4 GB fp32 model: the closed loop's and the offline evaluation's peak). Read this way, the
    file's bytes pass through the page cache (the kernel's, reclaimable) and one tensor-sized
    buffer at a time. The header is the format's: 8 bytes little-endian length, then JSON with each
    tensor's dtype, shape and `data_offsets` from the end of the header.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            length = int.from_bytes(os.pread(self.fd, 8, 0), "little")
            self.header = json.loads(os.pread(self.fd, length, 8))
        except (ValueError, OSError) as exc:
            os.close(self.fd)
            raise ModelLoadError(f"{path}: unreadable safetensors header ({exc}); "
                                 "re-download or re-export it") from None
        self.start = 8 + length

    def get(self, name: str) -> torch.Tensor:
        meta = self.header[name]
        begin, end = meta["data_offsets"]
        out = torch.empty(meta["shape"], dtype=_TORCH_DTYPE[meta["dtype"]])
        raw = out.reshape(-1).view(torch.uint8).numpy()  # the tensor's own bytes
        if raw.nbytes != end - begin:
            raise ModelLoadError(f"{self.path}: {name} holds {end - begin} bytes, its shape and dtype need "
                                 f"{raw.nbytes}; re-download or re-export it")
        done = 0
        while done < raw.nbytes:
            got = os.preadv(self.fd, [raw[done:]], self.start + begin + done)
            if got <= 0:
                raise ModelLoadError(f"{self.path}: ends inside {name} (truncated); re-download or re-export it")
            done += got
        return out

    def close(self) -> None:
        os.close(self.fd)


@contextlib.contextmanager
def _tensor_reader(where: dict[str, Path]) -> Iterator[Callable[[str], torch.Tensor]]:
    """`get(name)` reading each tensor from its file (each file opened once): by `pread`
    (`_PreadTensors`) where the host is little-endian like the format, else through safetensors."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        readers: dict[Path, Callable[[str], torch.Tensor]] = {}

        def get(name: str) -> torch.Tensor:
            file = where[name]
            if file not in readers:
                if sys.byteorder == "little" and hasattr(os, "preadv"):
                    reader = _PreadTensors(file)
                    stack.callback(reader.close)
                    readers[file] = reader.get
                else:
                    readers[file] = stack.enter_context(safe_open(str(file), framework="pt")).get_tensor
            return readers[file](name)

        yield get


def load_strict(
    module: torch.nn.Module,
    path: str | Path,
    *,
    rename: Callable[[str], str] | None = None,
    optional: frozenset[str] = frozenset(),
    only: frozenset[str] | None = None,
) -> dict[str, list[str]]:
    """Load `path` into `module` strictly, one tensor at a time (low peak memory).

    `rename` maps a file name to the model's name (for layouts such as openpi's). `optional`:
    model names a file may lack (tensors the forward never reads); they are zero-filled and
    listed in the report's "optional_missing". `only`: the model names this file provides (each
    must be there); the file's other tensors are not read (a model's frozen part from its base
    model's file, whose other tensors belong to parts this model does not have). Returns a
    report: which tied names were filled from which, tied duplicates that differed, and the
    optional names that were absent.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: weights file not found")
    raw_shapes, where = tensor_locations(path)
    rename = rename or (lambda n: n)
    to_file: dict[str, str] = {}
    for file_name in raw_shapes:
        model_name = rename(file_name)
        if model_name in to_file:
            raise ModelLoadError(
                f"{path}: tensors {to_file[model_name]!r} and {file_name!r} both map to {model_name!r}")
        to_file[model_name] = file_name
    provided = {m: raw_shapes[f] for m, f in to_file.items()}
    groups = tied_groups(module)
    expected = expected_shapes(module)
    if only is not None:
        provided = {m: shape for m, shape in provided.items() if m in only}
        expected = {m: shape for m, shape in expected.items() if m in only}
        groups = [kept for kept in ([n for n in g if n in only] for g in groups) if len(kept) > 1]
    plan, missing, unexpected, misshaped = compare(expected, provided, groups)
    optional_missing = sorted(n for n in missing if n in optional)
    missing = [n for n in missing if n not in optional]
    raise_if_not_strict(str(path), missing, unexpected, misshaped)

    targets = module.state_dict(keep_vars=True)
    report: dict[str, list[str]] = {"tied_filled": [], "tied_conflicts": [],
                                    "optional_missing": optional_missing}
    with torch.no_grad():
        for name in optional_missing:
            targets[name].zero_()
    loaded_from: dict[int, str] = {}
    with _tensor_reader(where) as get_tensor, torch.no_grad():
        for name, source in plan.items():
            target = targets[name]
            if id(target) in loaded_from:
                continue
            tensor = get_tensor(to_file[source])
            target.copy_(tensor)  # cast to the parameter's dtype in place
            loaded_from[id(target)] = source
            if source != name:
                report["tied_filled"].append(f"{name} <- {source}")
        for group in groups:
            present = [n for n in group if n in provided]
            if len(present) > 1:
                used = plan[group[0]]
                ref = get_tensor(to_file[used])
                for other in present:
                    if other != used and not torch.equal(get_tensor(to_file[other]), ref):
                        report["tied_conflicts"].append(
                            f"{other} differs from {used} (tied in the model; {used} was loaded)"
                        )
    return report


# torch dtype -> safetensors' dtype name (safetensors' format specification).
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_TORCH_DTYPE = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}  # what _PreadTensors reads
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _dtype_name(name: str, tensor: torch.Tensor) -> str:
    if tensor.dtype not in _SAFETENSORS_DTYPES:
        raise ModelLoadError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot hold")
    return _SAFETENSORS_DTYPES[tensor.dtype]


def write_safetensors(path: str | Path, names: Iterable[str], get_tensor: Callable[[str], torch.Tensor],
                      *, specs: dict[str, tuple[str, list[int]]] | None = None,
                      metadata: dict[str, str] | None = None) -> None:
    """Write the named tensors to one safetensors file, one tensor in memory at a time.

    The bytes of each tensor are written unchanged (same dtype, same values): merging shards or
    converting a torch state dict keeps every value bit for bit. `specs` (name -> safetensors
    dtype name and shape) spares reading each tensor twice; without it the header is built from
    the tensors themselves.
    """
    if sys.byteorder != "little":  # safetensors stores little-endian data
        raise ModelLoadError("writing safetensors needs a little-endian host")
    names = sorted(names)
    if specs is None:
        specs = {}
        for name in names:
            tensor = get_tensor(name)
            specs[name] = (_dtype_name(name, tensor), list(tensor.shape))
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name in names:
        dtype, shape = specs[name]
        size = _DTYPE_BYTES[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    path = Path(path)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for name in names:
            tensor = get_tensor(name).detach().to("cpu").contiguous()
            if (_dtype_name(name, tensor), list(tensor.shape)) != (specs[name][0], list(specs[name][1])):
                raise ModelLoadError(f"tensor {name!r} changed while being written ({tensor.dtype}, "
                                     f"{list(tensor.shape)} against {specs[name]})")
            if tensor.numel():
                fh.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
    follow_umask(path)


def merge_shards(index: str | Path, out: str | Path) -> int:
    """One safetensors file holding every tensor of the shards `index` lists (checked strictly);
    returns the number of shards."""
    from safetensors import safe_open

    _, where = tensor_locations(index)
    specs: dict[str, tuple[str, list[int]]] = {}
    for file in sorted(set(where.values())):
        with safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is no mapping
                if where.get(name) == file:
                    piece = fh.get_slice(name)
                    specs[name] = (piece.get_dtype(), list(piece.get_shape()))
    with _tensor_reader(where) as get_tensor:
        write_safetensors(out, where, get_tensor, specs=specs)
    return len(set(where.values()))


def read_torch_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A plain state dict from a torch file, read with `torch.load(weights_only=True)` only.

    RLinf writes its FSDP checkpoints' full weights so (`torch.save(get_model_state_dict(...,
    full_state_dict=True))` into `model_state_dict/full_weights.pt`; RLinf
    `rlinf/hybrid_engines/fsdp/strategy/base.py`). Anything but a flat {name: tensor} mapping is
    refused, and so is any pickled object `weights_only` does not allow: nothing else is unpickled.
    """
    import pickle

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: weights file not found")
    obj = None
    for mmap in (True, False):  # mmap: tensors are paged in as they are read (a legacy file cannot)
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            break
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelLoadError(
                f"{path}: refused: the file holds more than tensors and plain containers "
                f"(torch.load with weights_only=True: {first}). pisft never unpickles arbitrary objects; "
                f"re-save the weights as a plain state dict (torch.save(model.state_dict(), ...)) or as "
                f"safetensors") from None
        except (RuntimeError, OSError, ValueError, EOFError) as exc:
            if mmap:
                continue
            raise ModelLoadError(f"{path}: not a readable torch file ({type(exc).__name__}: {exc}); "
                                 f"re-download or re-save it") from None
    if not isinstance(obj, dict) or not obj:
        raise ModelLoadError(f"{path}: expected a state dict ({{tensor name: tensor}}), found "
                             f"{type(obj).__name__}{' (empty)' if isinstance(obj, dict) else ''}")
    bad = [f"{k!r}: {type(v).__name__}" for k, v in obj.items()
           if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise ModelLoadError(f"{path}: not a flat state dict of tensors; entries that are not tensors "
                             f"({len(bad)}):{_fmt(bad)}\n  (a training checkpoint with optimizer state? "
                             f"give the model's full weights file)")
    return obj


def save_weights(module: torch.nn.Module, path: str | Path,
                 state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write `module`'s weights (or the given full state dict) to safetensors, tied names once."""
    from safetensors.torch import save_file

    source = dict(state_dict if state_dict is not None else module.state_dict())
    expected = set(module.state_dict().keys())
    unknown = set(source) - expected
    if unknown:
        raise ValueError(f"state dict has names the model lacks: {sorted(unknown)[:LIST_LIMIT]}")
    absent = expected - set(source)
    for group in tied_groups(module):
        present = [n for n in _loader_preference(group) if n in source]
        if not present:
            continue
        # Saved once under the group's first name, with the value the forward pass reads.
        value = source[present[0]]
        for n in group:
            source.pop(n, None)
            absent.discard(n)
        source[group[0]] = value
    if absent:
        raise ValueError(f"state dict lacks names the model has: {sorted(absent)[:LIST_LIMIT]}")
    tensors = {}
    for name, tensor in source.items():
        if hasattr(tensor, "full_tensor"):  # a DTensor from FSDP2: gather
            tensor = tensor.full_tensor()
        tensors[name] = tensor.detach().to("cpu").contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    follow_umask(path)  # safetensors writes 0600
