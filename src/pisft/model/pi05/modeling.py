"""LeRobot's pi0.5 module (`modeling_pi05`) and the patching of a LeRobot namespace: one lock for
every patch pisft makes (`sized_construction`, `pi05_processors`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

PATCH_LOCK = threading.RLock()


def lerobot_pi05():
    from lerobot.policies.pi05 import modeling_pi05

    return modeling_pi05


@contextlib.contextmanager
def patched(module: Any, replacements: dict[str, Any]) -> Iterator[None]:
    originals = {}
    try:
        for name, value in replacements.items():
            originals[name] = getattr(module, name)  # AttributeError: LeRobot changed (tested)
            setattr(module, name, value)
        yield
    finally:
        for name, value in originals.items():
            setattr(module, name, value)
