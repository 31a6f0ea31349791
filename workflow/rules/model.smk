rule fetch_base:
    input:
        *code_files("fetch_base"),
        support.model_source_inputs(CFG),
    output:
        directory(f"{RESULTS}/base_model"),
    log:
        f"{LOGS}/fetch_base.log",
    benchmark:
        f"{BENCH}/fetch_base.tsv"
    params:
        code=code("fetch_base"),
        config=CONFIG_FILE,
        tracked=tracked("fetch_base"),
    shell:
        command("fetch_base")
