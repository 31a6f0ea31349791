"""The model registry: each model family's `ModelSpec` (pisft.model.spec) by name, the policy's type
as LeRobot names it (config.json's "type"), and by `model.preset`. A model's folder builds its spec;
`_BUILT_IN` lists it, one line per model (imported here, so a stage's code dependencies, read from
the imports by pisft.code_graph, hold the model's folder). `register` adds another (a test's
throwaway model) and tells the config its presets with their action chunks (`pisft.config.add_presets`:
they become valid `model.preset` values, which the config's chunk checks read); `unregister` takes them
back. A built-in model's presets are in the config's own table (`pisft.config.PRESETS`,
`PRESET_CHUNK_SIZES`), which a driver validates with without importing the registry.
"""

from __future__ import annotations

from typing import Any

from pisft import config
from pisft.errors import PisftError
from pisft.model.pi05.spec import SPEC as PI05
from pisft.model.spec import ModelSpec

_BUILT_IN = (PI05,)
_REGISTRY: dict[str, ModelSpec] = {spec.name: spec for spec in _BUILT_IN}


def register(spec: ModelSpec) -> ModelSpec:
    """Add `spec` under its name (a name taken, or a preset another spec holds, is refused)."""
    if spec.name in _REGISTRY:
        raise ValueError(f"a model named {spec.name!r} is registered already")
    taken = {p: s.name for s in _REGISTRY.values() for p in s.presets}
    clash = sorted(p for p in spec.presets if p in taken)
    if clash:
        raise ValueError(f"model {spec.name!r}: presets {clash} belong to {taken[clash[0]]!r}")
    config.add_presets(dict(spec.presets))  # refuses a name the config has already, adding nothing
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a registered spec (a test's throwaway model) and its presets from the config's choices;
    a built-in one stays."""
    if name not in {s.name for s in _BUILT_IN} and name in _REGISTRY:
        config.remove_presets(_REGISTRY.pop(name).presets)


def names() -> list[str]:
    return sorted(_REGISTRY)


def model_spec(name: str) -> ModelSpec:
    """The spec registered as `name` (LeRobot's policy type)."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise PisftError(f"no model {name!r} is registered (known: {', '.join(sorted(_REGISTRY))}): pisft "
                         f"builds, trains and serves only these")
    return spec


def spec_of(policy: Any) -> ModelSpec:
    """The spec of a built policy (or of a model holding one as `.policy`, the value model), by its
    LeRobot config's type."""
    inner = getattr(policy, "policy", policy)
    return model_spec(str(inner.config.type))


def spec_for_preset(preset: str) -> ModelSpec:
    """The spec whose presets hold `preset` (`model.preset`)."""
    for spec in _REGISTRY.values():
        if preset in spec.presets:
            return spec
    known = sorted(p for s in _REGISTRY.values() for p in s.presets)
    raise PisftError(f"no registered model has the preset {preset!r} (known: {', '.join(known)})")
