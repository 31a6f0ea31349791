"""The run folder of each training stage that checkpoints, one per run fingerprint: the policy's
(`train_8card`: `checkpoint_root`, `results/checkpoints/train/run-<fingerprint digest>`) and the
RECAP value model's (`train_value`: `results/checkpoints/value/run-<fingerprint digest>`, trained by
`pisft.recap.value_training`).

Here, below the trainers and without torch, so that the launcher names a stage's run folder (its
lock, pisft.train.guard) and, after a failure, the latest checkpoint in it without importing the
training code, the model, the RECAP package or torch (about 2 CPU s a launch).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pisft import layout
from pisft.base_identity import identity_sha256
from pisft.config import POLICY_RUN, VALUE_RUN, PisftConfig, fingerprint_keys, lookup, to_dict
from pisft.io import sha256_file
from pisft.layout import SPLIT_FILE
from pisft.stages import TRAIN_VALUE
from pisft.train import decisions


def _sha256_of(paths: list[Path], listed: list[Path] = ()) -> str | None:
    """sha256 over the content of `paths` and the names and sizes of the files under `listed`.

    The dataset's bulk (parquet/video files, possibly many GB) enters by name and size only:
    any change in its content also changes meta/stats.json (statistics over every frame),
    which is hashed in full. Hashing it all would cost minutes per start at LIBERO size.
    """
    h = hashlib.sha256()
    seen = False
    for p in paths:
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
            seen = True
    for folder in listed:
        for f in sorted(folder.rglob("*")) if folder.is_dir() else ():
            if f.is_file():
                h.update(f"{f.relative_to(folder.parent).as_posix()}:{f.stat().st_size}".encode())
                seen = True
    return h.hexdigest() if seen else None


# The trained parameters' names: a checkpoint of separate q/k/v (before the fused projections,
# pisft.model.pi05 12.) belongs to another run.
PARAMETER_LAYOUT = "fused qkv_proj, gate_up_proj"


def run_fingerprint(cfg: PisftConfig) -> dict[str, Any]:
    """What a checkpoint must share with the current run to be resumed (world size excluded).

    Every setting that changes what training computes (the keys marked POLICY_RUN in
    pisft.config: `model` and `data` whole but their input keys, and the `train` keys listed
    there with why the others stay out) and the content of its inputs: the model it starts from
    (`pisft.base_identity.model_identity`: its files' sha256 and its source, not the config that
    wrote it) and the dataset (split, features, statistics, prompt conditioning, episode index,
    data files).

    `train.compile` enters as `cfg` has it: train_8card's workers (and `run_folders.stage_checkpoint_root`)
    pass the config with `auto` replaced by the smoke gate's choice (pisft.train.decisions), so the
    fingerprint holds the mode the steps ran in: a run of the other mode is another run folder.
    """
    labels = layout.training_labels(cfg)
    # a RECAP iteration's run: which iteration, where it starts, and its labels
    recap = ({"iteration": cfg.iteration, "recap.init": cfg.recap.init, "labels": _sha256_of([labels])}
             if labels is not None else {})
    return {**settings_fingerprint(cfg, POLICY_RUN), **inputs_fingerprint(cfg, layout.init_model(cfg)), **recap,
            "parameter_layout": PARAMETER_LAYOUT}


def settings_fingerprint(cfg: PisftConfig, run: str) -> dict[str, Any]:
    """The values of the keys in `run`'s fingerprint (`pisft.config.fingerprint_keys`: POLICY_RUN or
    VALUE_RUN), by dotted key."""
    values = to_dict(cfg)
    return {key: lookup(values, key) for key in fingerprint_keys(run)}


def inputs_fingerprint(cfg: PisftConfig, base: Path | None = None) -> dict[str, Any]:
    """The identity of the model training starts from (`base`; the base model by default:
    `pisft.base_identity.identity_sha256`) and the content of the dataset (see `_sha256_of`)."""
    base = base or layout.base_model(cfg)
    data = layout.iteration(cfg).dataset
    return {
        "base_model": identity_sha256(base),
        "dataset": _sha256_of([data / SPLIT_FILE, data / "meta" / "info.json",
                               data / "meta" / "stats.json", data / "meta" / "prompt_conditioning.json",
                               data / "meta" / "tasks.parquet",
                               data / "meta" / "source_sampling.json"],  # the sources' weights
                              listed=[data / "data", data / "meta" / "episodes", data / "videos"]),
    }


def checkpoint_root(cfg: PisftConfig) -> Path:
    """Checkpoints of this run: one folder per run fingerprint under results/checkpoints/train.

    The same settings resume from their folder; settings that change what training computes
    (`run_fingerprint`: steps, lr schedule, seed, batch, precision, model and data settings, the
    content of the base model and of the dataset) start a fresh run in a new folder, and
    the checkpoints of the earlier run stay where they are (nothing is lost; delete them to
    free space). The world size is not part of the fingerprint: a run resumes on any number of
    processes.
    """
    return run_folder(layout.iteration(cfg).policy_checkpoints, run_fingerprint(cfg))


def run_folder(parent: Path, fingerprint: dict[str, Any]) -> Path:
    """`<parent>/run-<first 12 hex digits of the fingerprint's sha256>` (parent: a stage's
    checkpoints folder, `layout.Iteration.policy_checkpoints` or `.value_checkpoints`)."""
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    return parent / f"run-{digest[:12]}"


def other_runs(cfg: PisftConfig, mine: Path | None = None) -> list[Path]:
    """Checkpoint folders of runs with other settings beside `mine` (default: this config's
    policy run folder); kept, never deleted by pisft."""
    mine = checkpoint_root(cfg) if mine is None else mine
    parent = mine.parent
    if not parent.is_dir():
        return []
    return sorted(p for p in parent.iterdir() if p.is_dir() and p.name.startswith("run-") and p != mine)


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
    return checkpoint_root(decisions.resolved_for_folders(cfg))


def latest_checkpoint_text(cfg: PisftConfig, stage: str) -> str:
    """The latest complete checkpoint of a training stage's run folder, in words (for a message)."""
    from pisft.train import checkpoint  # torch: only after a failure

    root = stage_checkpoint_root(stage, cfg)
    found = checkpoint.latest_complete(root, log=lambda _msg: None, content=False)
    if found is None:
        return f"no complete checkpoint in {root} (a rerun starts from step 0)"
    return f"the latest complete checkpoint {found.path} (step {found.step}; a rerun resumes from it)"
