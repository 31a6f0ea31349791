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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from pisft.errors import ModelLoadError
from pisft.io import follow_umask

LIST_LIMIT = 12  # names shown per list in an error message


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


def file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}  # noqa: SIM118 - safe_open has no `in`
    except Exception as exc:  # noqa: BLE001 - safetensors raises many types for a damaged file
        raise ModelLoadError(
            f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc}); "
            f"re-download or re-export it"
        ) from None


def load_strict(
    module: torch.nn.Module,
    path: str | Path,
    *,
    rename: Callable[[str], str] | None = None,
    optional: frozenset[str] = frozenset(),
) -> dict[str, list[str]]:
    """Load `path` into `module` strictly, one tensor at a time (low peak memory).

    `rename` maps a file name to the model's name (for layouts such as openpi's). `optional`:
    model names a file may lack (tensors the forward never reads); they are zero-filled and
    listed in the report's "optional_missing". Returns a report: which tied names were filled
    from which, tied duplicates that differed, and the optional names that were absent.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: weights file not found")
    raw_shapes = file_shapes(path)
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
    with safe_open(str(path), framework="pt") as fh, torch.no_grad():
        for name, source in plan.items():
            target = targets[name]
            if id(target) in loaded_from:
                continue
            tensor = fh.get_tensor(to_file[source])
            target.copy_(tensor.to(dtype=target.dtype))
            loaded_from[id(target)] = source
            if source != name:
                report["tied_filled"].append(f"{name} <- {source}")
        for group in groups:
            present = [n for n in group if n in provided]
            if len(present) > 1:
                used = plan[group[0]]
                ref = fh.get_tensor(to_file[used])
                for other in present:
                    if other != used and not torch.equal(fh.get_tensor(to_file[other]), ref):
                        report["tied_conflicts"].append(
                            f"{other} differs from {used} (tied in the model; {used} was loaded)"
                        )
    return report


def read_tensor(path: str | Path, name: str, *,
                rename: Callable[[str], str] | None = None) -> torch.Tensor | None:
    """The tensor a file holds under model name `name` (after `rename`), or None."""
    from safetensors import safe_open

    rename = rename or (lambda n: n)
    with safe_open(str(path), framework="pt") as fh:
        for file_name in fh.keys():  # noqa: SIM118 - safe_open is no mapping
            if rename(file_name) == name:
                return fh.get_tensor(file_name)
    return None


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
