"""Action-chunk inference with a pi0.5 model: the one path that evaluation, closed-loop and
serving all use (preprocessor -> `policy.predict_action_chunk` -> postprocessor; with a
classifier-free guidance scale above 1, `pisft.model.guidance` in the middle).

Flow matching starts from Gaussian noise, so a prediction is only reproducible when the noise
is. `frame_noise` derives the noise of each frame from (seed, key), e.g. (seed, episode,
frame): the same frame gets the same noise whatever the batch it lands in, and the base and
the fine-tuned model are scored from the same starting noise.

How a loaded model runs: its precision (`pisft.policy.precision`, `eval.precision`: bf16 where
openpi runs bf16), its chunk compiled or eager (`pisft.policy.compiled`, `eval.compile`), and
real-time chunking (`enable_rtc`; a request's leftover of its previous chunk, in raw units, is
normalised with the model's own stats and handed to LeRobot's RTC: `pisft.policy.rtc`).
`describe()` records all three.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pisft.errors import ModelLoadError


def noise_generator(seed: int, key: Sequence[int]) -> torch.Generator:
    words = [int(seed)] + [int(k) for k in key]
    state = np.random.SeedSequence(words).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def frame_noise(keys: Sequence[Sequence[int]], *, seed: int, chunk_size: int,
                max_action_dim: int) -> torch.Tensor:
    """(len(keys), chunk_size, max_action_dim) standard-normal noise, one draw per key."""
    return torch.stack([
        torch.randn((chunk_size, max_action_dim), generator=noise_generator(seed, key))
        for key in keys
    ])


def quantile_normalize(x: np.ndarray, q01: np.ndarray, q99: np.ndarray) -> np.ndarray:
    """LeRobot/openpi quantile normalisation: q01 -> -1, q99 -> +1 (per dimension)."""
    denom = np.asarray(q99, dtype=np.float64) - np.asarray(q01, dtype=np.float64)
    denom = np.where(denom == 0, 1e-8, denom)
    return 2.0 * (np.asarray(x, dtype=np.float64) - q01) / denom - 1.0


@dataclass
class ChunkPredictor:
    """A loaded policy with its processors."""

    policy: object
    preprocessor: object
    postprocessor: object
    device: str
    model_dir: Path
    precision: dict | None = None  # `pisft.policy.precision.apply`'s record
    compiled_chunk: object | None = None  # `pisft.policy.compiled.CompiledChunk`, when compiled
    compile_choice: object | None = None  # `pisft.policy.compiled.CompileChoice`
    rtc: object | None = None  # `pisft.policy.rtc.RtcSettings`, when enabled

    @classmethod
    def load(cls, model_dir: str | Path, *, device: str = "cpu", dataset_stats=None,
             dtype: str | None = None, precision: str = "auto", compiled=False,
             layout: str = "openpi", note=print, trial=None) -> ChunkPredictor:
        """Load `model_dir` strictly; stats: the model's own, else `dataset_stats`.

        `precision`: `eval.precision` (`pisft.policy.precision`; `dtype`, when given, is that
        precision instead: "bfloat16" or "float32"); `compiled`: `eval.compile`
        (`pisft.policy.compiled`: True, False, None for the default the stage's first chunk decides
        on an accelerator, or a `CompileChoice` made by hand); `trial`: the stage's shared
        `compiled.Trial` (its replicas decide once); `note` says in one line what was chosen when
        the chunk is compiled, measured, or a choice fell back."""
        from pisft import device as device_mod
        from pisft.model import policy as model_policy
        from pisft.model.norm_stats import STATS_FILE
        from pisft.policy import precision as precision_mod

        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelLoadError(f"{model_dir}: model directory not found; run the stage that "
                                 f"writes it first (fetch_base or train_8card)")
        has_stats = (model_dir / STATS_FILE).is_file()
        if not has_stats and dataset_stats is None:
            raise ModelLoadError(
                f"{model_dir}: the model carries no normalisation stats ({STATS_FILE}); pass a "
                f"dataset's stats (serve: --dataset results/dataset)")
        kind = device_mod.resolve_kind(str(device).split(":")[0])
        own = model_policy.read_config(model_dir / model_policy.CONFIG_FILE, tolerate_unknown=True)[0].dtype
        setting = precision if dtype is None else _PRECISION_OF_DTYPE[dtype]
        choice = precision_mod.choose(setting, kind, own, layout=layout)
        policy = model_policy.load_policy(model_dir, device=device, dtype=choice.dtype)
        pre, post = model_policy.make_processors(policy, model_dir,
                                                 None if has_stats else dataset_stats)
        return cls.of_policy(policy, pre, post, device=device, model_dir=model_dir, precision=choice,
                             compiled=compiled, note=note, trial=trial)

    @classmethod
    def of_policy(cls, policy, preprocessor, postprocessor, *, device: str, model_dir: Path, precision,
                  compiled=False, note=print, trial=None) -> ChunkPredictor:
        """A predictor of a policy built in `precision.dtype` (`pisft.policy.precision.PrecisionChoice`;
        `load` reads one from a model directory, the benchmarks build one with random weights), laid
        out for inference and its chunk compiled as `compiled` says."""
        from pisft import device as device_mod
        from pisft.policy import compiled as compiled_mod
        from pisft.policy import precision as precision_mod

        policy.eval()
        policy.requires_grad_(False)  # inference only: no autograd graph, also under RTC's enable_grad
        record = precision_mod.apply(policy, precision)
        how = (compiled if isinstance(compiled, compiled_mod.CompileChoice)
               else compiled_mod.choose(compiled, device_mod.resolve_kind(str(device).split(":")[0])))
        if how.enabled or compiled is True:  # compiled, measured, or asked for and fell back; the default is recorded
            note(f"{Path(model_dir).name}: {how.why}")
        name = Path(model_dir).name
        chunk = compiled_mod.install(policy, how, on_fallback=lambda line: note(f"{name}: {line}"), trial=trial)
        return cls(policy=policy, preprocessor=preprocessor, postprocessor=postprocessor, device=device,
                   model_dir=Path(model_dir), precision=record, compiled_chunk=chunk, compile_choice=how)

    def enable_rtc(self, settings) -> None:
        """Real-time chunking with `settings` (`pisft.policy.rtc.RtcSettings`): LeRobot's
        `RTCConfig` on the policy, its `RTCProcessor` built (`pisft.policy.rtc.configure`)."""
        from pisft.policy import rtc

        rtc.configure(self.policy, settings)
        self.rtc = settings

    def describe(self) -> dict:
        """How this model runs: precision, the compiled chunk (and its compile times), RTC."""
        from pisft.model.registry import spec_of

        choice = self.compile_choice
        if self.compiled_chunk is not None:  # with the trial's decision and figures, once it ran
            compile_record = self.compiled_chunk.record()
        else:
            compile_record = choice.record() if choice is not None else {"compiled": False}
        out = {"precision": self.precision, "compile": compile_record,
               "rtc": self.rtc.record(spec_of(self.policy).rtc_source) if self.rtc is not None else {"enabled": False}}
        if self.compiled_chunk is not None:
            out["compile"]["first_call_s"] = dict(self.compiled_chunk.compile_s)
            out["compile"]["fell_back"] = self.compiled_chunk.fallen_back
            out["compile"]["actions_atol"] = _tolerance(self.policy)
        return out

    @property
    def chunk_size(self) -> int:
        return int(self.policy.config.chunk_size)

    @property
    def max_action_dim(self) -> int:
        return int(self.policy.config.max_action_dim)

    @property
    def action_dim(self) -> int:
        return int(self.policy.config.output_features["action"].shape[0])

    @property
    def state_dim(self) -> int:
        return int(self.policy.config.input_features["observation.state"].shape[0])

    @property
    def image_features(self) -> list[str]:
        return list(self.policy.config.image_features)

    @torch.no_grad()
    def predict(self, batch: dict, noise: torch.Tensor, *, cfg_scale: float = 1.0,
                unconditioned_tasks: Sequence[str] | None = None,
                prev_actions: torch.Tensor | None = None, delay: int = 0) -> torch.Tensor:
        """Raw-unit action chunks (B, chunk_size, action_dim), float32 on CPU.

        `batch` is in the dataset's layout (images float (B,3,H,W) in [0,1], state, `task`);
        an `action` key, if present, is ignored.

        `cfg_scale` w != 1: classifier-free guidance (`pisft.model.guidance`): `batch["task"]`
        holds the conditioned prompts and `unconditioned_tasks` the plain ones; every denoising
        step uses (1 - w) v_uncond + w v_cond. w = 1 is the conditioned prompt alone, LeRobot's
        sampler untouched.

        `prev_actions` (B, T, action_dim), raw units: each row's previous chunk from the action
        the robot executes when this observation was taken on (`enable_rtc` first); `delay`: the
        control steps it executes of them before this chunk arrives. LeRobot's RTC inpaints the
        chunk to agree with them (`pisft.policy.rtc`).
        """
        batch = {k: v for k, v in batch.items() if k not in ("action", "action_is_pad")}
        noise = noise.to(device=self.device, dtype=torch.float32)
        rtc_kwargs = {}
        if prev_actions is not None:
            from pisft.policy import rtc

            rtc_kwargs = rtc.chunk_kwargs(self, prev_actions, delay)
        if cfg_scale == 1.0:
            processed = self.preprocessor(batch)
            normalized = self.policy.predict_action_chunk(processed, noise=noise, **rtc_kwargs)
        else:
            from pisft.model import guidance

            if unconditioned_tasks is None:
                raise ValueError("cfg_scale != 1 needs the unconditioned prompts (unconditioned_tasks)")
            normalized = guidance.predict_normalized(self.policy, self.preprocessor, batch,
                                                     unconditioned_tasks, noise,
                                                     guidance.check_scale(cfg_scale, "cfg_scale"), **rtc_kwargs)
        raw = self.postprocessor(normalized)
        return raw.detach().to("cpu", torch.float32)


# `dtype` as `eval.precision` (ChunkPredictor.load's older argument).
_PRECISION_OF_DTYPE = {"bfloat16": "bf16", "bf16": "bf16", torch.bfloat16: "bf16",
                       "float32": "fp32", "fp32": "fp32", torch.float32: "fp32"}


def _tolerance(policy) -> float:
    from pisft.policy import compiled

    return compiled.tolerance(policy)
