# The RECAP loop (README, "The RECAP loop"): for each iteration k = 1..recap.iterations, one
# rule per stage, named <stage>_<k> (the DVC stage of the same name runs the same command).
# Iteration k reads policy k-1 (k = 1: the SFT run's) and writes results/recap/iter_<k>/.
# Generated in a loop rather than over a wildcard: iteration k's pool has k rollout folders (a
# number of inputs a wildcard cannot vary), and dvc.yaml, generated from these rules, needs
# concrete stages (DVC's templates cannot compute k-1).


for k in ITERATIONS:

    rule:
        name:
            rule_name("collect_rollouts", k)
        input:
            *code_files("collect_rollouts"),
            at(k - 1, "train", "model"),
        output:
            directory(at(k, "rollouts")),
        log:
            f"{LOGS}/{rule_name('collect_rollouts', k)}.log",
        benchmark:
            f"{BENCH}/{rule_name('collect_rollouts', k)}.tsv"
        threads: workflow.cores
        params:
            code=code("collect_rollouts"),
            config=CONFIG_FILE,
            tracked=tracked_at("collect_rollouts", k),
        shell:
            command_at("collect_rollouts", k)

    rule:
        name:
            rule_name("convert_recap", k)
        input:
            *code_files("convert_recap"),
            *SOURCES,
            *[at(j, "rollouts") for j in range(1, k + 1)],
        output:
            directory(at(k, "dataset")),
        log:
            f"{LOGS}/{rule_name('convert_recap', k)}.log",
        benchmark:
            f"{BENCH}/{rule_name('convert_recap', k)}.tsv"
        params:
            code=code("convert_recap"),
            config=CONFIG_FILE,
            tracked=tracked_at("convert_recap", k),
        shell:
            command_at("convert_recap", k)

    rule:
        name:
            rule_name("smoke_value", k)
        input:
            *code_files("smoke_value"),
            value_start(k),
            at(k, "dataset"),
        output:
            at(k, "value_smoke", "report.json"),
        log:
            f"{LOGS}/{rule_name('smoke_value', k)}.log",
        benchmark:
            f"{BENCH}/{rule_name('smoke_value', k)}.tsv"
        threads: workflow.cores
        resources:
            **support.accelerator_resources(CFG, 1),
        params:
            code=code("smoke_value"),
            config=CONFIG_FILE,
            tracked=tracked_at("smoke_value", k),
        shell:
            command_at("smoke_value", k)

    rule:
        name:
            rule_name("train_value", k)
        input:
            *code_files("train_value"),
            value_start(k),
            at(k, "dataset"),
            at(k, "value_smoke", "report.json"),
        output:
            directory(at(k, "value")),
        log:
            f"{LOGS}/{rule_name('train_value', k)}.log",
        benchmark:
            f"{BENCH}/{rule_name('train_value', k)}.tsv"
        threads: workflow.cores
        resources:
            **support.accelerator_resources(CFG, CFG.train.nproc_per_node),
        params:
            code=code("train_value"),
            config=CONFIG_FILE,
            tracked=tracked_at("train_value", k),
        shell:
            command_at("train_value", k)

    rule:
        name:
            rule_name("advantages", k)
        input:
            *code_files("advantages"),
            at(k, "dataset"),
            at(k, "value"),
        output:
            directory(at(k, "advantages")),
        log:
            f"{LOGS}/{rule_name('advantages', k)}.log",
        benchmark:
            f"{BENCH}/{rule_name('advantages', k)}.tsv"
        threads: workflow.cores
        params:
            code=code("advantages"),
            config=CONFIG_FILE,
            tracked=tracked_at("advantages", k),
        shell:
            command_at("advantages", k)

    rule:
        name:
            rule_name("train_8card", k)
        input:
            *code_files("train_8card"),
            f"{RESULTS}/base_model"
            if CFG.recap.init == "base"
            else at(k - 1, "train", "model"),
            at(k, "dataset"),
            at(k, "advantages"),
            f"{RESULTS}/smoke/report.json",  # the same step shape: iteration 0's smoke gate
        output:
            model=directory(at(k, "train", "model")),
            metrics=at(k, "train", "metrics.jsonl"),
        log:
            f"{LOGS}/{rule_name('train_8card', k)}.log",
        benchmark:
            f"{BENCH}/{rule_name('train_8card', k)}.tsv"
        threads: workflow.cores
        resources:
            **support.accelerator_resources(CFG, CFG.train.nproc_per_node),
        params:
            code=code("train_8card"),
            config=CONFIG_FILE,
            tracked=tracked_at("train_8card", k),
        shell:
            command_at("train_8card", k)

    rule:
        name:
            rule_name("closed_loop", k)
        input:
            *code_files("closed_loop"),
            at(k, "train", "model"),
        output:
            metrics=at(k, "closed_loop", "metrics.json"),
            report=at(k, "closed_loop", "report.md"),
            videos=directory(at(k, "closed_loop", "videos")),
        log:
            f"{LOGS}/{rule_name('closed_loop', k)}.log",
        benchmark:
            f"{BENCH}/{rule_name('closed_loop', k)}.tsv"
        threads: workflow.cores
        params:
            code=code("closed_loop"),
            config=CONFIG_FILE,
            tracked=tracked_at("closed_loop", k),
        shell:
            command_at("closed_loop", k)


if ITERATIONS:

    rule recap_summary:
        input:
            *code_files("recap_summary"),
            *[
                at(k, "closed_loop", "metrics.json")
                for k in range(0, CFG.recap.iterations + 1)
            ],
            *[
                at(k, part)
                for k in ITERATIONS
                for part in ("rollouts", "value", "advantages")
            ],
        output:
            metrics=f"{RESULTS}/recap/metrics.json",
            report=report(
                f"{RESULTS}/recap/report.md",
                caption="../report/recap_report.rst",
                category="RECAP",
            ),
            plot=report(
                f"{RESULTS}/recap/success.png",
                caption="../report/recap_report.rst",
                category="RECAP",
            ),
        log:
            f"{LOGS}/recap_summary.log",
        benchmark:
            f"{BENCH}/recap_summary.tsv"
        params:
            code=code("recap_summary"),
            config=CONFIG_FILE,
            tracked=tracked("recap_summary"),
        shell:
            command("recap_summary")
