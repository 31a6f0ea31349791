rule fetch_base:
    output:
        directory(f"{RESULTS}/base_model"),
    params:
        config=CONFIG_FILE,
        tracked=tracked("fetch_base"),
    log:
        f"{LOGS}/fetch_base.log",
    benchmark:
        f"{BENCH}/fetch_base.tsv"
    shell:
        "python -m pisft fetch_base --config {params.config} --log {log}"
