# Training rules run torchrun through the launcher. Checkpoints live in
# results/checkpoints/, which is not an output: Snakemake's clean-up of a failed job never
# deletes them, and rerunning the target resumes from the latest complete one.


rule smoke_1card:
    input:
        *code_files("smoke_1card"),
        f"{RESULTS}/base_model",
        f"{RESULTS}/dataset",
    output:
        f"{RESULTS}/smoke/report.json",
    log:
        f"{LOGS}/smoke_1card.log",
    benchmark:
        f"{BENCH}/smoke_1card.tsv"
    threads: workflow.cores
    resources:
        **support.accelerator_resources(CFG, 1),
    params:
        code=code("smoke_1card"),
        config=CONFIG_FILE,
        tracked=tracked("smoke_1card"),
    shell:
        command("smoke_1card")


rule train_8card:
    input:
        *code_files("train_8card"),
        f"{RESULTS}/base_model",
        f"{RESULTS}/dataset",
        f"{RESULTS}/smoke/report.json",
    output:
        model=directory(f"{RESULTS}/train/model"),
        metrics=f"{RESULTS}/train/metrics.jsonl",
    log:
        f"{LOGS}/train_8card.log",
    benchmark:
        f"{BENCH}/train_8card.tsv"
    threads: workflow.cores
    resources:
        **support.accelerator_resources(CFG, CFG.train.nproc_per_node),
    params:
        code=code("train_8card"),
        config=CONFIG_FILE,
        tracked=tracked("train_8card"),
    shell:
        command("train_8card")
