"""The chunk's entry points for a compiled program (9.; pisft.policy.compiled) and the velocity of a
denoising step (6.; pisft.model.guidance).

Numbers (5., 9., ...) are the items of the package's docstring (`pisft.model.pi05`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


_VELOCITY_HOOK = "_pisft_velocity_hook"  # marks the step velocity_hook installs (6.)


@contextlib.contextmanager
def velocity_hook(policy, hook) -> Iterator[None]:
    """Within the block, every denoising step of `policy.predict_action_chunk` returns
    `hook(velocity)` where `velocity(x_t, timestep)` is LeRobot's own step (6.).

    One inference at a time per policy (as `serve` and `closed_loop` run them): the hook is an
    attribute of the policy's model while the block lasts.
    """
    model = policy.model
    if "denoise_step" in vars(model):
        raise RuntimeError("velocity_hook: the policy's denoise_step is already hooked "
                           "(one inference at a time per policy)")
    original = model.denoise_step  # LeRobot's bound method

    def step(**kwargs):
        def velocity(x_t, timestep):
            return original(**{**kwargs, "x_t": x_t, "timestep": timestep})
        return hook(velocity)(kwargs["x_t"], kwargs["timestep"])

    setattr(step, _VELOCITY_HOOK, True)  # 9.: a compiled RTC chunk leaves a hooked step as it is
    model.denoise_step = step
    try:
        yield
    finally:
        del model.denoise_step


def install_sample_actions(policy, fn) -> None:
    """Every `policy.predict_action_chunk` runs `fn(images, img_masks, tokens, masks, noise=,
    num_steps=, **rtc)` in place of LeRobot's `PI05Pytorch.sample_actions` (9.)."""
    policy.model.sample_actions = fn


def lerobot_sample_actions(policy):
    """LeRobot's own `sample_actions`, bound to the policy's model (whatever is installed)."""
    core = policy.model
    return type(core).sample_actions.__get__(core)


def _prefix_vlm(policy):
    return policy.model.paligemma_with_expert.paligemma.model.language_model


def rtc_pieces(policy) -> dict[str, Any]:
    """LeRobot's three model calls of a chunk, bound (9.): `embed_prefix`, the VLM's
    `forward` (the prefix pass) and `denoise_step`."""
    core, vlm = policy.model, _prefix_vlm(policy)
    return {"embed_prefix": type(core).embed_prefix.__get__(core),
            "prefix_forward": type(vlm).forward.__get__(vlm),
            "denoise_step": type(core).denoise_step.__get__(core)}


def velocity_hooked(policy) -> bool:
    """Whether `velocity_hook` (6.) holds the policy's denoising step now."""
    step = vars(policy.model).get("denoise_step")
    return step is not None and getattr(step, _VELOCITY_HOOK, False)


@contextlib.contextmanager
def pieces_installed(policy, pieces: dict[str, Any]) -> Iterator[bool]:
    """Within the block LeRobot's `sample_actions` calls `pieces` (compiled `rtc_pieces`) for its
    prefix and its denoising steps; yields whether the steps are the given ones (not while
    `velocity_hook` holds them: a guided chunk's steps then run LeRobot's own)."""
    core, vlm = policy.model, _prefix_vlm(policy)
    hooked = velocity_hooked(policy)
    core.embed_prefix = pieces["embed_prefix"]
    vlm.forward = pieces["prefix_forward"]
    if not hooked:
        core.denoise_step = pieces["denoise_step"]
    try:
        yield not hooked
    finally:
        del core.embed_prefix
        del vlm.forward
        if not hooked:
            del core.denoise_step
