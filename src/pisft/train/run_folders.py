"""The run folder of each training stage that checkpoints: the policy's (`train_8card`:
`checkpoint.checkpoint_root`) and the RECAP value model's (`train_value`:
`results/checkpoints/value/run-<fingerprint digest>`, trained by `pisft.recap.value_training`).

Here, below the trainers, so that the launcher names the latest checkpoint of either after a
failure without importing the training code, the model or the RECAP package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pisft import layout
from pisft.config import VALUE_RUN, PisftConfig
from pisft.io import sha256_file
from pisft.stages import TRAIN_VALUE
from pisft.train import checkpoint, decisions
from pisft.train.checkpoint import inputs_fingerprint, run_folder, settings_fingerprint


def value_fingerprint(cfg: PisftConfig) -> dict[str, Any]:
    """What a value checkpoint must share with the current run to be resumed: its settings (the keys
    marked VALUE_RUN in pisft.config; the world size, the micro batch and everything that only
    splits or speeds up the same computation are left out, as for the policy), the model it starts
    from (`layout.value_init_model`: the base model or policy k-1), the dataset and the returns
    file (sha256)."""
    returns = layout.iteration(cfg).returns
    return {**settings_fingerprint(cfg, VALUE_RUN), **inputs_fingerprint(cfg, layout.value_init_model(cfg)),
            "value_global_batch_size": cfg.value_global_batch_size,  # 0 in the config: train's
            "returns": sha256_file(returns) if returns.is_file() else None}


def value_checkpoint_root(cfg: PisftConfig) -> Path:
    return run_folder(layout.iteration(cfg).value_checkpoints, value_fingerprint(cfg))


def stage_checkpoint_root(stage: str, cfg: PisftConfig) -> Path:
    """The run folder of `stage` (train_8card or train_value) for this config; the policy's with
    `auto` as the smoke gate decided it (`decisions.resolved_for_folders`)."""
    if stage == TRAIN_VALUE.name:
        return value_checkpoint_root(cfg)
    return checkpoint.checkpoint_root(decisions.resolved_for_folders(cfg))


def latest_checkpoint_text(cfg: PisftConfig, stage: str) -> str:
    """The latest complete checkpoint of a training stage's run folder, in words (for a message)."""
    root = stage_checkpoint_root(stage, cfg)
    found = checkpoint.latest_complete(root, log=lambda _msg: None, content=False)
    if found is None:
        return f"no complete checkpoint in {root} (a rerun starts from step 0)"
    return f"the latest complete checkpoint {found.path} (step {found.step}; a rerun resumes from it)"
