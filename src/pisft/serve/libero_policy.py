"""A pi0.5 model answering openpi LIBERO requests: observation in, raw-unit action chunk out.

Used by `python -m pisft serve` and, in-process, by the closed-loop evaluation, so both
answer the same request the same way. Noise: one seeded generator per episode (`reset(seed)`)
draws the flow-matching noise of each request in turn, so a rollout is reproducible.

Prompt: clients send the bare task (openpi's LIBERO client does); a model trained with
advantage-conditioned prompts (`data.advantage_tag`) is prompted the way RLinf evaluates it,
`"<task>\nAdvantage: positive"` (`pisft.data.prompts`; what the model directory records in
`prompt_conditioning.json`). A prompt that already carries an advantage label is used as sent.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pisft import device as device_mod
from pisft.data import prompts
from pisft.evaluate.inference import ChunkPredictor, noise_generator
from pisft.serve import observations


class LiberoPolicy:
    def __init__(self, predictor: ChunkPredictor, *, seed: int = 0,
                 conditioning: prompts.PromptConditioning | None = None) -> None:
        self.predictor = predictor
        self._seed = seed
        self.conditioning = conditioning if conditioning is not None else prompts.for_model(predictor.model_dir)
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
        }

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, *, device: str = "auto",
                       dataset_dir: str | Path | None = None, seed: int = 0,
                       trained_on: str | Path | None = None) -> LiberoPolicy:
        """`trained_on`: the converted dataset the model was fine-tuned on, whose prompt
        conditioning applies when the model directory records none."""
        stats = _dataset_stats(Path(dataset_dir)) if dataset_dir is not None else None
        kind = device_mod.resolve_kind(device)
        dev = str(device_mod.local_device(kind, 0)) if kind != "cpu" else "cpu"
        return cls(ChunkPredictor.load(model_dir, device=dev, dataset_stats=stats), seed=seed,
                   conditioning=prompts.for_model(model_dir, trained_on=trained_on))

    def reset(self, seed: int | None = None) -> None:
        """Start a new episode: the noise sequence restarts from `seed` (default: the server's)."""
        self._generator = noise_generator(self._seed if seed is None else seed, [0])

    def infer(self, obs: dict) -> dict:
        p = self.predictor
        batch = observations.to_batch(obs, image_features=p.image_features, state_dim=p.state_dim)
        batch["task"] = [self.conditioning.inference_prompt(t) for t in batch["task"]]
        noise = torch.randn((1, p.chunk_size, p.max_action_dim), generator=self._generator)
        actions = p.predict(batch, noise)[0].numpy().astype(np.float32)
        return {"actions": actions}


def _dataset_stats(dataset_dir: Path):
    from pisft.data.dataset import load_stats

    return load_stats(dataset_dir)
