"""Generate dvc.yaml from the Snakemake rules, so the two drivers share one DAG.

Each rule becomes a stage with the same command, its inputs as deps, the config keys it
tracks as params, and its outputs as outs. Paths that follow the config are DVC templates
read from `config/config.yaml` (`vars:`): `${results_dir}/...`, a local `${model.source}` and
`${model.tokenizer}`. So changing those paths needs no new dvc.yaml; the config's *shape* does
(docs/workflow.md, "Profiles"): whether the model and tokenizer come from a local folder, the
closed-loop stage, the RECAP loop's stages, the device's dependency lock, and the data sources
(`data.recap_dir`: every folder it names is a dep of convert_recap by its path, one folder or a
list alike; a template could not follow a list, nor a third source added to two). The shape is
written in the header.

Before any stage, DVC runs `config_check` (`CHECK_STAGE`, DVC only): every stage depends on its
small output, so DVC reproduces it first, and it depends on the keys of the shape, so it runs
when one of them changes. It stops the run (dvc.yaml regenerated, one line) when the config no
longer has the shape dvc.yaml was generated for, before DVC has removed any stage's outputs,
which it does before running a stage's command. DVC runs each command through
`pisft.workflow.drivers`, which checks the shape again (`dvc repro -s` skips config_check) and
keeps Snakemake's records in step (docs/workflow.md, "Both drivers agree").

What is DVC's alone is read from the stage table's rows (`pisft.stages.Output`), not passed to
the Snakemake rules (where a changed value would be a param that reruns the rule):
- an output marked `metric` is a DVC metric; an image marked `plot` is a DVC plot;
- the CSV tables are outs, drawn by the top-level `plots:` (their `Table`: x/y columns,
  template), since DVC cannot plot JSON lines;
- an output marked `linked_weights` (the base weights, linked from a local or hub source) is an
  out with `cache: false` unless the model is built here (`tiny`): the source is the copy of
  record, DVC's cache would be a second copy of several GB;
- a local model source or tokenizer is one folder dep (Snakemake gets its files as inputs);
- `params.code` (the source folders, shared modules and lock a stage runs) are deps; the
  rules' inputs under them (Snakemake's file-by-file view of the same code) are left out;
- training checkpoints (results/checkpoints/) are no DVC output at all: DVC neither deletes nor
  caches what it does not track, a rerun resumes from them, and a fresh clone (which has none)
  is not "changed" for want of them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

from pisft import config as pisft_config
from pisft import layout
from pisft.stages import DVC_WRAPPER as WRAPPER
from pisft.stages import MODEL_SOURCE, STAGES, Output, Table, shard_of, stage_of
from pisft.code_graph import lock_of
from pisft.workflow.snakemake_rules import RuleSpec, load_workflow

VARS_FILE = pisft_config.DEFAULT_CONFIG.as_posix()
HEADER = (
    "# Generated from workflow/rules/*.smk by `python -m pisft dvc-yaml`; do not edit by hand.\n"
    "# Paths come from config/config.yaml (vars); a test fails when this file is stale.\n"
)
SHAPE_PREFIX = "# shape: "


def _local(path_text: str) -> bool:
    """Whether a model source / tokenizer is a local folder (not a name pisft makes, not the hub)."""
    from pisft.model.sources import HF_PREFIX, NAMED

    text = path_text.strip()
    return bool(text) and text not in NAMED and not text.startswith(HF_PREFIX)


# The keys the shape is made of (`shape`), read off their marks (pisft.config.DAG_SHAPE): config_check
# depends on them, so a change runs it.
SHAPE_KEYS = pisft_config.keys_marked(pisft_config.DAG_SHAPE)
CHECK_STAGE = "config_check"
CHECK_FILE = "dvc_check.txt"  # under results_dir: what config_check writes and every stage depends on
CHECK_TEXT = "dvc.yaml matches the shape of config/config.yaml (config_check, python -m pisft.workflow.drivers)\n"


def shape(cfg: pisft_config.PisftConfig) -> str:
    """What of the config changes dvc.yaml's structure (the results and model paths do not: they
    are templates)."""
    lock = lock_of(cfg.device)
    sources = ",".join(Templater(cfg).path(s.path.rstrip("/")) for s in pisft_config.data_sources(cfg))
    return (f"model.source={'local' if _local(cfg.model.source) else cfg.model.source.split(':')[0]} "
            f"model.tokenizer={'local' if _local(cfg.model.tokenizer) else 'other'} "
            f"eval.closed_loop={str(cfg.eval.closed_loop).lower()} recap.iterations={cfg.recap.iterations} "
            f"recap.init={cfg.recap.init} recap.value_init={cfg.recap.value_init} lock={lock} "
            f"data.recap_dir={sources}"
            # the rollout stages' shard rules (one job: no word, the shape as it was)
            + (f" eval.shards={cfg.eval.shards}" if cfg.eval.shards > 1 else ""))


def shape_of(text: str) -> str | None:
    for line in text.splitlines()[:5]:
        if line.startswith(SHAPE_PREFIX):
            return line[len(SHAPE_PREFIX):].strip()
    return None


class Templater:
    """Concrete paths of one config -> DVC templates over config/config.yaml."""

    def __init__(self, cfg: pisft_config.PisftConfig):
        self.results = cfg.results_dir.rstrip("/")
        self.folders = {}
        # the data sources by their paths (in the shape): Snakemake lists an outside folder's files
        for source in pisft_config.data_sources(cfg):
            folder = source.path.rstrip("/")
            self.folders[folder] = self.path(folder)
        for key, value in (("model.source", cfg.model.source), ("model.tokenizer", cfg.model.tokenizer)):
            if _local(value):
                self.folders[value.rstrip("/")] = "${" + key + "}"

    def path(self, path: str) -> str:
        if path == self.results or path.startswith(self.results + "/"):
            return "${results_dir}" + path[len(self.results):]
        return path

    def dep(self, path: str) -> str:
        return self.folders.get(path.rstrip("/"), self.path(path))

    def cmd(self, cmd: str) -> str:
        return " ".join(self.path(token) for token in cmd.split(" "))

    def model_folders(self) -> list[str]:
        return [t for t in self.folders.values() if t.startswith("${model.")]

    def under_folder(self, path: str) -> str | None:
        """The dep of the folder `path` lies in (a local model source or tokenizer, a data
        source), if any: DVC hashes the folder whole."""
        for folder, template in self.folders.items():
            if path.startswith(folder + "/"):
                return template
        return None


def _outputs(rule: RuleSpec, cfg: pisft_config.PisftConfig) -> list[tuple[str, Output]]:
    """The rule's outputs, each with its row's `pisft.stages.Output` (what DVC makes of it)."""
    name, k = stage_of(rule.name)
    row = STAGES[name]
    if shard_of(rule.name):  # a shard's folder (eval.shards > 1): what its stage's merge reads, no metric
        return [(path, Output(path, folder=True)) for path in rule.outputs.values()]
    marks = {str(path): out for out, path in layout.outputs(cfg, row, k)}
    return [(path, marks[path]) for path in rule.outputs.values()]


def stage_for(rule: RuleSpec, cfg: pisft_config.PisftConfig) -> dict:
    t = Templater(cfg)
    stage: dict = {"cmd": f"{WRAPPER} {rule.name} -- {t.cmd(rule.cmd)}"}
    deps: list[str] = []
    for path in rule.inputs:
        dep = t.under_folder(path) or t.dep(path)
        if dep not in deps:
            deps.append(dep)
    if MODEL_SOURCE in STAGES[stage_of(rule.name)[0]].reads:  # a local model folder is a dep by shape,
        deps.extend(d for d in t.model_folders() if d not in deps)  # present yet or not
    deps.append(t.path(str(Path(cfg.results_dir, CHECK_FILE))))  # after config_check (module docstring)
    stage["deps"] = [*deps, *rule.code]
    if rule.tracked_keys:
        stage["params"] = [{rule.config_file: list(rule.tracked_keys)}]
    outs: list = []
    metrics: list = []
    plots: list = []
    built_here = cfg.model.source.strip() == "tiny"
    for path, out in _outputs(rule, cfg):
        if out.metric:
            metrics.append(t.path(path))
        elif out.plot is True:
            plots.append(t.path(path))
        elif out.linked_weights and not built_here:
            outs.append({t.path(path): {"cache": False}})
        else:
            outs.append(t.path(path))
    for key, entries in (("outs", outs), ("metrics", metrics), ("plots", plots)):
        if entries:
            stage[key] = entries
    return stage


def top_level_plots(rules: list[RuleSpec], cfg: pisft_config.PisftConfig) -> list:
    """How `dvc plots show` draws each table an output's `Table` describes (x, y columns,
    template), under the output's name."""
    t = Templater(cfg)
    plots = []
    for rule in rules:
        for path, out in _outputs(rule, cfg):
            if not isinstance(out.plot, Table):
                continue
            props: dict = {"x": out.plot.x, "y": {t.path(path): list(out.plot.y)}}
            if out.plot.template:
                props["template"] = out.plot.template
            plots.append({out.name: props})
    return plots


def check_stage(cfg: pisft_config.PisftConfig) -> dict:
    """config_check: the shape's keys as params, the file every stage depends on as its output."""
    t = Templater(cfg)
    # persist: DVC removes a stage's outputs before its command, unless persisted; a refused check
    # then leaves the file every stage depends on as it was (`dvc status` does not see them all changed)
    return {"cmd": f"{WRAPPER} {CHECK_STAGE} -- {VARS_FILE}",
            "params": [{VARS_FILE: list(SHAPE_KEYS)}],
            "outs": [{t.path(str(Path(cfg.results_dir, CHECK_FILE))): {"persist": True}}]}


def render(rules: list[RuleSpec], config: dict) -> str:
    cfg = pisft_config.from_dict(dict(config))
    doc: dict = {"vars": [VARS_FILE],
                 "stages": {CHECK_STAGE: check_stage(cfg), **{rule.name: stage_for(rule, cfg) for rule in rules}}}
    plots = top_level_plots(rules, cfg)
    if plots:
        doc["plots"] = plots
    return HEADER + SHAPE_PREFIX + shape(cfg) + "\n" + yaml.safe_dump(doc, sort_keys=False, width=120)


def resolve(text: str, config: dict) -> str:
    """dvc.yaml with its templates filled in from `config` (what DVC itself reads)."""
    def value(match: re.Match) -> str:
        node = config
        for part in match.group(1).split("."):
            node = node[int(part)] if isinstance(node, list) else node[part]
        return str(node)

    return re.sub(r"\$\{([a-zA-Z_.0-9]+)\}", value, text)


def main(check: bool = False, output: str = "dvc.yaml") -> int:
    workflow = load_workflow()
    text = render(workflow.rules, workflow.config)
    path = Path(output)
    if check:
        current = path.read_text() if path.is_file() else ""
        if current != text:
            print(
                f"{path} is stale: it differs from what the workflow rules generate. "
                "Run `python -m pisft dvc-yaml` and commit the result.",
                file=sys.stderr,
            )
            return 1
        print(f"{path} matches the workflow rules")
        return 0
    path.write_text(text)
    print(f"wrote {path} from the workflow rules")
    return 0
