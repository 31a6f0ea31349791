"""The one policy protocol: what both batching front ends (`pisft.policy.replicas`, threads;
`pisft.serve.policy_server`, asyncio) ask of a policy. `pisft.policy.libero.LiberoPolicy` is one.

A request is handled in two steps, so a front end can check and convert it off the model's
thread: `prepare` (validation, pixels to tensors, the prompt) and `predict_many` (one forward for
several prepared requests, each drawing its noise from its own generator, `new_noise(seed)`).

`as_policy` wraps what tests and callers hand the closed loop in its place: an object with
`infer_batch(requests, seeds)` (one forward for several raw requests, each seeded), or with
`reset(seed)` and `infer(request)` (one request at a time).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Policy(Protocol):
    def new_noise(self, seed: int | None = None) -> Any: ...

    def prepare(self, obs: Any) -> Any: ...  # checks and converts; no model work

    def predict_many(self, prepared: list, noises: list) -> list[dict]: ...  # one forward, one reply each


class _Wrapped:
    """A stand-in in the protocol: `prepare` keeps the request, the noise is its seed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.one_at_a_time = not callable(getattr(inner, "infer_batch", None))

    def __getattr__(self, name: str) -> Any:  # the stand-in's own attributes (guidance, ...)
        return getattr(self.inner, name)

    def new_noise(self, seed: int | None = None) -> Any:
        return seed

    def prepare(self, obs: Any) -> Any:
        return obs

    def predict_many(self, prepared: list, noises: list) -> list[dict]:
        if not self.one_at_a_time:
            return self.inner.infer_batch(prepared, noises)
        out = []
        for obs, seed in zip(prepared, noises, strict=True):
            self.inner.reset(seed)
            out.append(self.inner.infer(obs))
        return out


def as_policy(policy: Any) -> Any:
    """`policy` in the protocol: itself when it is one, else wrapped (module docstring)."""
    if isinstance(policy, Policy):
        return policy
    if callable(getattr(policy, "infer_batch", None)) or (
            callable(getattr(policy, "infer", None)) and callable(getattr(policy, "reset", None))):
        return _Wrapped(policy)
    raise TypeError(f"{type(policy).__name__} is not a policy: it needs prepare/predict_many/new_noise "
                    "(pisft.policy.interface.Policy), infer_batch(requests, seeds), or reset(seed) and infer(obs)")
