"""The results layout: every path under `results_dir`, named by what it is.

Each stage writes one folder of `results_dir` (README, "The stages"). The folders of one RECAP
iteration (`ITERATION_FOLDERS`: its rollouts, converted pool, value model, advantages, policy,
checkpoints, evaluations and logs) are at iteration 0 (the SFT run) those of `results_dir`
itself and at iteration k >= 1 those of `results_dir/recap/iter_<k>/`; the rest is shared by
every iteration: the base model, the demo data, the smoke report, the rules' benchmarks (one
file per rule), the benchmark report and the RECAP summary.

    layout.base_model(cfg)                      results/base_model
    layout.iteration(cfg).trained_model         results[/recap/iter_<k>]/train/model
    layout.iteration(cfg, 2).rollouts           results/recap/iter_2/rollouts
    layout.policy(cfg, k - 1)                   the policy RECAP iteration k starts from

A stage names its paths here and never spells them. This module sits on the ground floor
beside `pisft.config` and imports no pisft module: it reads a run's configuration (a
`pisft.config.PisftConfig`) through the few attributes `Run` lists, so the config can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# The folders of one RECAP iteration: at iteration k >= 1 they live in results/recap/iter_<k>/.
ITERATION_FOLDERS = ("rollouts", "dataset", "value_smoke", "value", "advantages", "train", "checkpoints",
                     "closed_loop", "eval", "logs")
RECAP_FOLDER = "recap"  # the RECAP summary, and the iterations k >= 1 beside it (iter_<k>)

# Files inside a stage's folder that more than one module names.
SPLIT_FILE = "split.json"  # in a converted dataset: the train/eval episode split
RETURNS_FILE = "returns.parquet"  # in a converted dataset: each frame's return (the value model learns it)
LABELS_FILE = "labels.parquet"  # in the advantages folder: each frame's advantage label
METRICS_FILE = "metrics.json"  # an evaluation's (eval, closed_loop) and the RECAP summary's figures
TRAIN_METRICS_FILE = "metrics.jsonl"  # a training run's per-step metrics
REPORT_FILE = "report.json"  # a smoke gate's report (smoke_1card, smoke_value)


class Run(Protocol):
    """What the layout reads of a run's configuration (`pisft.config.PisftConfig`)."""

    results_dir: str
    iteration: int  # the RECAP iteration its stages run for (0: the SFT run)
    recap: Any  # `recap.init`, `recap.value_init`: what an iteration's training starts from

    def at_iteration(self, k: int) -> Run: ...


@dataclass(frozen=True)
class Iteration:
    """The folders and files of one RECAP iteration `k` (0: the SFT run), under `root`."""

    k: int
    root: Path  # results_dir at k = 0; results_dir/recap/iter_<k> at k >= 1

    # ---- what the iteration's stages write, in pipeline order ----
    @property
    def rollouts(self) -> Path:
        """collect_rollouts: the episodes policy k-1 played (a RECAP dataset)."""
        return self.root / "rollouts"

    @property
    def dataset(self) -> Path:
        """convert_recap: the pi0.5-ready LeRobot dataset (at k >= 1, the pool)."""
        return self.root / "dataset"

    @property
    def split(self) -> Path:
        return self.dataset / SPLIT_FILE

    @property
    def returns(self) -> Path:
        return self.dataset / RETURNS_FILE

    @property
    def value_smoke(self) -> Path:
        """smoke_value: the value model's gate report."""
        return self.root / "value_smoke"

    @property
    def value_smoke_report(self) -> Path:
        return self.value_smoke / REPORT_FILE

    @property
    def value(self) -> Path:
        """train_value: the value model's export folder."""
        return self.root / "value"

    @property
    def value_model(self) -> Path:
        return self.value / "model"

    @property
    def advantages(self) -> Path:
        """advantages: the frames' advantage labels and their report."""
        return self.root / "advantages"

    @property
    def advantage_labels(self) -> Path:
        return self.advantages / LABELS_FILE

    @property
    def train(self) -> Path:
        """train_8card: the training run's export folder."""
        return self.root / "train"

    @property
    def trained_model(self) -> Path:
        """The exported policy (LeRobot layout)."""
        return self.train / "model"

    @property
    def train_metrics(self) -> Path:
        return self.train / TRAIN_METRICS_FILE

    @property
    def checkpoints(self) -> Path:
        """The training stages' run folders (persistent: never removed by a rerun)."""
        return self.root / "checkpoints"

    @property
    def policy_checkpoints(self) -> Path:
        """train_8card's run folders, one per run fingerprint (`pisft.train.checkpoint.run_folder`)."""
        return self.checkpoints / "train"

    @property
    def value_checkpoints(self) -> Path:
        """train_value's run folders, one per run fingerprint."""
        return self.checkpoints / "value"

    @property
    def closed_loop(self) -> Path:
        """closed_loop: the LIBERO rollouts' metrics, episodes and videos."""
        return self.root / "closed_loop"

    @property
    def closed_loop_metrics(self) -> Path:
        return self.closed_loop / METRICS_FILE

    @property
    def eval(self) -> Path:
        """evaluate: the offline evaluation's metrics, plots and report."""
        return self.root / "eval"

    @property
    def eval_metrics(self) -> Path:
        return self.eval / METRICS_FILE

    @property
    def logs(self) -> Path:
        """The stages' own logs (one folder per stage)."""
        return self.root / "logs"

    def stage_logs(self, stage: str) -> Path:
        """One stage's logs (a launched stage: one folder per start; smoke_1card: its report too,
        written even when the gate fails)."""
        return self.logs / stage

    def timing(self, stage: str) -> Path:
        """A rollout stage's timing record (closed_loop, collect_rollouts): how its run went (times,
        environment processes, batches, episodes run again), beside the logs: its outputs are the
        same bytes every run, this is not."""
        return self.logs / f"{stage}.timing.json"


def iteration(cfg: Run, k: int | None = None) -> Iteration:
    """The folders of RECAP iteration k (default: the one cfg's stages run for). An iteration
    the config does not have (k > recap.iterations) is refused (`PisftConfig.at_iteration`)."""
    k = cfg.iteration if k is None else cfg.at_iteration(k).iteration
    root = Path(cfg.results_dir, RECAP_FOLDER, f"iter_{k}") if k else Path(cfg.results_dir)
    return Iteration(k, root)


def results(cfg: Run, *parts: str) -> Path:
    """`results_dir/<parts>`, placed in the current iteration's folder when `parts` starts with
    one of ITERATION_FOLDERS. Prefer the names below and on `Iteration`."""
    if parts and Path(parts[0]).parts[0] in ITERATION_FOLDERS:
        return Path(iteration(cfg).root, *parts)
    return Path(cfg.results_dir, *parts)


# ---- shared by every iteration ----
def base_model(cfg: Run) -> Path:
    """fetch_base: the model every run starts from (LeRobot layout)."""
    return Path(cfg.results_dir, "base_model")


def demo_data(cfg: Run) -> Path:
    """demo_recap: the synthetic RECAP dataset (data.recap_dir's default)."""
    return Path(cfg.results_dir, "demo_recap")


def smoke(cfg: Run) -> Path:
    """smoke_1card: the gate's output folder."""
    return Path(cfg.results_dir, "smoke")


def smoke_report(cfg: Run) -> Path:
    return smoke(cfg) / REPORT_FILE


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
    return Path(cfg.results_dir, RECAP_FOLDER)


def recap_metrics(cfg: Run) -> Path:
    return recap_summary(cfg) / METRICS_FILE


# ---- what an iteration's training starts from ----
def policy(cfg: Run, k: int) -> Path:
    """The exported policy of iteration k (0: the SFT run's)."""
    return iteration(cfg, k).trained_model


def _start_model(cfg: Run, choice: str) -> Path:
    """`base`: the base model; `previous`: at RECAP iteration k >= 1 the exported policy of k - 1."""
    if cfg.iteration and choice == "previous":
        return policy(cfg, cfg.iteration - 1)
    return base_model(cfg)


def init_model(cfg: Run) -> Path:
    """The weights training starts from (`recap.init`)."""
    return _start_model(cfg, cfg.recap.init)


def value_init_model(cfg: Run) -> Path:
    """The weights the value model (train_value, smoke_value) starts from (`recap.value_init`)."""
    return _start_model(cfg, cfg.recap.value_init)


def training_labels(cfg: Run) -> Path | None:
    """At RECAP iteration k >= 1 the frames' advantage labels the policy trains on; else None."""
    return iteration(cfg).advantage_labels if cfg.iteration else None
