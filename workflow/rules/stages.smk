# Every rule, from the stage table (src/pisft/stages.py) through `stage_rule` (rules/common.smk):
# what a stage runs, writes, reads of the config and which code it depends on are in its row.
# Only the inputs are written here: which other stages' outputs a stage reads, at iteration k.
# The RECAP loop (README, "The RECAP loop"): for each iteration k = 1..recap.iterations, one
# rule per stage, named <stage>_<k> (the DVC stage of the same name runs the same command).
# Iteration k reads policy k-1 (k = 1: the SFT run's) and writes results/recap/iter_<k>/.
# Concrete rules rather than a wildcard: iteration k's pool has k rollout folders (a number of
# inputs a wildcard cannot vary), and dvc.yaml, generated from these rules, needs concrete
# stages (DVC's templates cannot compute k-1).
# The synthetic demo is always a stage (a few seconds, a few MB), read only when data.recap_dir
# is its folder: the DAG then has one shape whatever data.recap_dir names, so dvc.yaml follows a
# changed data path through its templates alone (docs/workflow.md, "Profiles").
# Training checkpoints live in results/checkpoints/, which is not an output: Snakemake's
# clean-up of a failed job never deletes them, and rerunning the target resumes from the latest.


def R(*parts):
    """A path under results_dir (the SFT run's, and what every iteration shares)."""
    return "/".join((RESULTS, *parts))


def inputs(stage, k):
    """What `stage` reads at iteration k (besides its code), as paths."""
    if stage == "fetch_base":
        return support.model_source_inputs(CFG)
    if stage == "demo_recap":
        return []
    if stage == "collect_rollouts":
        return [at(k - 1, "train", "model")]
    if stage == "convert_recap":
        return [*SOURCES, *[at(j, "rollouts") for j in range(1, k + 1)]]
    if stage == "smoke_1card":
        return [R("base_model"), R("dataset")]
    if stage in ("smoke_value", "train_value"):
        gate = [at(k, "value_smoke", "report.json")] if stage == "train_value" else []
        return [value_start(k), at(k, "dataset"), *gate]
    if stage == "advantages":
        return [at(k, "dataset"), at(k, "value")]
    if stage == "train_8card":
        if k == 0:
            return [R("base_model"), R("dataset"), R("smoke", "report.json")]
        start = (
            R("base_model") if CFG.recap.init == "base" else at(k - 1, "train", "model")
        )
        # the same step shape: iteration 0's smoke gate
        return [start, at(k, "dataset"), at(k, "advantages"), R("smoke", "report.json")]
    if stage == "closed_loop":
        return [R("train", "model") if k == 0 else at(k, "train", "model")]
    if stage == "evaluate":
        closed = [R("closed_loop", "metrics.json")] if CFG.eval.closed_loop else []
        return [
            R("base_model"),
            R("dataset"),
            R("train", "model"),
            R("train", "metrics.jsonl"),
            *closed,
        ]
    if stage == "recap_summary":
        return [
            *[
                at(j, "closed_loop", "metrics.json")
                for j in range(0, CFG.recap.iterations + 1)
            ],
            *[
                at(j, part)
                for j in ITERATIONS
                for part in ("rollouts", "value", "advantages")
            ],
        ]
    raise ValueError(f"{stage}: no inputs written in workflow/rules/stages.smk")


for name in rule_names(CFG.recap.iterations):
    stage, k = stage_of(name)
    if stage == "closed_loop" and k == 0 and not CFG.eval.closed_loop:
        continue  # iteration 0's closed loop is optional (eval.closed_loop); the RECAP loop's is not
    stage_rule(name, inputs(stage, k))
