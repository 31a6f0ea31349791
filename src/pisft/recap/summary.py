"""`recap_summary`: one record of the RECAP loop, iteration by iteration.

Reads what each iteration's stages wrote — the closed-loop evaluation of every policy (iteration 0
is the SFT run), and at k >= 1 the collection, the value model's held-out fit and the advantage
labels — and writes `results/recap/`:

- `metrics.json`: `{"iterations": [{"k": 0, "closed_loop": {...}}, {"k": 1, "rollouts": {...},
  "value": {...}, "advantages": {...}, "closed_loop": {...}}, ...]}`; `closed_loop` holds
  `success_rate`, `ci_low`, `ci_high` (95% Wilson), `episodes`, `errors` and per task;
- `success.png`: success against k with its intervals, overall and per task;
- `report.md`: the table, the plot, the value and advantage diagnostics, and what the figures
  can and cannot say (every policy is evaluated on the same fixed episodes, so iterations are
  compared on one evaluator; a tiny run shows that the loop runs, not that it improves).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pisft import layout
from pisft.config import PisftConfig, write_resolved
from pisft.errors import PisftError
from pisft.evaluate import robustness_report
from pisft.io import write_json_atomic, write_text_atomic
from pisft.stages import ADVANTAGES, CLOSED_LOOP, COLLECT_ROLLOUTS, TRAIN_VALUE

# An iteration's entry in metrics.json holds the figures of its stages' folders, each under the
# folder's name (the stage table's rows): rollouts, value, advantages, closed_loop.
ROLLOUTS, VALUE, LABELS, CLOSED = (s.folder for s in (COLLECT_ROLLOUTS, TRAIN_VALUE, ADVANTAGES, CLOSED_LOOP))


def _read(path: Path, producer: str) -> dict:
    if not path.is_file():
        raise PisftError(f"recap_summary: {path} not found; run the `{producer}` stage first "
                         "(snakemake --cores all runs what is missing)")
    return json.loads(path.read_text())


def closed_loop_entry(metrics: dict) -> dict[str, Any]:
    """The closed-loop figures of one iteration, from its `closed_loop/metrics.json`."""
    per_task = {f"{suite}/{tid}": {"task": t["task"], "success_rate": t["success_rate"],
                                   "ci_low": t["success_rate_ci_low"], "ci_high": t["success_rate_ci_high"],
                                   "episodes": t["trials"]}
                for suite, s in metrics.get("suites", {}).items() for tid, t in s["per_task"].items()}
    return {"successes": metrics["successes"], "success_rate": metrics["success_rate"],
            "ci_low": metrics["success_rate_ci_low"],
            "ci_high": metrics["success_rate_ci_high"], "episodes": metrics["episodes"],
            "errors": metrics.get("errors", 0), "per_task": per_task,
            **robustness_report.recap_entry(metrics)}  # eval.seeds' and eval.perturbations' figures, when set


def _rollouts_entry(folder: Path) -> dict[str, Any]:
    collection = _read(folder / "collection.json", COLLECT_ROLLOUTS.name)
    episodes = collection.get("episodes", [])
    return {"episodes": len(episodes), "frames": int(sum(e.get("frames", 0) for e in episodes)),
            "successes": int(sum(bool(e.get("success")) for e in episodes))}


def _value_entry(folder: Path) -> dict[str, Any]:
    metrics = _read(folder / "metrics.json", TRAIN_VALUE.name)
    keep = ("spearman_heldout", "bin_accuracy_heldout", "loss_first", "loss_last", "steps", "frames_heldout")
    return {k: metrics[k] for k in keep if k in metrics}


def _advantages_entry(folder: Path) -> dict[str, Any]:
    """The labelling's figures, from `advantages/summary.json` (pisft.recap.advantages)."""
    summary = _read(folder / "summary.json", ADVANTAGES.name)
    return {"positive_fraction": summary["positive_fraction"], "frames": summary["frames"],
            "positive": summary["positive"], "positive_by_value": summary.get("positive_by_value"),
            "threshold_scope": summary["scope"], "thresholds": summary.get("thresholds"),
            "lookahead": summary["lookahead"], "positive_quantile": summary.get("positive_quantile"),
            "positive_fraction_per_task": {t: e["positive_fraction"] for t, e in summary.get("per_task", {}).items()},
            "positive_fraction_per_source": {k: e["positive_fraction"]
                                             for k, e in summary.get("per_source_type", {}).items()}}


def collect(cfg: PisftConfig) -> dict[str, Any]:
    """Every iteration's figures, in order."""
    iterations = []
    for k in range(cfg.recap.iterations + 1):
        at = layout.iteration(cfg, k)
        entry: dict[str, Any] = {"k": k}
        if k:
            entry[ROLLOUTS] = _rollouts_entry(at.rollouts)
            entry[VALUE] = _value_entry(at.value)
            entry[LABELS] = _advantages_entry(at.advantages)
        metrics = _read(at.closed_loop_metrics, CLOSED_LOOP.rule(k))
        if not metrics.get(CLOSED_LOOP.name, True):  # its flag: whether it ran (eval.closed_loop)
            raise PisftError("recap_summary: the closed-loop evaluation is off (eval.closed_loop: false); the "
                             "RECAP loop compares iterations by it: set eval.closed_loop: true")
        entry[CLOSED] = closed_loop_entry(metrics)
        iterations.append(entry)
    return {"iterations": iterations,
            "evaluation": {"suites": list(cfg.eval.libero_suites), "task_ids": list(cfg.eval.task_ids),
                           "trials_per_task": cfg.eval.trials_per_task, "max_steps": cfg.eval.max_steps,
                           "seed": cfg.eval.closed_loop_seed, "cfg_scale": cfg.eval.cfg_scale,
                           "same_episodes_every_iteration": True}}


def success_plot(iterations: list[dict], path: Path) -> Path:
    """Success against k with 95% Wilson intervals: overall, and each task thin."""
    from pisft.evaluate.plots import plt, save_figure

    ks = [it["k"] for it in iterations]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    tasks = sorted({t for it in iterations for t in it[CLOSED]["per_task"]})
    for task in tasks:
        rates = [it[CLOSED]["per_task"].get(task, {}).get("success_rate") for it in iterations]
        ax.plot(ks, rates, marker=".", linewidth=0.8, alpha=0.5, label=f"task {task}")
    rate = [it[CLOSED]["success_rate"] for it in iterations]
    low = [r - it[CLOSED]["ci_low"] for r, it in zip(rate, iterations, strict=True)]
    high = [it[CLOSED]["ci_high"] - r for r, it in zip(rate, iterations, strict=True)]
    ax.errorbar(ks, rate, yerr=[low, high], marker="o", linewidth=2, capsize=4, color="black",
                label="all tasks (95% Wilson)")
    ax.set_xticks(ks)
    ax.set_xlabel("RECAP iteration k (0: SFT)")
    ax.set_ylabel("closed-loop success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def render_report(summary: dict) -> str:
    its = summary["iterations"]
    ev = summary["evaluation"]
    lines = ["# The RECAP loop", "",
             f"{len(its) - 1} iteration(s) after the SFT run (k = 0). Every policy is evaluated on the same "
             f"closed-loop episodes ({', '.join(ev['suites'])}, tasks {ev['task_ids'] or 'all'}, "
             f"{ev['trials_per_task']} trial(s) per task, seed {ev['seed']}, guidance scale {ev['cfg_scale']:g}), "
             "so the iterations are compared by one evaluator.", "",
             "![success per iteration](success.png)", "",
             "| k | success | 95% interval | episodes | errors | rollouts (successes / episodes, frames) | "
             "value ρ (held out) | positive fraction |",
             "|---:|---:|---|---:|---:|---|---:|---:|"]
    for it in its:
        cl = it[CLOSED]
        ro = it.get(ROLLOUTS)
        rollouts = f"{ro['successes']} / {ro['episodes']}, {ro['frames']}" if ro else "—"
        rho = it.get(VALUE, {}).get("spearman_heldout")
        pos = it.get(LABELS, {}).get("positive_fraction")
        lines.append(f"| {it['k']} | {_pct(cl['success_rate'])} | {_pct(cl['ci_low'])} – {_pct(cl['ci_high'])} | "
                     f"{cl['episodes']} | {cl['errors']} | {rollouts} | "
                     f"{'—' if rho is None else f'{rho:.3f}'} | {_pct(pos)} |")
    lines += ["", "## Per task", "", "| task | " + " | ".join(f"k = {it['k']}" for it in its) + " |",
              "|---|" + "---:|" * len(its)]
    tasks = sorted({t for it in its for t in it[CLOSED]["per_task"]})
    for task in tasks:
        cells = [_pct(it[CLOSED]["per_task"].get(task, {}).get("success_rate")) for it in its]
        name = next(it[CLOSED]["per_task"][task]["task"] for it in its if task in it[CLOSED]["per_task"])
        lines.append(f"| {task}: {name} | " + " | ".join(cells) + " |")
    for it in its[1:]:
        lines += ["", f"## Iteration {it['k']}: value model and advantages", ""]
        lines += ["- value model: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in it[VALUE].items())]
        adv = it[LABELS]
        per_task = adv.get("positive_fraction_per_task", {})
        per_source = adv.get("positive_fraction_per_source", {})
        lines += [f"- positive fraction {_pct(adv.get('positive_fraction'))} (scope {adv.get('threshold_scope')}, "
                  f"N = {adv.get('lookahead')}); per task: "
                  + ", ".join(f"{t} {_pct(v)}" for t, v in per_task.items())
                  + "; per source: " + ", ".join(f"{s} {_pct(v)}" for s, v in per_source.items())]
        plot = (f" (calibration plot `recap/iter_{it['k']}/value/calibration.png`)"
                if it[VALUE].get("frames_heldout") else " (no held-out episodes: recap.holdout_fraction 0)")
        lines += [f"- details: `recap/iter_{it['k']}/value/metrics.json`{plot}, "
                  f"`recap/iter_{it['k']}/advantages/summary.json`"]
    # success under each perturbation per iteration (eval.perturbations)
    lines += robustness_report.recap_lines({it["k"]: it[CLOSED] for it in its})
    lines += ["", "## Reading these figures", "",
              "A success rate over a handful of episodes has a wide interval: compare iterations by their "
              "intervals, not their point values. The embedded default (the tiny model, a few rollouts, a "
              "short episode limit) shows that the loop runs end to end — collection, value model, labels, "
              "retraining, evaluation — not that RECAP improves a policy; that needs the real model and "
              "RLinf's recipe (config/profiles/, README \"The RECAP loop\").", ""]
    return "\n".join(lines)


def run(cfg: PisftConfig) -> Path:
    if not cfg.recap.iterations:
        raise PisftError("recap_summary: recap.iterations is 0; there is no RECAP loop to summarise")
    summary = collect(cfg)
    out = layout.recap_summary(cfg)  # beside the iterations' folders: written file by file, each atomically
    out.mkdir(parents=True, exist_ok=True)
    plot = out / "success.png"
    success_plot(summary["iterations"], plot.with_name(".success.png.tmp.png")).replace(plot)
    write_json_atomic(layout.recap_metrics(cfg), summary)
    write_resolved(cfg, out / "pisft_config.json")
    write_text_atomic(out / "report.md", render_report(summary))
    rates = ", ".join(f"k={it['k']} {_pct(it[CLOSED]['success_rate'])}" for it in summary["iterations"])
    print(f"recap_summary: closed-loop success {rates} -> {out}/report.md", flush=True)
    return out
