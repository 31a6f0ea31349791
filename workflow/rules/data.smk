if CFG.uses_demo_data:

    rule demo_recap:
        output:
            directory(CFG.data.recap_dir),
        log:
            f"{LOGS}/demo_recap.log",
        benchmark:
            f"{BENCH}/demo_recap.tsv"
        params:
            config=CONFIG_FILE,
            tracked=tracked("demo_recap"),
        shell:
            "python -m pisft demo_recap --config {params.config} --log {log}"


rule convert_recap:
    input:
        CFG.data.recap_dir,
    output:
        directory(f"{RESULTS}/dataset"),
    log:
        f"{LOGS}/convert_recap.log",
    benchmark:
        f"{BENCH}/convert_recap.tsv"
    params:
        config=CONFIG_FILE,
        tracked=tracked("convert_recap"),
    shell:
        "python -m pisft convert_recap --config {params.config} --log {log}"
