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

# What one message may decode into, checked on its headers before anything is built
# (`check_structure`): a LIBERO request is about 30 objects (an array is a map of 4 entries) at
# depth 3, while 20 MiB of msgpack can hold 20 million one-byte integers (gigabytes of Python
# objects and seconds of decoding) or nest a million levels deep.
MAX_OBJECTS = 4096
MAX_DEPTH = 32


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


_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8,
          0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}
_SIZED = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4}  # bin, str: length bytes
_EXT = {0xc7: 1, 0xc8: 2, 0xc9: 4}  # length bytes, then a type byte
_CONTAINERS = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}  # length bytes, items per entry


def check_structure(data: bytes, max_objects: int = MAX_OBJECTS, max_depth: int = MAX_DEPTH) -> int:
    """Walk a msgpack message's headers, building nothing; the number of objects it holds.
    ProtocolError as soon as it holds more than `max_objects` objects or nests deeper than
    `max_depth`, or declares more than its bytes can hold: the walk costs at most
    `max_objects` steps, whatever the message's size."""
    n, pos, count = len(data), 0, 0
    pending = [1]  # items still to read at each open level
    while pending:
        if pending[-1] == 0:
            pending.pop()
            continue
        pending[-1] -= 1
        if pos >= n:
            raise ProtocolError("not a msgpack message: it ends inside an object")
        count += 1
        if count > max_objects:
            raise ProtocolError(f"the message holds more than {max_objects} objects (msgpack values); a "
                                f"request is a map of a few arrays and a prompt: send arrays, not lists")
        b = data[pos]
        pos += 1
        items = 0
        if b <= 0x7f or b >= 0xe0:  # fixint
            pass
        elif b <= 0x8f:
            items = 2 * (b & 0x0f)
        elif b <= 0x9f:
            items = b & 0x0f
        elif b <= 0xbf:
            pos += b & 0x1f
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED or b in _EXT:
            width = _SIZED.get(b) or _EXT[b]
            pos += width + int.from_bytes(data[pos:pos + width], "big") + (1 if b in _EXT else 0)
        elif b in _CONTAINERS:
            width, per = _CONTAINERS[b]
            items = per * int.from_bytes(data[pos:pos + width], "big")
            pos += width
        else:
            raise ProtocolError(f"not a msgpack message: byte 0x{b:02x} at offset {pos - 1}")
        if items:
            if items > n - pos:  # every item takes at least one byte
                raise ProtocolError(f"not a msgpack message: a container declares {items} items in the "
                                    f"{n - pos} bytes left")
            pending.append(items)
            if len(pending) - 1 > max_depth:
                raise ProtocolError(f"the message nests deeper than {max_depth} levels; a request is a map "
                                    "of arrays and a prompt")
    if pos > n:
        raise ProtocolError("not a msgpack message: it ends inside an object")
    return count


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_encode, use_bin_type=True)


def unpackb(data: bytes, *, max_objects: int = MAX_OBJECTS, max_depth: int = MAX_DEPTH) -> Any:
    """Decode one message, after `check_structure` bounded what it may decode into."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        check_structure(bytes(data), max_objects, max_depth)
    try:
        return msgpack.unpackb(data, object_hook=_decode, raw=False, strict_map_key=False)
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.exceptions.ExtraData,
            msgpack.exceptions.FormatError, msgpack.exceptions.StackError) as exc:
        raise ProtocolError(f"not a msgpack message: {exc}") from None
