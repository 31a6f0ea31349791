"""Deterministic episode-level train/eval split, stratified by task."""

from __future__ import annotations

import hashlib

import numpy as np


def _task_seed(task: str, seed: int) -> list[int]:
    # Stable across Python runs (str hash is salted), so the split depends on seed and task only.
    digest = hashlib.sha256(task.encode()).digest()
    return [seed, int.from_bytes(digest[:8], "little")]


def stratified_split(episode_tasks: dict[int, str], eval_fraction: float, seed: int) -> dict[str, list[int]]:
    """{"train": [...], "eval": [...]} over the episode indices of `episode_tasks` (index -> task).

    Per task with n episodes: round(eval_fraction * n) go to eval, at least 1 when n >= 2 and at
    most n - 1 (a task with a single episode keeps it for training); eval_fraction 0 holds
    none out (every episode trains). Which ones is drawn from `seed` and the task text,
    independently of the other tasks.
    """
    by_task: dict[str, list[int]] = {}
    for ep, task in sorted(episode_tasks.items()):
        by_task.setdefault(task, []).append(ep)
    train: list[int] = []
    evals: list[int] = []
    for task in sorted(by_task):
        eps = by_task[task]
        n = len(eps)
        n_eval = 0 if n < 2 or eval_fraction <= 0 else min(n - 1, max(1, int(round(eval_fraction * n))))
        order = np.random.default_rng(_task_seed(task, seed)).permutation(n)
        chosen = {eps[i] for i in order[:n_eval]}
        evals.extend(e for e in eps if e in chosen)
        train.extend(e for e in eps if e not in chosen)
    return {"train": sorted(train), "eval": sorted(evals)}
