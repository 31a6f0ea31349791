"""Benchmark of closed_loop's policy side: one request at a time, batched by arrival time, and
batched at a fixed shape (the stages' deterministic forward).

The tiny pi0.5-architecture model (random init with its zero-initialised parameters filled, as
training leaves them, so that its actions follow a forward's rows as a trained model's do:
`fill_zero_parameters`; saved with stats, loaded through `LiberoPolicy` as the stage loads it,
one CPU thread: `policy_threads`) answers 8 environment processes of a fast stand-in simulator
(`stand_in_simulator`: LIBERO's interface and image sizes, no physics, no rendering), so the
figure is the policy, the requests' trip through the pipes and the dispatch, not the simulator.
The same episodes run side by side on the same workers:
- `sequential`: one request per forward (`eval.policy_batch: 1`);
- by arrival time, a forward of whatever waits (the rule before issue 47, which `serve` keeps):
  `batched` with the batching rule's measured hold (`pisft.policy.batching`), `batched_no_hold`
  without any hold, `batched_waiting` with a hand-set 50 ms hold;
- at a fixed shape (`pisft.policy.fixed_shape.FixedShape`, what closed_loop and collect_rollouts
  run): `fixed` every forward of `num_envs` rows (`eval.policy_batch: 8`) with the measured hold,
  `fixed_waiting` the same with the 50 ms hold (other batches, the same bits), `fixed_half`
  forwards of `num_envs // 2` rows.

Where the simulation dominates (`simulation_dominates`: the stand-in sleeping `SLOW_STEP_S` a
step, about LIBERO's share of a chunk against the tiny model's forward), the default hold is
compared with no hold, and the fixed shape with both.

Reported: requests/s of each (requests over the rollouts' wall time, worker start-up excluded),
their ratios to `sequential` and `fixed_vs_batched_requests_per_s` (what determinism costs against
the arrival-time batching), `mean_policy_batch`, policy ms per forward and per request; and the
actions: every chunk is keyed by its noise seed (fixed by the episode and the chunk), and
`fixed_actions_match` says the fixed-shape runs of the same rows gave the same bits whatever their
batches, `arrival_actions_max_abs_diff` how far the arrival-time runs' chunks are from the
sequential run's (not 0: which requests shared a forward changed the bits).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import numpy as np

from pisft import rollout
from pisft.bench.stand_in_simulator import StandInSimulator
from pisft.policy.replicas import PolicyPool, policy_threads
from pisft.device import intra_op_threads
from pisft.rollout.workers import ProcessWorker

WAIT_MS = 50.0  # eval.policy_batch_wait_ms of the hand-set runs
SLOW_STEP_S = 0.04  # the stand-in's seconds a step where the simulation dominates (5 steps a chunk)
NUM_ENVS = 8


class _Recording:
    """The policy, keeping every chunk's actions by its noise seed."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.chunks: dict[int, np.ndarray] = {}

    def infer_batch(self, requests: list[dict], seeds: list[int]) -> list[dict]:
        replies = self.policy.infer_batch(requests, seeds)
        for seed, reply in zip(seeds, replies, strict=True):
            self.chunks[seed] = reply["actions"]
        return replies


def tiny_stats() -> dict[str, dict[str, np.ndarray]]:
    """Normalisation stats for the tiny model: state in [-2, 2], actions in [-1, 1] (q01/q99)."""
    return {
        "observation.state": {"q01": np.full(8, -2.0, np.float32), "q99": np.full(8, 2.0, np.float32),
                              "mean": np.zeros(8, np.float32), "std": np.ones(8, np.float32)},
        "action": {"q01": np.full(7, -1.0, np.float32), "q99": np.full(7, 1.0, np.float32),
                   "mean": np.zeros(7, np.float32), "std": np.ones(7, np.float32)},
    }


def fill_zero_parameters(policy, seed: int = 0) -> None:
    """Every parameter that is all zeros drawn from normal(0, 0.01) (`seed`), as training leaves
    them. pi0.5 starts its action expert's adaRMS projections at zero, so at initialisation the
    flow time does not reach the expert, and a forward's rounding by its number of rows, which
    enters through the time MLP (one row per request), never shows in the actions
    (`pisft.policy.fixed_shape`)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            if p.is_floating_point() and not p.any():
                p.normal_(0.0, 0.01, generator=gen)


def write_tiny_model(out: Path, *, trained_like: bool = False) -> Path:
    """The tiny model (seed 0) saved with `tiny_stats` into the new folder `out` (also the tests'
    tiny model, tests/model_fixtures.py). `trained_like`: its zero parameters filled
    (`fill_zero_parameters`), so its actions follow the rows of a forward as a trained model's do."""
    from pisft.model.policy import build_policy, save_model
    from pisft.model.tokenizer import save_tiny_tokenizer

    out.mkdir(parents=True)
    save_tiny_tokenizer(out / "tokenizer")
    policy = build_policy("tiny", seed=0)
    if trained_like:
        fill_zero_parameters(policy)
    save_model(policy, out, tokenizer_dir=out / "tokenizer", dataset_stats=tiny_stats())
    return out


def _pass(policy, workers: list, *, policy_batch: int, episodes_per_env: int, max_steps: int,
          wait_ms: float = 0.0, hold: bool = True, rows: int = 0) -> tuple[dict, dict]:
    """One run of the episodes; `rows` > 0: every forward of that many rows (`FixedShape`)."""
    from pisft.policy.fixed_shape import FixedShape

    settings = rollout.Settings(suites=("libero_10",), trials_per_task=episodes_per_env, replan_steps=5,
                                num_wait_steps=10, seed=7, resize_size=224, max_steps=max_steps,
                                task_ids=tuple(range(len(workers))), num_envs=len(workers), videos=False,
                                policy_batch=max(policy_batch, 1), policy_batch_wait_ms=wait_ms)
    specs, languages = rollout.plan_episodes(StandInSimulator(len(workers)), settings, None)
    recording = _Recording(FixedShape(policy, rows) if rows else policy)
    pool = PolicyPool([recording], max_batch=policy_batch, wait_ms=wait_ms, devices=["cpu"])
    pool.rule.adaptive = hold  # False: no measured hold (the rule before it measured)
    try:
        t0 = time.perf_counter()
        results = rollout.run_episodes(specs, pool, settings, workers=workers, languages=languages,
                                       stage="bench")
        wall = time.perf_counter() - t0
    finally:
        pool.close()
    stats = pool.stats.to_dict()
    return {
        "policy_batch_limit": policy_batch,
        "forward_rows": rows or None,
        "episodes": len(results),
        "requests": stats["policy_requests"],
        "wall_s": wall,
        "requests_per_s": stats["policy_requests"] / wall,
        "mean_policy_batch": stats["mean_policy_batch"],
        "max_policy_batch": stats["max_policy_batch"],
        "policy_ms_per_forward": stats["policy_ms_per_forward"],
        "policy_ms_per_request": stats["policy_ms_per_request"],
    }, recording.chunks


def _workers(factory, num_envs: int, name: str) -> list:
    workers = [ProcessWorker(factory, name=f"{name}-env{i}") for i in range(num_envs)]
    for w in workers:
        w.wait_ready()
    return workers


def _max_diff(runs: list[dict], reference: dict) -> float:
    return max((float(np.abs(chunks[k] - reference[k]).max()) for chunks in runs for k in reference if k in chunks),
               default=float("nan"))


def _same_bits(runs: list[dict]) -> bool:
    first = runs[0]
    return all(r.keys() == first.keys() and all(np.array_equal(r[k], first[k]) for k in first) for r in runs[1:])


def run(work: Path, *, num_envs: int = NUM_ENVS, episodes_per_env: int = 2, max_steps: int = 40,
        slow_step_s: float = SLOW_STEP_S) -> dict:
    from pisft.policy.libero import LiberoPolicy

    with intra_op_threads(policy_threads()):
        model = write_tiny_model(Path(work) / "tiny_model", trained_like=True)
        policy = LiberoPolicy.from_model_dir(model, device="cpu")
        half = max(1, num_envs // 2)
        workers: list = []
        try:
            workers = _workers(functools.partial(StandInSimulator, num_envs), num_envs, "bench")
            kw = {"episodes_per_env": episodes_per_env, "max_steps": max_steps}
            _pass(policy, workers, policy_batch=0, episodes_per_env=1, max_steps=10)  # warm-up (not reported)
            sequential, seq_chunks = _pass(policy, workers, policy_batch=1, **kw)
            no_hold, no_hold_chunks = _pass(policy, workers, policy_batch=0, hold=False, **kw)
            batched, batch_chunks = _pass(policy, workers, policy_batch=0, **kw)
            waiting, wait_chunks = _pass(policy, workers, policy_batch=0, wait_ms=WAIT_MS, **kw)
            fixed, fixed_chunks = _pass(policy, workers, policy_batch=num_envs, rows=num_envs, **kw)
            fixed_waiting, fixed_wait_chunks = _pass(policy, workers, policy_batch=num_envs, rows=num_envs,
                                                     wait_ms=WAIT_MS, **kw)
            fixed_half, _ = _pass(policy, workers, policy_batch=half, rows=half, **kw)
            for w in workers:
                w.close()
            workers = _workers(functools.partial(StandInSimulator, num_envs, slow_step_s), num_envs, "bench-slow")
            slow_no_hold, _ = _pass(policy, workers, policy_batch=0, hold=False, **kw)
            slow_default, _ = _pass(policy, workers, policy_batch=0, **kw)
            slow_fixed, slow_fixed_chunks = _pass(policy, workers, policy_batch=num_envs, rows=num_envs, **kw)
        finally:
            for w in workers:
                w.close()
    arrival = (batch_chunks, wait_chunks, no_hold_chunks)
    return {
        "model": "tiny pi0.5-architecture (random init, zero-initialised parameters filled as training leaves "
                 f"them), LiberoPolicy on the CPU, {policy_threads()} thread",
        "simulator": StandInSimulator().describe()["package"],
        "num_envs": num_envs,
        "episode_steps": max_steps,
        "sequential": sequential,
        "batched": batched,
        "batched_no_hold": no_hold,
        "batched_waiting": waiting,
        "fixed": fixed,
        "fixed_waiting": fixed_waiting,
        "fixed_half": fixed_half,
        "batched_vs_sequential_requests_per_s": batched["requests_per_s"] / sequential["requests_per_s"],
        "mean_policy_batch": batched["mean_policy_batch"],
        "batched_no_hold_vs_sequential_requests_per_s": no_hold["requests_per_s"] / sequential["requests_per_s"],
        "batched_waiting_vs_sequential_requests_per_s": waiting["requests_per_s"] / sequential["requests_per_s"],
        "fixed_vs_sequential_requests_per_s": fixed["requests_per_s"] / sequential["requests_per_s"],
        "fixed_waiting_vs_sequential_requests_per_s": fixed_waiting["requests_per_s"] / sequential["requests_per_s"],
        "fixed_half_vs_sequential_requests_per_s": fixed_half["requests_per_s"] / sequential["requests_per_s"],
        "fixed_vs_batched_requests_per_s": fixed["requests_per_s"] / batched["requests_per_s"],
        "simulation_dominates": {
            "step_s": slow_step_s, "no_hold": slow_no_hold, "default": slow_default, "fixed": slow_fixed,
            "default_vs_no_hold_requests_per_s": slow_default["requests_per_s"] / slow_no_hold["requests_per_s"],
            "fixed_vs_default_requests_per_s": slow_fixed["requests_per_s"] / slow_default["requests_per_s"],
        },
        "fixed_actions_match": _same_bits([fixed_chunks, fixed_wait_chunks, slow_fixed_chunks]),
        "arrival_actions_max_abs_diff": _max_diff(list(arrival), seq_chunks),
        "arrival_actions_match": _same_bits([seq_chunks, *arrival]),
        "targets": {"batched_vs_sequential_requests_per_s": 3.0, "mean_policy_batch": 4.0},
    }
