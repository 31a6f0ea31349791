"""Reading a config: YAML as both drivers read it (Snakemake's YAML 1.1, DVC's 1.2; a value they
read differently refused), values typed on a command line, `load` and `from_dict` (the schema,
then every check), and the resolved config every stage output carries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from pisft.config.checks import MAX_CONFIG_BYTES, MAX_SEEDS, check_list_lengths, check_unknown_keys, cross_check
from pisft.config.schema import MAPPING_KEYS, ConfigError, PisftConfig

DEFAULT_CONFIG = Path("config/config.yaml")


def from_dict(raw: dict | None, source: str = "<config>") -> PisftConfig:
    """Validate a plain mapping against the schema; return the typed config."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(raw).__name__}")
    check_unknown_keys(raw, source)
    check_list_lengths(raw, source)
    schema = OmegaConf.structured(PisftConfig)
    OmegaConf.set_struct(schema, True)
    for dotted in MAPPING_KEYS:  # the user's own keys (validated by the cross-checks)
        OmegaConf.set_struct(OmegaConf.select(schema, dotted), False)
    try:
        merged = OmegaConf.merge(schema, OmegaConf.create(raw))
    except ConfigKeyError as exc:  # pragma: no cover - caught by check_unknown_keys first
        raise ConfigError(f"{source}: {exc.msg}") from None
    except ValidationError as exc:
        key = exc.full_key or "?"
        raise ConfigError(
            f"{source}: key '{key}' has the wrong type: {exc.msg.splitlines()[0]}"
        ) from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{source}: {exc}") from None
    cfg: PisftConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    cross_check(cfg, source)
    return cfg


def _pyyaml_loader():
    """PyYAML's safe loader (YAML 1.1, as Snakemake reads configs) that refuses a repeated key
    instead of keeping the last one silently."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found the key {key!r} twice (first on line {seen[key] + 1}); a repeated key "
                        "silently replaces the first: keep one", key_node.start_mark)
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep)

    return Loader


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    nan = isinstance(a, float) and isinstance(b, float) and a != a and b != b  # .nan: read alike by both
    return type(a) is type(b) and (a == b or nan)


def _readings_differ(one: Any, two: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, YAML 1.1 reading, YAML 1.2 reading) of every value read differently."""
    if isinstance(one, dict) and isinstance(two, dict):
        out = []
        for key in list(dict.fromkeys([*one, *two])):
            where = f"{path}.{key}" if path else str(key)
            if key not in one or key not in two:
                out.append((where, one.get(key, "(a different key)"), two.get(key, "(a different key)")))
            else:
                out.extend(_readings_differ(one[key], two[key], where))
        return out
    if isinstance(one, list) and isinstance(two, list) and len(one) == len(two):
        return [d for i, (x, y) in enumerate(zip(one, two, strict=True))
                for d in _readings_differ(x, y, f"{path}[{i}]")]
    return [] if _same(one, two) else [(path, one, two)]


def _reading(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})" if value != "(a different key)" else str(value)


def yaml_text(text: str, source: str, *, both_readings: bool = True) -> Any:
    """The YAML document in `text` as PyYAML reads it (YAML 1.1: Snakemake), refusing a repeated
    key; with `both_readings`, also refusing any value that ruamel (YAML 1.2: DVC) reads
    differently (`010`, `0o10`, `yes`/`no`/`on`/`off`, `12:30`, `1e3`, ...), naming the key and
    how to write it so both drivers plan the same run."""
    import yaml

    if len(text) > MAX_CONFIG_BYTES:  # before either reader: 10^5 seeds took them 30 s, 10^6 minutes
        raise ConfigError(f"{source}: {len(text) // 1024} KiB of YAML; a run config is a few KiB (config/config.yaml: "
                          f"about 5), at most {MAX_CONFIG_BYTES // 1024}: no key takes a list that long (eval.seeds: "
                          f"at most {MAX_SEEDS} seeds)")
    try:
        one = yaml.load(text, Loader=_pyyaml_loader())  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    if not both_readings:
        return one
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError as RuamelError

    try:
        two = YAML(typ="safe", pure=True).load(text)  # DVC's reader: YAML 1.2, refuses repeated keys
    except RuamelError as exc:
        raise ConfigError(f"{source}: YAML 1.2 (DVC's reader) refuses it: {exc}") from None
    differ = _readings_differ(one, two)
    if differ:
        lines = [f"{key}: Snakemake (YAML 1.1) reads {_reading(a)}, DVC (YAML 1.2) reads {_reading(b)}"
                 for key, a, b in differ]
        raise ConfigError(
            f"{source}: {len(differ)} value(s) mean different things to the two drivers:\n  - "
            + "\n  - ".join(lines)
            + "\nQuote a value meant as text (e.g. \"yes\", \"12:30\", \"010\"); write a number so both "
              "read it alike: a float with a dot and a signed exponent (5.0e-5, 1.0e+3), an integer in "
              "plain decimal (8, not 010 or 0o10); true/false for a flag")
    return one


def read_yaml(path: str | Path, *, missing: str, both_readings: bool = True) -> Any:
    """The YAML document in `path` (safe loader). ConfigError naming the file when it is absent
    (`missing` says what to do), is not valid YAML (with the line and column), repeats a key, or
    (`both_readings`) holds a value YAML 1.1 and 1.2 read differently (`yaml_text`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: {missing}")
    return yaml_text(path.read_text(), str(path), both_readings=both_readings)


def _command_line_loader():
    """The loader of a value typed on a command line (`--set KEY=VALUE`, Snakemake's `--config
    KEY=VALUE`): `_pyyaml_loader` (YAML 1.1 as Snakemake reads config.yaml, a repeated key refused),
    with a flag only `true`/`false` (any case): YAML 1.1's yes/no/on/off/y/n stay text, as YAML 1.2
    (DVC) reads them, so `train.compile=off` is the mode `off`, not False (a flag still takes the
    text: OmegaConf reads "off" as false)."""
    base = _pyyaml_loader()

    class Loader(base):
        def construct_yaml_bool(self, node):
            text = self.construct_scalar(node)
            return text.lower() == "true" if text.lower() in ("true", "false") else text

    Loader.add_constructor("tag:yaml.org,2002:bool", Loader.construct_yaml_bool)
    return Loader


def read_value(text: str, source: str) -> Any:
    """A value typed on a command line, read as config.yaml is (`_command_line_loader`): `5` a
    number, `null` or nothing None, `{name: camera, strength: 5}` a mapping of a name and a number.
    ConfigError naming `source` (e.g. `--set eval.seeds=[7`) when it is not valid YAML."""
    import yaml

    try:
        return yaml.load(text, Loader=_command_line_loader())  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {' '.join(str(exc).split())}") from None


def merge_into(base: dict, more: dict) -> dict:
    """`more` merged into `base` in place, key by key into mappings on both sides (a list or a
    value replaces), as Snakemake merges `--config` and `--configfile` onto config.yaml."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge_into(base[key], value)
        else:
            base[key] = value
    return base


def command_line_values(entries: list[str], flag: str) -> dict:
    """Snakemake's `--config KEY=VALUE ...` (`flag`) as pisft reads it: each KEY a top-level key
    (Snakemake's rule), each VALUE through `read_value`, later entries merged onto earlier ones.
    Snakemake's own reading of a nested value keeps every number and `null` as text (PyYAML's
    BaseLoader: `strength: 5` is '5'); this one reads them as config.yaml and `--set` do."""
    out: dict = {}
    for entry in entries:
        if "=" not in entry:
            raise ConfigError(f"{flag} {entry}: expected KEY=VALUE, e.g. {flag} 'train={{steps: 10}}'")
        key, value = entry.split("=", 1)
        merge_into(out, {key: read_value(value, f"{flag} {entry}")})
    return out


def load(path: str | Path = DEFAULT_CONFIG, overrides: list[str] | None = None) -> PisftConfig:
    """Load and validate a YAML config file (safe loader), with optional `key=value` overrides
    (each value read by `read_value`)."""
    path = Path(path)
    raw = read_yaml(path, missing=f"config file not found; pass --config PATH (default {DEFAULT_CONFIG})")
    if raw is None:
        raise ConfigError(f"{path}: the config file is empty (or only comments): a run on code "
                          f"defaults is not what was meant; start from {DEFAULT_CONFIG}")
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected KEY=VALUE, e.g. train.steps=10")
        key, value = item.split("=", 1)
        node = raw
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                where = ".".join(parts[:i + 1])
                raise ConfigError(f"--set {item}: '{where}' is a value, not a section; set it as --set {where}=VALUE")
        node[parts[-1]] = read_value(value, f"--set {item}")
    return from_dict(raw, str(path))


def to_dict(cfg: PisftConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def resolved(cfg: PisftConfig) -> dict:
    """The config plus its derived values: what every stage output carries."""
    out = to_dict(cfg)
    out["derived"] = {"world_size": cfg.world_size, "grad_accum_steps": cfg.grad_accum_steps}
    return out


def write_resolved(cfg: PisftConfig, path: Path) -> None:
    path.write_text(json.dumps(resolved(cfg), indent=2, sort_keys=True) + "\n")
