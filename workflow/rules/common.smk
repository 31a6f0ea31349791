# Shared set-up: validate the config before any job, pick the interpreter, and name the
# config sections each stage reads (Snakemake reruns a stage when one of them changes).
import os
import sys
from pathlib import Path

from pisft import config as pisft_config
from pisft import layout
from pisft.workflow import snakemake_support as support
from pisft.workflow.stages import STAGES, rule_name

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
SOURCES = [
    s.path for s in pisft_config.data_sources(CFG)
]  # data.recap_dir: one folder or several
ITERATIONS = range(
    1, CFG.recap.iterations + 1
)  # the RECAP iterations after the SFT run (rules/recap.smk)


def command(stage):
    """The stage's `python -m pisft` command, from the stage table (pisft.workflow.stages)."""
    return STAGES[stage].command


def tracked(stage):
    """The config sections `stage` reads; a change in any of them reruns it."""
    return support.tracked_params(CFG_VALUES, stage)


def code(stage):
    """The source `stage` runs and the dependency lock (DVC deps: folders)."""
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
    """A path of iteration k (results/recap/iter_<k>/...; iteration 0: results/...)."""
    return str(CFG.at_iteration(k).results(*parts))


def value_start(k):
    """What iteration k's value model starts from (recap.value_init: the base model, or
    policy k-1 with `previous`), as smoke_value and train_value load it."""
    return str(layout.value_init_model(CFG.at_iteration(k)))
