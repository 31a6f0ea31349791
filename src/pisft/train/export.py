"""Export the trained model: stream its tensors to rank 0, write `results/train/` atomically.

`results/train/` (the Snakemake output of train_8card) appears in one rename on rank 0 after
everything in it is written:
  model/              LeRobot layout (config.json, model.safetensors, tokenizer/, normalisation
                      stats, LeRobot's policy_preprocessor.json / policy_postprocessor.json and
                      their state files (`pisft.model.lerobot_processors`), MANIFEST.json) —
                      loadable with pisft.model.policy.load_policy, LeRobot's
                      PI05Policy.from_pretrained and make_pre_post_processors: a plain pi0.5, LoRA adapters merged
                      (W + (alpha / r) B A), frozen tensors the base model's bytes
                      (`pisft.train.export_weights`, one tensor in memory at a time);
                      pisft_model.json records `trainable` (the mode)
  adapter/            (train.trainable: lora) the adapter alone in PEFT's layout
                      (adapter_config.json, adapter_model.safetensors, config.json with
                      use_peft), loadable onto the base model with peft's PeftModel.from_pretrained
  metrics.jsonl       one JSON object per optimizer step of the whole run (resumes included)
  train_summary.json  world size, device, resume point, wall time, sharding figures
  pisft_config.json   the resolved config
"""

from __future__ import annotations

import json
import shutil
from typing import Any

from pisft import layout
from pisft import disk_space
from pisft.data.prompts import CONDITIONING_FILE
from pisft.io import atomic_dir, dir_bytes, write_json_atomic, write_manifest
from pisft.model.lerobot_processors import write_processors
from pisft.model.norm_stats import STATS_FILE
from pisft.model.policy import WEIGHTS_FILE
from pisft.train import export_weights
from pisft.train.run_folders import latest_checkpoint_text

ADAPTER_DIR = "adapter"


def export_model(ctx: Any, built: Any, metrics_log: Any, summary: dict, resolved: dict) -> None:
    """Collective: every rank joins each tensor's gather (in the same order); rank 0 writes.

    The action expert's lm_head was detached for training (never used, never trained): the export
    carries the base model's tensor when it had one, so LeRobot's strict loader accepts it."""
    from pisft.model.policy import model_info, save_model

    applied = getattr(built, "trainable", None)
    spec = applied.spec if applied is not None else None
    if not ctx.is_main:
        export_weights.write_policy_weights(built.model, built.base_dir / WEIGHTS_FILE, None, is_main=False)
        if spec is not None:
            export_weights.write_adapter(built.model, spec, built.base_dir, None, is_main=False)
        return
    if applied is not None:
        model_info(built.model)["trainable"] = applied.record()
    with disk_space.export_room(layout.iteration(ctx.cfg).train, None, what="export of the trained model",
                                checkpoints=lambda: latest_checkpoint_text(ctx.cfg, ctx.stage),
                                extra_bytes=disk_space.model_bytes(built.model)
                                + dir_bytes(built.base_dir / "tokenizer")), \
            atomic_dir(layout.iteration(ctx.cfg).train) as tmp:
        model_dir = tmp / "model"
        model_dir.mkdir()
        save_model(built.model, model_dir, tokenizer_dir=built.base_dir / "tokenizer",
                   dataset_stats=built.stats,
                   write_weights=lambda path: export_weights.write_policy_weights(
                       built.model, built.base_dir / WEIGHTS_FILE, path, is_main=True))
        if spec is not None:
            export_weights.write_adapter(built.model, spec, built.base_dir, tmp / ADAPTER_DIR, is_main=True,
                                         policy_config=built.model.config)
        # how prompts were conditioned: the dataset's record, or the RECAP iteration's labels
        if ctx.cfg.iteration and built.conditioning is not None:
            built.conditioning.write(model_dir / CONDITIONING_FILE)
        elif (built.dataset_dir / "meta" / CONDITIONING_FILE).is_file():
            shutil.copy2(built.dataset_dir / "meta" / CONDITIONING_FILE, model_dir / CONDITIONING_FILE)
        (model_dir / "pisft_config.json").write_text(json.dumps(resolved, indent=2, sort_keys=True) + "\n")
        if (model_dir / STATS_FILE).is_file():  # LeRobot's processor files, the tokenizer inside them
            write_processors(model_dir)
        write_manifest(model_dir)
        shutil.copy2(metrics_log.path, tmp / layout.TRAIN_METRICS_FILE)
        write_json_atomic(tmp / "train_summary.json", summary)
        write_json_atomic(tmp / "pisft_config.json", resolved)
