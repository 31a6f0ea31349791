"""Closed-loop LIBERO evaluation: roll the policy out in the simulator, count successes.

The loop is openpi's LIBERO evaluation (`examples/libero/main.py`): for every task of every
suite, `trials_per_task` episodes, each starting from the task's fixed initial state number i;
`num_wait_steps` dummy actions while objects settle; then the policy is asked for an action
chunk, the first `replan_steps` actions are executed, and it is asked again; an episode
succeeds when the environment reports `done` within the suite's step limit. An exception in
an episode ends it as a failure — and, unlike openpi, is recorded in `episodes.jsonl` and
counted per task (`errors`), so a crash does not pass as a policy failure unnoticed.

The policy is anything with `infer(request) -> {"actions": (horizon, 7)}` and `reset()`:
in-process, `pisft.serve.libero_policy.LiberoPolicy` (the same code that `python -m pisft
serve` runs), so the in-process and the served model answer the same requests the same way.

Stage output, `results/closed_loop/` (atomic): `metrics.json` (success rate overall, per suite
and per task), `episodes.jsonl` (one line per episode), `report.md`, `pisft_config.json`.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from pisft import config as config_mod
from pisft.errors import PisftError
from pisft.evaluate import libero_sim
from pisft.io import atomic_dir, write_json_atomic, write_text_atomic

log = logging.getLogger("pisft.closed_loop")

OUTPUT_DIR = "closed_loop"


class ChunkPolicy(Protocol):
    def infer(self, obs: dict) -> dict: ...

    def reset(self, seed: int | None = None) -> None: ...


@dataclass(frozen=True)
class Settings:
    suites: tuple[str, ...]
    trials_per_task: int
    replan_steps: int
    num_wait_steps: int
    seed: int
    resize_size: int

    @classmethod
    def from_config(cls, cfg: config_mod.PisftConfig) -> Settings:
        e = cfg.eval
        return cls(suites=tuple(e.libero_suites), trials_per_task=e.trials_per_task,
                   replan_steps=e.replan_steps, num_wait_steps=e.num_wait_steps,
                   seed=e.closed_loop_seed, resize_size=e.resize_size)


@dataclass
class EpisodeResult:
    suite: str
    task_id: int
    task: str
    trial: int
    success: bool
    steps: int  # policy steps executed (wait steps not counted)
    policy_calls: int
    wall_time_s: float
    error: str | None = None


def episode_seed(seed: int, suite: str, task_id: int, trial: int) -> int:
    """Seed of the policy's noise for one episode: fixed by the run seed and the episode."""
    words = [seed, task_id, trial] + [ord(c) for c in suite]
    return int(np.random.SeedSequence(words).generate_state(1)[0])


def rollout(env: libero_sim.Env, policy: ChunkPolicy, *, init_state: Any, prompt: str,
            max_steps: int, settings: Settings) -> tuple[bool, int, int]:
    """One episode: (success, policy steps executed, policy calls). Exceptions propagate."""
    env.reset()
    obs = env.set_init_state(init_state)
    for _ in range(settings.num_wait_steps):
        obs, _, _, _ = env.step(list(libero_sim.DUMMY_ACTION))
    plan: collections.deque = collections.deque()
    calls = 0
    for t in range(max_steps):
        if not plan:
            request = libero_sim.policy_request(obs, prompt, resize=settings.resize_size)
            chunk = np.asarray(policy.infer(request)["actions"])
            calls += 1
            if chunk.ndim != 2 or len(chunk) < settings.replan_steps:
                raise PisftError(
                    f"the policy returned actions of shape {chunk.shape}; replanning every "
                    f"{settings.replan_steps} steps needs at least that many (lower eval.replan_steps)")
            plan.extend(chunk[: settings.replan_steps])
        obs, _, done, _ = env.step(plan.popleft().tolist())
        if done:
            return True, t + 1, calls
    return False, max_steps, calls


def evaluate_suite(simulator: libero_sim.Simulator, policy: ChunkPolicy, suite_name: str,
                   settings: Settings, *, on_episode: Callable[[EpisodeResult], None] | None = None
                   ) -> list[EpisodeResult]:
    if suite_name not in libero_sim.SUITE_MAX_STEPS:
        raise PisftError(f"eval.libero_suites: unknown suite '{suite_name}'; one of "
                         f"{', '.join(libero_sim.SUITE_MAX_STEPS)}")
    max_steps = libero_sim.SUITE_MAX_STEPS[suite_name]
    suite = simulator.suite(suite_name)
    results: list[EpisodeResult] = []
    for task_id in range(suite.n_tasks):
        task = suite.get_task(task_id)
        init_states = suite.get_task_init_states(task_id)
        if len(init_states) < settings.trials_per_task:
            raise PisftError(
                f"{suite_name} task {task_id} has {len(init_states)} initial states, fewer than "
                f"eval.trials_per_task={settings.trials_per_task}; lower eval.trials_per_task")
        env = simulator.make_env(task, resolution=libero_sim.RENDER_RESOLUTION, seed=settings.seed)
        try:
            for trial in range(settings.trials_per_task):
                policy.reset(episode_seed(settings.seed, suite_name, task_id, trial))
                start = time.monotonic()
                error = None
                try:
                    success, steps, calls = rollout(env, policy, init_state=init_states[trial],
                                                    prompt=task.language, max_steps=max_steps,
                                                    settings=settings)
                except Exception as exc:  # noqa: BLE001 - an episode that crashed is a failure
                    success, steps, calls = False, 0, 0
                    error = f"{type(exc).__name__}: {exc}"
                    log.error("%s task %d trial %d failed with %s", suite_name, task_id, trial, error)
                result = EpisodeResult(suite=suite_name, task_id=task_id, task=task.language,
                                       trial=trial, success=success, steps=steps,
                                       policy_calls=calls, wall_time_s=time.monotonic() - start,
                                       error=error)
                results.append(result)
                if on_episode is not None:
                    on_episode(result)
        finally:
            close = getattr(env, "close", None)
            if close is not None:
                close()
    return results


def summarize(results: list[EpisodeResult]) -> dict:
    """Success per task, per suite and overall (suites in the order they were run)."""
    suites: dict[str, dict] = {}
    for r in results:
        s = suites.setdefault(r.suite, {"per_task": {}, "successes": 0, "trials": 0, "errors": 0})
        t = s["per_task"].setdefault(r.task, {"task_id": r.task_id, "successes": 0, "trials": 0,
                                              "errors": 0})
        for entry in (s, t):
            entry["successes"] += int(r.success)
            entry["trials"] += 1
            entry["errors"] += int(r.error is not None)
    for s in suites.values():
        for t in s["per_task"].values():
            t["success_rate"] = t["successes"] / t["trials"]
        s["success_rate"] = s["successes"] / s["trials"]
    total = sum(s["trials"] for s in suites.values())
    return {
        "success_rate": (sum(s["successes"] for s in suites.values()) / total) if total else None,
        # Mean of the suites' rates: how LIBERO results are usually quoted.
        "mean_suite_success_rate": (float(np.mean([s["success_rate"] for s in suites.values()]))
                                    if suites else None),
        "episodes": total,
        "errors": sum(s["errors"] for s in suites.values()),
        "suites": suites,
    }


def report_markdown(metrics: dict, settings: Settings, model_dir: str) -> str:
    lines = ["# Closed-loop LIBERO evaluation", "",
             f"Model `{model_dir}`; {settings.trials_per_task} trials per task, replanning every "
             f"{settings.replan_steps} steps, {settings.num_wait_steps} wait steps, seed {settings.seed}, "
             f"images resized to {settings.resize_size}."]
    if metrics.get("prompt"):
        lines.append(f"Prompt: {metrics['prompt']['describe']}.")
    lines += ["", "| suite | success rate | successes / trials | episodes that crashed |", "|---|---|---|---|"]
    for name, s in metrics["suites"].items():
        lines.append(f"| {name} | {s['success_rate']:.3f} | {s['successes']} / {s['trials']} | {s['errors']} |")
    lines += ["", "| suite | task | success rate | successes / trials |", "|---|---|---|---|"]
    for name, s in metrics["suites"].items():
        for task, t in s["per_task"].items():
            lines.append(f"| {name} | {task} | {t['success_rate']:.3f} | {t['successes']} / {t['trials']} |")
    return "\n".join(lines) + "\n"


def _check_config(cfg: config_mod.PisftConfig) -> None:
    if not cfg.eval.closed_loop:
        raise PisftError("closed-loop evaluation is off (eval.closed_loop: false); enable it with "
                         "--set eval.closed_loop=true on a host with the LIBERO simulator")


def run(cfg: config_mod.PisftConfig, *, simulator: libero_sim.Simulator | None = None,
        policy: ChunkPolicy | None = None) -> dict:
    """The closed_loop stage: the fine-tuned model (`results/train/model`) in LIBERO."""
    _check_config(cfg)
    settings = Settings.from_config(cfg)
    model_dir = cfg.results("train", "model")
    if simulator is None:
        simulator = libero_sim.LiberoSimulator()
    if policy is None:
        from pisft.serve.libero_policy import LiberoPolicy

        policy = LiberoPolicy.from_model_dir(model_dir, device=cfg.device, seed=settings.seed,
                                             trained_on=cfg.results("dataset"))
    start = time.monotonic()
    with atomic_dir(cfg.results(OUTPUT_DIR)) as out:
        results: list[EpisodeResult] = []
        with open(out / "episodes.jsonl", "w") as fh:
            def record(r: EpisodeResult) -> None:
                fh.write(json.dumps(asdict(r)) + "\n")
                fh.flush()
                done = len(results) + 1
                log.info("%s task %d trial %d: %s (%d steps)", r.suite, r.task_id, r.trial,
                         "success" if r.success else "failure", r.steps)
                results.append(r)
                if done % 10 == 0:
                    print(f"closed_loop: {done} episodes, {sum(x.success for x in results)} successes",
                          flush=True)

            for suite_name in settings.suites:
                evaluate_suite(simulator, policy, suite_name, settings, on_episode=record)
        metrics = summarize(results)
        metrics["settings"] = asdict(settings)
        metrics["model_dir"] = str(model_dir)
        cond = getattr(policy, "conditioning", None)  # LiberoPolicy: how the task is turned into the prompt
        if cond is not None:
            metrics["prompt"] = {**cond.to_dict(), "describe": cond.describe()}
        metrics["wall_time_s"] = time.monotonic() - start
        write_json_atomic(out / "metrics.json", metrics)
        write_text_atomic(out / "report.md", report_markdown(metrics, settings, str(model_dir)))
        config_mod.write_resolved(cfg, out / "pisft_config.json")
    print(f"closed_loop: success rate {metrics['success_rate']:.3f} over {metrics['episodes']} "
          f"episodes -> {cfg.results(OUTPUT_DIR)}/metrics.json", flush=True)
    return metrics
