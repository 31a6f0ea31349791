"""Which config keys each stage reads.

The workflow rules pass `tracked("<stage>")` as a param, so Snakemake reruns a stage exactly
when one of its keys changes; `dvc.yaml` (generated from the rules) lists the same keys.
A key is a section (`model`) or a dotted key (`data.success_only`).
"""

from __future__ import annotations

from pisft.config import lookup  # noqa: F401 - the rules' parse-time helpers read keys through it

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
    "data.positive_only_conditional",
    "data.unconditional_prob",  # recorded in the dataset (meta/prompt_conditioning.json), read by training
    "data.columns",
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


# The source each stage runs: a change reruns the stage (and what follows). Paths relative to
# the project root; package folders as a whole (DVC hashes their content; Snakemake gets their
# .py files as inputs). Every stage also depends on SHARED_CODE and the dependency lock.
SHARED_CODE = (
    "src/pisft/__init__.py",
    "src/pisft/__main__.py",
    "src/pisft/cli.py",
    "src/pisft/config.py",
    "src/pisft/device.py",
    "src/pisft/errors.py",
    "src/pisft/io.py",
    "src/pisft/logs.py",
    "src/pisft/workflow/invalidate.py",
    "src/pisft/workflow/stages.py",
)
TRAIN_CODE = ("src/pisft/train", "src/pisft/model", "src/pisft/data")
EVAL_CODE = ("src/pisft/evaluate", "src/pisft/serve", "src/pisft/model", "src/pisft/data")
STAGE_CODE: dict[str, tuple[str, ...]] = {
    "fetch_base": ("src/pisft/model",),
    "demo_recap": ("src/pisft/data",),
    "convert_recap": ("src/pisft/data",),
    "smoke_1card": TRAIN_CODE,
    "train_8card": TRAIN_CODE,
    "evaluate": EVAL_CODE,
    "closed_loop": EVAL_CODE,
}
LOCKS = {"npu": "workflow/envs/ascend-aarch64.lock.txt"}
DEFAULT_LOCK = "workflow/envs/cpu-cuda.lock.txt"


def code_deps(stage: str, device: str) -> list[str]:
    """Package folders, shared modules and the dependency lock that `stage` depends on."""
    return [*STAGE_CODE[stage], *SHARED_CODE, LOCKS.get(device, DEFAULT_LOCK)]
