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
import logging
import math
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pisft.config import LEROBOT_RTC_DEFAULTS, RTC_SCHEDULES
from pisft.errors import PisftError
from pisft.policy.observations import Limits
from pisft.serve.policy_server import (DEFAULT_HOST, DEFAULT_MAX_BATCH, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_DECODES,
                                       DEFAULT_MAX_MESSAGE_MIB, DEFAULT_PORT, MIB, PolicyServer)

MAX_BATCH_WINDOW_MS = 1000.0  # a longer window would delay a lone client's every request by over a second


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
