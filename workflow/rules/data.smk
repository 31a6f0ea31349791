if CFG.uses_demo_data:

    rule demo_recap:
        input:
            code_files("demo_recap"),
        output:
            directory(CFG.data.recap_dir),
        log:
            f"{LOGS}/demo_recap.log",
        benchmark:
            f"{BENCH}/demo_recap.tsv"
        params:
            code=code("demo_recap"),
            config=CONFIG_FILE,
            tracked=tracked("demo_recap"),
        shell:
            command("demo_recap")


rule convert_recap:
    input:
        *code_files("convert_recap"),
        CFG.data.recap_dir,
    output:
        directory(f"{RESULTS}/dataset"),
    log:
        f"{LOGS}/convert_recap.log",
    benchmark:
        f"{BENCH}/convert_recap.tsv"
    params:
        code=code("convert_recap"),
        config=CONFIG_FILE,
        tracked=tracked("convert_recap"),
    shell:
        command("convert_recap")
