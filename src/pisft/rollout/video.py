"""Rollout videos: agent view and wrist camera side by side, H.264 MP4, written frame by frame.

Encoded with PyAV (`av`, already a LeRobot dependency in the lock; its wheels bundle FFmpeg with
libx264), so no other encoder is installed. Frames are encoded as they arrive: a 520-step
LIBERO-10 episode never sits in memory. H.264 in yuv420p at 10 frames per second (openpi's
`examples/libero/main.py` writes its replay videos at 10 fps) plays in every browser, which is
what the Snakemake report and `report.md` need.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FPS = 10


class SideBySideWriter:
    """Write (agent | wrist) frames to an MP4; both images (H, W, 3) uint8 of the same height."""

    def __init__(self, path: str | Path, *, fps: int = FPS) -> None:
        self.path = Path(path)
        self.fps = fps
        self.frames = 0
        self._container = None
        self._stream = None

    def _open(self, height: int, width: int) -> None:
        import av

        if height % 2 or width % 2:
            raise ValueError(f"H.264 in yuv420p needs even frame sizes, got {width}x{height}")
        # into the folder the stage made: one gone since (a killed stage's temporary output,
        # removed by its rerun) is not made again
        if not self.path.parent.is_dir():
            raise FileNotFoundError(f"{self.path.parent}: the video folder is gone")
        self._container = av.open(str(self.path), mode="w")
        stream = self._container.add_stream("libx264", rate=self.fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "23", "preset": "veryfast"}
        self._stream = stream

    def add(self, agent: np.ndarray, wrist: np.ndarray) -> None:
        import av

        if agent.shape[0] != wrist.shape[0]:
            raise ValueError(f"agent view {agent.shape} and wrist {wrist.shape} differ in height")
        frame = np.ascontiguousarray(np.concatenate([agent, wrist], axis=1), dtype=np.uint8)
        if self._container is None:
            self._open(frame.shape[0], frame.shape[1])
        for packet in self._stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
            self._container.mux(packet)
        self.frames += 1

    def close(self) -> int:
        """Flush and close; returns the number of frames written (0: no file was created)."""
        if self._container is not None:
            for packet in self._stream.encode():
                self._container.mux(packet)
            self._container.close()
            self._container = None
        return self.frames


def probe(path: str | Path) -> dict:
    """Decode a video: frame count, width, height and codec (what the tests and the report check)."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = 0
        width = height = 0
        for frame in container.decode(stream):
            frames += 1
            width, height = frame.width, frame.height
        return {"frames": frames, "width": width, "height": height, "codec": stream.codec_context.name}


def html_page(mp4: str | Path, title: str, caption: str = "") -> str:
    """A self-contained page showing the video (embedded as a data URI).

    `snakemake --report` shows HTML results inline but offers an MP4 only as a download, so the
    closed_loop stage writes one such page beside each video for the report (docs/libero.md)."""
    import base64
    import html

    data = base64.b64encode(Path(mp4).read_bytes()).decode("ascii")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title></head>\n"
            f"<body><h3>{html.escape(title)}</h3>\n"
            f"<video controls loop autoplay muted width=\"512\" src=\"data:video/mp4;base64,{data}\"></video>\n"
            f"<p>{html.escape(caption)}</p></body></html>\n")
