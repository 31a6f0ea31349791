"""`python -m pisft serve --model DIR`: serve an exported model over openpi's websocket protocol.

openpi's own clients (`openpi_client.websocket_client_policy.WebsocketClientPolicy`, used by
its LIBERO example) connect unchanged: on connect the server sends its metadata; each request
is one observation (see `pisft.policy.observations`), answered with
`{"actions": float32 (chunk_size, action_dim) in raw action units, "server_timing": {...}}`.

Hostile or broken clients (docs/serving.md):
- A message over `--max-message-mib` is refused by the websocket layer from its frame header
  (close code 1009, "message too big"), before it is read; the client must reconnect.
- A malformed request (not msgpack, a missing key, a wrong shape, an image too small, too
  large or too elongated, a prompt over `--max-prompt-chars`) is answered with a text frame
  holding the error, which openpi's client raises as `RuntimeError`; the connection stays open.
  Sizes are checked before any pixel is converted (`observations.to_batch`).
- A message that would decode into more than `protocol.MAX_OBJECTS` objects or nest deeper than
  `protocol.MAX_DEPTH` (a list of millions of small integers fits in a few MiB) is refused as a
  bad request from its msgpack headers, before anything is built: checking a message costs at
  most MAX_OBJECTS steps, decoding it at most its bytes. At most `--max-decodes` messages are
  decoded at once (others wait their turn) and at most `--max-connections` connections are
  open (one more is closed at once with code 1013, "try again later"). So an ordinary client
  waits at most for `--max-decodes` bounded decodes and the inference in progress; a reset
  with a seed outside 0..2**63-1 is a bad request.
- A model whose actions are not finite (NaN, inf) is never served: the client gets a text
  frame "model error: ... non-finite actions ...", and the server's log says so.
- An unexpected error is logged here with its traceback under a short error id; the client gets
  the id and the exception's type, never the traceback, and the connection stays open.
- Decoding and checking run in worker threads and the model in one thread of its own, so the
  event loop keeps serving every connection: a client with a large or slow request delays the
  others by at most the inference in progress.

Batching (`--policy-batch-wait-ms MS`, off by default; `--policy-batch N`; the closed loop's names,
`eval.policy_batch_wait_ms` and `eval.policy_batch`; `--batch-window-ms` and `--max-batch`, the
names before, still work this release with a deprecation line): the rule is the one of
`pisft.policy.batching`, this module its asyncio front end. With the window off the model
answers one request at a time. With it on, when the model is free the first request waiting for
it opens a window of at most MS milliseconds, counted from when that request was queued (one
queued behind a forward for longer than MS waits no more); requests of other connections queued
by then join it, up to N, and all of them go through one forward (`predict_many`), each drawing
its noise from its own connection's generator. So a client's actions do not depend on what it was
batched with, to float32 rounding: on CPU identical bits with one thread, about one ulp apart
with several (their split of the work depends on the batch size); an accelerator's kernels may
round differently with the batch size too. A connection has at most one request in a batch. Each
reply is checked on its own: non-finite actions in one row answer that request with the model
error and the others with their actions; a forward that raises is retried request by request
(`batching.answer_each`), so a request whose forward raises alone is answered with the error (its
own error id, logged once with its traceback) and its batch-mates with their actions. The policy
must have `predict_many` (`LiberoPolicy` does). The cost is up to MS ms of latency for a request that finds the model
free; the gain, one forward instead of several when many clients share one accelerator.

Noise: each connection draws its flow-matching noise from a generator of its own, started
from `--seed` when it connects, so a client's rollout is reproducible whatever other clients
do. A request `{"reset": true}` (optionally with `"seed": <int>`) restarts it, e.g. at the
start of an episode, and is answered `{"reset": true, "seed": <seed>}`.

`server_timing` is measured as openpi's `WebsocketPolicyServer` measures it: `infer_ms` is the
time in the model's inference for this request alone (not the time queued behind other
clients, reported separately as `queue_ms`), and from a connection's second request on,
`prev_total_ms` is the previous request's whole cycle, from waiting for it to having sent the
reply. With batching on, `infer_ms` is the shared forward's time (the same for every request of
the batch), `queue_ms` includes the batching window, and `batch_size` says how many requests
shared the forward. `GET /healthz` answers 200 for load balancers and probes.

`policy_timing` is openpi's `Policy.infer`'s (src/openpi/policies/policy.py): `infer_ms`, the
model's own time for the forward the request was in (`LiberoPolicy.predict_many`), without the
server's decoding and queueing.

Inference at robot speed (docs/serving.md, "Inference at robot speed"): `--precision` and
`--compile` are `eval.precision` and `eval.compile` (the compiled chunk: one graph per batch-size
bucket, the first chunk of each compiles; `auto`: on an accelerator the first request's chunk decides,
`pisft.policy.compiled.Trial`). The ready line says what each chose and why; the trial's decision is
printed when the first chunk has made it. `--rtc` turns on real-time chunking (LeRobot's RTC,
`pisft.policy.rtc`) per connection: the server keeps the chunk it answered last on each
connection; a request that carries `"rtc/executed_steps": n` (where the robot was in that chunk
when it took this observation: the index of its next action, the d actions a chunk started after
counted, so a chunk executed from index d with m actions done has n = d + m) and
`"rtc/delay_steps": d` (the control steps it will execute of the rest before this reply arrives)
is answered with a chunk inpainted to agree with that chunk's actions from n on, and the reply says
so (`"rtc": {"delay_steps": d, "prev_steps": ...}`). A request without them gets a plain chunk, as
does the first of a connection (or after a reset: there is no previous chunk) and one whose previous
chunk is all executed. The robot then executes the new chunk from index d on. A malformed field is a
bad request, whether or not there is a chunk to agree with: n a whole number in 0..len(last chunk),
d one in 0..chunk_size and at most the actions left after n (the robot cannot execute more of them
while it waits).

The port is bound before the model loads, so "port in use" is reported at once.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import http
import logging
import math
import signal
import socket
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pisft.config import LEROBOT_RTC_DEFAULTS, RTC_SCHEDULES
from pisft.errors import PisftError
from pisft.policy.batching import BatchRule, answer_each, rewinding
from pisft.policy.interface import Policy
from pisft.serve import protocol
from pisft.policy.observations import Limits, ObservationError

log = logging.getLogger("pisft.serve")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
MIB = 1 << 20
DEFAULT_MAX_MESSAGE_MIB = 32  # two 2048×2048 uint8 images fit; openpi's LIBERO client sends ~0.3 MiB
CLOSE_MESSAGE_TOO_BIG = 1009
CLOSE_TRY_AGAIN_LATER = 1013
MAX_SEED = 1 << 63
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_MAX_DECODES = 2  # messages decoded and checked at once (each is bounded: protocol.MAX_OBJECTS)
DEFAULT_MAX_BATCH = 8  # requests in one forward when batching is on (--policy-batch-wait-ms)
MAX_BATCH_WINDOW_MS = 1000.0  # a longer window would delay a lone client's every request by over a second


@dataclass
class _Reset:
    seed: int | None


@dataclass
class _Session:
    """One connection's state."""

    noise: Any
    prev_total_ms: float | None = None
    last_actions: Any = None  # the chunk answered last (raw), for real-time chunking (--rtc)


# A request's: the index in the last chunk answered of the next action to execute (its d skipped
# actions counted: a chunk executed from index d with m actions done is at d + m).
RTC_EXECUTED_KEY = "rtc/executed_steps"


def _rtc_request(obs: dict, last: Any, enabled: bool, chunk_size: int | None = None) -> tuple[dict, int | None]:
    """The request with the previous chunk's unexecuted actions in place of `rtc/executed_steps`
    (`LiberoPolicy`'s `RTC_PREV_KEY`), and how many there are; the request as sent when it asks for
    no real-time chunking or there is nothing left to agree with (a plain chunk). Every malformed
    field is an ObservationError (a bad request), whether or not there is a chunk to agree with:
    `rtc/executed_steps` a whole number in 0..len(last chunk), `rtc/delay_steps` one in
    0..`chunk_size` (the model's) and at most the actions left of the last chunk, which the robot
    executes while it waits (docs/serving.md: the reply's first d actions agree with them)."""
    from pisft.policy.libero import RTC_DELAY_KEY, RTC_PREV_KEY
    from pisft.policy.rtc import delay_problem, whole_steps

    if RTC_PREV_KEY in obs:
        raise ObservationError(f"'{RTC_PREV_KEY}' is the server's: it keeps the chunk it answered last on "
                               f"this connection; send '{RTC_EXECUTED_KEY}' (the index in it of your next "
                               "action when you took this observation) instead")
    if RTC_EXECUTED_KEY not in obs:
        if RTC_DELAY_KEY in obs:
            raise ObservationError(f"'{RTC_DELAY_KEY}' needs '{RTC_EXECUTED_KEY}' (the index in the last chunk "
                                   "answered of your next action when you took this observation); send neither "
                                   "for a plain chunk")
        return obs, None
    if not enabled:
        raise ObservationError(f"'{RTC_EXECUTED_KEY}': this server runs without real-time chunking (start it "
                               "with --rtc); send requests without the rtc/ keys for plain chunks")
    executed, raw = whole_steps(obs[RTC_EXECUTED_KEY]), obs[RTC_EXECUTED_KEY]
    if executed is None or executed < 0:  # an array here was an internal TypeError (issue 56)
        raise ObservationError(f"'{RTC_EXECUTED_KEY}' must be a whole number >= 0, the index in the last chunk "
                               f"of your next action, got {raw!r}")
    if last is not None and executed > len(last):
        raise ObservationError(f"'{RTC_EXECUTED_KEY}' is {executed}, past the end of the last chunk answered on this "
                               f"connection ({len(last)} actions: {len(last)} means all of it executed)")
    if RTC_DELAY_KEY not in obs:
        raise ObservationError(f"real-time chunking needs '{RTC_DELAY_KEY}' with '{RTC_EXECUTED_KEY}'")
    delay = obs[RTC_DELAY_KEY]
    if chunk_size is None:  # a policy without a predictor: the model's chunk is unknown here
        steps = whole_steps(delay)
        problem = None if steps is not None and steps >= 0 else (
            f"'{RTC_DELAY_KEY}' must be a whole number of control steps >= 0, got {delay!r}")
    else:
        problem = delay_problem(delay, chunk_size, RTC_DELAY_KEY)
    if problem:  # checked whether or not there is a chunk to agree with
        raise ObservationError(problem)
    rest = {k: v for k, v in obs.items() if k != RTC_EXECUTED_KEY}
    if last is None or executed == len(last):  # nothing of a previous chunk left: a plain chunk
        return {k: v for k, v in rest.items() if k != RTC_DELAY_KEY}, None
    left = np.asarray(last)[executed:]
    if whole_steps(delay) > len(left):
        raise ObservationError(
            f"'{RTC_DELAY_KEY}' is {delay}, more than the {len(left)} actions left of the last chunk after "
            f"'{RTC_EXECUTED_KEY}' {executed}: the robot cannot execute {delay} of them while it waits for this "
            f"reply, whose first {delay} actions would agree with them; send the delay you will wait, at most "
            f"{len(left)}, or '{RTC_EXECUTED_KEY}': {len(last)} (all executed) for a plain chunk")
    return {**rest, RTC_PREV_KEY: left}, len(left)


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


def _reset_request(obs: Any) -> _Reset | None:
    """`{"reset": true[, "seed": int]}` -> _Reset; anything else -> None."""
    if not isinstance(obs, dict) or "reset" not in obs:
        return None
    extra = sorted(map(str, set(obs) - {"reset", "seed"}))
    flag = obs["reset"]
    if extra or not (isinstance(flag, (bool, np.bool_)) and flag):
        raise ObservationError(f"a reset request is {{'reset': True}} with an optional integer "
                               f"'seed'; got reset={obs['reset']!r} and other keys {extra}")
    seed = obs.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not hasattr(seed, "__index__"):
            raise ObservationError(f"'seed' of a reset request must be an integer, got {seed!r}")
        seed = int(seed)
        if not 0 <= seed < MAX_SEED:
            raise ObservationError(f"'seed' of a reset request must be in 0..2**63-1, got {seed}")
    return _Reset(seed)


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
        """`batch_window_s`: the batching window in seconds (0: off, one request a forward; the
        module docstring); `max_batch`: requests in one forward at most when it is on."""
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


def prepared_delay(prepared: Any) -> int:
    """The RTC delay a prepared request carries (`LiberoPolicy.prepare`'s `RTC_KEY`)."""
    from pisft.policy.libero import RTC_KEY

    return prepared[RTC_KEY][1]


def _internal_error(kind: str, error_id: str) -> str:
    """What a client learns of an unexpected error: its type and the id it is logged under."""
    return (f"internal error on the server ({kind}, error id {error_id}); "
            f"the server's log has the details under this id. The connection stays open.")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); OSError when the port is taken or the host unknown."""
    error: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio does
            sock.bind(address)
            sock.listen(100)
            sock.setblocking(False)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error or OSError(f"no address for {host}")


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def _batch_window_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= MAX_BATCH_WINDOW_MS):
        raise argparse.ArgumentTypeError(
            f"must be a number of milliseconds from 0 (no batching, the default) to "
            f"{MAX_BATCH_WINDOW_MS:g}, got {text!r}; a few ms suit a model whose forward takes tens of ms")
    return value


def _max_batch(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of requests, at least 1, got {text!r}; "
                                         f"turn batching off with --policy-batch-wait-ms 0 instead")
    return value


def _cfg_scale(text: str) -> float:
    from pisft.model.guidance import check_scale

    try:
        return check_scale(text, "the scale")
    except PisftError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("the scale: ")) from None


def build_parser() -> argparse.ArgumentParser:
    defaults = Limits()
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
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the flow-matching noise (each connection starts from it)")
    p.add_argument("--cfg-scale", type=_cfg_scale, default=1.0,
                   help="classifier-free guidance scale w of an advantage-conditioned model "
                        "(RLinf's cfgrl_guidance_scale; the config's eval.cfg_scale): 1 prompts with "
                        "the positive tag alone (default), w > 1 blends (1 - w) v_uncond + w v_cond at "
                        "every denoising step, at about twice the compute; a model trained on plain "
                        "prompts ignores it. The metadata reports the scale in effect (cfg_scale)")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="inference precision, the config's eval.precision: bf16 (float32 only where openpi keeps "
                        "it), fp32, auto (default: bf16 on an accelerator, the model's own on the CPU)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="the action chunk compiled and graph-captured per batch-size bucket, the config's "
                        "eval.compile: on, off, auto (default: on an accelerator the first request's chunk runs "
                        "eager and compiled and the faster is chosen, said in one line; on the CPU eager; the "
                        "first chunk of each bucket compiles)")
    p.add_argument("--rtc", action="store_true",
                   help="real-time chunking per connection (LeRobot's RTC): a request with 'rtc/executed_steps' "
                        "and 'rtc/delay_steps' gets a chunk that agrees with the rest of the connection's last one "
                        "(docs/serving.md)")
    rtc = LEROBOT_RTC_DEFAULTS
    p.add_argument("--rtc-execution-horizon", type=_positive(int), default=rtc["execution_horizon"], metavar="N",
                   help=f"RTC's guidance window (LeRobot's default {rtc['execution_horizon']}; "
                        "eval.rtc.execution_horizon)")
    p.add_argument("--rtc-max-guidance-weight", type=_positive(float), default=rtc["max_guidance_weight"], metavar="W",
                   help=f"RTC's guidance weight clamp (LeRobot's default {rtc['max_guidance_weight']}; "
                        "eval.rtc.max_guidance_weight)")
    p.add_argument("--rtc-schedule", choices=RTC_SCHEDULES, default=rtc["schedule"],
                   help=f"RTC's prefix weights (LeRobot's default {rtc['schedule']}; eval.rtc.schedule)")
    p.add_argument("--max-message-mib", type=_positive(float), default=DEFAULT_MAX_MESSAGE_MIB,
                   help=f"largest request in MiB; a larger one closes its connection with code "
                        f"1009 (default {DEFAULT_MAX_MESSAGE_MIB})")
    p.add_argument("--max-connections", type=_positive(int), default=DEFAULT_MAX_CONNECTIONS,
                   help=f"open connections at most; one more is closed at once with code 1013, try again "
                        f"later (default {DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--max-decodes", type=_positive(int), default=DEFAULT_MAX_DECODES,
                   help=f"requests decoded and checked at once; others wait their turn (default "
                        f"{DEFAULT_MAX_DECODES})")
    p.add_argument("--policy-batch-wait-ms", "--batch-window-ms", dest="batch_window_ms", type=_batch_window_ms,
                   default=0.0, metavar="MS",
                   help="batch concurrent clients: when the model is free, the first waiting request "
                        "waits at most MS ms for other connections' requests, and all go through one "
                        "forward, each with its own connection's noise (same actions as one at a time). "
                        "For many clients on one accelerator; costs up to MS ms of latency. Default 0: "
                        f"off, one request a forward; at most {MAX_BATCH_WINDOW_MS:g}")
    p.add_argument("--policy-batch", "--max-batch", dest="max_batch", type=_max_batch, default=DEFAULT_MAX_BATCH,
                   metavar="N",
                   help=f"requests in one forward at most when --policy-batch-wait-ms is on; the window closes "
                        f"early once N have joined (default {DEFAULT_MAX_BATCH}). The names are the closed "
                        "loop's (eval.policy_batch, eval.policy_batch_wait_ms); --max-batch and "
                        "--batch-window-ms, their names before, still work this release")
    p.add_argument("--max-image-side", type=_positive(int), default=defaults.max_image_side,
                   help=f"largest image side in pixels (default {defaults.max_image_side})")
    p.add_argument("--max-prompt-chars", type=_positive(int), default=defaults.max_prompt_chars,
                   help=f"longest task instruction in characters (default {defaults.max_prompt_chars})")
    return p


COMPILE_FLAG = {"auto": None, "on": True, "off": False}  # --compile as eval.compile

# The flags' names before they took the closed loop's (eval.policy_batch, eval.policy_batch_wait_ms).
DEPRECATED_FLAGS = {"--max-batch": "--policy-batch", "--batch-window-ms": "--policy-batch-wait-ms"}


def deprecation_notes(argv: list[str]) -> list[str]:
    """A line for each old flag name in `argv` (they still work this release)."""
    used = {a.split("=", 1)[0] for a in argv}
    return [f"pisft serve: note: {old} is deprecated, use {new} (the same setting; {old} goes in the next "
            "release)" for old, new in DEPRECATED_FLAGS.items() if old in used]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    for note in deprecation_notes(argv):
        print(note, file=sys.stderr, flush=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        sock = bind(args.host, args.port)  # before the model loads: a taken port fails at once
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; "
              f"pick another --port (0 picks a free one) or stop what uses it", file=sys.stderr)
        return 2
    if not args.model.is_dir():  # before the (slow) imports of torch and LeRobot
        sock.close()
        print(f"error: {args.model}: model directory not found; pass an exported model "
              f"(results/train/model, written by train_8card, or results/base_model, by fetch_base)",
              file=sys.stderr)
        return 2
    limits = Limits(max_image_side=args.max_image_side, max_prompt_chars=args.max_prompt_chars)
    try:
        from pisft.policy.libero import LiberoPolicy
        from pisft.policy.rtc import RtcSettings

        rtc = (RtcSettings(args.rtc_execution_horizon, args.rtc_max_guidance_weight, args.rtc_schedule)
               if args.rtc else None)
        policy = LiberoPolicy.from_model_dir(args.model, device=args.device, dataset_dir=args.dataset,
                                             seed=args.seed, limits=limits, cfg_scale=args.cfg_scale,
                                             precision=args.precision, compiled=COMPILE_FLAG[args.compile],
                                             rtc=rtc, note=lambda line: print(f"pisft serve: {line}", flush=True))
    except PisftError as exc:
        sock.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        server = PolicyServer(policy, host=args.host, sock=sock,
                              max_message_bytes=int(args.max_message_mib * MIB),
                              max_connections=args.max_connections, max_decodes=args.max_decodes,
                              batch_window_s=args.batch_window_ms / 1000.0, max_batch=args.max_batch)
    except PisftError as exc:
        sock.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def ready(host: str, port: int) -> None:
        cond = getattr(policy, "conditioning", None)
        prompt = f"; prompt: {cond.describe()}" if cond is not None else ""
        guided = getattr(policy, "guidance", None)
        if guided is not None:
            prompt += f"; {guided['describe']}"
        batching = (f"; batching: a window of {args.batch_window_ms:g} ms, up to {args.max_batch} "
                    f"requests a forward" if args.batch_window_ms > 0 else "")
        if args.rtc:
            batching += "; real-time chunking per connection (rtc/executed_steps, rtc/delay_steps)"
        import torch

        from pisft import device as device_mod

        predictor = getattr(policy, "predictor", None)
        if predictor is not None:  # eval.precision's and eval.compile's choices, as a stage's metrics record them
            how = predictor.describe()
            batching += f"; {how['precision']['why']}; {how['compile']['why']}"
        if not device_mod.row(device_mod.resolve_kind(args.device)).accelerator:
            # the model thread's intra-op threads: the CPU latency, and (with torch's default of
            # one per core) the float32 bits of a reply, depend on them (module docstring)
            batching += f"; {torch.get_num_threads()} CPU threads"
        print(f"pisft serve: serving {args.model} on ws://{host}:{port} "
              f"(openpi websocket policy protocol; GET /healthz){prompt}; limits: "
              f"{args.max_message_mib:g} MiB a message, {limits.max_image_side} px an image side, "
              f"{limits.max_prompt_chars} prompt characters{batching}", flush=True)

    async def serve_until_signalled() -> None:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
        await server.run(on_ready=ready, stop=stop)

    asyncio.run(serve_until_signalled())
    summary = f"; {server.oversized} oversized messages refused" if server.oversized else ""
    if server.forwards:
        summary += f"; {server.batched_requests} requests answered in {server.forwards} batched forwards"
    print(f"pisft serve: stopped after {server.requests} requests ({server.errors} errors){summary}",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
