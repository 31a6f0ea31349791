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


def it(k):
    """The folders of iteration k (pisft.layout names every path under results_dir)."""
    return layout.iteration(CFG, k)


def paths(*items):
    return [str(p) for p in items]


def inputs(stage, k):
    """What `stage` reads at iteration k (besides its code), as paths."""
    if stage == "fetch_base":
        return support.model_source_inputs(CFG)
    if stage == "demo_recap":
        return []
    if stage == "collect_rollouts":
        return paths(it(k - 1).trained_model)
    if stage == "convert_recap":
        return [*SOURCES, *paths(*[it(j).rollouts for j in range(1, k + 1)])]
    if stage == "smoke_1card":
        return paths(layout.base_model(CFG), it(0).dataset)
    if stage in ("smoke_value", "train_value"):
        gate = [it(k).value_smoke_report] if stage == "train_value" else []
        return [value_start(k), *paths(it(k).dataset, *gate)]
    if stage == "advantages":
        # the value model's frozen weights are read from the model it started from
        return [value_start(k), *paths(it(k).dataset, it(k).value)]
    if stage == "train_8card":
        if k == 0:
            return paths(
                layout.base_model(CFG), it(0).dataset, layout.smoke_report(CFG)
            )
        # what iteration k starts from (recap.init), and the same step shape: iteration 0's smoke gate
        start = layout.init_model(CFG.at_iteration(k))
        return paths(start, it(k).dataset, it(k).advantages, layout.smoke_report(CFG))
    if stage == "closed_loop":
        return paths(it(k).trained_model)
    if stage == "evaluate":
        closed = [it(0).closed_loop_metrics] if CFG.eval.closed_loop else []
        return paths(
            layout.base_model(CFG),
            it(0).dataset,
            it(0).trained_model,
            it(0).train_metrics,
            *closed,
        )
    if stage == "recap_summary":
        return paths(
            *[it(j).closed_loop_metrics for j in range(0, CFG.recap.iterations + 1)],
            *[
                getattr(it(j), part)
                for j in ITERATIONS
                for part in ("rollouts", "value", "advantages")
            ],
        )
    raise ValueError(f"{stage}: no inputs written in workflow/rules/stages.smk")


for name in rule_names(CFG.recap.iterations):
    stage, k = stage_of(name)
    if stage == "closed_loop" and k == 0 and not CFG.eval.closed_loop:
        continue  # iteration 0's closed loop is optional (eval.closed_loop); the RECAP loop's is not
    stage_rule(name, inputs(stage, k))
