"""The stages of the pipeline, written once: every fact of a stage is in its row.

`STAGES` is the one table: name, the function that runs, the config keys read, the outputs
(and the workflow's names for them), when it runs (iteration 0, every RECAP iteration, after
the loop), and how: under torchrun or not, as one process (a smoke gate), the gate it needs
passed first, whether it resumes, whether it takes every core. It sits on the ground floor (it
imports only `pisft.config`; `pisft.code_graph` for the code it runs), so everything can read
it: the CLI (`python -m pisft <stage>`, `python -m pisft launch <training stage>`), the launcher
(`pisft.train.launch`: processes, gate report, resume advice), the torchrun worker's dispatch
(`python -m pisft.train --stage`), the Snakemake rules (every rule is made from its row by
`stage_rule` in workflow/rules/common.smk) and, through the rules, `dvc.yaml` and the
invalidation of downstream outputs. A test checks that the rules write exactly the outputs
listed here. Adding a stage: its row here, its function, and what it reads in
workflow/rules/stages.smk.

Keys: a section (`model`) or a dotted key (`data.success_only`), read off the keys' marks in
pisft.config (a key's roles are marks on its field); Snakemake reruns a stage exactly when one of
its keys changes, and `dvc.yaml` lists the same keys as params.
"""

from __future__ import annotations

from dataclasses import dataclass

from pisft import config
from pisft.config import lookup  # noqa: F401 - the rules' parse-time helpers read keys through it

# The keys each stage reads, read off their marks in the schema (pisft.config: a key's roles are
# marks on its field), in the schema's order.
DEMO_KEYS = config.keys_marked(config.DEMO)
CONVERT_KEYS = config.keys_marked(config.CONVERSION)
# What a training step does (not how long the run is): a change reruns the smoke test.
TRAIN_STEP_KEYS = config.keys_marked(config.TRAIN_STEP)
EVAL_KEYS = config.keys_marked(config.OFFLINE_EVAL)
CLOSED_LOOP_KEYS = config.keys_marked(config.CLOSED_LOOP)
# The RECAP loop's stages (iteration k >= 1; README, "The RECAP loop"): the rollouts, the value
# model (smoke_value, train_value), the advantage labelling.
COLLECT_KEYS = config.keys_marked(config.COLLECTION)
VALUE_KEYS = config.keys_marked(config.VALUE)
ADVANTAGE_KEYS = config.keys_marked(config.ADVANTAGE)
# What retraining at iteration k reads besides `train`: where it starts, how labels become prompts.
RETRAIN_KEYS = config.keys_marked(config.RETRAINING)

# The code a stage depends on (`code_deps`) is what it runs, read from the imports
# (pisft.code_graph): its function's module and everything that one imports, inside functions too;
# what starts it (`python -m pisft`, the DVC wrapper: their module-level imports); for a
# training stage the launcher and the torchrun worker; and the dependency lock. An edit reruns
# exactly the stages whose code reaches the edited file, and the list follows the code when it moves.
RUNNERS = ("pisft.__main__", "pisft.cli", "pisft.workflow.drivers")  # module level: they dispatch
TRAINING_RUNNERS = ("pisft.train.launch", "pisft.train.__main__")  # what they run, whole
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
    # runs it in every torchrun worker with the worker's pisft.train.job.Context.
    run: str
    keys: tuple[str, ...]  # the config keys it reads
    outputs: tuple[str, ...]  # what it writes, relative to results_dir
    help: str
    training: bool = False  # started under torchrun by `python -m pisft launch <name>`
    # When it runs: "sft" at iteration 0 only; "all" at iteration 0 and at every RECAP iteration
    # k >= 1 (in results/recap/iter_<k>/); "recap" at the RECAP iterations only; "after" once,
    # after the last iteration, when recap.iterations > 0.
    iterations: str = "sft"
    recap_keys: tuple[str, ...] = ()  # keys it also reads at a RECAP iteration
    one_process: bool = False  # a training stage run as one process on one device (a smoke gate)
    gate: str | None = None  # the smoke gate whose passing report it needs first (its first output)
    resumable: bool = False  # checkpoints and resumes: a rerun after a failure goes on from there
    all_cores: bool = False  # the workflow gives it every core (Snakemake's `threads`)
    # The workflow's names of its outputs, in order ("" for none): dvc.yaml turns an output
    # named `metrics` into a DVC metric, the `plots:` section draws evaluate's tables by name.
    output_names: tuple[str, ...] = ()

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

    def is_directory(self, output: str) -> bool:
        """An output without a file suffix is a directory (`base_model`, `train/model`)."""
        return "." not in output.rpartition("/")[2]

    def named_outputs(self) -> list[tuple[str, str]]:
        """(name, output) in order; the name is "" for an unnamed output."""
        names = self.output_names or ("",) * len(self.outputs)
        assert len(names) == len(self.outputs), self.name
        return list(zip(names, self.outputs, strict=True))


EVAL_OUTPUTS = tuple(f"eval/{name}" for name in (
    "metrics.json", "report.md", "loss.png", "throughput.png", "per_task.png", "per_step.png",
    "per_step.csv", "per_task.csv", "per_dim.csv", "eval_info.json"))

STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("fetch_base", "pisft.model.fetch:run", ("model",),
          ("base_model",), "fetch (or build) the base model into results/base_model"),
    Stage("demo_recap", "pisft.data.demo:run", DEMO_KEYS,
          ("demo_recap",), "write the synthetic demo dataset (when data.recap_dir is the demo folder)"),
    Stage("collect_rollouts", "pisft.recap.collect:run", ("device", *COLLECT_KEYS),
          ("rollouts",), "RECAP: roll policy k-1 out in the LIBERO simulator, record every step",
          iterations="recap", all_cores=True),
    Stage("convert_recap", "pisft.data.convert:run", CONVERT_KEYS,
          ("dataset",), "convert the RECAP dataset (at iteration k, the pool) into the training dataset",
          iterations="all", recap_keys=("recap.holdout_fraction",)),
    Stage("smoke_1card", "pisft.gates.smoke:run_smoke", ("device", "smoke", *TRAIN_STEP_KEYS),
          ("smoke/report.json",),
          "a few optimizer steps on one device: the go/no-go report", training=True, one_process=True,
          all_cores=True),
    Stage("smoke_value", "pisft.gates.value_smoke:run_value_smoke", ("device", "smoke", *VALUE_KEYS),
          ("value_smoke/report.json",),
          "RECAP: the value model's first steps on one device: the go/no-go before train_value",
          training=True, iterations="recap", one_process=True, all_cores=True),
    Stage("train_value", "pisft.recap.value_training:run_value_training", ("device", *VALUE_KEYS),
          ("value",),
          "RECAP: train the distributional value model on the pool", training=True, iterations="recap",
          gate="smoke_value", resumable=True, all_cores=True),
    Stage("advantages", "pisft.recap.advantages:run", ("device", *ADVANTAGE_KEYS),
          ("advantages",), "RECAP: every frame's value and N-step advantage, the positive labels",
          iterations="recap", all_cores=True),
    Stage("train_8card", "pisft.train.run:run_training", ("device", "train", "model.state_in_prompt", "data.augment"),
          ("train/model", "train/metrics.jsonl"),
          "train on train.nproc_per_node x train.nnodes devices; resumes, exports", training=True,
          iterations="all", recap_keys=RETRAIN_KEYS, gate="smoke_1card", resumable=True, all_cores=True,
          output_names=("model", "metrics")),
    Stage("closed_loop", "pisft.evaluate.closed_loop:run", ("device", *CLOSED_LOOP_KEYS),
          ("closed_loop/metrics.json", "closed_loop/report.md", "closed_loop/videos"),
          "closed-loop LIBERO success rates, rollout videos (LIBERO simulator)", iterations="all",
          all_cores=True, output_names=("metrics", "report", "videos")),
    Stage("evaluate", "pisft.evaluate.offline:run", ("device", *EVAL_KEYS),
          EVAL_OUTPUTS, "held-out action error of the base and the fine-tuned model, plots, report",
          output_names=("metrics", "report", "loss_plot", "throughput_plot", "per_task_plot", "per_step_plot",
                        "per_step", "per_task", "per_dim", "info")),
    Stage("recap_summary", "pisft.recap.summary:run", ("recap.iterations",),
          ("recap/metrics.json", "recap/report.md", "recap/success.png"),
          "RECAP: success per iteration (Wilson intervals), value and advantage diagnostics",
          iterations="after", output_names=("metrics", "report", "plot")),
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


def code_modules(stage: str) -> set[str]:
    """The pisft modules `stage` runs (see RUNNERS above)."""
    from pisft import code_graph

    row = STAGES[stage]
    modules = code_graph.reach((row.run.partition(":")[0],)) | code_graph.reach(RUNNERS, top_level=True)
    if row.training:
        modules |= code_graph.reach(TRAINING_RUNNERS)
    return modules


def code_deps(stage: str, device: str) -> list[str]:
    """The source files `stage` runs (sorted, relative to the project root) and the dependency lock."""
    from pisft import code_graph

    return [*code_graph.files_of(code_modules(stage)), LOCKS.get(device, DEFAULT_LOCK)]
