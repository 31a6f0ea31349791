"""Closed-loop LIBERO evaluation: roll the policy out in the simulator, count successes.

The loop is openpi's LIBERO evaluation (`examples/libero/main.py`): for every task of every
suite, `trials_per_task` episodes, episode i starting from the task's fixed initial state
number i; `num_wait_steps` dummy actions while objects settle; then the policy is asked for an
action chunk, the first `replan_steps` actions are executed, and it is asked again; an episode
succeeds when the environment reports `done` within the step limit (openpi's per suite, or
`eval.max_steps`). An episode that ends in an error (an exception in the simulator, a worker
process that died, a policy that failed or answered with non-finite actions) is not a failed
trial: it is run again from its start on a fresh worker, up to `EPISODE_ATTEMPTS` in all (its
seeds fixed, so any attempt that runs to its end gives the same result), and one that errs on
every attempt fails the stage naming the episodes and their errors; a success rate counts only
episodes that ran to their end (the timing record's `retried` counts those that needed another
attempt).

**Where what runs.** Environments run in `eval.num_envs` worker processes
(`pisft.rollout.workers`; default: the cores available), each keeping the environment
of its current task and building the policy's requests itself. The policy runs in this (the
parent) process, as one replica per accelerator (`eval.policy_devices`; on the CPU one), each in
a thread of its own (`pisft.policy.replicas`): the requests of every environment waiting
at that moment go to a free replica as one forward of `eval.policy_batch` rows (padded when fewer
wait: `pisft.policy.fixed_shape`), and while it
computes, the other environments simulate and their requests queue up for the next forward; a
batch that could still grow may wait `eval.policy_batch_wait_ms` for the environments still
simulating. On this 2-core CPU a chunk is 5 simulator steps of about 0.2 CPU-s each (both
256×256 cameras rendered in software) and the tiny policy about 0.05 CPU-s per request on one
thread (`policy_threads`), so N workers keep N cores simulating; on an accelerator node a
batched pi0.5 forward serves many environments at once (docs/libero.md, "The full protocol").

**The same bytes for any `eval.num_envs`, any load and number of replicas.** Episodes are
listed in a fixed order (suite, task, trial); each gets its environment seed
(`eval.closed_loop_seed`, set before every reset, so an episode does not depend on what its
worker ran before) and, for the k-th chunk of the episode, a policy noise seed derived from
(run seed, suite, task, initial state = trial, k) (`chunk_seed`), from which its request draws
its noise whatever it is batched with. Every forward has the same rows (`eval.policy_batch`, at
most one per episode), so which worker runs an episode, which requests share a forward, which
replica computes it and in which order replies arrive change no bit; results are written in
episode order. They depend on the config (`eval.policy_batch` included), the model and the
policy's CPU thread count (`metrics.json`'s `forward`).

**Several seeds, perturbed episodes** (`eval.seeds`, `eval.perturbations`; docs/robustness.md): the
same episodes again at each further seed and under each perturbation, planned after the evaluation's
own and run in the same pass (`pisft.evaluate.robustness`); the success rate pools the unperturbed
episodes of every seed, `seeds` and `robustness` in metrics.json give the rest. Neither key set: the
outputs are what they were.

The policy is anything with `infer(request) -> {"actions": (horizon, 7)}` and
`reset(seed)`: by default `pisft.policy.libero.LiberoPolicy` (the same code that
`python -m pisft serve` runs), so the in-process and the served model answer the same
requests the same way.

The rollouts run on the rollout engine (`pisft.rollout`: settings, episode plan and seeds,
workers, the scheduler); this module is the stage: the summary, the report, the outputs.

Stage output, `results/closed_loop/` (atomic): `metrics.json` (success overall, per suite and
per task with 95% Wilson intervals, episode lengths, the simulator package and version, the
settings and the forward's rows), `episodes.jsonl` (one line per episode), `videos/` (agent
view | wrist camera MP4 of the first episode of each task), all three the same bytes every run;
`report.md`, `pisft_config.json`. How the run went (simulator steps/s, policy ms per chunk,
environments, batches, episodes run again, each episode's times) is the timing record,
`results/logs/closed_loop.timing.json` (`layout.Iteration.timing`). See docs/libero.md.

**Inference delay and real-time chunking** (`eval.rtc`, `pisft.rollout.chunking`): with
`eval.rtc.delay_steps` d > 0 the environment keeps executing the current chunk for d steps while
the next is computed, as a robot does; every run records `action_jerk` (mean |Δ²a| at chunk
boundaries). With `eval.rtc.enabled` the same episodes run twice, with plain chunking and with
real-time chunking at the same delay (same seeds, same noise): the top-level figures are the
RTC run's, `rtc_comparison` has both (success, episode length, action jerk).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pisft import config as config_mod
from pisft import layout
from pisft import logs as logs_mod
from pisft.errors import PisftError
from pisft.evaluate import robustness, robustness_report
from pisft.evaluate.intervals import success_fields
from pisft.integrity import stage_output, verify_read
from pisft.io import atomic_dir, write_json_atomic, write_text_atomic
from pisft.policy.replicas import PolicyPool, open_policy_pool, policy_record
from pisft.rollout import libero_sim
from pisft.rollout import plan as rollout_plan
from pisft.rollout import video as video_mod
from pisft.rollout.chunking import pooled_jerk
from pisft.rollout.plan import VIDEO_DIR, plan_episodes
from pisft.rollout.scheduler import (
    EpisodeResult,
    env_count,
    mujoco_note,
    progress,
    roll_out,
    simulator_info,
    timing,
)
from pisft.rollout.scheduler import stats as _stats
from pisft.rollout.settings import Settings
from pisft.stages import CLOSED_LOOP

# Its name (the stage table's row): its settings, logs and progress lines, and metrics.json's flag of whether
# it ran its episodes (eval.closed_loop), which `evaluate` and the RECAP summary read.
STAGE = CLOSED_LOOP.name

CONFIDENCE = 0.95


def _rate(entry: dict) -> None:
    """success_rate and its 95% Wilson interval as two scalars (`success_rate_ci_low/_high`,
    like the evaluate stage's `action_mse_ci_low/_high`), so `dvc metrics diff` compares them."""
    entry.update(success_fields(entry["successes"], entry["trials"], CONFIDENCE))


def summarize(results: list[EpisodeResult]) -> dict:
    """Success per task, per suite and overall (suites in the order they were run), 95% Wilson
    intervals, episode lengths. Deterministic: how the run went (times, episodes run again after
    an error) is kept apart (`timing`, the timing record).

    Only over episodes that ran to their end: a result with an error is refused (a crash is not
    a failed trial; the scheduler (`pisft.rollout.scheduler`) retries it or stops the run). `errors` stays in the output
    (0: none counted)."""
    crashed = [r for r in results if r.error is not None]
    if crashed:
        r = crashed[0]
        raise PisftError(f"{len(crashed)} episode(s) ended in an error (e.g. {r.suite} task {r.task_id} "
                         f"trial {r.trial}: {r.error}); a success rate counts only episodes that ran "
                         "to their end")
    suites: dict[str, dict] = {}
    for r in results:
        s = suites.setdefault(r.suite, {"per_task": {}, "successes": 0, "trials": 0, "errors": 0,
                                        "_steps": []})
        # keyed by task id: LIBERO-90 repeats instructions across scenes
        t = s["per_task"].setdefault(str(r.task_id), {"task_id": r.task_id, "task": r.task, "successes": 0,
                                                      "trials": 0, "errors": 0, "_steps": [],
                                                      "video": None})
        for entry in (s, t):
            entry["successes"] += int(r.success)
            entry["trials"] += 1
            entry["_steps"].append(r.steps)
        if r.video and t["video"] is None:
            t["video"] = r.video
    for s in suites.values():
        for entry in (s, *s["per_task"].values()):
            _rate(entry)
            entry["episode_steps"] = _stats(entry.pop("_steps"))
    total = sum(s["trials"] for s in suites.values())
    successes = sum(s["successes"] for s in suites.values())
    out = {"successes": successes, "trials": total}
    _rate(out)
    out.update({
        # Mean of the suites' rates: how LIBERO results are usually quoted.
        "mean_suite_success_rate": (float(np.mean([s["success_rate"] for s in suites.values()]))
                                    if suites else None),
        "episodes": total,
        "errors": 0,  # episodes that ended in an error are never counted (see above)
        "episode_steps": _stats([r.steps for r in results]),
        "successful_episode_steps": _stats([r.steps for r in results if r.success]),
        "confidence_interval": "success_rate_ci_low/_high: 95% Wilson score interval over the episodes",
        "suites": suites,
    })
    return out


def expectation(cfg: config_mod.PisftConfig, settings: Settings) -> str | None:
    """What a reader should expect of these numbers, when the run is the embedded default."""
    notes = []
    if cfg.model.source == "tiny" and layout.uses_demo_data(cfg):
        notes.append(
            f"This model is the embedded default: the tiny pi0.5-architecture model (random init), "
            f"fine-tuned for {cfg.train.steps} steps on synthetic LIBERO-like data whose images and "
            f"actions do not come from the simulator. Expect a success rate of about 0: this check "
            f"shows that the loop runs (the simulator steps and renders both cameras, requests are "
            f"built as openpi's LIBERO client builds them, the model answers, its actions are "
            f"executed), not what the model can do.")
    short = [s for s in settings.suites if settings.steps_for(s) < libero_sim.SUITE_MAX_STEPS[s]]
    if short:
        notes.append(
            f"Episodes are cut at {settings.max_steps} steps (eval.max_steps), below openpi's limit "
            f"for {', '.join(f'{s} ({libero_sim.SUITE_MAX_STEPS[s]})' for s in short)}: even a good "
            f"policy rarely finishes a task that quickly, so these rates are not comparable with "
            f"published LIBERO results (eval.max_steps: 0 restores openpi's limits).")
    return " ".join(notes) or None


def _fmt_ci(entry: dict) -> str:
    low, high = entry.get("success_rate_ci_low"), entry.get("success_rate_ci_high")
    return f"[{low:.2f}, {high:.2f}]" if low is not None and high is not None else "n/a"


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def report_markdown(metrics: dict, settings: Settings, model_dir: str, *, video_prefix: str = "",
                    run_timing: dict | None = None) -> str:
    """report.md: the metrics, and from the run's timing record its environments, retries and
    throughput."""
    sim = metrics.get("simulator", {})
    t = run_timing or {}
    sim_name = sim.get("package", "?") + (f" {sim['version']}" if sim.get("version") else "")
    lines = ["# Closed-loop LIBERO evaluation", ""]
    if metrics.get("expectation"):
        lines += [f"**What to expect.** {metrics['expectation']}", ""]
    lines += [
        f"Model `{model_dir}`; simulator {sim_name}; trials per task: {settings.trials_per_task}, "
        f"replanning every {settings.replan_steps} steps, {settings.num_wait_steps} wait steps, "
        f"environment seed {settings.seed}, images resized to {settings.resize_size}, step limit "
        + (f"{settings.max_steps} (eval.max_steps)" if settings.max_steps else "openpi's per suite")
        + f". {t.get('num_envs', '?')} environment processes.",
    ]
    if metrics.get("prompt"):
        lines.append(f"Prompt: {metrics['prompt']['describe']}.")
    if metrics.get("guidance"):
        lines.append(f"Guidance: {metrics['guidance']['describe']}.")
    lines += ["", f"Success rate {_num(metrics['success_rate'], '.3f')} "
              f"(95% Wilson {_fmt_ci(metrics)}) over {metrics['episodes']} "
              f"episodes, every one run to its end; {t.get('retried', 0)} of them ended in an "
              f"error first and were run again on a fresh worker (the timing record: `retried_errors`).", ""]
    lines += ["| suite | success rate | 95% CI | successes / trials | mean steps |",
              "|---|---|---|---|---|"]
    for name, s in metrics["suites"].items():
        lines.append(f"| {name} | {s['success_rate']:.3f} | {_fmt_ci(s)} | "
                     f"{s['successes']} / {s['trials']} | {_num(s['episode_steps']['mean'], '.1f')} |")
    lines += ["", "| suite | task | success rate | 95% CI | successes / trials | mean steps | video |",
              "|---|---|---|---|---|---|---|"]
    for name, s in metrics["suites"].items():
        for e in s["per_task"].values():
            video = f"[{Path(e['video']).name}]({video_prefix}{e['video']})" if e.get("video") else "—"
            lines.append(f"| {name} | {e['task_id']}: {e['task']} | {e['success_rate']:.3f} | "
                         f"{_fmt_ci(e)} | {e['successes']} / {e['trials']} | "
                         f"{_num(e['episode_steps']['mean'], '.1f')} | {video} |")
    lines += chunking_lines(metrics)
    if t:
        lines += ["", f"Throughput: {_num(t.get('simulator_steps_per_s'), '.2f')} simulator steps/s per "
                  f"environment (physics and both 256×256 renders), "
                  f"{_num(t.get('simulator_steps_per_s_all_envs'), '.2f')} steps/s over all environments; "
                  f"policy {_num(t.get('policy_ms_per_chunk'), '.1f')} ms per chunk "
                  + (f"(a forward: p50 {_num(t.get('policy_forward_ms_p50'), '.1f')} ms, p99 "
                     f"{_num(t.get('policy_forward_ms_p99'), '.1f')} ms) " if t.get("policy_forward_ms_p50") else "")
                  + f"({t.get('policy_calls')} chunks"
                  + (f", {_num(t.get('mean_policy_batch'), '.1f')} per forward on average over "
                     f"{t.get('policy_replicas')} replica(s): {', '.join(t.get('policy_devices') or [])}"
                     if t.get("policy_forwards") else "")
                  + f"); rollouts took {_num(t.get('wall_time_s'), '.1f')} s."]
    videos = [(name, e) for name, s in metrics["suites"].items() for e in s["per_task"].values()
              if e.get("video")]
    if videos:
        lines += ["", "## Videos", "",
                  "First episode of each task: agent view (left) and wrist camera (right), rotated as "
                  "the policy sees them, 10 frames per second.", ""]
        for name, e in videos:
            src = f"{video_prefix}{e['video']}"
            lines += [f"{name} task {e['task_id']}: {e['task']}", "",
                      f'<video src="{src}" controls width="512"></video>', ""]
    lines += robustness_report.report_lines(metrics, video_prefix=video_prefix)  # eval.seeds, eval.perturbations
    return "\n".join(lines) + "\n"


def chunking_lines(metrics: dict) -> list[str]:
    """The report's paragraph on the inference delay, real-time chunking and the jerk."""
    c = metrics.get("chunking")
    if not c:
        return []
    how = "real-time chunking (LeRobot's RTC)" if c["rtc"] else "plain chunking"
    lines = ["", f"Chunks: {how}, {c['replan_steps']} actions executed per chunk, an inference delay of "
             f"{c['delay_steps']} control steps (eval.rtc.delay_steps: the environment keeps executing the "
             f"current chunk while the next is computed). Action jerk (mean |Δ²a| at the "
             f"{c['chunk_boundaries']} chunk boundaries): {_num(c['action_jerk'], '.4g')}; elsewhere "
             f"{_num(c['action_jerk_inside'], '.4g')}."]
    comparison = metrics.get("rtc_comparison")
    if comparison:
        lines += ["", f"Real-time chunking against plain chunking at the same delay ({comparison['delay_steps']} "
                  "steps), the same episodes and noise:", "",
                  "| chunking | success rate | 95% CI | mean steps | action jerk at boundaries | elsewhere |",
                  "|---|---|---|---|---|---|"]
        for name in ("plain", "rtc"):
            side = comparison[name]
            lines.append(f"| {'RTC' if name == 'rtc' else 'plain'} | {_num(side['success_rate'], '.3f')} | "
                         f"{_fmt_ci(side)} | {_num(side['mean_episode_steps'], '.1f')} | "
                         f"{_num(side['action_jerk'], '.4g')} | {_num(side['action_jerk_inside'], '.4g')} |")
    return lines


OFF_NOTE = ("eval.closed_loop is false: closed-loop evaluation was not run (no simulator was "
            "started). Set eval.closed_loop: true to run it.")


def write_not_run(cfg: config_mod.PisftConfig) -> dict:
    """The stage with eval.closed_loop off (a DVC pipeline keeps the stage whatever the config
    says): an explicit "not run" output, never numbers; `evaluate` ignores it while the key is
    off and refuses it when the key is on (`offline.closed_loop_results`)."""
    metrics = {STAGE: False, "note": OFF_NOTE}
    with atomic_dir(layout.iteration(cfg).closed_loop) as out:
        (out / VIDEO_DIR).mkdir()
        write_json_atomic(out / layout.METRICS_FILE, metrics)
        write_text_atomic(out / "report.md", f"# Closed-loop LIBERO evaluation\n\nNot run: {OFF_NOTE}\n")
        config_mod.write_resolved(cfg, out / "pisft_config.json")
    print(f"closed_loop: not run ({OFF_NOTE})", flush=True)
    return metrics


def run(cfg: config_mod.PisftConfig, *, simulator: Callable[[], libero_sim.Simulator] | None = None,
        policy: Any = None, inline: bool = False, shard: tuple[int, int] | None = None) -> dict:
    """The closed_loop stage: the fine-tuned model (`results/train/model`) in LIBERO.

    `simulator` is a picklable factory (default `libero_sim.LiberoSimulator`): called here to
    plan the episodes (and to fail at once, with the install instructions, when LIBERO is
    missing) and in every worker. `inline` runs the environments in this process (tests).
    `shard` (i, n): only shard i of n's episodes, into its shard folder (`pisft.rollout.plan`, "Scattered rollouts");
    `merge` writes the stage's outputs from the n shards.
    """
    if not cfg.eval.closed_loop:
        return write_not_run(cfg)
    if shard is not None:
        return _run_shard(cfg, *shard, simulator=simulator, policy=policy, inline=inline)
    settings = Settings.for_evaluation(cfg, stage=STAGE)
    model_dir = layout.iteration(cfg).trained_model
    factory = simulator if simulator is not None else libero_sim.LiberoSimulator
    sim = factory()  # SimulatorUnavailable with the install line when LIBERO is not installed
    sim_info = simulator_info(sim)
    with atomic_dir(layout.iteration(cfg).closed_loop) as out:
        specs, languages = plan_episodes(sim, settings, out)
        # then the same episodes at eval.seeds' other seeds and under eval.perturbations (none by default)
        episodes = robustness.plan(cfg, sim, settings, out, specs)
        with open_policy_pool(cfg, policy, model_dir=model_dir, trained_on=layout.iteration(cfg).dataset,
                              seed=settings.seed, rows=settings.forward_rows(len(specs)),
                              wait_ms=settings.policy_batch_wait_ms, stage=STAGE, rtc=settings.rtc) as pool:
            _check_chunk(pool, settings, model_dir)
            metrics, run_timing = _evaluate(cfg, settings, pool, out, episodes, languages, factory=factory, sim=sim,
                                            sim_info=sim_info, inline=inline, model_dir=model_dir)
    write_json_atomic(layout.iteration(cfg).timing(STAGE), run_timing)
    t = run_timing
    print(f"closed_loop: success rate {metrics['success_rate']:.3f} over {metrics['episodes']} "
          f"episodes in {t['wall_time_s']:.1f} s ({_num(t['simulator_steps_per_s'], '.2f')} simulator steps/s per "
          f"environment, policy {_num(t['policy_ms_per_chunk'], '.1f')} ms per chunk) -> "
          f"{layout.iteration(cfg).closed_loop_metrics}", flush=True)
    return metrics


def _check_chunk(pool: PolicyPool, settings: Settings, model_dir: Path) -> None:
    predictor = getattr(pool.replicas[0], "predictor", None)
    problems = [] if predictor is None else config_mod.chunk_problems(
        settings.replan_steps, settings.delay_steps, predictor.chunk_size, f"the model's ({model_dir})")
    if problems:  # the config check asks the same of model.preset's chunk
        raise PisftError(problems[0])


def _plan(cfg: config_mod.PisftConfig, sim: libero_sim.Simulator, settings: Settings, out: Path):
    """The run's episodes into `out` (the evaluation's, then eval.seeds' and eval.perturbations'), the
    tasks' instructions, the plain-chunking pass's episodes (eval.rtc.enabled; else None), and the
    rows of every forward (those of the evaluation's own episodes: `Settings.forward_rows`)."""
    specs, languages = plan_episodes(sim, settings, out)
    episodes = robustness.plan(cfg, sim, settings, out, specs)
    plain_specs = plan_episodes(sim, replace(settings, rtc=None, videos=False), out)[0] if settings.rtc else None
    return episodes, languages, plain_specs, settings.forward_rows(len(specs))


def _run_shard(cfg: config_mod.PisftConfig, i: int, n: int, *, simulator, policy, inline: bool) -> dict:
    """Shard i of n (`pisft.rollout.plan`, "Scattered rollouts"): its block of the plan, with the whole
    plan's forward rows, into `layout.Iteration.shard` (results, videos); its timing record beside the logs."""
    settings = Settings.for_evaluation(cfg, stage=STAGE)
    model_dir = layout.iteration(cfg).trained_model
    factory = simulator if simulator is not None else libero_sim.LiberoSimulator
    sim = factory()
    sim_info = simulator_info(sim)
    label = f"{STAGE} {rollout_plan.shard_name(i, n)}"
    with stage_output(layout.iteration(cfg).shard(STAGE, i, n)) as out:
        episodes, languages, plain_specs, rows = _plan(cfg, sim, settings, out)
        picked = rollout_plan.pick_shard(episodes.specs, i, n)
        plain_picked = rollout_plan.pick_shard(plain_specs, i, n) if plain_specs is not None else None
        num_envs = env_count(settings, picked, stage=STAGE)
        print(f"{label}: episodes {picked[0].index}..{picked[-1].index} of {len(episodes.specs)}, {num_envs} "
              f"environment {'(inline)' if inline else 'processes'}", flush=True)
        mujoco_logs = logs_mod.mujoco_log_dir(STAGE, layout.iteration(cfg).logs)
        (out / VIDEO_DIR).mkdir(exist_ok=True)
        with open_policy_pool(cfg, policy, model_dir=model_dir, trained_on=layout.iteration(cfg).dataset,
                              seed=settings.seed, rows=rows, wait_ms=settings.policy_batch_wait_ms, stage=STAGE,
                              rtc=settings.rtc) as pool:
            _check_chunk(pool, settings, model_dir)
            passes, indices, wall = {}, {}, 0.0
            for key, chosen, how in (("plain", plain_picked, replace(settings, rtc=None, videos=False)),
                                     ("episodes", picked, settings)):
                if chosen is None:
                    continue
                passes[key], seconds = roll_out(
                    chosen, pool, how, factory=factory, simulator=sim, num_envs=num_envs, inline=inline,
                    languages=languages, name=STAGE, log_dir=mujoco_logs,
                    on_episode=progress(f"{label}{' (plain)' if key == 'plain' else ''}", len(chosen),
                                        lambda r: f"{r.suite} task {r.task_id} trial {r.trial}"))
                indices[key], wall = [s.index for s in chosen], wall + seconds
            mujoco_note(mujoco_logs, STAGE)
            run_timing = timing(passes["episodes"], wall, num_envs, pool, settings)
            rollout_plan.save_shard(
                out, stage=STAGE, i=i, n=n, total=len(episodes.specs), results=passes, indices=indices,
                record={"settings": settings.record(), "policy": policy_record(pool), "simulator": sim_info})
    write_json_atomic(layout.iteration(cfg).timing(f"{STAGE}.{rollout_plan.shard_name(i, n)}"), run_timing)
    print(f"{label}: {len(picked)} episodes in {run_timing['wall_time_s']:.1f} s -> "
          f"{layout.iteration(cfg).shard(STAGE, i, n)}", flush=True)
    return run_timing


def merge(cfg: config_mod.PisftConfig, n: int, *, simulator: Callable[[], libero_sim.Simulator] | None = None) -> dict:
    """The stage's outputs from its n shards (`run(shard=...)`): the episodes planned again, every
    result taken by its index, the videos gathered, then written as the one-job run writes them
    (`write_outputs`): the same metrics.json, episodes.jsonl, videos. The timing record sums the shards'."""
    if not cfg.eval.closed_loop:
        return write_not_run(cfg)
    settings = Settings.for_evaluation(cfg, stage=STAGE)
    model_dir = layout.iteration(cfg).trained_model
    sim = (simulator if simulator is not None else libero_sim.LiberoSimulator)()
    sim_info = simulator_info(sim)
    folders = [layout.iteration(cfg).shard(STAGE, i, n) for i in range(1, n + 1)]
    for folder in folders:
        if folder.is_dir():
            verify_read(folder, what=f"merging {STAGE}'s shards", required=True)
    with atomic_dir(layout.iteration(cfg).closed_loop) as out:
        episodes, _languages, plain_specs, _rows = _plan(cfg, sim, settings, out)
        counts = {"episodes": len(episodes.specs), **({"plain": len(plain_specs)} if plain_specs else {})}
        passes, record = rollout_plan.load_shards(folders, stage=STAGE, total=len(episodes.specs), passes=counts,
                                                 result=EpisodeResult)
        if record["settings"] != json.loads(json.dumps(settings.record())) or record["simulator"] != sim_info:
            raise PisftError(f"{STAGE}: the shards ran with other settings or another simulator than the config "
                             "now gives; run every shard again")
        (out / VIDEO_DIR).mkdir(exist_ok=True)
        for folder in folders:
            shutil.copytree(folder / VIDEO_DIR, out / VIDEO_DIR, dirs_exist_ok=True)
        timings = [json.loads(layout.iteration(cfg).timing(f"{STAGE}.{rollout_plan.shard_name(i, n)}").read_text())
                   for i in range(1, n + 1)]
        run_timing = rollout_plan.merged_timing(timings, passes["episodes"], settings, timing)
        metrics = write_outputs(cfg, settings, out, episodes, passes["episodes"], passes.get("plain"),
                                sim_info=sim_info, policy=record["policy"], run_timing=run_timing, model_dir=model_dir)
    write_json_atomic(layout.iteration(cfg).timing(STAGE), run_timing)
    print(f"closed_loop: merged {n} shards: success rate {metrics['success_rate']:.3f} over {metrics['episodes']} "
          f"episodes -> {layout.iteration(cfg).closed_loop_metrics}", flush=True)
    return metrics


def chunking_summary(results: list[EpisodeResult], settings: Settings) -> dict:
    """The delay, RTC and the jerk of a run's executed actions (pisft.rollout.chunking)."""
    jerk = pooled_jerk([r.chunking for r in results if r.chunking is not None])
    return {"delay_steps": settings.delay_steps, "replan_steps": settings.replan_steps, "rtc": settings.rtc is not None,
            **jerk}


def _side(results: list[EpisodeResult], settings: Settings) -> dict:
    """One side of `rtc_comparison`: success (Wilson interval), episode length, jerk."""
    s = summarize(results)
    return {"success_rate": s["success_rate"], "success_rate_ci_low": s["success_rate_ci_low"],
            "success_rate_ci_high": s["success_rate_ci_high"], "episodes": s["episodes"],
            "mean_episode_steps": s["episode_steps"]["mean"], **chunking_summary(results, settings)}


def _evaluate(cfg: config_mod.PisftConfig, settings: Settings, pool: PolicyPool, out: Path,
              episodes: robustness.Plan, languages: dict, *, factory: Callable[[], libero_sim.Simulator],
              sim: libero_sim.Simulator, sim_info: dict, inline: bool, model_dir: Path) -> tuple[dict, dict]:
    """The rollouts into `out`: metrics.json, episodes.jsonl, the videos (the same bytes for the
    same config, model and thread count), report.md, and the run's timing record beside the
    logs (`layout.Iteration.timing`); (the metrics, the timing record)."""
    specs = episodes.specs
    num_envs = env_count(settings, specs, stage=STAGE)
    print(f"closed_loop: {len(specs)} episodes in {sim_info.get('package')} "
          f"{sim_info.get('version') or ''}, {num_envs} environment "
          f"{'(inline)' if inline else 'processes'}", flush=True)
    record = progress(STAGE, len(specs), lambda r: f"{r.suite} task {r.task_id} trial {r.trial}")

    mujoco_logs = logs_mod.mujoco_log_dir(STAGE, layout.iteration(cfg).logs)
    (out / VIDEO_DIR).mkdir(exist_ok=True)  # the workers write into it (a declared output, also when videos are off)
    plain = None
    if settings.rtc:  # the unperturbed episodes with plain chunking at the same delay first (no videos)
        plain_settings = replace(settings, rtc=None, videos=False)
        plain_specs, _ = plan_episodes(sim, plain_settings, out)
        print(f"closed_loop: plain chunking at a delay of {settings.delay_steps} steps, for the comparison "
              "with real-time chunking", flush=True)
        plain, _ = roll_out(plain_specs, pool, plain_settings, factory=factory, simulator=sim,
                            num_envs=num_envs, inline=inline, languages=languages,
                            on_episode=progress("closed_loop (plain)", len(plain_specs), lambda r: f"plain {r.suite} "
                                                f"task {r.task_id} trial {r.trial}"),
                            name=STAGE, log_dir=mujoco_logs)
        print(f"closed_loop: real-time chunking (LeRobot's RTC) at a delay of {settings.delay_steps} steps",
              flush=True)
    all_results, wall = roll_out(specs, pool, settings, factory=factory, simulator=sim, num_envs=num_envs,
                                 inline=inline, languages=languages, on_episode=record, name=STAGE,
                                 log_dir=mujoco_logs)
    mujoco_note(mujoco_logs, STAGE)
    run_timing = timing(all_results, wall, num_envs, pool, settings)
    metrics = write_outputs(cfg, settings, out, episodes, all_results, plain, sim_info=sim_info,
                            policy=policy_record(pool), run_timing=run_timing, model_dir=model_dir)
    return metrics, run_timing


def write_outputs(cfg: config_mod.PisftConfig, settings: Settings, out: Path, episodes: robustness.Plan,
                  all_results: list[EpisodeResult], plain: list[EpisodeResult] | None, *, sim_info: dict,
                  policy: dict, run_timing: dict, model_dir: Path) -> dict:
    """What the rollouts give, in `out`: the video pages, episodes.jsonl, metrics.json (`policy`: the
    policy's record, `policy_record`), report.md, the resolved config. The one-job run and the merge
    of its shards (`merge`) both write through here: the same results, the same bytes."""
    results = episodes.unperturbed(all_results)  # every seed's: openpi's protocol (all of them by default)
    for r in results:
        if r.video:  # a page per video for `snakemake --report`, which plays no bare MP4
            write_text_atomic(out / Path(r.video).with_suffix(".html"), video_mod.html_page(
                out / r.video, f"{r.suite} task {r.task_id}: {r.task}",
                f"Trial {r.trial}: {'success' if r.success else 'failure'} after {r.steps} steps"
                f". Agent view (left) and wrist "
                f"camera (right), as the policy sees them; {video_mod.FPS} frames per second; "
                f"simulator {sim_info.get('package')} {sim_info.get('version') or ''}."))
    robustness.write_video_pages(episodes, all_results, out, sim_info)
    with open(out / "episodes.jsonl", "w") as fh:
        for line in episodes.outcomes(all_results):
            fh.write(json.dumps(line) + "\n")
    metrics = {STAGE: True, **summarize(results)}
    metrics["simulator"] = sim_info
    metrics["settings"] = settings.record()
    metrics["model_dir"] = str(model_dir)
    metrics["expectation"] = expectation(cfg, settings)
    metrics["chunking"] = chunking_summary(results, settings)
    metrics["action_jerk"] = metrics["chunking"]["action_jerk"]
    if plain is not None:  # the same episodes on both sides: the evaluation's own, at the first seed
        metrics["rtc_comparison"] = {"delay_steps": settings.delay_steps, "plain": _side(plain, settings),
                                     "rtc": _side(episodes.at_first_seed(all_results), settings)}
        metrics["rtc_comparison"]["plain"]["rtc"] = False
    metrics.update(robustness.summary(episodes, all_results))  # seeds, robustness: only with those keys set
    metrics.update(policy)
    write_json_atomic(out / layout.METRICS_FILE, metrics)
    write_text_atomic(out / "report.md", report_markdown(metrics, settings, str(model_dir), run_timing=run_timing))
    config_mod.write_resolved(cfg, out / "pisft_config.json")
    return metrics
