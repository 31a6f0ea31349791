"""A real PolicyServer running on its own event loop in a background thread, for the serving tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
from websockets.exceptions import ConnectionClosed


def start_in_thread(server, *, timeout: float) -> tuple[dict[str, str], Callable[[], None]]:
    """Run `server` until the returned stop() is called; the dict holds its "url" (ws://) and "http"."""
    loop = asyncio.new_event_loop()
    stop_future = loop.create_future()
    ready = threading.Event()
    where: dict[str, str] = {}

    def on_ready(host, port):
        where["url"] = f"ws://{host}:{port}"
        where["http"] = f"http://{host}:{port}"
        ready.set()

    thread = threading.Thread(
        target=lambda: loop.run_until_complete(server.run(on_ready=on_ready, stop=stop_future)), daemon=True)
    thread.start()
    assert ready.wait(timeout), "server did not start"

    def stop() -> None:
        loop.call_soon_threadsafe(stop_future.set_result, None)
        thread.join(timeout)
        loop.close()

    return where, stop


def assert_refused_unread(ws, message: bytes) -> None:
    """Send a message over the server's size limit: the server closes the connection with 1009
    ("message too big") from the frame header, without reading it."""
    try:
        ws.send(message)
    except (ConnectionClosed, OSError):
        pass  # the server may close before the whole frame is written
    with pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=60)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
