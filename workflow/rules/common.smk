# Shared set-up: validate the config before any job, pick the interpreter, and make every rule
# from its row in the stage table (src/pisft/stages.py): inputs, outputs, report entries,
# command, the config keys that rerun it, its code, its cores.
import os
import sys
from pathlib import Path

from pisft import config as pisft_config
from pisft import layout
from pisft.workflow import snakemake_support as support

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


def outputs_of(row, k):
    """The rule's outputs, from the row: named, folders marked, iteration 0's reported ones
    wrapped for Snakemake's report (captions in workflow/report/; dvc.yaml has no report).
    """
    unnamed, named = [], {}
    for out, where in layout.outputs(CFG, row, k):
        path = directory(str(where)) if out.folder else str(where)
        if out.report and k == 0:
            shown = (
                {"patterns": list(out.report.patterns)} if out.report.patterns else {}
            )
            path = report(
                path,
                caption=f"../report/{out.report.caption}",
                category=out.report.category,
                **shown,
            )
        if out.name:
            named[out.name] = path
        else:
            unnamed.append(path)
    return unnamed, named


def stage_rule(row, k):
    """Define the rule that runs `row`'s stage at iteration k (`train_8card_1`): all of it from
    the row in pisft.stages. A stage scattered over N > 1 jobs (its `shards_key`, eval.shards)
    is N shard rules, each a job the executor places on any node, and its own rule, which merges
    their folders into its outputs (docs/workflow.md, "Scattered evaluation and collection").
    """
    rule_id = row.rule(k)
    unnamed, named = outputs_of(row, k)
    nproc = 1 if row.one_process else CFG.train.nproc_per_node
    shards = row.shards(CFG_VALUES)
    inputs = support.stage_inputs(CFG, CFG_VALUES, row, k)
    command = row.command_at(k)
    if shards > 1:
        for i in range(1, shards + 1):
            shard_rule(row, k, i, shards, inputs)
        inputs = support.shard_folders(CFG, row, k, shards)
        command = row.merge_command(k, shards)

    rule:
        name:
            rule_id
        input:
            *support.stage_code_files(CFG, row.name),
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
            **(support.node_resources(CFG, row) if row.training else {}),
        params:
            code=support.stage_code(CFG, row.name),
            config=CONFIG_FILE,
            tracked=support.tracked_params(CFG_VALUES, row.name, k),
        shell:
            command


def shard_rule(row, k, i, n, inputs):
    """Shard i of n of `row`'s stage at iteration k: what the stage reads, its block of the
    episodes into its shard folder (pisft.layout.Iteration.shard); its keys and code rerun it.
    """
    rule_id = row.shard_rule(k, i, n)

    rule:
        name:
            rule_id
        input:
            *support.stage_code_files(CFG, row.name),
            *inputs,
        output:
            directory(str(layout.iteration(CFG, k).shard(row.name, i, n))),
        log:
            f"{LOGS}/{rule_id}.log",
        benchmark:
            f"{BENCH}/{rule_id}.tsv"
        threads: workflow.cores if row.all_cores else 1
        params:
            code=support.stage_code(CFG, row.name),
            config=CONFIG_FILE,
            tracked=support.tracked_params(CFG_VALUES, row.name, k),
        shell:
            row.shard_command(k, i, n)
