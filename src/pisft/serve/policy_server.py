"""`PolicyServer`: one policy served to many websocket connections with asyncio. Each connection
has a session of its own (its noise, the chunk answered last); requests are decoded and checked in
worker threads, the model runs in one thread of its own, one request a forward or batched
(the asyncio front end of `pisft.policy.batching`'s rule), and each reply is checked before it is
sent. What a client sees (hostile clients, batching, noise, timing, real-time chunking) is in
`pisft.serve.server`'s docstring, the command that runs this server."""

from __future__ import annotations

import asyncio
import concurrent.futures
import http
import logging
import math
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pisft.errors import PisftError
from pisft.policy.batching import BatchRule, answer_each, rewinding
from pisft.policy.interface import Policy
from pisft.policy.observations import ObservationError
from pisft.serve import protocol
from pisft.serve.request_fields import _Reset, _reset_request, _rtc_request, prepared_delay

log = logging.getLogger("pisft.serve")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
MIB = 1 << 20
DEFAULT_MAX_MESSAGE_MIB = 32  # two 2048×2048 uint8 images fit; openpi's LIBERO client sends ~0.3 MiB
CLOSE_MESSAGE_TOO_BIG = 1009
CLOSE_TRY_AGAIN_LATER = 1013
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_MAX_DECODES = 2  # messages decoded and checked at once (each is bounded: protocol.MAX_OBJECTS)
DEFAULT_MAX_BATCH = 8  # requests in one forward when batching is on (--policy-batch-wait-ms)


@dataclass
class _Session:
    """One connection's state."""

    noise: Any
    prev_total_ms: float | None = None
    last_actions: Any = None  # the chunk answered last (raw), for real-time chunking (--rtc)


@dataclass(eq=False)
class _Job:
    """A checked request waiting for a batched forward (batching on)."""

    prepared: Any
    session: _Session
    submitted: float  # the server's clock, for queue_ms
    queued: float  # the event loop's clock, for the window
    reply: asyncio.Future  # -> (result, begin, end, batch size), or _ForwardFailed


class _ForwardFailed(Exception):
    """A request's forward raised, also when retried alone (`batching.answer_each`): it is
    answered with `error` (logged once under `error_id`)."""

    def __init__(self, error: BaseException, error_id: str, size: int) -> None:
        super().__init__(f"the forward of a request of a batch of {size} failed (error id {error_id})")
        self.error, self.error_id, self.size = error, error_id, size


def _non_finite(actions: Any) -> str | None:
    """What is not finite in a reply's actions (a description), or None when all are finite."""
    try:
        a = np.asarray(actions)
    except Exception:  # noqa: BLE001 - not an array at all
        return f"not an array of numbers: {type(actions).__name__}"
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
        return f"not an array of numbers: dtype {a.dtype}"
    finite = np.isfinite(a)
    if finite.all():
        return None
    nan = int(np.isnan(a).sum()) if np.issubdtype(a.dtype, np.inexact) else 0
    return f"{nan} NaN and {int(a.size - finite.sum()) - nan} infinite of {a.size} values"


class PolicyServer:
    """One policy, many connections; inferences run one at a time in a thread of their own."""

    def __init__(self, policy: Policy, *, host: str = DEFAULT_HOST,
                 port: int = DEFAULT_PORT, sock: socket.socket | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_MIB * MIB,
                 clock: Callable[[], float] = time.monotonic,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_decodes: int = DEFAULT_MAX_DECODES,
                 batch_window_s: float = 0.0, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        """`batch_window_s`: the batching window in seconds (0: off, one request a forward;
        `pisft.serve.server`'s docstring); `max_batch`: requests in one forward at most when it is on."""
        if not (isinstance(batch_window_s, (int, float)) and math.isfinite(batch_window_s)
                and batch_window_s >= 0):
            raise ValueError(f"batch_window_s must be a finite number of seconds >= 0 (0: no batching), "
                             f"got {batch_window_s!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if batch_window_s > 0 and not callable(getattr(policy, "predict_many", None)):
            raise PisftError(f"batching (--policy-batch-wait-ms) needs a policy that answers several requests "
                             f"in one forward (predict_many); {type(policy).__name__} has none: serve it "
                             f"without a batching window (--policy-batch-wait-ms 0)")
        self._policy = policy
        # real-time chunking per connection (--rtc): the policy's model has it on
        self.rtc = getattr(getattr(policy, "predictor", None), "rtc", None) is not None
        self.chunk_size = getattr(getattr(policy, "predictor", None), "chunk_size", None)  # the longest delay
        self.batch_window_s = float(batch_window_s)
        self.max_batch = max_batch
        # the one batching rule (pisft.policy.batching) with this server's hand-set window: a server
        # does not know when its clients' next requests come, so it does not forecast them
        self._rule = BatchRule(max_batch=max_batch, wait_s=self.batch_window_s, adaptive=False)
        self.forwards = 0  # batched forwards run (batching on)
        self.batched_requests = 0  # requests answered through them
        self._pending: deque[_Job] = deque()
        self._queued: asyncio.Event | None = None
        self._host = host
        self._port = port
        self._sock = sock
        self.max_message_bytes = max_message_bytes
        self._clock = clock
        self._model_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.requests = 0
        self.errors = 0
        self.oversized = 0
        self.non_finite = 0  # replies refused because the model's actions were NaN or infinite
        self.max_connections = max_connections
        self.max_decodes = max_decodes
        self.connections = 0  # open now
        self.refused_connections = 0  # closed at once with 1013: max_connections were open
        self.decodes_waiting = 0  # messages waiting for a decode slot
        self._decode_slots: asyncio.Semaphore | None = None
        self._submitted = 0
        self._started = 0

    @property
    def waiting(self) -> int:
        """Requests checked and waiting for the model (behind the one it is running)."""
        return self._submitted - self._started

    def _decode(self, message: bytes, last: Any = None) -> Any:
        """Worker thread: msgpack -> checked, converted request (or a reset), and the previous
        chunk's actions it is to agree with (`last`: the connection's last chunk; None: none)."""
        obs = protocol.unpackb(message)
        reset = _reset_request(obs)
        if reset is not None:
            return reset, None
        if not isinstance(obs, dict):
            raise ObservationError(
                f"a request must be a map of observation keys, got {type(obs).__name__}")
        obs, prev_steps = _rtc_request(obs, last, self.rtc, self.chunk_size)
        return self._policy.prepare(obs), prev_steps

    def _predict(self, prepared: Any, noise: Any) -> tuple[dict, float, float]:
        """Model thread: the inference, with when it started and ended."""
        self._started += 1
        begin = self._clock()
        result = self._policy.predict(prepared, noise)
        return result, begin, self._clock()

    async def _through_batch(self, prepared: Any, session: _Session,
                             submitted: float) -> tuple[dict, float, float, int]:
        """Queue a checked request for the batcher and wait for its share of a forward."""
        assert self._queued is not None
        loop = asyncio.get_running_loop()
        job = _Job(prepared, session, submitted, loop.time(), loop.create_future())
        self._pending.append(job)
        self._queued.set()
        return await job.reply

    def _take(self, batch: list[_Job]) -> None:
        """Move queued requests into `batch` as the rule says (oldest first, up to max_batch, one
        per connection: a second request of a connection already in it waits for the next
        forward), dropping those whose client went away."""
        live = [job for job in self._pending if not job.reply.done()]  # cancelled: its connection closed
        batch, rest = self._rule.take(live, key=lambda job: id(job.session), batch=batch)
        self._pending.clear()
        self._pending.extend(rest)

    async def _collect(self) -> list[_Job]:
        """The next batch: wait for a request, then for others as long as the rule holds it
        (until max_batch have joined or the window, counted from when the first was queued, has
        closed)."""
        assert self._queued is not None
        loop = asyncio.get_running_loop()
        batch: list[_Job] = []
        while True:
            self._take(batch)
            timeout = None
            if batch:
                timeout = self._rule.hold_s(now=loop.time(), oldest=batch[0].queued, waiting=len(batch),
                                            could_join=self.max_batch)
                if timeout is None:
                    return batch
            self._queued.clear()
            try:
                await asyncio.wait_for(self._queued.wait(), timeout)
            except TimeoutError:
                pass

    def _forward_each(self, prepared: list, noises: list) -> tuple[list, float, float]:
        """Model thread: one forward for the batch; a request whose forward raises is retried
        alone (`batching.answer_each`), so one bad request errs alone."""
        self._started += len(prepared)
        begin = self._clock()
        outcomes = answer_each(self._policy.predict_many, prepared, rewinding(noises))
        end = self._clock()
        self._rule.forward_done(end - begin)
        return outcomes, begin, end

    async def _batcher(self) -> None:
        """Batching on: collect a batch, run its forward in the model thread, hand out the replies."""
        loop = asyncio.get_running_loop()
        while True:
            batch = [job for job in await self._collect() if not job.reply.done()]
            if not batch:
                continue
            outcomes, begin, end = await loop.run_in_executor(
                self._model_thread, self._forward_each, [job.prepared for job in batch],
                [job.session.noise for job in batch])
            self.forwards += 1
            self.batched_requests += len(batch)
            for job, outcome in zip(batch, outcomes, strict=True):
                if job.reply.done():
                    continue
                if outcome.error is None:
                    job.reply.set_result((outcome.reply, begin, end, len(batch)))
                    continue
                exc = outcome.error
                error_id = uuid.uuid4().hex[:12]
                if not isinstance(exc, (protocol.ProtocolError, PisftError)):
                    log.error("the forward of a request (of a batch of %d) failed (error id %s)", len(batch),
                              error_id, exc_info=exc)
                job.reply.set_exception(_ForwardFailed(exc, error_id, len(batch)))

    async def _reply(self, message: Any, session: _Session) -> bytes | str:
        self.requests += 1
        try:
            if isinstance(message, str):
                raise protocol.ProtocolError("expected a binary msgpack frame, got a text frame")
            assert self._decode_slots is not None
            self.decodes_waiting += 1
            try:
                await self._decode_slots.acquire()
            finally:
                self.decodes_waiting -= 1
            try:
                prepared, prev_steps = await asyncio.to_thread(self._decode, message, session.last_actions)
            finally:
                self._decode_slots.release()
            if isinstance(prepared, _Reset):
                seed = self._policy_seed() if prepared.seed is None else prepared.seed
                session.noise = self._policy.new_noise(seed)
                session.last_actions = None  # a new episode: nothing to agree with
                return protocol.packb({"reset": True, "seed": seed})
            submitted = self._clock()
            self._submitted += 1
            batch_size = None
            if self.batch_window_s > 0:
                try:
                    result, begin, end, batch_size = await self._through_batch(prepared, session, submitted)
                except _ForwardFailed as failed:
                    if isinstance(failed.error, (protocol.ProtocolError, PisftError)):
                        raise failed.error from None  # a bad request, answered as one below
                    self.errors += 1
                    return _internal_error(type(failed.error).__name__, failed.error_id)
            else:
                loop = asyncio.get_running_loop()
                result, begin, end = await loop.run_in_executor(
                    self._model_thread, self._predict, prepared, session.noise)
            result = dict(result)
            bad = _non_finite(result.get("actions"))
            if bad:
                self.errors += 1
                self.non_finite += 1
                log.error("the model returned non-finite actions (%s); answered with an error", bad)
                return (f"model error: the model returned non-finite actions ({bad}); they were not "
                        "served. The model diverged or its normalization statistics are broken: check "
                        "its training log and norm stats. The connection stays open.")
            session.last_actions = np.asarray(result["actions"])
            if prev_steps is not None:
                result["rtc"] = {"delay_steps": int(prepared_delay(prepared)), "prev_steps": prev_steps}
            timing = {"infer_ms": (end - begin) * 1000.0, "queue_ms": (begin - submitted) * 1000.0}
            if batch_size is not None:
                timing["batch_size"] = batch_size
            if session.prev_total_ms is not None:
                timing["prev_total_ms"] = session.prev_total_ms
            result["server_timing"] = timing
            return protocol.packb(result)
        except (protocol.ProtocolError, PisftError) as exc:
            self.errors += 1
            log.warning("bad request: %s", exc)
            return f"bad request: {exc}"
        except Exception as exc:  # anything else: logged with its id, the connection kept
            self.errors += 1
            error_id = uuid.uuid4().hex[:12]
            log.error("request failed (error id %s)", error_id, exc_info=True)
            return _internal_error(type(exc).__name__, error_id)

    @property
    def metadata(self) -> dict:
        """What a client gets on connecting: the policy's metadata, with this server's message
        limit (--max-message-mib) beside the policy's own limits in `limits`, and how the model runs
        as of this connection (`inference`: `--compile auto`'s decision once a first chunk made it)."""
        meta = dict(self._policy.metadata)
        predictor = getattr(self._policy, "predictor", None)
        if predictor is not None and "inference" in meta:  # as of now: eval.compile's trial decides on a first chunk
            meta["inference"] = predictor.describe()
        meta["limits"] = {**meta.get("limits", {}), "max_message_bytes": self.max_message_bytes}
        return meta

    def _policy_seed(self) -> int | None:
        return getattr(self._policy, "seed", None)

    async def _handler(self, websocket) -> None:

        peer = websocket.remote_address
        if self.connections >= self.max_connections:
            self.refused_connections += 1
            log.warning("connection from %s refused: %d connections open (--max-connections)", peer,
                        self.connections)
            await websocket.close(CLOSE_TRY_AGAIN_LATER, f"server busy: {self.connections} connections open "
                                                         "(--max-connections); try again later")
            return
        self.connections += 1
        try:
            await self._serve_connection(websocket, peer)
        finally:
            self.connections -= 1

    async def _serve_connection(self, websocket, peer) -> None:
        import websockets

        log.info("connection from %s", peer)
        session = _Session(noise=self._policy.new_noise(None))
        try:
            await websocket.send(protocol.packb(self.metadata))
            while True:
                start = self._clock()  # as openpi: the cycle starts when we wait for the request
                message = await websocket.recv()
                await websocket.send(await self._reply(message, session))
                session.prev_total_ms = (self._clock() - start) * 1000.0
        except websockets.ConnectionClosed as exc:
            if exc.sent is not None and exc.sent.code == CLOSE_MESSAGE_TOO_BIG:
                self.oversized += 1
                log.warning("connection from %s closed: a message over the limit of %d bytes "
                            "(--max-message-mib)", peer, self.max_message_bytes)
        log.info("connection from %s closed", peer)

    @staticmethod
    def _health(connection, request):
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        return None

    async def run(self, *, on_ready: Callable[[str, int], None] | None = None,
                  stop: asyncio.Future | None = None) -> None:
        from websockets.asyncio.server import serve

        where = {"sock": self._sock} if self._sock is not None else {"host": self._host, "port": self._port}
        self._model_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pisft-model")
        self._decode_slots = asyncio.Semaphore(self.max_decodes)
        self._queued = asyncio.Event()
        batcher = asyncio.create_task(self._batcher()) if self.batch_window_s > 0 else None
        try:
            # max_queue: at most 2 received frames buffered per connection (a client that
            # pipelines requests cannot make the server hold many large messages).
            async with serve(self._handler, compression=None, max_size=self.max_message_bytes,
                             max_queue=2, process_request=self._health, **where) as server:
                sockets = list(server.sockets)
                port = sockets[0].getsockname()[1] if sockets else self._port
                if on_ready is not None:
                    on_ready(self._host, port)
                if stop is None:
                    await server.serve_forever()
                else:
                    await stop
        finally:
            if batcher is not None:  # after the connections closed: their requests were answered
                batcher.cancel()
                try:
                    await batcher
                except asyncio.CancelledError:
                    pass
                while self._pending:
                    self._pending.popleft().reply.cancel()
            self._model_thread.shutdown(wait=True, cancel_futures=True)


def _internal_error(kind: str, error_id: str) -> str:
    """What a client learns of an unexpected error: its type and the id it is logged under."""
    return (f"internal error on the server ({kind}, error id {error_id}); "
            f"the server's log has the details under this id. The connection stays open.")

