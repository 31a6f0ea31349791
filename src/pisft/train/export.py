"""Export the trained model: gather the full state dict, write `results/train/` atomically.

`results/train/` (the Snakemake output of train_8card) appears in one rename on rank 0 after
everything in it is written:
  model/              LeRobot layout (config.json, model.safetensors, tokenizer/, normalisation
                      stats, MANIFEST.json) — loadable with pisft.model.policy.load_policy
  metrics.jsonl       one JSON object per optimizer step of the whole run (resumes included)
  train_summary.json  world size, device, resume point, wall time, sharding figures
  pisft_config.json   the resolved config
"""

from __future__ import annotations

import json
import shutil
from typing import Any

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from pisft import disk_space
from pisft.data.prompts import CONDITIONING_FILE
from pisft.io import atomic_dir, dir_bytes, write_json_atomic, write_manifest
from pisft.model import lerobot_internals as internals
from pisft.model.policy import WEIGHTS_FILE
from pisft.model.weights import lerobot_name, read_tensor
from pisft.train.run_folders import latest_checkpoint_text


def export_model(ctx: Any, built: Any, metrics_log: Any, summary: dict, resolved: dict) -> None:
    from pisft.model.policy import save_model

    # Collective: every rank takes part in gathering; only rank 0 receives the full tensors.
    full = get_model_state_dict(built.policy,
                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not ctx.is_main:
        return
    # The action expert's lm_head was detached for training (never used, never trained): the
    # export carries the base model's tensor when it had one, so LeRobot's strict loader accepts it.
    head = read_tensor(built.base_dir / WEIGHTS_FILE, internals.EXPERT_HEAD, rename=lerobot_name)
    if head is not None:
        internals.attach_expert_head(built.policy, head)
        full[internals.EXPERT_HEAD] = head
    with disk_space.export_room(ctx.cfg.results("train"), full, what="export of the trained model",
                                checkpoints=lambda: latest_checkpoint_text(ctx.cfg, ctx.stage),
                                extra_bytes=dir_bytes(built.base_dir / "tokenizer")), \
            atomic_dir(ctx.cfg.results("train")) as tmp:
        model_dir = tmp / "model"
        model_dir.mkdir()
        save_model(built.policy, model_dir, tokenizer_dir=built.base_dir / "tokenizer",
                   dataset_stats=built.stats, state_dict=full)
        # how prompts were conditioned: the dataset's record, or the RECAP iteration's labels
        if ctx.cfg.iteration and built.conditioning is not None:
            built.conditioning.write(model_dir / CONDITIONING_FILE)
        elif (built.dataset_dir / "meta" / CONDITIONING_FILE).is_file():
            shutil.copy2(built.dataset_dir / "meta" / CONDITIONING_FILE, model_dir / CONDITIONING_FILE)
        (model_dir / "pisft_config.json").write_text(json.dumps(resolved, indent=2, sort_keys=True) + "\n")
        write_manifest(model_dir)
        shutil.copy2(metrics_log.path, tmp / "metrics.jsonl")
        write_json_atomic(tmp / "train_summary.json", summary)
        write_json_atomic(tmp / "pisft_config.json", resolved)
