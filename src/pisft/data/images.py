"""PNG and MP4 helpers: decode, encode, resize and validate camera frames (HWC uint8 RGB).

PNG work goes through OpenCV, which releases the GIL, so a thread pool decodes on all cores.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from fractions import Fraction
from pathlib import Path

import cv2
import numpy as np

# zlib level of the PNGs we write. 1 is ~2x faster than PIL's default 6 at 256x256 for a
# few percent more bytes (`make bench` times the conversion that writes them).
PNG_LEVEL = 1


class ImageDecodeError(ValueError):
    """A frame that is not a decodable RGB image (message says why)."""


def decode_png(data: bytes) -> np.ndarray:
    """PNG (or any OpenCV-readable) bytes -> HWC uint8 RGB; raises ImageDecodeError."""
    if not data:
        raise ImageDecodeError("empty image bytes")
    buf = np.frombuffer(data, dtype=np.uint8)
    img = cv2.imdecode(buf, cv2.IMREAD_UNCHANGED)
    if img is None:
        raise ImageDecodeError("the bytes are not a decodable image")
    if img.dtype != np.uint8:
        raise ImageDecodeError(f"pixel type is {img.dtype}, expected 8-bit RGB")
    if img.ndim != 3 or img.shape[2] != 3:
        channels = 1 if img.ndim == 2 else img.shape[2]
        raise ImageDecodeError(f"image has {channels} channel(s), expected 3 (RGB)")
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


def encode_png(img: np.ndarray, level: int = PNG_LEVEL) -> bytes:
    """HWC uint8 RGB -> PNG bytes (deterministic for a given OpenCV build)."""
    ok, buf = cv2.imencode(".png", cv2.cvtColor(img, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_PNG_COMPRESSION, level])
    if not ok:  # pragma: no cover - OpenCV only fails on invalid arrays
        raise ValueError("PNG encoding failed")
    return buf.tobytes()


def resize(img: np.ndarray, size: int) -> np.ndarray:
    """Square resize to size x size (area filter when shrinking, bilinear when growing)."""
    if img.shape[0] == size and img.shape[1] == size:
        return img
    interp = cv2.INTER_AREA if size < img.shape[0] else cv2.INTER_LINEAR
    return cv2.resize(img, (size, size), interpolation=interp)


# ---------------------------------------------------------------- video (MP4 via PyAV)

class Mp4Writer:
    """Append RGB frames to an MP4 (yuv420p; frame i has pts i, time base 1/fps)."""

    def __init__(self, path: Path, fps: int, width: int, height: int, codec: str = "libx264"):
        import av

        path.parent.mkdir(parents=True, exist_ok=True)
        self._container = av.open(str(path), mode="w")
        stream = self._container.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.time_base = Fraction(1, fps)
        if codec == "libx264":
            stream.options = {"crf": "18", "g": "2", "preset": "veryfast"}
        self._stream = stream
        self._next_pts = 0

    def write(self, frames: Sequence[np.ndarray] | np.ndarray) -> None:
        import av

        for img in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
            frame.pts = self._next_pts
            self._next_pts += 1
            for packet in self._stream.encode(frame):
                self._container.mux(packet)

    def close(self) -> None:
        for packet in self._stream.encode():
            self._container.mux(packet)
        self._container.close()


def encode_mp4(frames: Sequence[np.ndarray] | np.ndarray, path: Path, fps: int, codec: str = "libx264") -> None:
    """Write RGB frames to one MP4."""
    h, w = frames[0].shape[:2]
    writer = Mp4Writer(path, fps, w, h, codec)
    writer.write(frames)
    writer.close()


def iter_mp4(path: Path, start_s: float = 0.0) -> Iterator[tuple[float, np.ndarray]]:
    """Yield (timestamp_s, HWC uint8 RGB) for the frames of the first video stream.

    With `start_s` > 0 the decoder first seeks to the key frame at or before it (frames before
    `start_s` may still be yielded; callers skip them by timestamp).
    """
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        if start_s > 0 and stream.time_base is not None:
            container.seek(int(start_s / stream.time_base), stream=stream, backward=True, any_frame=False)
        for frame in container.decode(stream):
            ts = float(frame.pts * stream.time_base) if frame.pts is not None else float(frame.time or 0.0)
            yield ts, frame.to_ndarray(format="rgb24")


def decode_mp4_range(path: Path, start_s: float, count: int, fps: int) -> list[np.ndarray]:
    """Decode `count` frames starting at `start_s` (frames matched to timestamps within half a frame)."""
    half = 0.5 / fps
    out: list[np.ndarray] = []
    for ts, img in iter_mp4(path, start_s):
        if ts < start_s - half:
            continue
        if len(out) >= count:
            break
        out.append(img)
    return out
