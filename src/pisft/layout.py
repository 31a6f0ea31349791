"""The results layout: every path under `results_dir`, named by what it is.

Each stage writes one folder of `results_dir` (README, "The stages"), and its row in the stage
table (`pisft.stages`) says which and what is in it: the names here are read off the rows. The
folders of one RECAP iteration (`ITERATION_FOLDERS`: those of the stages that are not `shared`
— its rollouts, converted pool, value model, advantages, policy, evaluations — and its
checkpoints and logs) are at iteration 0 (the SFT run) those of `results_dir` itself and at
iteration k >= 1 those of `results_dir/recap/iter_<k>/`; the rest is shared by every iteration:
the base model, the demo data, the smoke report, the rules' benchmarks (one file per rule), the
benchmark report and the RECAP summary.

    layout.base_model(cfg)                      results/base_model
    layout.iteration(cfg).trained_model         results[/recap/iter_<k>]/train/model
    layout.iteration(cfg, 2).rollouts           results/recap/iter_2/rollouts
    layout.output(cfg, stages.CLOSED_LOOP, "metrics")   any stage's output, by its name
    layout.policy(cfg, k - 1)                   the policy RECAP iteration k starts from
    layout.writer_of(path)                      the stage (and iteration) that wrote a folder

A stage names its paths here and never spells them. This module sits on the ground floor: it
reads the stage table and a run's configuration (a `pisft.config.PisftConfig`) through the few
attributes `Run` lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pisft.config import data_sources
from pisft.stages import (ADVANTAGES, CLOSED_LOOP, COLLECT_ROLLOUTS, CONVERT_RECAP, DEMO_RECAP, EVALUATE, FETCH_BASE,
                          Output, RECAP_SUMMARY, SMOKE_1CARD, SMOKE_VALUE, STAGES, TRAIN_8CARD, TRAIN_VALUE,
                          Stage)

CHECKPOINTS_FOLDER = "checkpoints"  # the training stages' run folders (persistent: no stage's output)
LOGS_FOLDER = "logs"  # the stages' own logs
SHARDS_FOLDER = "shards"  # the scattered rollout stages' shards (eval.shards > 1), before their merge
# The folders of one RECAP iteration: at iteration k >= 1 they live in results/recap/iter_<k>/.
ITERATION_FOLDERS = (*(s.folder for s in STAGES.values() if not s.shared), CHECKPOINTS_FOLDER, LOGS_FOLDER,
                     SHARDS_FOLDER)
RECAP_FOLDER = RECAP_SUMMARY.folder  # the RECAP summary, and the iterations k >= 1 beside it (iter_<k>)
ITERATION_PREFIX = "iter_"

# Files inside a stage's folder that more than one module names.
SPLIT_FILE = "split.json"  # in a converted dataset: the train/eval episode split
RETURNS_FILE = "returns.parquet"  # in a converted dataset: each frame's return (the value model learns it)
LABELS_FILE = "labels.parquet"  # in the advantages folder: each frame's advantage label
METRICS_FILE = "metrics.json"  # an evaluation's (eval, closed_loop) and the RECAP summary's figures
TRAIN_METRICS_FILE = "metrics.jsonl"  # a training run's per-step metrics
REPORT_FILE = "report.json"  # a smoke gate's report (smoke_1card, smoke_value)
VALUE_MODEL_FOLDER = "model"  # in train_value's folder: the value model's export


class Run(Protocol):
    """What the layout reads of a run's configuration (`pisft.config.PisftConfig`)."""

    results_dir: str
    iteration: int  # the RECAP iteration its stages run for (0: the SFT run)
    recap: Any  # `recap.init`, `recap.value_init`: what an iteration's training starts from

    def at_iteration(self, k: int) -> Run: ...


def _in_iteration(stage: Stage, *inside: str, name: str | None = None) -> property:
    """An iteration's path of `stage`: its folder, one of its outputs (`name`), or a path inside
    its folder; the row says where."""
    assert not stage.shared, f"{stage.name} writes results_dir's folder, shared by every iteration"

    def path(self: Iteration) -> Path:
        return self.root.joinpath(stage.output(name).path if name is not None else stage.folder, *inside)
    return property(path, doc=f"{stage.name}: {stage.help}" if not inside and name is None else None)


@dataclass(frozen=True)
class Iteration:
    """The folders and files of one RECAP iteration `k` (0: the SFT run), under `root`."""

    k: int
    root: Path  # results_dir at k = 0; results_dir/recap/iter_<k> at k >= 1

    # ---- what the iteration's stages write, in pipeline order ----
    rollouts = _in_iteration(COLLECT_ROLLOUTS)  # the episodes policy k-1 played (a RECAP dataset)
    dataset = _in_iteration(CONVERT_RECAP)  # the pi0.5-ready LeRobot dataset (at k >= 1, the pool)
    split = _in_iteration(CONVERT_RECAP, SPLIT_FILE)
    returns = _in_iteration(CONVERT_RECAP, RETURNS_FILE)
    value_smoke = _in_iteration(SMOKE_VALUE)  # the value model's gate
    value_smoke_report = _in_iteration(SMOKE_VALUE, name="")
    value = _in_iteration(TRAIN_VALUE)  # the value model's export folder
    value_model = _in_iteration(TRAIN_VALUE, VALUE_MODEL_FOLDER)
    advantages = _in_iteration(ADVANTAGES)  # the frames' advantage labels and their report
    advantage_labels = _in_iteration(ADVANTAGES, LABELS_FILE)
    train = _in_iteration(TRAIN_8CARD)  # the training run's export folder
    trained_model = _in_iteration(TRAIN_8CARD, name="model")  # the exported policy (LeRobot layout)
    train_metrics = _in_iteration(TRAIN_8CARD, name="metrics")
    closed_loop = _in_iteration(CLOSED_LOOP)  # the LIBERO rollouts' metrics, episodes and videos
    closed_loop_metrics = _in_iteration(CLOSED_LOOP, name="metrics")
    eval = _in_iteration(EVALUATE)  # the offline evaluation's metrics, plots and report
    eval_metrics = _in_iteration(EVALUATE, name="metrics")

    # ---- what the stages keep beside their outputs ----
    @property
    def checkpoints(self) -> Path:
        """The training stages' run folders (persistent: never removed by a rerun)."""
        return self.root / CHECKPOINTS_FOLDER

    def checkpoints_of(self, stage: Stage) -> Path:
        """A resuming training stage's run folders, one per run fingerprint
        (`pisft.train.run_folders.run_folder`): named as its output folder."""
        assert stage.resumable, stage.name
        return self.checkpoints / stage.folder

    @property
    def policy_checkpoints(self) -> Path:
        return self.checkpoints_of(TRAIN_8CARD)

    @property
    def value_checkpoints(self) -> Path:
        return self.checkpoints_of(TRAIN_VALUE)

    @property
    def logs(self) -> Path:
        """The stages' own logs (one folder per stage)."""
        return self.root / LOGS_FOLDER

    def stage_logs(self, stage: str) -> Path:
        """One stage's logs (a launched stage: one folder per start; smoke_1card: its report too,
        written even when the gate fails)."""
        return self.logs / stage

    @property
    def shards(self) -> Path:
        """The scattered rollout stages' shards (eval.shards > 1; pisft.rollout.plan)."""
        return self.root / SHARDS_FOLDER

    def shard(self, stage: str, i: int, n: int) -> Path:
        """Shard i of n of a scattered rollout stage: its episodes' results, videos, recordings,
        which the stage's merge reads."""
        return self.shards / stage / f"shard_{i}_of_{n}"

    def timing(self, stage: str) -> Path:
        """A rollout stage's timing record (closed_loop, collect_rollouts): how its run went (times,
        environment processes, batches, episodes run again), beside the logs: its outputs are the
        same bytes every run, this is not."""
        return self.logs / f"{stage}.timing.json"


def iteration(cfg: Run, k: int | None = None) -> Iteration:
    """The folders of RECAP iteration k (default: the one cfg's stages run for). An iteration
    the config does not have (k > recap.iterations) is refused (`PisftConfig.at_iteration`)."""
    k = cfg.iteration if k is None else cfg.at_iteration(k).iteration
    root = Path(cfg.results_dir, RECAP_FOLDER, f"{ITERATION_PREFIX}{k}") if k else Path(cfg.results_dir)
    return Iteration(k, root)


def results(cfg: Run, *parts: str) -> Path:
    """`results_dir/<parts>`, placed in the current iteration's folder when `parts` starts with
    one of ITERATION_FOLDERS. Prefer the names below and on `Iteration`."""
    if parts and Path(parts[0]).parts[0] in ITERATION_FOLDERS:
        return Path(iteration(cfg).root, *parts)
    return Path(cfg.results_dir, *parts)


def output(cfg: Run, stage: Stage, name: str = "", k: int | None = None) -> Path:
    """Where `stage`'s output `name` ("" for its only one) lies for cfg's iteration (or k): in
    results_dir for a shared stage, else in the iteration's folder."""
    return _placed(cfg, stage, stage.output(name).path, k)


def outputs(cfg: Run, stage: Stage, k: int | None = None) -> list[tuple[Output, Path]]:
    """Every output of `stage` with where it lies for cfg's iteration (or k), in the row's order."""
    return [(out, _placed(cfg, stage, out.path, k)) for out in stage.outputs]


def _placed(cfg: Run, stage: Stage, path: str, k: int | None) -> Path:
    return Path(cfg.results_dir, path) if stage.shared else iteration(cfg, k).root / path


# ---- shared by every iteration ----
def base_model(cfg: Run) -> Path:
    """fetch_base: the model every run starts from (LeRobot layout)."""
    return output(cfg, FETCH_BASE)


def demo_data(cfg: Run) -> Path:
    """demo_recap: the synthetic RECAP dataset (data.recap_dir's default)."""
    return output(cfg, DEMO_RECAP)


def uses_demo_data(cfg: Any) -> bool:
    """Whether `data.recap_dir` names the demo folder (alone or among its sources)."""
    return any(Path(s.path) == demo_data(cfg) for s in data_sources(cfg))


def smoke(cfg: Run) -> Path:
    """smoke_1card: the gate's output folder."""
    return Path(cfg.results_dir, SMOKE_1CARD.folder)


def smoke_report(cfg: Run) -> Path:
    return output(cfg, SMOKE_1CARD)


def benchmarks(cfg: Run) -> Path:
    """Every rule's benchmark file (the drivers' stage wall times)."""
    return Path(cfg.results_dir, "benchmarks")


def benchmark(cfg: Run, rule: str) -> Path:
    return benchmarks(cfg) / f"{rule}.tsv"


def bench_report(cfg: Run) -> Path:
    """`python -m pisft bench`: the benchmark report."""
    return Path(cfg.results_dir, "bench", "bench.json")


# The variable that places inductor's caches. The launcher sets it for the training workers before
# torch runs there: torch sets it to its own default (a folder under /tmp) the first time anything asks
# for its cache, as the smoke gate's memory estimate does before the model is compiled.
COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache(cfg: Run) -> Path:
    """torch.compile's caches (inductor's code and graphs) of the training stages (train.compile):
    a rerun of a stage loads what an earlier run compiled. No stage's output."""
    return Path(cfg.results_dir, "cache", "inductor")


def effective_config(cfg: Run) -> Path:
    """The config a driver's run resolved (`pisft.workflow.snakemake_support`)."""
    return Path(cfg.results_dir, "config", "effective.yaml")


def recap_summary(cfg: Run) -> Path:
    """recap_summary: the RECAP loop's figures across iterations (beside the iterations' folders)."""
    return Path(cfg.results_dir, RECAP_SUMMARY.folder)


def recap_metrics(cfg: Run) -> Path:
    return output(cfg, RECAP_SUMMARY, "metrics")


# ---- what an iteration's training starts from ----
def policy(cfg: Run, k: int) -> Path:
    """The exported policy of iteration k (0: the SFT run's)."""
    return iteration(cfg, k).trained_model


def start_model(cfg: Run, choice: str) -> Path:
    """The weights a training starts from, as `recap.init` or `recap.value_init` chooses (a row's
    `pisft.stages.StartModel` names the key): `base`, the base model; `previous`, at RECAP
    iteration k >= 1 the exported policy of k - 1."""
    if cfg.iteration and choice == "previous":
        return policy(cfg, cfg.iteration - 1)
    return base_model(cfg)


def init_model(cfg: Run) -> Path:
    """The weights training starts from (`recap.init`)."""
    return start_model(cfg, cfg.recap.init)


def value_init_model(cfg: Run) -> Path:
    """The weights the value model (train_value, smoke_value) starts from (`recap.value_init`)."""
    return start_model(cfg, cfg.recap.value_init)


def training_labels(cfg: Run) -> Path | None:
    """At RECAP iteration k >= 1 the frames' advantage labels the policy trains on; else None."""
    return iteration(cfg).advantage_labels if cfg.iteration else None


# ---- which stage wrote a folder ----
def writer_of(path: str | Path) -> tuple[Stage, int] | None:
    """The stage, and the iteration, that wrote the folder `path`, from where it lies: one of a
    stage's folder outputs, or a folder directly inside one (`.../recap/iter_2/value/model` ->
    train_value at iteration 2). For a manifest that does not name its writer (`pisft.integrity`);
    None for a folder no stage writes."""
    parts = Path(path).parts
    for inside in (0, 1):  # the output itself before a folder in one
        for stage in STAGES.values():
            for out in stage.outputs:
                tail = tuple(out.path.split("/"))
                end = len(parts) - inside
                if not out.folder or end - len(tail) < 0 or parts[end - len(tail):end] != tail:
                    continue
                head = parts[:end - len(tail)]
                return stage, (0 if stage.shared else _iteration_of(head))
    return None


def _iteration_of(head: tuple[str, ...]) -> int:
    """k for a folder under `.../recap/iter_<k>/`, else 0."""
    if len(head) >= 2 and head[-2] == RECAP_FOLDER and head[-1].startswith(ITERATION_PREFIX):
        k = head[-1][len(ITERATION_PREFIX):]
        return int(k) if k.isdigit() else 0
    return 0
