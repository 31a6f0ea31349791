"""Which config keys each stage reads.

The workflow rules pass `tracked("<stage>")` as a param, so Snakemake reruns a stage exactly
when one of its keys changes; `dvc.yaml` (generated from the rules) lists the same keys.
A key is a section (`model`) or a dotted key (`data.success_only`).
"""

from __future__ import annotations

DEMO_KEYS = (
    "data.demo_episodes_per_task",
    "data.demo_episode_length",
    "data.demo_failure_fraction",
    "data.demo_image_size",
    "data.demo_seed",
)
CONVERT_KEYS = (
    "data.recap_dir",
    "data.success_only",
    "data.tasks",
    "data.advantage_tag",
    "data.image_size",
    "data.eval_fraction",
    "data.split_seed",
)
# What a training step does (not how long the run is): a change reruns the smoke test.
TRAIN_STEP_KEYS = (
    "train.nproc_per_node",
    "train.micro_batch_size",
    "train.global_batch_size",
    "train.precision",
    "train.seed",
    "train.lr",
    "train.weight_decay",
    "train.grad_clip",
    "train.activation_checkpointing",
    "train.peak_flops",
    "train.num_workers",
    "train.log_every",  # host syncs per step: the smoke run's step time and projection
    "train.deterministic",  # numerics and speed of every step (train_8card reads all of `train`)
)

EVAL_KEYS = (
    "eval.max_episodes",
    "eval.batch_size",
    "eval.frame_stride",
    "eval.seed",
    "eval.bootstrap_samples",
)
CLOSED_LOOP_KEYS = (
    "eval.closed_loop",
    "eval.libero_suites",
    "eval.trials_per_task",
    "eval.replan_steps",
    "eval.num_wait_steps",
    "eval.closed_loop_seed",
    "eval.resize_size",
)

STAGE_KEYS: dict[str, tuple[str, ...]] = {
    "fetch_base": ("model",),
    "demo_recap": DEMO_KEYS,
    "convert_recap": CONVERT_KEYS,
    "smoke_1card": ("device", "smoke", *TRAIN_STEP_KEYS),
    "train_8card": ("device", "train"),
    "evaluate": ("device", *EVAL_KEYS),
    "closed_loop": ("device", *CLOSED_LOOP_KEYS),
}


def lookup(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node
