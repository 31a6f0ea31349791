# Every rule, from the stage table (src/pisft/stages.py) through `stage_rule` (rules/common.smk):
# what a stage runs, reads, writes, reads of the config and which code it depends on are in its row.
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


for row, k in support.stage_rules(CFG, CFG_VALUES):
    stage_rule(row, k)
