"""The stages of the pipeline, written once: name, what runs, the config keys read, the outputs.

`STAGES` is the one table. It feeds the CLI (`python -m pisft <stage>`, `python -m pisft launch
<training stage>`), the torchrun worker's dispatch (`python -m pisft.train --stage`), the
Snakemake rules (`command(...)`, `tracked(...)`, `code(...)` in workflow/rules/common.smk) and,
through the rules, `dvc.yaml` and the invalidation of downstream outputs. A test checks that
the rules write exactly the outputs listed here. Adding a stage: its row here, its function,
and its rule (inputs, outputs).

Keys: a section (`model`) or a dotted key (`data.success_only`); Snakemake reruns a stage
exactly when one of its keys changes, and `dvc.yaml` lists the same keys as params.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    "data.balance_source_weights",  # recorded in the dataset (meta/source_sampling.json), read by training
    "data.success_only",
    "data.tasks",
    "data.advantage_tag",
    "data.positive_only_conditional",
    "data.unconditional_prob",  # recorded in the dataset (meta/prompt_conditioning.json), read by training
    "data.columns",
    "data.image_size",
    "data.eval_fraction",
    "data.split_seed",
    "recap.gamma",  # the returns written beside the dataset (returns.parquet)
    "recap.failure_reward",
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
    "train.fsdp_min_unit_params",  # the FSDP layout the smoke run measures
    "train.log_every",  # host syncs per step: the smoke run's step time and projection
    "train.deterministic",  # numerics and speed of every step (train_8card reads all of `train`)
    "train.trainable",  # what trains: the step's gradients, optimizer state and memory
    "train.lora_targets",
    "train.lora_rank",
    "train.lora_alpha",
    "data.augment",  # the images every step trains on (read by the training loaders only)
)

EVAL_KEYS = (
    "eval.max_episodes",
    "eval.batch_size",
    "eval.frame_stride",
    "eval.seed",
    "eval.bootstrap_samples",
    "eval.cfg_scale",
)
# The RECAP value model (train_value) and the advantage labelling (advantages).
CLOSED_LOOP_KEYS = (
    "eval.closed_loop",
    "eval.libero_suites",
    "eval.trials_per_task",
    "eval.replan_steps",
    "eval.num_wait_steps",
    "eval.closed_loop_seed",
    "eval.resize_size",
    "eval.max_steps",
    "eval.task_ids",
    "eval.videos",
    "eval.cfg_scale",
    # not eval.num_envs: it changes how fast, not what (results do not depend on it)
)
# The RECAP loop's stages (iteration k >= 1; README, "The RECAP loop").
COLLECT_KEYS = (
    "recap.suite",
    "recap.task_ids",
    "recap.episodes_per_task",
    "recap.max_steps",
    "recap.collect_seed",
    "eval.trials_per_task",  # collection starts from the initial states after the evaluation's
    "eval.num_wait_steps",
    "eval.replan_steps",
    "eval.resize_size",
    "eval.cfg_scale",
)
VALUE_KEYS = (
    "train",  # the process layout, micro batch, precision, seed and schedule shape
    "recap.value_bins",
    "recap.value_steps",
    "recap.value_lr",
    "recap.value_head_lr",
    "recap.value_global_batch_size",
    "recap.value_trainable",
    "data.augment",  # the value model trains with the policy's switch
    "recap.value_init",  # the model it starts from: the base model or policy k-1
)
ADVANTAGE_KEYS = (
    "recap.gamma",
    "recap.lookahead",
    "recap.positive_quantile",
    "recap.threshold_scope",
    "train.precision",  # the value model's inference precision
    # not eval.batch_size, train.num_workers: they change how fast, not what
)
# What retraining at iteration k reads besides `train`: where it starts, how labels become prompts.
RETRAIN_KEYS = ("recap.init", "recap.policy_steps", "data.positive_only_conditional", "data.unconditional_prob")

# The source each stage runs: a change reruns the stage (and what follows). Paths relative to
# the project root; package folders as a whole (DVC hashes their content; Snakemake gets their
# .py files as inputs). Every stage also depends on SHARED_CODE and the dependency lock.
SHARED_CODE = (
    "src/pisft/__init__.py",
    "src/pisft/__main__.py",
    "src/pisft/cli.py",
    "src/pisft/config.py",
    "src/pisft/device.py",
    "src/pisft/disk_space.py",  # every stage's writes name a full disk through it
    "src/pisft/errors.py",
    "src/pisft/integrity.py",  # every reader checks its inputs through it
    "src/pisft/io.py",
    "src/pisft/logs.py",
    "src/pisft/workflow/drivers.py",  # the wrapper DVC runs every stage through
    "src/pisft/workflow/invalidate.py",
    "src/pisft/workflow/stages.py",
)
TRAIN_CODE = ("src/pisft/train", "src/pisft/model", "src/pisft/data")
EVAL_CODE = ("src/pisft/evaluate", "src/pisft/serve", "src/pisft/policy", "src/pisft/rollout", "src/pisft/model",
             "src/pisft/data")
RECAP_CODE = ("src/pisft/recap",)
# DVC runs each stage's command through this wrapper (pisft.workflow.drivers: the config-shape
# check, the benchmark row, Snakemake's records): dvc.yaml's cmd is `<wrapper> <stage> -- <command>`.
DVC_WRAPPER = "python -m pisft.workflow.drivers dvc"
LOCKS = {"npu": "workflow/envs/ascend-aarch64.lock.txt"}
DEFAULT_LOCK = "workflow/envs/cpu-cuda.lock.txt"


@dataclass(frozen=True)
class Stage:
    """One stage: what `python -m pisft` runs for it, what it reads and what it writes."""

    name: str
    # "module:function". A stage run in-process gets the validated PisftConfig; a training stage
    # runs it in every torchrun worker with the worker's pisft.train.stage.Context.
    run: str
    keys: tuple[str, ...]  # the config keys it reads
    code: tuple[str, ...]  # the source it runs (besides SHARED_CODE and the dependency lock)
    outputs: tuple[str, ...]  # what it writes, relative to results_dir
    help: str
    training: bool = False  # started under torchrun by `python -m pisft launch <name>`
    # When it runs: "sft" at iteration 0 only; "all" at iteration 0 and at every RECAP iteration
    # k >= 1 (in results/recap/iter_<k>/); "recap" at the RECAP iterations only; "after" once,
    # after the last iteration, when recap.iterations > 0.
    iterations: str = "sft"
    recap_keys: tuple[str, ...] = ()  # keys it also reads at a RECAP iteration
    one_process: bool = False  # a training stage run as one process on one device (a smoke gate)

    @property
    def command(self) -> str:
        """The command the workflow runs (Snakemake's shell, dvc.yaml's cmd)."""
        verb = f"launch {self.name}" if self.training else self.name
        return f"python -m pisft {verb} --config {{params.config}} --log {{log}}"

    def command_at(self, k: int) -> str:
        """The command of iteration k's rule."""
        return self.command if k == 0 else self.command.replace(" --log ", f" --iteration {k} --log ")

    def keys_at(self, k: int) -> tuple[str, ...]:
        return self.keys if k == 0 else self.keys + self.recap_keys

    def runs_at(self, k: int) -> bool:
        return {"sft": k == 0, "all": True, "recap": k >= 1, "after": False}[self.iterations]


EVAL_OUTPUTS = tuple(f"eval/{name}" for name in (
    "metrics.json", "report.md", "loss.png", "throughput.png", "per_task.png", "per_step.png",
    "per_step.csv", "per_task.csv", "per_dim.csv", "eval_info.json"))

STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("fetch_base", "pisft.model.fetch:run", ("model",), ("src/pisft/model",),
          ("base_model",), "fetch (or build) the base model into results/base_model"),
    Stage("demo_recap", "pisft.data.demo:run", DEMO_KEYS, ("src/pisft/data",),
          ("demo_recap",), "write the synthetic demo dataset (when data.recap_dir is the demo folder)"),
    Stage("collect_rollouts", "pisft.recap.collect:run", ("device", *COLLECT_KEYS), (*RECAP_CODE, *EVAL_CODE),
          ("rollouts",), "RECAP: roll policy k-1 out in the LIBERO simulator, record every step",
          iterations="recap"),
    Stage("convert_recap", "pisft.data.convert:run", CONVERT_KEYS, ("src/pisft/data",),
          ("dataset",), "convert the RECAP dataset (at iteration k, the pool) into the training dataset",
          iterations="all", recap_keys=("recap.holdout_fraction",)),
    Stage("smoke_1card", "pisft.train.smoke:run_smoke", ("device", "smoke", *TRAIN_STEP_KEYS),
          (*TRAIN_CODE, "src/pisft/inspect"), ("smoke/report.json",),  # its report carries the estimate
          "a few optimizer steps on one device: the go/no-go report", training=True, one_process=True),
    Stage("smoke_value", "pisft.recap.value_training:run_value_smoke", ("device", "smoke", *VALUE_KEYS),
          (*RECAP_CODE, *TRAIN_CODE), ("value_smoke/report.json",),
          "RECAP: the value model's first steps on one device: the go/no-go before train_value",
          training=True, iterations="recap", one_process=True),
    Stage("train_value", "pisft.recap.value_training:run_value_training", ("device", *VALUE_KEYS),
          (*RECAP_CODE, *TRAIN_CODE), ("value",),
          "RECAP: train the distributional value model on the pool", training=True, iterations="recap"),
    Stage("advantages", "pisft.recap.advantages:run", ("device", *ADVANTAGE_KEYS), (*RECAP_CODE, *TRAIN_CODE),
          ("advantages",), "RECAP: every frame's value and N-step advantage, the positive labels",
          iterations="recap"),
    Stage("train_8card", "pisft.train.run:run_training", ("device", "train", "model.state_in_prompt", "data.augment"),
          TRAIN_CODE,
          ("train/model", "train/metrics.jsonl"),
          "train on train.nproc_per_node x train.nnodes devices; resumes, exports", training=True,
          iterations="all", recap_keys=RETRAIN_KEYS),
    Stage("closed_loop", "pisft.evaluate.closed_loop:run", ("device", *CLOSED_LOOP_KEYS), EVAL_CODE,
          ("closed_loop/metrics.json", "closed_loop/report.md", "closed_loop/videos"),
          "closed-loop LIBERO success rates, rollout videos (LIBERO simulator)", iterations="all"),
    Stage("evaluate", "pisft.evaluate.offline:run", ("device", *EVAL_KEYS), EVAL_CODE,
          EVAL_OUTPUTS, "held-out action error of the base and the fine-tuned model, plots, report"),
    Stage("recap_summary", "pisft.recap.summary:run", ("recap.iterations",), (*RECAP_CODE, "src/pisft/evaluate"),
          ("recap/metrics.json", "recap/report.md", "recap/success.png"),
          "RECAP: success per iteration (Wilson intervals), value and advantage diagnostics",
          iterations="after"),
)}
TRAINING_STAGES = tuple(name for name, s in STAGES.items() if s.training)
STAGE_KEYS: dict[str, tuple[str, ...]] = {name: s.keys for name, s in STAGES.items()}


def rule_name(stage: str, k: int) -> str:
    """The workflow rule (and DVC stage) of `stage` at iteration k: `train_8card`, `train_8card_1`."""
    return stage if k == 0 else f"{stage}_{k}"


def rule_names(iterations: int) -> list[str]:
    """The workflow's rules, in order: the SFT run's stages (iteration 0), each RECAP iteration's,
    then the stages that run once after the loop."""
    names = [rule_name(n, k) for k in range(iterations + 1) for n, s in STAGES.items() if s.runs_at(k)]
    return names + ([n for n, s in STAGES.items() if s.iterations == "after"] if iterations else [])


def stage_of(rule: str) -> tuple[str, int]:
    """The stage and iteration a rule runs: `train_8card_1` -> ("train_8card", 1)."""
    base, _, k = rule.rpartition("_")
    if k.isdigit() and base in STAGES:
        return base, int(k)
    return rule, 0


def code_deps(stage: str, device: str) -> list[str]:
    """Package folders, shared modules and the dependency lock that `stage` depends on."""
    return [*STAGES[stage].code, *SHARED_CODE, LOCKS.get(device, DEFAULT_LOCK)]
