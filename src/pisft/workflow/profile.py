"""Switch the run to a profile, for Snakemake and DVC alike: `python -m pisft profile FILE`.

Both drivers read `config/config.yaml` (Snakemake's `configfile:`, DVC's params and templates),
so a profile is applied there: its keys are written over the file's (comments and the other
keys kept), the result is validated first (nothing is written when it is refused), and
dvc.yaml is regenerated for the new shape (a local model folder, the device's lock). Then
`snakemake --cores all` and `dvc repro` both run the profile. `git diff config/config.yaml`
shows what changed; `git checkout config/config.yaml dvc.yaml` goes back.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import yaml

from pisft import config as pisft_config
from pisft.errors import PisftError
from pisft.io import write_text_atomic


def _merge(target, overlay: dict) -> None:
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value


def _read_profile(profile: Path) -> dict:
    """A profile's keys as YAML 1.2 reads them (`lr: 1e-4` is the number 1e-4), refusing a
    repeated key; a string that YAML 1.1 (Snakemake) would read as something else (`yes`, `12:30`)
    is kept as a string, quoted when written."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError as RuamelError
    from ruamel.yaml.scalarstring import DoubleQuotedScalarString

    if not profile.is_file():
        raise PisftError(f"{profile}: no such profile; the profiles are in config/profiles/")
    text = profile.read_text()
    pisft_config.yaml_text(text, str(profile), both_readings=False)  # repeated keys, as PyYAML sees them
    try:
        overlay = YAML(typ="safe", pure=True).load(text)
    except RuamelError as exc:
        raise PisftError(f"{profile}: not valid YAML: {exc}") from None

    def quote(value):
        if isinstance(value, dict):
            return {k: quote(v) for k, v in value.items()}
        if isinstance(value, list):
            return [quote(v) for v in value]
        if isinstance(value, str) and yaml.safe_load(f"k: {value}") != {"k": value}:
            return DoubleQuotedScalarString(value)
        return value

    if not isinstance(overlay, dict) or not overlay:
        raise PisftError(f"{profile}: a profile is a mapping of config keys (see config/profiles/)")
    return quote(overlay)


def _represent_float(representer, value: float):
    """A profile's float as both drivers read it: a dot and a signed exponent (1.0e-10, not
    1e-10, which YAML 1.1 reads as a string)."""
    if value != value or value in (float("inf"), float("-inf")):
        return representer.represent_float(value)
    text = repr(value)
    if "e" in text:
        mantissa, exponent = text.split("e")
        if "." not in mantissa:
            mantissa += ".0"
        if exponent[0] not in "+-":
            exponent = "+" + exponent
        text = f"{mantissa}e{exponent}"
    elif "." not in text:
        text += ".0"
    return representer.represent_scalar("tag:yaml.org,2002:float", text)


# The profiles applied to config/config.yaml, in order, recorded in the file itself (one comment
# line; `git checkout config/config.yaml` resets it with the keys): a later profile that replaces
# a key an earlier one set, and that still holds that value, says so (a device profile applied
# after a recipe silently replaced the recipe's batch, learning rate and iterations).
RECORD = "# profiles applied (python -m pisft profile), in order: "


def applied_profiles(text: str) -> list[str]:
    for line in text.splitlines():
        if line.startswith(RECORD):
            return [p.strip() for p in line[len(RECORD):].split(",") if p.strip()]
    return []


def _with_record(text: str, profiles: list[str]) -> str:
    """`text` with the record line naming `profiles`, in place of the old one or at the end of the
    file's opening comment."""
    lines = [line for line in text.splitlines(keepends=True) if not line.startswith(RECORD)]
    at = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    return "".join([*lines[:at], RECORD + ", ".join(dict.fromkeys(profiles)) + "\n", *lines[at:]])


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _replaced(text: str, doc, overlay: dict) -> dict[str, list[tuple[str, object, object]]]:
    """Per earlier profile still in effect: the keys `overlay` gives another value, (key, old, new)."""
    now = pisft_config.flatten(_plain(dict(doc)))
    new = pisft_config.flatten(_plain(overlay))
    out: dict[str, list[tuple[str, object, object]]] = {}
    for earlier in applied_profiles(text):
        if not Path(earlier).is_file():
            continue
        theirs = pisft_config.flatten(_plain(_read_profile(Path(earlier))))
        keys = [(k, now[k], new[k]) for k in new if k in theirs and k in now
                and now[k] == theirs[k] and new[k] != now[k]]
        if keys:
            out[earlier] = keys
    return out


def switch(profile: str | Path, config: str | Path = pisft_config.DEFAULT_CONFIG,
           dvc_file: str | Path = "dvc.yaml") -> int:
    from ruamel.yaml import YAML  # round-trip YAML (comments kept); installed with DVC
    from ruamel.yaml.error import YAMLError as RuamelError

    profile, config = Path(profile), Path(config)
    overlay = _read_profile(profile)
    rt = YAML()
    rt.preserve_quotes = True
    rt.representer.add_representer(float, _represent_float)
    try:
        doc = rt.load(config.read_text())
    except RuamelError as exc:
        raise PisftError(f"{config}: not valid YAML: {exc}") from None
    text = config.read_text()
    replaced = _replaced(text, doc, overlay)
    _merge(doc, overlay)
    buffer = io.StringIO()
    rt.dump(doc, buffer)
    text = _with_record(buffer.getvalue(), [*applied_profiles(text), str(profile)])
    # before any write: what both drivers will read, alike (numbers as numbers), and valid
    source = f"{config} with {profile}"
    pisft_config.from_dict(pisft_config.yaml_text(text, source), source)
    write_text_atomic(config, text)
    for earlier, keys in replaced.items():
        print(f"note: {profile} replaces {len(keys)} key(s) that {earlier}, applied before, set: "
              + ", ".join(f"{k} {old!r} -> {new!r}" for k, old, new in keys)
              + f" (the later profile wins; to keep {earlier}'s values apply it last)")
    from pisft.workflow import dvc_yaml

    with contextlib.redirect_stdout(io.StringIO()):
        dvc_yaml.main(output=str(dvc_file))
    print(f"{config} now runs {profile} (and {dvc_file} is regenerated): `snakemake --cores all` and "
          f"`dvc repro` both use it. `git diff {config}` shows the change; "
          f"`git checkout {config} {dvc_file}` goes back.")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pisft profile FILE   (e.g. config/profiles/ascend-8card.yaml)", file=sys.stderr)
        return 2
    try:
        return switch(argv[0])
    except PisftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
