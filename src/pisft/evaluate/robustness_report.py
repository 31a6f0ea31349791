"""The closed loop's seeds and perturbations in words: report.md's sections, and what `recap_summary`
keeps of them per RECAP iteration. Reads metrics.json's `seeds`, `seed_spread` and `robustness`
(`pisft.evaluate.robustness.summary`; docs/robustness.md) and nothing else, so the summary stage does
not depend on the rollout code."""

from __future__ import annotations

from typing import Any


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _ci(e: dict) -> str:
    low, high = e.get("success_rate_ci_low"), e.get("success_rate_ci_high")
    return "n/a" if low is None or high is None else f"[{low:.2f}, {high:.2f}]"


def report_lines(metrics: dict, *, video_prefix: str = "") -> list[str]:
    """report.md's sections on the seeds and the perturbations; none when neither key was set."""
    lines: list[str] = []
    seeds = metrics.get("seeds")
    if seeds:
        spread = metrics.get("seed_spread", {})
        lines += ["", "## Seeds", "",
                  f"The success rate above pools the unperturbed episodes of {len(seeds)} seeds "
                  f"({', '.join(seeds)}; each the environment seed and the root of the policy's noise), with the "
                  "Wilson interval of the pooled trials. Per seed: "
                  + "; ".join(f"{k}: {e['successes']} / {e['trials']} ({_pct(e['success_rate'])})"
                              for k, e in seeds.items())
                  + f". Spread over the seeds: {_pct(spread.get('min'))} – {_pct(spread.get('max'))}, standard "
                  f"deviation {_pct(spread.get('std'))}."]
    rob = metrics.get("robustness")
    if not rob:
        return lines
    u = rob["unperturbed"]
    lines += ["", "## Robustness", "",
              f"The same episodes under each perturbation (docs/robustness.md), pooled over seed(s) "
              f"{', '.join(str(s) for s in rob['seeds'])}, beside the unperturbed figure ({u['successes']} / "
              f"{u['trials']}, {_pct(u['success_rate'])}). Drop: unperturbed minus perturbed success, in points; "
              "relative drop: the drop over the unperturbed rate (— when that rate is 0).", "",
              "| suite | perturbation | success | 95% CI | successes / trials | unperturbed | drop | relative drop "
              "| per seed | video |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for entry in rob["perturbations"].values():
        per_seed = ", ".join(f"{k}: {_pct(e['success_rate'])}" for k, e in entry.get("seeds", {}).items()) or "—"
        video = f"[video]({video_prefix}{entry['video']})" if entry.get("video") else "—"
        for suite, e in entry["suites"].items():
            lines.append(f"| {suite} | {entry['label']} | {_pct(e['success_rate'])} | {_ci(e)} | "
                         f"{e['successes']} / {e['trials']} | {_pct(e['unperturbed_success_rate'])} | "
                         f"{_pct(e['drop'])} | {_pct(e['relative_drop'])} | {per_seed} | {video} |")
    return lines


def recap_entry(metrics: dict) -> dict:
    """What `recap_summary` keeps of one iteration's seeds and perturbations."""
    out: dict[str, Any] = {}
    if metrics.get("seeds"):
        out["seeds"] = {k: e["success_rate"] for k, e in metrics["seeds"].items()}
        out["seed_spread"] = metrics.get("seed_spread")
    rob = metrics.get("robustness")
    if rob:
        out["robustness"] = {key: {"label": e["label"], "success_rate": e["success_rate"],
                                   "ci_low": e["success_rate_ci_low"], "ci_high": e["success_rate_ci_high"],
                                   "drop": e["drop"], "relative_drop": e["relative_drop"]}
                             for key, e in rob["perturbations"].items()}
    return out


def recap_lines(closed_loop: dict[int, dict]) -> list[str]:
    """recap_summary's table: success under each perturbation per iteration, with the relative drop
    (`closed_loop`: each iteration k's closed-loop entry, `recap_entry`'s figures among them)."""
    keys = list(dict.fromkeys(key for e in closed_loop.values() for key in e.get("robustness", {})))
    if not keys:
        return []
    lines = ["", "## Robustness per iteration", "",
             "Success under each perturbation (the same episodes as the row above it, docs/robustness.md) and, in "
             "brackets, the relative drop from the iteration's unperturbed success: does RECAP training make the "
             "policy more or less robust?", "",
             "| perturbation | " + " | ".join(f"k = {k}" for k in closed_loop) + " |",
             "|---|" + "---:|" * len(closed_loop),
             "| unperturbed | " + " | ".join(_pct(e["success_rate"]) for e in closed_loop.values()) + " |"]
    for key in keys:
        label = next(e["robustness"][key]["label"] for e in closed_loop.values() if key in e.get("robustness", {}))
        cells = []
        for entry in closed_loop.values():
            e = entry.get("robustness", {}).get(key)
            cells.append("—" if e is None else f"{_pct(e['success_rate'])} ({_pct(e['relative_drop'])})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines
