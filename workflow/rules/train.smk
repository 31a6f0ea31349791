# Training rules run torchrun through the launcher. Checkpoints live in
# results/checkpoints/, which is not an output: Snakemake's clean-up of a failed job never
# deletes them, and rerunning the target resumes from the latest complete one.


rule smoke_1card:
    input:
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
        config=CONFIG_FILE,
        tracked=tracked("smoke_1card"),
    shell:
        "python -m pisft launch smoke_1card --config {params.config} --log {log}"


rule train_8card:
    input:
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
        config=CONFIG_FILE,
        tracked=tracked("train_8card"),
        persist=f"{RESULTS}/checkpoints/train",
    shell:
        "python -m pisft launch train_8card --config {params.config} --log {log}"
