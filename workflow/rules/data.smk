# The synthetic demo is always a stage (a few seconds, a few MB), read only when data.recap_dir
# is its folder: the DAG then has one shape whatever data.recap_dir names, so dvc.yaml follows a
# changed data path through its templates alone (docs/workflow.md, "Profiles").


rule demo_recap:
    input:
        code_files("demo_recap"),
    output:
        directory(f"{RESULTS}/demo_recap"),
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
        *SOURCES,
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
