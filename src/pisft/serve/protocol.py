"""openpi's websocket policy protocol: msgpack frames with NumPy arrays, no pickle.

Wire format (what `openpi-client`'s `msgpack_numpy` produces and reads):
- an array is a map `{b"__ndarray__": True, b"data": <raw bytes>, b"dtype": <dtype.str>,
  b"shape": [..]}`; a NumPy scalar is `{b"__npgeneric__": True, b"data": <item>, b"dtype": ..}`;
- on connect the server sends one frame: the metadata map;
- then each binary frame from the client is an observation map, answered by one binary frame
  with the result map (`{"actions": array(horizon, action_dim), ...}`);
- an error is answered by a *text* frame holding the message (the client raises it).

Only plain numeric, boolean and string dtypes are accepted: object and void arrays (which
could need pickle to rebuild) are refused in both directions.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

ALLOWED_KINDS = frozenset("biufSU")  # bool, int, uint, float, bytes, unicode


class ProtocolError(ValueError):
    """A frame that is not a valid msgpack-numpy message."""


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in ALLOWED_KINDS:
            raise TypeError(f"cannot send an array of dtype {obj.dtype}")
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(),
                b"dtype": obj.dtype.str, b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        if obj.dtype.kind not in ALLOWED_KINDS:
            raise TypeError(f"cannot send a scalar of dtype {obj.dtype}")
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send an object of type {type(obj).__name__}")


def _dtype(raw: Any) -> np.dtype:
    try:
        dtype = np.dtype(raw.decode() if isinstance(raw, bytes) else raw)
    except TypeError as exc:
        raise ProtocolError(f"unknown array dtype {raw!r}") from exc
    if dtype.kind not in ALLOWED_KINDS:
        raise ProtocolError(f"array dtype {dtype} is not allowed (only numbers, bools, strings)")
    return dtype


def _decode(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        dtype = _dtype(obj.get(b"dtype"))
        shape = obj.get(b"shape")
        data = obj.get(b"data")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ProtocolError(f"array shape {shape!r} is not a list of sizes")
        if not isinstance(data, bytes):
            raise ProtocolError("array data must be bytes")
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if len(data) != expected:
            raise ProtocolError(f"array of shape {list(shape)} and dtype {dtype} needs {expected} "
                                f"bytes, got {len(data)}")
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    if b"__npgeneric__" in obj:
        return _dtype(obj.get(b"dtype")).type(obj.get(b"data"))
    return obj


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_encode, use_bin_type=True)


def unpackb(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, object_hook=_decode, raw=False, strict_map_key=False)
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.exceptions.ExtraData,
            msgpack.exceptions.FormatError, msgpack.exceptions.StackError) as exc:
        raise ProtocolError(f"not a msgpack message: {exc}") from None
