"""The fields of a request that the server reads itself, before the policy sees the observation: a
reset (`{"reset": true[, "seed": int]}`, which restarts the connection's noise) and real-time
chunking's `rtc/executed_steps` and `rtc/delay_steps` (`--rtc`). What they mean for a client is in
`pisft.serve.server`'s docstring and docs/serving.md; each malformed field is an ObservationError,
answered as a bad request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pisft.policy.observations import ObservationError

MAX_SEED = 1 << 63


@dataclass
class _Reset:
    seed: int | None


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
    from pisft.policy.rtc import RTC_DELAY_KEY, RTC_PREV_KEY
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


def prepared_delay(prepared: Any) -> int:
    """The RTC delay a prepared request carries (`LiberoPolicy.prepare`'s `RTC_KEY`)."""
    from pisft.policy.rtc import RTC_KEY

    return prepared[RTC_KEY][1]
