"""`python -m pisft.serve.hostile_probe --url ws://HOST:PORT`: what hostile requests cost a server.

Sends to a running `pisft serve` (or any openpi websocket policy server) the requests that
docs/serving.md says are refused, and measures, with a second well-behaved client
sending ordinary LIBERO requests meanwhile, how long that client waited:
- one image of 8192×8192×3 uint8 (192 MiB), over the default message limit;
- an 8 MB prompt;
- degenerate images of shape (1, 10000, 3) and (3, 224, 3);
- 20 million one-byte integers (20 MB, under the size limit) and a 1,000,000-level nesting;
- 200 idle connections held open at once.
Prints one JSON object: per probe, how the hostile request was answered (reply text head,
or the close code), its wall time, and the good client's slowest and median round trip while
it ran, next to the good client's round trip alone (`baseline_ms`). Wall-clock figures on a
shared machine vary; compare them only within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time

import numpy as np

from pisft.serve import protocol


def libero_request(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
            "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
            "observation/state": rng.uniform(-1, 1, 8),
            "prompt": "put the bowl on the plate"}


@contextlib.contextmanager
def _connect(url: str):
    from websockets.sync.client import connect

    with connect(url, compression=None, max_size=None, open_timeout=60) as ws:
        ws.recv(timeout=120)  # metadata
        yield ws


def _round_trip(ws, frame: bytes, timeout: float) -> tuple[float, str]:
    """(seconds, outcome): the reply's kind, a text reply's head, or the close code."""
    from websockets.exceptions import ConnectionClosed

    start = time.monotonic()
    try:
        ws.send(frame)
        reply = ws.recv(timeout=timeout)
    except ConnectionClosed as exc:
        code = exc.rcvd.code if exc.rcvd is not None else None
        return time.monotonic() - start, f"connection closed by the server (code {code})"
    except OSError as exc:
        return time.monotonic() - start, f"connection failed: {exc}"
    outcome = reply[:160] if isinstance(reply, str) else "actions"
    return time.monotonic() - start, outcome


def probe(url: str, frame: bytes, good, good_frame: bytes, timeout: float) -> dict:
    """Send `frame` from a fresh connection while `good` keeps sending `good_frame`."""
    done = threading.Event()
    result: dict = {}

    def hostile() -> None:
        try:
            with _connect(url) as ws:
                wall, outcome = _round_trip(ws, frame, timeout)
            result.update(outcome=outcome, wall_s=round(wall, 3))
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            result.update(outcome=f"cannot connect: {exc}", wall_s=0.0)
        finally:
            done.set()

    thread = threading.Thread(target=hostile, daemon=True)
    thread.start()
    waits = []
    while not done.is_set() or not waits:
        wall, outcome = _round_trip(good, good_frame, timeout)
        if outcome != "actions":
            result["good_client_error"] = outcome
            break
        waits.append(wall * 1000.0)
    thread.join(timeout)
    result.update(good_client_requests=len(waits), good_client_max_ms=round(max(waits), 1),
                  good_client_median_ms=round(statistics.median(waits), 1))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pisft.serve.hostile_probe", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="the server, e.g. ws://127.0.0.1:8000")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for one reply")
    args = p.parse_args(argv)
    with _connect(args.url) as good:
        out = _run(args, good)
    print(json.dumps(out, indent=1))
    return 0


def _run(args: argparse.Namespace, good) -> dict:
    good_frame = protocol.packb(libero_request())
    baseline = [_round_trip(good, good_frame, args.timeout)[0] * 1000.0 for _ in range(3)]
    out: dict = {"url": args.url, "baseline_ms": round(statistics.median(baseline), 1)}
    for name, make in hostile_frames().items():
        frame = make()
        out[name] = {"bytes": len(frame), **probe(args.url, frame, good, good_frame, args.timeout)}
        del frame
    out["connections_200"] = connection_flood(args.url, 200, good, good_frame, args.timeout)
    return out


def hostile_frames() -> dict:
    """name -> a function building the hostile frame (built one at a time: some are large)."""
    base = libero_request(1)
    return {
        "image_192MiB": lambda: protocol.packb({**base, "observation/image": np.zeros((8192, 8192, 3), np.uint8)}),
        "prompt_8MB": lambda: protocol.packb({**base, "prompt": "pick " * 1_600_000}),
        "image_1x10000": lambda: protocol.packb({**base, "observation/image": np.zeros((1, 10000, 3), np.uint8)}),
        "image_3x224": lambda: protocol.packb({**base, "observation/image": np.zeros((3, 224, 3), np.uint8)}),
        # under the size limit, tens of millions of objects once decoded
        "objects_20M": lambda: protocol.packb({**base, "observation/state": [0] * 20_000_000}),
        "nesting_1M": lambda: b"\x91" * 1_000_000 + b"\x00",
    }


def connection_flood(url: str, n: int, good, good_frame: bytes, timeout: float) -> dict:
    """Open `n` idle connections at once (and hold them) while `good` keeps sending requests:
    how many were accepted, how many refused, and the good client's round trips meanwhile."""
    from websockets.exceptions import ConnectionClosed, InvalidHandshake
    from websockets.sync.client import connect

    held, refused, failed = [], 0, 0
    for _ in range(n):
        try:
            ws = connect(url, compression=None, max_size=None, open_timeout=60)
            ws.recv(timeout=timeout)  # the metadata, or the close of a refused connection
            held.append(ws)
        except ConnectionClosed:
            refused += 1
        except (OSError, InvalidHandshake, TimeoutError):
            failed += 1
    waits = [_round_trip(good, good_frame, timeout)[0] * 1000.0 for _ in range(5)]
    for ws in held:
        ws.close()
    return {"accepted": len(held), "refused": refused, "failed": failed,
            "good_client_max_ms": round(max(waits), 1), "good_client_median_ms": round(statistics.median(waits), 1)}


if __name__ == "__main__":
    raise SystemExit(main())
