if CFG.eval.closed_loop:

    rule closed_loop:
        input:
            *code_files("closed_loop"),
            f"{RESULTS}/train/model",
        output:
            metrics=f"{RESULTS}/closed_loop/metrics.json",
            report=report(
                f"{RESULTS}/closed_loop/report.md",
                caption="../report/closed_loop_report.rst",
                category="Closed-loop LIBERO",
            ),
            # one HTML page per video (the report plays no bare MP4), the MP4s beside them
            videos=report(
                directory(f"{RESULTS}/closed_loop/videos"),
                patterns=["{name}.html"],
                caption="../report/closed_loop_video.rst",
                category="Closed-loop LIBERO",
            ),
        log:
            f"{LOGS}/closed_loop.log",
        benchmark:
            f"{BENCH}/closed_loop.tsv"
        params:
            code=code("closed_loop"),
            config=CONFIG_FILE,
            tracked=tracked("closed_loop"),
        shell:
            command("closed_loop")


rule evaluate:
    input:
        *code_files("evaluate"),
        f"{RESULTS}/base_model",
        f"{RESULTS}/dataset",
        f"{RESULTS}/train/model",
        f"{RESULTS}/train/metrics.jsonl",
        *([f"{RESULTS}/closed_loop/metrics.json"] if CFG.eval.closed_loop else []),
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
        throughput_plot=report(
            f"{RESULTS}/eval/throughput.png",
            caption="../report/throughput.rst",
            category="Training",
        ),
        per_task_plot=report(
            f"{RESULTS}/eval/per_task.png",
            caption="../report/per_task.rst",
            category="Evaluation",
        ),
        per_step_plot=report(
            f"{RESULTS}/eval/per_step.png",
            caption="../report/per_step.rst",
            category="Evaluation",
        ),
        per_step=f"{RESULTS}/eval/per_step.csv",
        per_task=f"{RESULTS}/eval/per_task.csv",
        per_dim=f"{RESULTS}/eval/per_dim.csv",
        info=f"{RESULTS}/eval/eval_info.json",
    log:
        f"{LOGS}/evaluate.log",
    benchmark:
        f"{BENCH}/evaluate.tsv"
    params:
        code=code("evaluate"),
        config=CONFIG_FILE,
        tracked=tracked("evaluate"),
    shell:
        command("evaluate")
