"""Action-chunk inference with a pi0.5 model: the one path that evaluation, closed-loop and
serving all use (preprocessor -> `policy.predict_action_chunk` -> postprocessor; with a
classifier-free guidance scale above 1, `pisft.model.guidance` in the middle).

Flow matching starts from Gaussian noise, so a prediction is only reproducible when the noise
is. `frame_noise` derives the noise of each frame from (seed, key), e.g. (seed, episode,
frame): the same frame gets the same noise whatever the batch it lands in, and the base and
the fine-tuned model are scored from the same starting noise.
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

    @classmethod
    def load(cls, model_dir: str | Path, *, device: str = "cpu", dataset_stats=None,
             dtype: str | None = None) -> ChunkPredictor:
        """Load `model_dir` strictly; stats: the model's own, else `dataset_stats`."""
        from pisft.model import policy as model_policy
        from pisft.model.norm_stats import STATS_FILE

        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelLoadError(f"{model_dir}: model directory not found; run the stage that "
                                 f"writes it first (fetch_base or train_8card)")
        has_stats = (model_dir / STATS_FILE).is_file()
        if not has_stats and dataset_stats is None:
            raise ModelLoadError(
                f"{model_dir}: the model carries no normalisation stats ({STATS_FILE}); pass a "
                f"dataset's stats (serve: --dataset results/dataset)")
        policy = model_policy.load_policy(model_dir, device=device, dtype=dtype)
        policy.eval()
        pre, post = model_policy.make_processors(policy, model_dir,
                                                 None if has_stats else dataset_stats)
        return cls(policy=policy, preprocessor=pre, postprocessor=post, device=device,
                   model_dir=model_dir)

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
                unconditioned_tasks: Sequence[str] | None = None) -> torch.Tensor:
        """Raw-unit action chunks (B, chunk_size, action_dim), float32 on CPU.

        `batch` is in the dataset's layout (images float (B,3,H,W) in [0,1], state, `task`);
        an `action` key, if present, is ignored.

        `cfg_scale` w != 1: classifier-free guidance (`pisft.model.guidance`): `batch["task"]`
        holds the conditioned prompts and `unconditioned_tasks` the plain ones; every denoising
        step uses (1 - w) v_uncond + w v_cond. w = 1 is the conditioned prompt alone, LeRobot's
        sampler untouched.
        """
        batch = {k: v for k, v in batch.items() if k not in ("action", "action_is_pad")}
        noise = noise.to(device=self.device, dtype=torch.float32)
        if cfg_scale == 1.0:
            processed = self.preprocessor(batch)
            normalized = self.policy.predict_action_chunk(processed, noise=noise)
        else:
            from pisft.model import guidance

            if unconditioned_tasks is None:
                raise ValueError("cfg_scale != 1 needs the unconditioned prompts (unconditioned_tasks)")
            normalized = guidance.predict_normalized(self.policy, self.preprocessor, batch,
                                                     unconditioned_tasks, noise,
                                                     guidance.check_scale(cfg_scale, "cfg_scale"))
        raw = self.postprocessor(normalized)
        return raw.detach().to("cpu", torch.float32)
