"""What the benchmarks' command lines share: a comma-separated list of names from a fixed set
(`gpu_infer --runs`, `gpu_step --trainable`)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable


def names_from(text: str, allowed: Iterable[str], each: str, note: str = "") -> list[str]:
    """The names of `text` ("a,b"), each one of `allowed`; else an argparse error that says what
    `each` name may be (`note` after the list)."""
    allowed = list(allowed)
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: each {each} one of {', '.join(allowed)}{note}")
    return names
