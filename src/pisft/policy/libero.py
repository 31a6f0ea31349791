"""A pi0.5 model answering openpi LIBERO requests: observation in, raw-unit action chunk out.

Used by `python -m pisft serve` and, in-process, by the closed-loop evaluation, so both
answer the same request the same way. Noise: a seeded generator draws the flow-matching noise
of each request in turn, so a rollout is reproducible. In-process, `reset(seed)` restarts the
policy's own generator (one per episode); the server gives every connection a generator of its
own (`new_noise`), so each client's requests draw the same noise whatever other clients do.

A request is handled in two steps, so the server can check and convert it off the model's
thread: `prepare` (validation against `observations.Limits`, pixels to tensors, the prompt)
and `predict` (the model). `infer` is both.

Prompt: clients send the bare task (openpi's LIBERO client does); a model trained with
advantage-conditioned prompts (`data.advantage_tag`) is prompted the way RLinf evaluates it,
`"<task>\nAdvantage: positive"` (`pisft.data.prompts`; what the model directory records in
`prompt_conditioning.json`). A prompt that already carries an advantage label is used as sent.
The prompt is cut to what the tokenizer can use before it is tokenized (`prompt_budget`).

Guidance: `cfg_scale` (`eval.cfg_scale`, `serve --cfg-scale`) w > 1 guides an
advantage-conditioned model as RLinf does (`pisft.model.guidance`): every denoising step blends
the velocity under the prompt above (v_cond) with the velocity under the plain task (v_uncond),
(1 - w) v_uncond + w v_cond. w = 1, and any scale for a model trained on plain prompts, is the
prompt above alone; `metadata["guidance"]` records which (`cfg_scale`: the scale in effect).

Real-time chunking (`rtc`, `pisft.policy.rtc`): a request may carry the raw actions of its
previous chunk not yet executed when its observation was taken (`rtc.RTC_PREV_KEY`) and the control
steps the robot executes of them before the answer arrives (`rtc.RTC_DELAY_KEY`); the chunk is then
inpainted to agree with them (LeRobot's RTC). The closed loop's chunking (`pisft.rollout.chunking`)
sets both; `serve` sets the first from the chunk it answered the connection last. A request
without them gets a plain chunk.

Every reply carries `policy_timing` (`infer_ms`: the model's time for the forward it was in), as
openpi's `Policy.infer` does (src/openpi/policies/policy.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import time

import numpy as np
import torch

from pisft import device as device_mod
from pisft.data import prompts
from pisft.data.libero import strip_advantage
from pisft.policy.predictor import ChunkPredictor, noise_generator
from pisft.model import guidance
from pisft.policy import observations
from pisft.policy import rtc as rtc_mod
from pisft.policy.rtc import RTC_DELAY_KEY, RTC_KEY, RTC_PREV_KEY


def prompt_budget(preprocessor: Any) -> int | None:
    """Characters of a prompt that can reach the model: None when there is no tokenizer step.

    The tokenizer keeps `max_length` tokens and no token stands for more characters than its
    longest vocabulary entry, so the kept tokens come from the first `max_length × longest`
    characters; twice that leaves room for merges across the cut. Cutting there first means a
    long prompt is never tokenized whole only to be truncated (LeRobot's TokenizerProcessorStep
    truncates after tokenizing).
    """
    for step in getattr(preprocessor, "steps", ()):
        tokenizer = getattr(step, "input_tokenizer", None)
        max_length = getattr(step, "max_length", None)
        if tokenizer is not None and isinstance(max_length, int) and hasattr(tokenizer, "get_vocab"):
            longest = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
            return 2 * max_length * max(longest, 1)
    return None


# The prepared request's plain-task prompts (the unconditioned branch), only when guidance applies.
UNCONDITIONED_KEY = "pisft.unconditioned_task"


def cut_prompt(text: str, budget: int | None) -> str:
    """The prompt as the model sees it, without the characters it cannot reach.

    LeRobot's pi0.5 prompt step strips the task first, so leading whitespace is not counted.
    """
    if budget is None or len(text) <= budget:
        return text
    return text.lstrip()[:budget]


class LiberoPolicy:
    def __init__(self, predictor: ChunkPredictor, *, seed: int = 0,
                 conditioning: prompts.PromptConditioning | None = None,
                 limits: observations.Limits | None = None, cfg_scale: float = 1.0,
                 rtc: rtc_mod.RtcSettings | None = None) -> None:
        self.predictor = predictor
        if rtc is not None:
            predictor.enable_rtc(rtc)
        self.seed = seed
        self.limits = limits if limits is not None else observations.Limits()
        self.conditioning = conditioning if conditioning is not None else prompts.for_model(predictor.model_dir)
        requested = guidance.check_scale(cfg_scale, "cfg_scale")
        # the scale in effect: 1 for a model trained on plain prompts (it has no conditioned branch)
        self.cfg_scale = guidance.applied_scale(requested, self.conditioning)
        self.guidance = guidance.record(requested, self.conditioning)
        self.prompt_budget = prompt_budget(predictor.preprocessor)
        resolution = getattr(predictor.policy.config, "image_resolution", None)
        self.image_resolution = tuple(resolution) if resolution is not None else None
        self.reset(seed)
        self.metadata = {
            "policy": "pi05",
            "model_dir": str(predictor.model_dir),
            "action_horizon": predictor.chunk_size,
            "action_dim": predictor.action_dim,
            "state_dim": predictor.state_dim,
            "observation_keys": [observations.OPENPI_LIBERO_KEYS.get(k, k)
                                 for k in predictor.image_features] +
                                [observations.OPENPI_LIBERO_KEYS[observations.STATE],
                                 observations.PROMPT_KEY],
            "action_units": "raw (unnormalised with the model's stats)",
            "prompt_conditioning": self.conditioning.to_dict(),
            "cfg_scale": self.cfg_scale,
            "guidance": self.guidance,
            "limits": {**self.limits.to_dict(), "min_image_side": observations.MIN_IMAGE_SIDE},
            "inference": predictor.describe(),
        }

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, *, device: str = "auto", device_index: int = 0,
                       dataset_dir: str | Path | None = None, seed: int = 0,
                       trained_on: str | Path | None = None,
                       limits: observations.Limits | None = None,
                       cfg_scale: float = 1.0, precision: str = "auto", compiled: bool | None = False,
                       rtc: rtc_mod.RtcSettings | None = None, note=print, trial=None) -> LiberoPolicy:
        """`trained_on`: the converted dataset the model was fine-tuned on, whose prompt
        conditioning applies when the model directory records none. `cfg_scale`: the
        classifier-free guidance scale (module docstring). `device_index`: which device of
        `device`'s kind (closed_loop's replicas, one per device). `precision`, `compiled`:
        `eval.precision`, `eval.compile` (`ChunkPredictor.load`; `trial`: the stage's shared
        `compiled.Trial`, one for its replicas); `rtc`: real-time chunking on."""
        requested = guidance.check_scale(cfg_scale, "cfg_scale")  # before the model loads
        stats = _dataset_stats(Path(dataset_dir)) if dataset_dir is not None else None
        kind = device_mod.resolve_kind(device)
        dev = str(device_mod.local_device(kind, device_index))  # the CPU: "cpu", whatever the index
        predictor = ChunkPredictor.load(model_dir, device=dev, dataset_stats=stats, precision=precision,
                                        compiled=compiled, note=note, trial=trial)
        return cls(predictor, seed=seed, conditioning=prompts.for_model(model_dir, trained_on=trained_on),
                   limits=limits, cfg_scale=requested, rtc=rtc)

    def new_noise(self, seed: int | None = None) -> torch.Generator:
        """A noise generator starting an episode from `seed` (default: the policy's seed)."""
        return noise_generator(self.seed if seed is None else seed, [0])

    def reset(self, seed: int | None = None) -> None:
        """Start a new episode: the noise sequence restarts from `seed` (default: the policy's)."""
        self._generator = self.new_noise(seed)

    def prepare(self, obs: Any) -> dict:
        """Check a request and convert it to the model's batch of one (no model work)."""
        p = self.predictor
        batch = observations.to_batch(obs, image_features=p.image_features, state_dim=p.state_dim,
                                      limits=self.limits, image_resolution=self.image_resolution)
        sent = batch["task"]
        batch["task"] = [cut_prompt(self.conditioning.inference_prompt(t), self.prompt_budget)
                         for t in sent]
        if self.cfg_scale != 1.0:
            batch[UNCONDITIONED_KEY] = [cut_prompt(strip_advantage(t), self.prompt_budget) for t in sent]
        leftover = self._rtc_request(obs)
        if leftover is not None:
            batch[RTC_KEY] = leftover
        return batch

    def _rtc_request(self, obs: Any) -> tuple[torch.Tensor, int] | None:
        """(the raw leftover (T, action_dim), the delay) a request carries, checked; None: none."""
        if not isinstance(obs, dict) or (RTC_PREV_KEY not in obs and RTC_DELAY_KEY not in obs):
            return None
        p = self.predictor
        if p.rtc is None:
            raise observations.ObservationError(
                f"'{RTC_PREV_KEY}'/'{RTC_DELAY_KEY}': real-time chunking is off for this model (serve "
                f"--rtc, eval.rtc.enabled)")
        if RTC_PREV_KEY not in obs or RTC_DELAY_KEY not in obs:
            raise observations.ObservationError(f"real-time chunking needs both '{RTC_PREV_KEY}' and "
                                                f"'{RTC_DELAY_KEY}', got one")
        delay = obs[RTC_DELAY_KEY]
        problem = rtc_mod.delay_problem(delay, p.chunk_size, RTC_DELAY_KEY)
        if problem:  # an array here was int()'s TypeError (issue 56)
            raise observations.ObservationError(problem)
        prev = np.asarray(obs[RTC_PREV_KEY])
        if (prev.ndim != 2 or not 1 <= prev.shape[0] <= p.chunk_size or prev.shape[1] != p.action_dim
                or not np.issubdtype(prev.dtype, np.number) or not np.isfinite(prev).all()):
            raise observations.ObservationError(
                f"'{RTC_PREV_KEY}' must be finite numbers of shape (1..{p.chunk_size}, {p.action_dim}), got "
                f"shape {prev.shape}, dtype {prev.dtype}")
        return torch.as_tensor(prev, dtype=torch.float32), rtc_mod.whole_steps(delay)

    def forward_group(self, batch: dict) -> Any:
        """Which prepared requests one forward can hold: those of one real-time chunking group
        (`rtc.group_key`: the delay and the leftover's length; None, a plain chunk)."""
        return rtc_mod.group_key(*(batch.get(RTC_KEY) or (None, 0)))

    def predict(self, batch: dict, noise: torch.Generator) -> dict:
        """The action chunk of a prepared request, drawing its noise from `noise`."""
        return self.predict_many([batch], [noise])[0]

    def predict_many(self, batches: list[dict], noises: list[torch.Generator]) -> list[dict]:
        """The action chunks of several prepared requests in one forward, each drawing its noise
        from its own generator, so a request's chunk does not depend on what it is batched with,
        to float32 rounding: the forward rounds by its number of rows (measured on this CPU with a
        trained model: 1, 2-3 and 4 or more rows give chunks 1-4 float32 steps apart; with two
        threads also by a request's place), never by the other rows' content. The closed loop and
        the collection compute at a fixed number of rows (`pisft.policy.fixed_shape`)."""
        if len(batches) != len(noises) or not batches:
            raise ValueError(f"predict_many: {len(batches)} requests and {len(noises)} noise generators")
        p = self.predictor
        start = time.perf_counter()
        # each request's noise from its own generator, in request order, whatever the grouping
        draws = [torch.randn((len(b["task"]), p.chunk_size, p.max_action_dim), generator=g)
                 for b, g in zip(batches, noises, strict=True)]
        groups: dict = {}
        for i, b in enumerate(batches):  # rows of one forward share the RTC delay (pisft.policy.rtc)
            groups.setdefault(self.forward_group(b), []).append(i)
        actions: dict[int, np.ndarray] = {}
        for key, rows in groups.items():
            merged = _concat([{k: v for k, v in batches[i].items() if k != RTC_KEY} for i in rows])
            plain = merged.pop(UNCONDITIONED_KEY, None)
            kwargs: dict = {} if plain is None else {"cfg_scale": self.cfg_scale, "unconditioned_tasks": plain}
            if key is not None:
                kwargs.update(prev_actions=torch.stack([batches[i][RTC_KEY][0] for i in rows]), delay=key[0])
            out = p.predict(merged, torch.cat([draws[i] for i in rows]), **kwargs).numpy().astype(np.float32)
            actions.update(zip(rows, out, strict=True))
        timing = {"infer_ms": 1000.0 * (time.perf_counter() - start)}
        return [{"actions": actions[i], "policy_timing": dict(timing)} for i in range(len(batches))]

    def infer(self, obs: dict) -> dict:
        return self.predict(self.prepare(obs), self._generator)

    def infer_batch(self, requests: list[dict], seeds: list[int]) -> list[dict]:
        """`infer` of each request after `reset(seed)`, in one forward (closed-loop batching)."""
        return self.predict_many([self.prepare(r) for r in requests], [self.new_noise(s) for s in seeds])


def _concat(batches: list[dict]) -> dict:
    """Prepared requests (batches of one, the same keys) as one batch."""
    keys = set(batches[0])
    if any(set(b) != keys for b in batches):
        raise ValueError("predict_many: the prepared requests do not have the same keys")
    merged: dict = {}
    for key in batches[0]:
        values = [b[key] for b in batches]
        merged[key] = torch.cat(values) if isinstance(values[0], torch.Tensor) else [x for v in values for x in v]
    return merged


def _dataset_stats(dataset_dir: Path):
    from pisft.data.dataset import load_stats

    return load_stats(dataset_dir)
