"""The stages of the pipeline, written once: every fact of a stage is in its row.

`STAGES` is the one table, a row per stage (`Stage`): its name, the function that runs, the
config keys it reads, what it reads of the other stages' outputs (`Read`, and the data from outside
results_dir, `Source`, and the model a training starts from, `StartModel`), what it writes
(`Output`: a file or folder relative to results_dir or to its RECAP iteration's folder, named for
the workflow, shown in Snakemake's report, a DVC metric or plot), its command, when it runs
(iteration 0, every RECAP iteration, after the loop), and how: under torchrun or not, as one
process (a smoke gate), the gate it needs passed first, whether it resumes, whether it takes
every core. Each row is also a module constant (`TRAIN_8CARD`), so code that means a stage names
it through the table rather than spelling it.

Everything else is derived from the rows: the CLI (`python -m pisft <stage>`, `python -m pisft
launch <training stage>`), the launcher (`pisft.train.launch`: processes, gate report, resume
advice), the torchrun worker's dispatch (`python -m pisft.train --stage`), every path of
`pisft.layout` a stage writes, which stage wrote a folder (`pisft.layout.writer_of`, read by
`pisft.integrity`), the Snakemake rules (every rule is made from its row by `stage_rule` in
workflow/rules/common.smk: inputs, outputs, report entries, command, keys, code), and through
the rules `dvc.yaml` (metrics, plots) and the invalidation of downstream outputs.

Adding a stage is its row here and its function (docs/development.md, "Adding a stage").

It sits on the ground floor and imports only `pisft.config` (the keys' values are read through
`pisft.config.lookup`), so every module can read it. A stage's code dependencies (the files it
runs) are computed from the rows by `pisft.code_graph.code_deps`.

Keys: a section (`model`) or a dotted key (`data.success_only`), read off the keys' marks in
pisft.config (a key's roles are marks on its field); Snakemake reruns a stage exactly when one of
its keys changes, and `dvc.yaml` lists the same keys as params.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pisft import config
from pisft.config import lookup


def resolve(target: str):
    """The function a row names as "module:function" (its `run`, `merge` or `before_group`)."""
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


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

# DVC runs each stage's command through this wrapper (pisft.workflow.drivers: the config-shape
# check, the benchmark row, Snakemake's records): dvc.yaml's cmd is `<wrapper> <stage> -- <command>`.
DVC_WRAPPER = "python -m pisft.workflow.drivers dvc"
CLI = "python -m pisft"  # what runs a stage: `python -m pisft <stage>`, `python -m pisft launch <stage>`

# Which iterations of its writer a `Read` reads, from the reader's iteration k (K: recap.iterations):
# k itself, k-1 (policy k-1), 0 (the SFT run), 1..k (the RECAP iterations up to k: a pool),
# 0..K (every iteration), 1..K (every RECAP iteration).
READ_AT = ("k", "k-1", "0", "1..k", "0..K", "1..K")
SHARD_TAG = "__shard_"  # a shard rule's name: <the stage's rule>__shard_<i>_of_<n> (`Stage.shard_rule`)


@dataclass(frozen=True)
class Read:
    """An output of another stage that a stage reads (a Snakemake input, a DVC dep)."""

    stage: str  # the stage that writes it
    output: str = ""  # the writer's output, by its name ("": its only output)
    at: str = "k"  # which of the writer's iterations (READ_AT)

    def __post_init__(self) -> None:
        assert self.at in READ_AT, self.at

    def iterations(self, k: int, last: int) -> range:
        """The writer's iterations read at the reader's iteration k (`last`: recap.iterations)."""
        return {"k": range(k, k + 1), "k-1": range(k - 1, k), "0": range(1), "1..k": range(1, k + 1),
                "0..K": range(last + 1), "1..K": range(1, last + 1)}[self.at]


@dataclass(frozen=True)
class Source:
    """What a stage reads from outside results_dir: `model` (model.source and model.tokenizer, a
    local folder's files) or `data` (the RECAP datasets of data.recap_dir)."""

    what: str

    def __post_init__(self) -> None:
        assert self.what in ("model", "data"), self.what


@dataclass(frozen=True)
class StartModel:
    """The model a training starts from, as a config key chooses it (`pisft.layout.start_model`):
    `base`, the base model; `previous`, at RECAP iteration k >= 1 the policy of k - 1."""

    key: str  # recap.init, recap.value_init


MODEL_SOURCE = Source("model")
DATA_SOURCES = Source("data")


@dataclass(frozen=True)
class Report:
    """How Snakemake's report shows an output (`snakemake --report`; iteration 0's rule only, an
    iteration's closed loop is in the RECAP summary). dvc.yaml has no report."""

    caption: str  # a file in workflow/report/
    category: str
    patterns: tuple[str, ...] = ()  # a folder's files the report shows (one HTML page per video)


@dataclass(frozen=True)
class Table:
    """How `dvc plots show` draws a CSV output (dvc.yaml's top-level `plots:`, under the output's
    name): DVC cannot plot JSON lines, so the tables are written for it."""

    x: str
    y: tuple[str, ...]
    template: str = ""  # DVC's plot template ("": its default, lines)


@dataclass(frozen=True)
class Output:
    """One file or folder a stage writes, relative to its folder's root: results_dir, or at RECAP
    iteration k >= 1 results_dir/recap/iter_<k>/ for a stage that is not `shared`."""

    path: str
    name: str = ""  # the workflow's name (Snakemake's named output; `Read.output` names it)
    folder: bool = False  # a folder (Snakemake's directory()), else a file
    report: Report | None = None  # shown in Snakemake's report
    metric: bool = False  # a DVC metric (`dvc metrics show`)
    plot: bool | Table = False  # a DVC plot: an image as it is, or a table drawn as `Table` says
    # may hold links to the model source's files: DVC does not cache it (the source is the copy
    # of record; a second copy of several GB) unless pisft built the model (model.source: tiny)
    linked_weights: bool = False


def file(path: str, name: str = "", **how: Any) -> Output:
    return Output(path, name, **how)


def folder(path: str, name: str = "", **how: Any) -> Output:
    return Output(path, name, folder=True, **how)


@dataclass(frozen=True)
class Stage:
    """One stage: what `python -m pisft` runs for it, what it reads and what it writes."""

    name: str
    # "module:function". A stage run in-process gets the validated PisftConfig; a training stage
    # runs it in every torchrun worker with the worker's pisft.train.job.Context.
    run: str
    keys: tuple[str, ...]  # the config keys it reads
    outputs: tuple[Output, ...]  # what it writes: one folder of results_dir (or of its iteration's)
    help: str
    reads: tuple[Read | Source | StartModel, ...] = ()  # what it reads, in order (besides its gate's report)
    recap_reads: tuple[Read, ...] = ()  # what it also reads at a RECAP iteration
    training: bool = False  # started under torchrun by `python -m pisft launch <name>`
    # When it runs: "sft" at iteration 0 only; "all" at iteration 0 and at every RECAP iteration
    # k >= 1 (in results/recap/iter_<k>/); "recap" at the RECAP iterations only; "after" once,
    # after the last iteration, when recap.iterations > 0.
    iterations: str = "sft"
    # Its folder is results_dir's at every iteration (what every iteration shares: the base model,
    # the demo data, the SFT run's smoke gate, the RECAP summary), not the iteration's own.
    shared: bool = False
    sft_only_if: str = ""  # a boolean key: iteration 0 has the stage only while it is true
    recap_keys: tuple[str, ...] = ()  # keys it also reads at a RECAP iteration
    one_process: bool = False  # a training stage run as one process on one device (a smoke gate)
    # "module:function(cfg)" run in a training stage's process before it joins its process group
    # (pisft.train.job.setup_process): smoke_1card's memory estimates, which need a process without one
    before_group: str = ""
    gate: str | None = None  # the smoke gate whose passing report it needs first (its first output)
    resumable: bool = False  # checkpoints and resumes: a rerun after a failure goes on from there
    all_cores: bool = False  # the workflow gives it every core (Snakemake's `threads`)
    # The key that scatters it over jobs (eval.shards; pisft.rollout.plan, "Scattered rollouts"): at N > 1
    # its rule of an iteration is N shard rules (`shard_rule`: `run` with shard=(i, N), one block of its
    # episodes each, into `layout.Iteration.shard`) and its own rule, which runs `merge` ("module:function",
    # given the config and N) to write its outputs from them (`merge_command`).
    shards_key: str = ""
    merge: str = ""

    def __post_init__(self) -> None:
        assert self.iterations in ("sft", "all", "recap", "after"), self.iterations
        assert bool(self.shards_key) == bool(self.merge), f"{self.name}: a scattered stage names its merge"
        assert len({o.path.split("/")[0] for o in self.outputs}) == 1, f"{self.name}: one folder"
        assert len({o.name for o in self.outputs if o.name}) == len([o for o in self.outputs if o.name]), self.name

    @property
    def folder(self) -> str:
        """The folder of results_dir (or of its iteration's) that holds every output."""
        return self.outputs[0].path.split("/")[0]

    def output(self, name: str = "") -> Output:
        """The output named `name`; "" for the only one."""
        if not name:
            assert len(self.outputs) == 1, f"{self.name} writes {len(self.outputs)} outputs: name one"
            return self.outputs[0]
        found = [o for o in self.outputs if o.name == name]
        assert found, f"{self.name} writes no output named {name!r}"
        return found[0]

    @property
    def verb(self) -> str:
        """What follows `python -m pisft`: the stage, or `launch <stage>` for a training stage."""
        return f"launch {self.name}" if self.training else self.name

    @property
    def command(self) -> str:
        """The command the workflow runs (Snakemake's shell, dvc.yaml's cmd)."""
        return f"{CLI} {self.verb} --config {{params.config}} --log {{log}}"

    def command_at(self, k: int) -> str:
        """The command of iteration k's rule."""
        return self.command if k == 0 else self.command.replace(" --log ", f" --iteration {k} --log ")

    def shards(self, values: Mapping[str, Any]) -> int:
        """The jobs its rule of an iteration is scattered over for the config `values` (1: one job)."""
        return int(lookup(values, self.shards_key)) if self.shards_key else 1

    def shard_rule(self, k: int, i: int, n: int) -> str:
        """The rule (and DVC stage) of shard i of n at iteration k: `closed_loop_1__shard_2_of_3`."""
        assert self.shards_key and 1 <= i <= n, (self.name, i, n)
        return f"{self.rule(k)}{SHARD_TAG}{i}_of_{n}"

    def shard_command(self, k: int, i: int, n: int) -> str:
        """The command of shard i of n's rule: the stage's, with `--shard i/n`."""
        return self.command_at(k).replace(" --config ", f" --shard {i}/{n} --config ", 1)

    def merge_command(self, k: int, n: int) -> str:
        """The command of its own rule when it is scattered over n shards: merge them (`--merge-shards n`)."""
        return self.command_at(k).replace(" --config ", f" --merge-shards {n} --config ", 1)

    def invocation(self, k: int) -> str:
        """The command that reruns iteration k's run of it by hand (recorded in its manifests,
        `written_by`), less the config: `python -m pisft launch train_8card --iteration 1`."""
        return f"{CLI} {self.verb}" + (f" --iteration {k}" if k else "")

    def rule(self, k: int) -> str:
        """The workflow rule (and DVC stage) of iteration k: `train_8card`, `train_8card_1`."""
        return self.name if k == 0 else f"{self.name}_{k}"

    def keys_at(self, k: int) -> tuple[str, ...]:
        return self.keys if k == 0 else self.keys + self.recap_keys

    def reads_at(self, k: int) -> tuple[Read | Source | StartModel, ...]:
        return self.reads if k == 0 else self.reads + self.recap_reads

    def runs_at(self, k: int) -> bool:
        return {"sft": k == 0, "all": True, "recap": k >= 1, "after": False}[self.iterations]

    def switched_off(self, k: int, values: Mapping[str, Any]) -> bool:
        """Whether the config `values` (the validated config as a mapping, `pisft.config.to_dict`)
        leaves iteration k's rule out (`sft_only_if`)."""
        return k == 0 and bool(self.sft_only_if) and not lookup(values, self.sft_only_if)


STAGES: dict[str, Stage] = {}


def _row(stage: Stage) -> Stage:
    """Enter `stage` in the table, in pipeline order."""
    assert stage.name not in STAGES, stage.name
    STAGES[stage.name] = stage
    return stage


FETCH_BASE = _row(Stage(
    "fetch_base", "pisft.model.fetch:run", ("model",),
    (folder("base_model", linked_weights=True),), "fetch (or build) the base model into results/base_model",
    reads=(MODEL_SOURCE,), shared=True))
DEMO_RECAP = _row(Stage(
    "demo_recap", "pisft.data.demo:run", DEMO_KEYS,
    (folder("demo_recap"),), "write the synthetic demo dataset (when data.recap_dir is the demo folder)",
    shared=True))
COLLECT_ROLLOUTS = _row(Stage(
    "collect_rollouts", "pisft.recap.collect:run", ("device", *COLLECT_KEYS),
    (folder("rollouts"),), "RECAP: roll policy k-1 out in the LIBERO simulator, record every step",
    reads=(Read("train_8card", "model", at="k-1"),), iterations="recap", all_cores=True,
    shards_key="eval.shards", merge="pisft.recap.collect:merge"))
CONVERT_RECAP = _row(Stage(
    "convert_recap", "pisft.data.convert:run", CONVERT_KEYS,
    (folder("dataset"),), "convert the RECAP dataset (at iteration k, the pool) into the training dataset",
    reads=(DATA_SOURCES, Read("collect_rollouts", at="1..k")), iterations="all",
    recap_keys=("recap.holdout_fraction",)))
SMOKE_1CARD = _row(Stage(
    "smoke_1card", "pisft.gates.smoke:run_smoke", ("device", "smoke", *TRAIN_STEP_KEYS),
    (file("smoke/report.json"),),
    "a few optimizer steps on one device: the go/no-go report",
    reads=(Read("fetch_base"), Read("convert_recap", at="0")), training=True, shared=True, one_process=True,
    all_cores=True, before_group="pisft.gates.smoke:estimate_before_group"))
SMOKE_VALUE = _row(Stage(
    "smoke_value", "pisft.gates.value_smoke:run_value_smoke", ("device", "smoke", *VALUE_KEYS),
    (file("value_smoke/report.json"),),
    "RECAP: the value model's first steps on one device: the go/no-go before train_value",
    reads=(StartModel("recap.value_init"), Read("convert_recap")), training=True, iterations="recap",
    one_process=True, all_cores=True))
TRAIN_VALUE = _row(Stage(
    "train_value", "pisft.recap.value_training:run_value_training", ("device", *VALUE_KEYS),
    (folder("value"),),
    "RECAP: train the distributional value model on the pool",
    reads=(StartModel("recap.value_init"), Read("convert_recap")), training=True, iterations="recap",
    gate="smoke_value", resumable=True, all_cores=True))
ADVANTAGES = _row(Stage(
    "advantages", "pisft.recap.advantages:run", ("device", *ADVANTAGE_KEYS),
    (folder("advantages"),), "RECAP: every frame's value and N-step advantage, the positive labels",
    # the value model's frozen weights are read from the model it started from
    reads=(StartModel("recap.value_init"), Read("convert_recap"), Read("train_value")), iterations="recap",
    all_cores=True))
TRAIN_8CARD = _row(Stage(
    "train_8card", "pisft.train.run:run_training", ("device", "train", "model.state_in_prompt", "data.augment"),
    (folder("train/model", "model"), file("train/metrics.jsonl", "metrics")),
    "train on train.nproc_per_node x train.nnodes devices; resumes, exports",
    # what iteration k starts from (recap.init), and the same step shape: iteration 0's smoke gate
    reads=(StartModel("recap.init"), Read("convert_recap")), recap_reads=(Read("advantages"),), training=True,
    iterations="all", recap_keys=RETRAIN_KEYS, gate="smoke_1card", resumable=True, all_cores=True))
CLOSED_LOOP = _row(Stage(
    "closed_loop", "pisft.evaluate.closed_loop:run", ("device", *CLOSED_LOOP_KEYS),
    (file("closed_loop/metrics.json", "metrics", metric=True),
     file("closed_loop/report.md", "report", report=Report("closed_loop_report.rst", "Closed-loop LIBERO")),
     # one HTML page per video (the report plays no bare MP4), the MP4s beside them
     folder("closed_loop/videos", "videos",
            report=Report("closed_loop_video.rst", "Closed-loop LIBERO", patterns=("{name}.html",)))),
    "closed-loop LIBERO success rates, rollout videos (LIBERO simulator)",
    reads=(Read("train_8card", "model"),), iterations="all", all_cores=True,
    shards_key="eval.shards", merge="pisft.evaluate.closed_loop:merge",
    # iteration 0's closed loop is optional (eval.closed_loop); the RECAP loop's is not
    sft_only_if="eval.closed_loop"))
EVALUATE = _row(Stage(
    "evaluate", "pisft.evaluate.offline:run", ("device", *EVAL_KEYS),
    (file("eval/metrics.json", "metrics", metric=True),
     file("eval/report.md", "report", report=Report("eval_report.rst", "Evaluation")),
     file("eval/loss.png", "loss_plot", plot=True, report=Report("loss.rst", "Training")),
     file("eval/throughput.png", "throughput_plot", plot=True, report=Report("throughput.rst", "Training")),
     file("eval/per_task.png", "per_task_plot", plot=True, report=Report("per_task.rst", "Evaluation")),
     file("eval/per_step.png", "per_step_plot", plot=True, report=Report("per_step.rst", "Evaluation")),
     file("eval/per_step.csv", "per_step",
          plot=Table("step", ("base_action_mse_norm", "finetuned_action_mse_norm"))),
     file("eval/per_task.csv", "per_task",
          plot=Table("task", ("base_action_mse", "finetuned_action_mse"), template="bar_horizontal")),
     file("eval/per_dim.csv", "per_dim", plot=Table("dim", ("base_action_mse", "finetuned_action_mse"))),
     file("eval/eval_info.json", "info")),
    "held-out action error of the base and the fine-tuned model, plots, report",
    reads=(Read("fetch_base"), Read("convert_recap"), Read("train_8card", "model"), Read("train_8card", "metrics"),
           Read("closed_loop", "metrics"))))
RECAP_SUMMARY = _row(Stage(
    "recap_summary", "pisft.recap.summary:run", ("recap.iterations",),
    (file("recap/metrics.json", "metrics", metric=True),
     file("recap/report.md", "report", report=Report("recap_report.rst", "RECAP")),
     file("recap/success.png", "plot", plot=True, report=Report("recap_report.rst", "RECAP"))),
    "RECAP: success per iteration (Wilson intervals), value and advantage diagnostics",
    reads=(Read("closed_loop", "metrics", at="0..K"), Read("collect_rollouts", at="1..K"),
           Read("train_value", at="1..K"), Read("advantages", at="1..K")),
    iterations="after", shared=True))
TRAINING_STAGES = tuple(name for name, s in STAGES.items() if s.training)
STAGE_KEYS: dict[str, tuple[str, ...]] = {name: s.keys for name, s in STAGES.items()}


def rule_name(stage: str, k: int) -> str:
    """The workflow rule (and DVC stage) of `stage` at iteration k: `train_8card`, `train_8card_1`."""
    return STAGES[stage].rule(k)


def rules(iterations: int) -> list[tuple[Stage, int]]:
    """The workflow's rules as (stage, iteration), in order: the SFT run's stages (iteration 0),
    each RECAP iteration's, then the stages that run once after the loop (as iteration 0)."""
    runs = [(s, k) for k in range(iterations + 1) for s in STAGES.values() if s.runs_at(k)]
    return runs + ([(s, 0) for s in STAGES.values() if s.iterations == "after"] if iterations else [])


def rule_names(iterations: int) -> list[str]:
    """The workflow's rules, in order (`rules`)."""
    return [s.rule(k) for s, k in rules(iterations)]


def shard_of(rule: str) -> tuple[int, int] | None:
    """(i, n) of a shard rule (`closed_loop_1__shard_2_of_3` -> (2, 3)); None for any other rule."""
    _, tag, shard = rule.partition(SHARD_TAG)
    if not tag:
        return None
    i, _, n = shard.partition("_of_")
    return int(i), int(n)


def stage_of(rule: str) -> tuple[str, int]:
    """The stage and iteration a rule runs: `train_8card_1` -> ("train_8card", 1); a shard rule's are
    its stage's (`closed_loop_1__shard_2_of_3` -> ("closed_loop", 1))."""
    own = rule.partition(SHARD_TAG)[0]
    base, _, k = own.rpartition("_")
    if k.isdigit() and base in STAGES:
        return base, int(k)
    return own, 0

