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


def switch(profile: str | Path, config: str | Path = pisft_config.DEFAULT_CONFIG,
           dvc_file: str | Path = "dvc.yaml") -> int:
    from ruamel.yaml import YAML  # round-trip YAML (comments kept); installed with DVC

    profile, config = Path(profile), Path(config)
    overlay = pisft_config.read_yaml(profile, missing="no such profile; the profiles are in config/profiles/")
    if not isinstance(overlay, dict) or not overlay:
        raise PisftError(f"{profile}: a profile is a mapping of config keys (see config/profiles/)")
    rt = YAML()
    rt.preserve_quotes = True
    doc = rt.load(config.read_text())
    _merge(doc, overlay)
    buffer = io.StringIO()
    rt.dump(doc, buffer)
    pisft_config.from_dict(yaml.safe_load(buffer.getvalue()), f"{config} with {profile}")  # before any write
    write_text_atomic(config, buffer.getvalue())
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
