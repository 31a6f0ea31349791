rule evaluate:
    input:
        f"{RESULTS}/base_model",
        f"{RESULTS}/dataset",
        f"{RESULTS}/train/model",
        f"{RESULTS}/train/metrics.jsonl",
    output:
        metrics=f"{RESULTS}/eval/metrics.json",
        report=report(
            f"{RESULTS}/eval/report.md",
            caption="../report/eval_report.rst",
            category="Evaluation",
        ),
        loss_plot=report(
            f"{RESULTS}/eval/loss.png",
            caption="../report/loss.rst",
            category="Training",
        ),
    log:
        f"{LOGS}/evaluate.log",
    benchmark:
        f"{BENCH}/evaluate.tsv"
    params:
        config=CONFIG_FILE,
        tracked=tracked("evaluate"),
    shell:
        "python -m pisft evaluate --config {params.config} --log {log}"
