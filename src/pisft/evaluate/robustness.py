"""The closed loop beyond one seed and LIBERO's fixed scenes: `eval.seeds` and `eval.perturbations`
(docs/robustness.md).

`plan` lists the stage's episodes after the evaluation's own (openpi's protocol at the first seed,
planned by `pisft.rollout.plan.plan_episodes` as always): the same episodes at every further seed (the
seed is an episode's environment seed and the root of its policy noise), then, for each perturbation
(`pisft.rollout.perturb`), the same episodes at every seed under it. All of them run in one
`roll_out` (the workers keep each task's environment across them), and each
episode's seeds and perturbation are fixed by the episode, so the results are the same bytes for the
same config whatever runs them; with neither key set the plan is the evaluation's alone and every
output is as it was.

`summary` pools the unperturbed episodes of every seed (the stage's headline figures, with the
Wilson interval of the pooled trials), gives each seed's success and their spread (`seeds`,
`seed_spread`), and per perturbation the success per suite beside the unperturbed figure, the drop
and the relative drop (`robustness`). The report's sections and `recap_summary`'s share of them are
`pisft.evaluate.robustness_report`'s, which reads metrics.json only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pisft import config as config_mod
from pisft.errors import PisftError
from pisft.evaluate.intervals import success_fields
from pisft.io import write_text_atomic
from pisft.rollout import libero_sim, perturb
from pisft.rollout import video as video_mod
from pisft.rollout.plan import VIDEO_DIR
from pisft.rollout.scheduler import EpisodeResult
from pisft.rollout.settings import Settings
from pisft.rollout.workers import EpisodeSpec


@dataclass(frozen=True)
class Condition:
    """What a group of episodes runs under: a seed, and a perturbation or none."""

    seed: int
    perturbation: perturb.Perturbation | None = None


@dataclass
class Plan:
    """The stage's episodes in order, each with its condition; the evaluation's own come first."""

    specs: list[EpisodeSpec]
    conditions: list[Condition]  # one per spec
    seeds: list[int]
    perturbations: list[perturb.Perturbation]
    videos: dict[int, str] = field(default_factory=dict)  # spec index -> a perturbed episode's video (relative)

    @property
    def extended(self) -> bool:
        return len(self.seeds) > 1 or bool(self.perturbations)

    def unperturbed(self, results: list[EpisodeResult]) -> list[EpisodeResult]:
        """The unperturbed episodes of every seed: the evaluation as openpi's protocol runs it."""
        return [r for r, c in zip(results, self.conditions, strict=True) if c.perturbation is None]

    def at_first_seed(self, results: list[EpisodeResult]) -> list[EpisodeResult]:
        """The evaluation's own episodes: unperturbed, at the first seed (what the plain-chunking pass of
        an RTC comparison runs again)."""
        first = Condition(self.seeds[0])
        return [r for r, c in zip(results, self.conditions, strict=True) if c == first]

    def outcomes(self, results: list[EpisodeResult]) -> list[dict]:
        """episodes.jsonl's lines: each episode's outcome, with its seed when there are several and its
        perturbation (what was applied) when it had one; one at strength 0 applied nothing and says
        which it was run under (its name and strength 0)."""
        lines = []
        for r, c, s in zip(results, self.conditions, self.specs, strict=True):
            line = r.outcome()
            if len(self.seeds) > 1:
                line["seed"] = c.seed
            if c.perturbation is not None and "perturbation" not in line:
                line["perturbation"] = {"name": c.perturbation.name, "strength": c.perturbation.strength}
            if s.index in self.videos and r.video:
                line["video"] = self.videos[s.index]
            lines.append(line)
        return lines


def plan(cfg: config_mod.PisftConfig, simulator: libero_sim.Simulator, settings: Settings, out: Path,
         specs: list[EpisodeSpec]) -> Plan:
    """`specs` (the evaluation's, at `settings.seed`, the first of eval.seeds) followed by the same episodes
    at the other seeds and under every perturbation at every seed. One video per perturbation: its first
    episode at the first seed, in `videos/<perturbation>_<strength>/`."""
    seeds = config_mod.closed_loop_seeds(cfg.eval)
    perturbations = [perturb.Perturbation(n, s) for n, s in config_mod.perturbation_conditions(cfg.eval)]
    if seeds[0] != settings.seed:  # config validation holds this; a bug otherwise
        raise PisftError(f"closed_loop: the first seed {seeds[0]} is not the evaluation's {settings.seed}")
    _check(simulator, settings, perturbations)
    out_specs, conditions = list(specs), [Condition(seeds[0])] * len(specs)
    result = Plan(out_specs, conditions, seeds, perturbations)

    def add(seed: int, p: perturb.Perturbation | None, video: bool) -> None:
        # the evaluation's episodes, of which a seed changes the environment seed alone (plan_episodes)
        for i, spec in enumerate(specs):
            index = len(out_specs)
            path = None
            if video and i == 0:
                folder = Path(out).absolute() / VIDEO_DIR / p.key
                folder.mkdir(parents=True, exist_ok=True)
                path = str(folder / f"{spec.suite}_task{spec.task_id:02d}.mp4")
                result.videos[index] = f"{VIDEO_DIR}/{p.key}/{Path(path).name}"
            out_specs.append(dataclasses.replace(spec, index=index, env_seed=seed, perturbation=p, video=path))
            conditions.append(Condition(seed, p))

    for seed in seeds[1:]:
        add(seed, None, False)
    for p in perturbations:
        for k, seed in enumerate(seeds):
            add(seed, p, settings.videos and k == 0)
    return result


def _check(simulator: libero_sim.Simulator, settings: Settings, perturbations: list[perturb.Perturbation]) -> None:
    """Refuse, before any rollout, what a perturbation cannot do here: what the config check refuses too
    (`config.perturbation_suite_problems`), then what this simulator decides."""
    problems = config_mod.perturbation_suite_problems([(p.name, p.strength) for p in perturbations], settings.suites)
    if problems:
        raise PisftError("; ".join(problems))
    for p in perturbations:
        if not p.active:
            continue
        if p.name in perturb.SCENE and not isinstance(simulator, libero_sim.LiberoSimulator):
            raise PisftError(f"eval.perturbations: {p.name} edits LIBERO's MuJoCo scene, and this simulator "
                             f"({type(simulator).__module__}.{type(simulator).__qualname__}) is not LIBERO's; "
                             "only language and obs_noise apply to it")
        if p.name == "language":
            missing = []
            for suite_name in settings.suites:
                suite = simulator.suite(suite_name)
                for task_id in settings.task_ids or range(suite.n_tasks):
                    task = suite.get_task(task_id)
                    if perturb.paraphrase(suite_name, getattr(task, "name", None)) is None:
                        missing.append(f"{suite_name} task {task_id}")
            if missing:
                raise PisftError("eval.perturbations: language: LIBERO-Pro has no paraphrase of "
                                 + ", ".join(missing[:5])
                                 + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                                 + " (it covers the 40 tasks of libero_spatial, libero_object, libero_goal and "
                                 "libero_10; docs/robustness.md): leave language out for these suites")


def write_video_pages(the_plan: Plan, results: list[EpisodeResult], out: Path, sim_info: dict) -> None:
    """A page per perturbed episode's video for `snakemake --report` (as the stage writes for its own)."""
    for r, c, s in zip(results, the_plan.conditions, the_plan.specs, strict=True):
        rel = the_plan.videos.get(s.index)
        if rel is None or not r.video or c.perturbation is None:
            continue
        write_text_atomic(out / Path(rel).with_suffix(".html"), video_mod.html_page(
            out / rel, f"{r.suite} task {r.task_id}: {r.task} ({c.perturbation.label()})",
            f"Trial {r.trial}, seed {c.seed}, under {c.perturbation.label()}: "
            f"{'success' if r.success else 'failure'} after {r.steps} steps. Agent view (left) and wrist camera "
            f"(right), as the policy sees them; {video_mod.FPS} frames per second; simulator "
            f"{sim_info.get('package')} {sim_info.get('version') or ''}."))


def _rate(results: list[EpisodeResult]) -> dict:
    successes = sum(int(r.success) for r in results)
    return {"successes": successes, "trials": len(results), **success_fields(successes, len(results))}


def _drop(perturbed: float | None, unperturbed: float | None) -> dict:
    """The drop in success (points) and relative to the unperturbed rate (None when that is 0)."""
    if perturbed is None or unperturbed is None:
        return {"drop": None, "relative_drop": None}
    return {"drop": unperturbed - perturbed,
            "relative_drop": (unperturbed - perturbed) / unperturbed if unperturbed > 0 else None}


def _spread(rates: list[float | None]) -> dict:
    values = np.asarray([r for r in rates if r is not None], dtype=np.float64)
    if not values.size:
        return {"min": None, "max": None, "range": None, "std": None}
    return {"min": float(values.min()), "max": float(values.max()), "range": float(values.max() - values.min()),
            # the sample standard deviation of the seeds' rates (ddof 1); 0 for one seed
            "std": float(values.std(ddof=1)) if values.size > 1 else 0.0}


def summary(the_plan: Plan, results: list[EpisodeResult]) -> dict:
    """metrics.json's `seeds` and `seed_spread` (several seeds) and `robustness` (perturbations); {} when
    neither key is set, so the evaluation's metrics stay as they were."""
    out: dict[str, Any] = {}
    by: dict[Condition, list[EpisodeResult]] = {}
    for r, c in zip(results, the_plan.conditions, strict=True):
        by.setdefault(c, []).append(r)
    base = {seed: by[Condition(seed)] for seed in the_plan.seeds}
    if len(the_plan.seeds) > 1:
        out["seeds"] = {str(seed): _rate(rs) for seed, rs in base.items()}
        out["seed_spread"] = _spread([e["success_rate"] for e in out["seeds"].values()])
    if not the_plan.perturbations:
        return out
    pooled = [r for rs in base.values() for r in rs]
    suites = list(dict.fromkeys(r.suite for r in pooled))
    unperturbed = {"all": _rate(pooled), **{s: _rate([r for r in pooled if r.suite == s]) for s in suites}}
    perturbations = {}
    for p in the_plan.perturbations:
        runs = {seed: by[Condition(seed, p)] for seed in the_plan.seeds}
        every = [r for rs in runs.values() for r in rs]
        entry = {"perturbation": p.name, "strength": p.strength, "unit": config_mod.PERTURBATIONS[p.name].unit,
                 "label": p.label(), **_rate(every)}
        entry.update(_drop(entry["success_rate"], unperturbed["all"]["success_rate"]))
        entry["unperturbed_success_rate"] = unperturbed["all"]["success_rate"]
        entry["suites"] = {}
        for s in suites:
            e = _rate([r for r in every if r.suite == s])
            e["unperturbed_success_rate"] = unperturbed[s]["success_rate"]
            e.update(_drop(e["success_rate"], unperturbed[s]["success_rate"]))
            entry["suites"][s] = e
        if len(the_plan.seeds) > 1:
            entry["seeds"] = {str(seed): _rate(rs) for seed, rs in runs.items()}
            entry["seed_spread"] = _spread([e["success_rate"] for e in entry["seeds"].values()])
        entry["video"] = next((the_plan.videos[s.index] for s, c, r in zip(the_plan.specs, the_plan.conditions, results,
                                                                           strict=True)
                               if c == Condition(the_plan.seeds[0], p) and s.index in the_plan.videos and r.video),
                              None)
        perturbations[p.key] = entry
    out["robustness"] = {
        "seeds": list(the_plan.seeds),
        "unperturbed": {"successes": unperturbed["all"]["successes"], "trials": unperturbed["all"]["trials"],
                        "success_rate": unperturbed["all"]["success_rate"],
                        "success_rate_ci_low": unperturbed["all"]["success_rate_ci_low"],
                        "success_rate_ci_high": unperturbed["all"]["success_rate_ci_high"],
                        "suites": {s: unperturbed[s] for s in suites}},
        "perturbations": perturbations,
        "same_episodes": "each perturbation runs the unperturbed episodes (tasks, initial states, seeds and "
                         "policy noise) with only the perturbation changed",
    }
    return out
