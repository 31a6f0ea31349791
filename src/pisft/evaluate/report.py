"""`results/eval/report.md`: did fine-tuning work, where, how sure are we, and how the run was made."""

from __future__ import annotations

import json
from collections.abc import Mapping

from pisft.evaluate import robustness_report
from pisft.evaluate.action_error import METRICS


def _fmt(x, digits: int = 4) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _ci(section: dict, metric: str) -> str:
    low, high = section.get(f"{metric}_ci_low"), section.get(f"{metric}_ci_high")
    if low is None or high is None:
        return ""
    return f" [{_fmt(low)}, {_fmt(high)}]"


def _every(stride: int) -> str:
    if stride == 1:
        return "every frame"
    suffix = {2: "nd", 3: "rd"}.get(stride % 10 if stride % 100 not in (11, 12, 13) else 0, "th")
    return f"every {stride}{suffix} frame (frame_index % {stride} == 0)"


def _headline(metrics: dict) -> list[str]:
    comp = metrics["comparison"]["action_mse"]
    ratio = comp.get("ratio")
    lines = []
    if ratio is None:
        lines.append("The error ratio is undefined (no valid frames or a zero base error).")
        return lines
    low, high = comp.get("ratio_ci_low"), comp.get("ratio_ci_high")
    level = int(round(100 * metrics.get("confidence_level", 0.95)))
    sure = ""
    if low is not None and high is not None:
        if high < 1.0:
            sure = f" The {level}% interval of the ratio lies below 1: fine-tuning reduced the error."
        elif low > 1.0:
            sure = f" The {level}% interval of the ratio lies above 1: fine-tuning increased the error."
        else:
            sure = f" The {level}% interval of the ratio contains 1: no clear difference."
        sure = f"; ratio {level}% CI [{_fmt(low, 3)}, {_fmt(high, 3)}])." + sure
    else:
        sure = ")."
    lines.append(
        f"Fine-tuned held-out action MSE is **{_fmt(ratio, 3)}×** the base model's "
        f"({_fmt(metrics['finetuned']['action_mse'])} vs {_fmt(metrics['base']['action_mse'])}, "
        f"raw units{sure}"
    )
    return lines


def _per_dim_table(per_dim: list[dict]) -> list[str]:
    if not per_dim:
        return []
    lines = ["### Per action dimension", "",
             "| dim | base action_mse | fine-tuned action_mse | base action_mse_norm | fine-tuned action_mse_norm |",
             "|---|---|---|---|---|"]
    for row in per_dim:
        lines.append(f"| {row['dim']} | {_fmt(row['base_action_mse'])} | {_fmt(row['finetuned_action_mse'])} | "
                     f"{_fmt(row['base_action_mse_norm'])} | {_fmt(row['finetuned_action_mse_norm'])} |")
    return lines + [""]


def _ci95(entry: dict) -> str:
    low, high = entry.get("success_rate_ci_low"), entry.get("success_rate_ci_high")
    return f"[{low:.2f}, {high:.2f}]" if low is not None and high is not None else "n/a"


def closed_loop_section(cl: dict, video_prefix: str = "../closed_loop/") -> list[str]:
    """The closed_loop stage's results (results/closed_loop/metrics.json) in the evaluation report."""
    out = ["## Closed-loop LIBERO success", ""]
    sim = cl.get("simulator") or {}
    t = cl.get("timing") or {}
    settings = cl.get("settings") or {}
    out.append(f"Simulator: {sim.get('package', 'unknown')}"
               + (f" {sim['version']}" if sim.get("version") else "")
               + (f" (robosuite {sim['robosuite']}, MuJoCo {sim['mujoco']}, MUJOCO_GL={sim.get('MUJOCO_GL')})"
                  if sim.get("robosuite") else "")
               + f"; trials per task: {settings.get('trials_per_task', '?')}, step limit "
               + (f"{settings['max_steps']} (eval.max_steps)" if settings.get("max_steps") else "openpi's per suite")
               + f"; {t.get('num_envs', '?')} environment processes.")
    out.append("")
    if cl.get("expectation"):
        out += [f"**What to expect.** {cl['expectation']}", ""]
    if cl.get("prompt"):
        out += [f"Prompt: {cl['prompt'].get('describe')}.", ""]
    if cl.get("guidance"):
        out += [f"Guidance: {cl['guidance'].get('describe')}.", ""]
    out += ["| suite | task | successes / trials | success rate | 95% CI (Wilson) | mean steps | crashed | video |",
            "|---|---|---|---|---|---|---|---|"]
    for suite, entry in cl.get("suites", {}).items():
        for t_entry in entry.get("per_task", {}).values():
            video = t_entry.get("video")
            link = f"[{video.split('/')[-1]}]({video_prefix}{video})" if video else "—"
            steps = (t_entry.get("episode_steps") or {}).get("mean")
            out.append(f"| {suite} | {t_entry.get('task_id')}: {t_entry.get('task')} | {t_entry['successes']} / "
                       f"{t_entry['trials']} | {_fmt(t_entry['success_rate'], 3)} | {_ci95(t_entry)} | "
                       f"{_fmt(steps, 4)} | {t_entry.get('errors', 0)} | {link} |")
        steps = (entry.get("episode_steps") or {}).get("mean")
        out.append(f"| **{suite}** | all | {entry['successes']} / {entry['trials']} | "
                   f"**{_fmt(entry['success_rate'], 3)}** | {_ci95(entry)} | {_fmt(steps, 4)} | "
                   f"{entry.get('errors', 0)} | |")
    out.append("")
    if t:
        out += [f"Simulator {_fmt(t.get('simulator_steps_per_s'), 3)} steps/s per environment (physics and "
                f"both camera renders; {_fmt(t.get('simulator_steps_per_s_all_envs'), 3)} steps/s over all "
                f"environments), policy {_fmt(t.get('policy_ms_per_chunk'), 3)} ms per action chunk, "
                f"rollouts {_fmt(t.get('wall_time_s'), 3)} s. Videos (first episode of each task, agent view "
                "and wrist camera): linked above, and in `snakemake --report` under \"Closed-loop LIBERO\".", ""]
    return out + robustness_report.report_lines(cl, video_prefix=video_prefix)  # eval.seeds, eval.perturbations


def build(*, metrics: dict, eval_info: dict, train_summary: dict, run_info: dict,
          plots: Mapping[str, str | None], resolved_config: dict,
          closed_loop: dict | None = None, per_dim: list[dict] | None = None) -> str:
    level = int(round(100 * metrics.get("confidence_level", 0.95)))
    out: list[str] = ["# pisft evaluation report", ""]
    out += _headline(metrics) + [""]

    out += ["## Open-loop action error on held-out episodes", ""]
    out.append(
        f"{metrics['episodes']} held-out episodes, {metrics['tasks']} tasks, {metrics['frames']} "
        f"evaluated frames ({_every(eval_info['frame_stride'])} of each episode; "
        f"chunk of {eval_info['chunk_size']} steps, padded steps past the episode end excluded). "
        f"Flow-matching noise is fixed per frame (seed {eval_info['seed']}), the same for both "
        f"models. Intervals: {level}% percentile bootstrap over episodes "
        f"({metrics.get('bootstrap_samples', 0)} resamples, seed {eval_info['seed']})."
    )
    held = eval_info.get("held_out")
    if held:
        unknown = f", {held['unknown']} of unknown outcome" if held.get("unknown") else ""
        out += ["", f"Held-out episodes: {held['successes']} successes, {held['failures']} failures{unknown} "
                f"(of {held['episodes']}). The error is measured against the recorded actions of every "
                "evaluated episode, failed rollouts included (with `data.success_only: false` they are held "
                "out and scored like demonstrations)."]
    prompts_used = eval_info.get("prompts")
    if prompts_used:
        out += ["", "Prompts: " + "; ".join(
            f"{'fine-tuned' if name == 'finetuned' else name} model: {p.get('describe')}"
            for name, p in prompts_used.items()) + "."]
    guided = eval_info.get("guidance")
    if guided:
        out += ["", "Guidance (eval.cfg_scale): " + "; ".join(
            f"{'fine-tuned' if name == 'finetuned' else name} model: {g.get('describe')}"
            for name, g in guided.items()) + "."]
    out += ["", "| metric | base | fine-tuned | fine-tuned / base |", "|---|---|---|---|"]
    for m in METRICS:
        b, f = metrics["base"], metrics["finetuned"]
        comp = metrics["comparison"][m]
        ratio = _fmt(comp.get("ratio"), 3)
        if comp.get("ratio_ci_low") is not None:
            ratio += f" [{_fmt(comp['ratio_ci_low'], 3)}, {_fmt(comp['ratio_ci_high'], 3)}]"
        out.append(f"| {m} | {_fmt(b[m])}{_ci(b, m)} | {_fmt(f[m])}{_ci(f, m)} | {ratio} |")
    out += ["", "`action_mse`/`action_l1` are in the dataset's raw action units; `_norm` in the "
            "model's quantile-normalised space ([-1, 1] between q01 and q99 of each dimension).", ""]

    out += ["### Per task", "", "| task | episodes | frames | base action_mse | fine-tuned action_mse "
            "| base action_mse_norm | fine-tuned action_mse_norm |", "|---|---|---|---|---|---|---|"]
    for task, b in metrics["base"]["per_task"].items():
        f = metrics["finetuned"]["per_task"][task]
        out.append(f"| {task} | {b['episodes']} | {b['frames']} | {_fmt(b['action_mse'])} | "
                   f"{_fmt(f['action_mse'])} | {_fmt(b['action_mse_norm'])} | {_fmt(f['action_mse_norm'])} |")
    out.append("")
    out += _per_dim_table(per_dim or [])
    for key, caption in (("per_task", "Per-task error, base vs fine-tuned"),
                         ("per_step", "Error per step of the action chunk")):
        if plots.get(key):
            out += [f"![{caption}]({plots[key]})", ""]
    out += ["Tables behind the plots: `per_step.csv`, `per_dim.csv`, `per_task.csv`.", ""]

    if closed_loop:
        out += closed_loop_section(closed_loop)
    iterations = (resolved_config.get("recap") or {}).get("iterations", 0)
    if iterations:
        out += ["## The RECAP loop", "",
                f"This is iteration 0 (the SFT run) of a RECAP loop of {iterations} iteration(s). Every "
                "iteration's closed-loop success, on these same episodes, with the rollouts, the value "
                "model's held-out fit and the advantage labels: [the RECAP report](../recap/report.md) "
                "(`results/recap/`, written by `recap_summary` after the last iteration).", ""]

    out += ["## Training", ""]
    if train_summary:
        out.append(
            f"{train_summary.get('steps')} optimizer steps logged; loss {_fmt(train_summary.get('first_loss'))} "
            f"→ {_fmt(train_summary.get('last_loss'))} (mean of the last 10%: "
            f"{_fmt(train_summary.get('final_loss_mean_last_10pct'))})."
        )
        extra = [f"{k.removeprefix('mean_').removeprefix('max_')}: {_fmt(v)}"
                 for k, v in train_summary.items() if k.startswith(("mean_", "max_"))]
        if extra:
            out.append("Per step, after the first (mean; memory: max): " + ", ".join(extra) + ".")
    else:
        out.append("No training log (`train/metrics.jsonl`) was found.")
    out.append("")
    for key, caption in (("loss", "Training loss and learning rate"),
                         ("throughput", "Throughput, step time and memory")):
        if plots.get(key):
            out += [f"![{caption}]({plots[key]})", ""]
        elif train_summary:
            out += [f"({caption}: not in the training log.)", ""]

    out += ["## How this run was made", ""]
    training = run_info.get("training", {})
    if training:
        out.append("| training | value |")
        out.append("|---|---|")
        out += [f"| {k} | {_fmt(v)} |" for k, v in training.items()]
        out.append("")
    out.append(f"Evaluation device: {eval_info.get('device')}; evaluation batch size "
               f"{eval_info.get('batch_size')}; evaluation wall time {_fmt(eval_info.get('wall_time_s'), 3)} s.")
    out.append("")
    times = run_info.get("stage_wall_time_s", {})
    if times:
        out += ["| stage | wall time (s) |", "|---|---|"]
        out += [f"| {k} | {_fmt(v, 4)} |" for k, v in times.items()]
        out.append("")
    else:
        out += ["No per-stage wall times were found (Snakemake writes them to "
                "`results/benchmarks/<rule>.tsv`).", ""]
    out += ["| package | version |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in run_info.get("versions", {}).items()]
    out += ["", f"Host: {run_info.get('host', {}).get('platform', '?')}.", ""]
    if run_info.get("smoke"):
        out += ["Smoke report: " + ", ".join(f"{k}={_fmt(v)}" for k, v in run_info["smoke"].items()), ""]
    out += ["<details><summary>Resolved configuration of this evaluation</summary>", "", "```json",
            json.dumps(resolved_config, indent=2, sort_keys=True), "```", "", "</details>", ""]
    return "\n".join(out)
