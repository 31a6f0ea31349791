# Shared set-up: validate the config before any job, pick the interpreter, and name the
# config sections each stage reads (Snakemake reruns a stage when one of them changes).
import os
import sys
from pathlib import Path

from pisft import config as pisft_config
from pisft import layout
from pisft.workflow import snakemake_support as support
from pisft.stages import STAGES, rule_name, rule_names, stage_of

# Commands run `python -m pisft ...`; make `python` the interpreter that runs Snakemake.
os.environ["PATH"] = os.pathsep.join(
    [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
)
os.environ.setdefault("PYTHONUNBUFFERED", "1")

# Validated once per parse; the rules read CFG (and CFG_VALUES, the same as a mapping).
CFG, CONFIG_FILE = support.validated_config(config, workflow)
CFG_VALUES = pisft_config.to_dict(CFG)
RESULTS = CFG.results_dir
LOGS = f"{RESULTS}/logs"
BENCH = f"{RESULTS}/benchmarks"
SOURCES = support.source_inputs(
    CFG
)  # data.recap_dir: one folder or several (an outside folder's files)
ITERATIONS = range(
    1, CFG.recap.iterations + 1
)  # the RECAP iterations after the SFT run (rules/stages.smk)


def command(stage):
    """The stage's `python -m pisft` command, from the stage table (pisft.stages)."""
    return STAGES[stage].command


def tracked(stage):
    """The config sections `stage` reads; a change in any of them reruns it."""
    return support.tracked_params(CFG_VALUES, stage)


def code(stage):
    """The source files `stage` runs (its imports) and the dependency lock (DVC deps)."""
    return support.stage_code(CFG, stage)


def code_files(stage):
    """The same as files: editing the code reruns the stage."""
    return support.stage_code_files(CFG, stage)


def command_at(stage, k):
    """The stage's command at RECAP iteration k (`--iteration k`)."""
    return STAGES[stage].command_at(k)


def tracked_at(stage, k):
    """The config keys `stage` reads at iteration k."""
    return support.tracked_params(CFG_VALUES, stage, k)


def at(k, *parts):
    """A path of iteration k (results/recap/iter_<k>/...; iteration 0: results/...): a stage row's output."""
    return str(layout.results(CFG.at_iteration(k), *parts))


def value_start(k):
    """What iteration k's value model starts from (recap.value_init: the base model, or
    policy k-1 with `previous`), as smoke_value and train_value load it."""
    return str(layout.value_init_model(CFG.at_iteration(k)))


# How Snakemake's report shows an output (Snakemake only: dvc.yaml has no report):
# output -> report() options. Paths as in the stage table (relative to the iteration's folder).
REPORT = {
    "closed_loop/report.md": dict(
        caption="../report/closed_loop_report.rst", category="Closed-loop LIBERO"
    ),
    # one HTML page per video (the report plays no bare MP4), the MP4s beside them
    "closed_loop/videos": dict(
        patterns=["{name}.html"],
        caption="../report/closed_loop_video.rst",
        category="Closed-loop LIBERO",
    ),
    "eval/report.md": dict(caption="../report/eval_report.rst", category="Evaluation"),
    "eval/loss.png": dict(caption="../report/loss.rst", category="Training"),
    "eval/throughput.png": dict(
        caption="../report/throughput.rst", category="Training"
    ),
    "eval/per_task.png": dict(caption="../report/per_task.rst", category="Evaluation"),
    "eval/per_step.png": dict(caption="../report/per_step.rst", category="Evaluation"),
    "recap/report.md": dict(caption="../report/recap_report.rst", category="RECAP"),
    "recap/success.png": dict(caption="../report/recap_report.rst", category="RECAP"),
}
# The iteration-0 rules shown in the report (an iteration's closed loop is in recap/'s summary).
REPORTED = ("closed_loop", "evaluate", "recap_summary")


def outputs_of(stage, k, rule_id):
    """The rule's outputs, from the stage table's row: named, directories marked, reported ones wrapped."""
    row = STAGES[stage]
    unnamed, named = [], {}
    for name, out in row.named_outputs():
        path = at(k, out)
        if row.is_directory(out):
            path = directory(path)
        if rule_id in REPORTED and out in REPORT:
            path = report(path, **REPORT[out])
        if name:
            named[name] = path
        else:
            unnamed.append(path)
    return unnamed, named


def stage_rule(rule_id, inputs):
    """Define the rule that runs `rule_id` (a stage at an iteration, `train_8card_1`): everything
    but its inputs from the stage's row in pisft.stages (command, outputs, keys, code, cores).
    """
    stage, k = stage_of(rule_id)
    row = STAGES[stage]
    unnamed, named = outputs_of(stage, k, rule_id)
    nproc = 1 if row.one_process else CFG.train.nproc_per_node

    rule:
        name:
            rule_id
        input:
            *code_files(stage),
            *inputs,
        output:
            *unnamed,
            **named,
        log:
            f"{LOGS}/{rule_id}.log",
        benchmark:
            f"{BENCH}/{rule_id}.tsv"
        threads: workflow.cores if row.all_cores else 1
        resources:
            **(support.accelerator_resources(CFG, nproc) if row.training else {}),
        params:
            code=code(stage),
            config=CONFIG_FILE,
            tracked=tracked_at(stage, k),
        shell:
            command_at(stage, k)
