"""pisft's own records (`pisft_model.json`, the value model's config, a dataset's sampling and
prompt records, its split, a smoke report), type-checked where they are read.

A record is JSON that pisft wrote, but a hand edit or another tool may have rewritten it (and
refreshed the manifest): `"state_in_prompt": "false"` is a non-empty string, which Python takes
for true, so `serve` prompted with the state against the record's word. Every field a reader
uses is checked against the type the writer writes, strictly: a flag is `true`/`false` (not a
string, not 0/1), an integer is not a flag or a float, a number is not a string. A record that
fails stops the reader with one line naming the file, the field, what it holds and what it must
hold, and the stage that writes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pisft.errors import DataError


class RecordError(DataError):
    """A record pisft wrote holds a field of another type than the one its writer writes."""


# A field's type: bool, int, float (an int is a float too), str, dict, list, a list of one of
# those (`(list, int)`), or None-able (`(None, dict)`).
Spec = Any


def _type_name(spec: Spec) -> str:
    if isinstance(spec, tuple):
        if spec[0] is list:
            return f"a list of {_type_name(spec[1])}s"
        if spec[0] is None:
            return f"{_type_name(spec[1])} or null"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
            list: "a list"}[spec]


def _matches(value: Any, spec: Spec) -> bool:
    if isinstance(spec, tuple):
        if spec[0] is None:
            return value is None or _matches(value, spec[1])
        return isinstance(value, list) and all(_matches(v, spec[1]) for v in value)
    if spec is bool:
        return isinstance(value, bool)
    if spec is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if spec is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, spec)


def check(record: Any, fields: dict[str, Spec], *, path: str | Path, writer: str,
          required: tuple[str, ...] = ()) -> dict[str, Any]:
    """`record` (a parsed JSON object) with every field of `fields` it holds of its type, and the
    `required` ones present; else RecordError. `writer`: the stage (and command) that writes it."""
    fix = f"it is written by {writer}: rerun that (or restore the file) rather than editing it by hand"
    if not isinstance(record, dict):
        raise RecordError(f"{path}: holds {type(record).__name__}, not the mapping pisft writes; {fix}")
    for key in required:
        if key not in record:
            raise RecordError(f"{path}: the field {key!r} is missing; {fix}")
    for key, spec in fields.items():
        if key in record and not _matches(record[key], spec):
            raise RecordError(f"{path}: {key!r} is {json.dumps(record[key])} ({type(record[key]).__name__}), "
                              f"but must be {_type_name(spec)}; {fix}")
    return record


def read(path: str | Path, fields: dict[str, Spec], *, writer: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON record at `path`, checked (`check`); unreadable JSON is a RecordError too."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RecordError(f"{path}: not valid JSON ({exc}); it is written by {writer}: rerun that") from None
    return check(record, fields, path=path, writer=writer, required=required)


def fields_of(cls: type) -> dict[str, Spec]:
    """The field types of a record's dataclass (str, int, float, bool, dict, list, X | None)."""
    import dataclasses
    import types
    import typing

    hints = typing.get_type_hints(cls)
    out: dict[str, Spec] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
        if optional:
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        base = typing.get_origin(hint) or hint
        out[f.name] = (None, base) if optional else base
    return out
