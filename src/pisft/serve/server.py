"""`python -m pisft serve --model DIR`: serve an exported model over openpi's websocket protocol.

openpi's own clients (`openpi_client.websocket_client_policy.WebsocketClientPolicy`, used by
its LIBERO example) connect unchanged: on connect the server sends its metadata; each request
is one observation (see `pisft.serve.observations`), answered with
`{"actions": float32 (chunk_size, action_dim) in raw action units, "server_timing": {...}}`.

A malformed request (not msgpack, a missing key, a wrong shape) is answered with a text frame
holding the error — the openpi client raises it as `RuntimeError` — and the connection stays
open: the next good request is served as usual. Unlike openpi's server, an unexpected error
during inference does not close the connection either; it is logged with its traceback and
reported to the client the same way. `GET /healthz` answers 200 for load balancers and probes.
"""

from __future__ import annotations

import argparse
import asyncio
import http
import logging
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pisft.errors import PisftError
from pisft.serve import protocol
from pisft.serve.observations import ObservationError

log = logging.getLogger("pisft.serve")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


class InferencePolicy(Protocol):
    metadata: dict

    def infer(self, obs: dict) -> dict: ...


class PolicyServer:
    """One policy, many connections; inferences run one at a time in a worker thread."""

    def __init__(self, policy: InferencePolicy, *, host: str = DEFAULT_HOST,
                 port: int = DEFAULT_PORT) -> None:
        self._policy = policy
        self._host = host
        self._port = port
        self._lock = threading.Lock()
        self.requests = 0
        self.errors = 0

    def _infer(self, obs: Any) -> dict:
        with self._lock:
            if not isinstance(obs, dict):
                raise ObservationError(
                    f"a request must be a map of observation keys, got {type(obs).__name__}")
            return self._policy.infer(obs)

    async def _reply(self, message: Any) -> bytes | str:
        self.requests += 1
        start = time.monotonic()
        try:
            if isinstance(message, str):
                raise protocol.ProtocolError("expected a binary msgpack frame, got a text frame")
            obs = protocol.unpackb(message)
            result = await asyncio.to_thread(self._infer, obs)
            result = dict(result)
            result["server_timing"] = {"infer_ms": (time.monotonic() - start) * 1000.0}
            return protocol.packb(result)
        except (protocol.ProtocolError, ObservationError) as exc:
            self.errors += 1
            log.warning("bad request: %s", exc)
            return f"bad request: {exc}"
        except Exception:  # noqa: BLE001 - report to the client, keep serving
            self.errors += 1
            tb = traceback.format_exc()
            log.error("inference failed:\n%s", tb)
            return f"inference failed on the server:\n{tb}"

    async def _handler(self, websocket) -> None:
        import websockets

        log.info("connection from %s", websocket.remote_address)
        await websocket.send(protocol.packb(self._policy.metadata))
        try:
            async for message in websocket:
                await websocket.send(await self._reply(message))
        except websockets.ConnectionClosed:
            pass
        log.info("connection from %s closed", websocket.remote_address)

    @staticmethod
    def _health(connection, request):
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        return None

    async def run(self, *, on_ready: Callable[[str, int], None] | None = None,
                  stop: asyncio.Future | None = None) -> None:
        from websockets.asyncio.server import serve

        async with serve(self._handler, self._host, self._port, compression=None,
                         max_size=None, process_request=self._health) as server:
            sockets = list(server.sockets)
            port = sockets[0].getsockname()[1] if sockets else self._port
            if on_ready is not None:
                on_ready(self._host, port)
            if stop is None:
                await server.serve_forever()
            else:
                await stop


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pisft serve",
        description="Serve an exported pisft/LeRobot pi0.5 model over openpi's websocket policy "
                    "protocol (what openpi's LIBERO client speaks).")
    p.add_argument("--model", required=True, type=Path,
                   help="exported model directory (e.g. results/train/model)")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default {DEFAULT_HOST}; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"TCP port (default {DEFAULT_PORT}, as openpi; 0 picks a free one)")
    p.add_argument("--device", default="auto", choices=("auto", "npu", "cuda", "cpu"))
    p.add_argument("--dataset", type=Path, default=None,
                   help="dataset whose normalisation stats to use when the model directory has "
                        "none (e.g. results/dataset for the base model)")
    p.add_argument("--seed", type=int, default=0, help="seed of the flow-matching noise")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        from pisft.serve.libero_policy import LiberoPolicy

        policy = LiberoPolicy.from_model_dir(args.model, device=args.device,
                                             dataset_dir=args.dataset, seed=args.seed)
    except PisftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = PolicyServer(policy, host=args.host, port=args.port)

    def ready(host: str, port: int) -> None:
        cond = getattr(policy, "conditioning", None)
        prompt = f"; prompt: {cond.describe()}" if cond is not None else ""
        print(f"pisft serve: serving {args.model} on ws://{host}:{port} "
              f"(openpi websocket policy protocol; GET /healthz){prompt}", flush=True)

    async def serve_until_signalled() -> None:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
        await server.run(on_ready=ready, stop=stop)

    try:
        asyncio.run(serve_until_signalled())
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; "
              f"pick another --port or stop what uses it", file=sys.stderr)
        return 2
    print(f"pisft serve: stopped after {server.requests} requests ({server.errors} errors)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
