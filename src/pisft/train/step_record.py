"""Which optimizer steps of a run ran under which settings: the record every checkpoint
(`trainer_state.json`, `step_settings`), `train_summary.json` and the exported model's
`pisft_model.json` carry.

The settings recorded are those a run may resume across, which change how a step is computed
but not what the run is: the micro batch (the global batch split into other micro-batches: other
summation orders), activation checkpointing, the world size; and the compile mode, which the run
fingerprint holds (a run of another mode is another run folder, pisft.train.checkpoint), so it
changes only across checkpoints written before it was recorded. Each entry covers steps
`first_step`..`last_step` (1-based, inclusive). A resume under other settings than the steps before
it is said in one line (`mixed_line`), logged and recorded beside the entries.
"""

from __future__ import annotations

from typing import Any

SETTINGS = ("train.compile", "train.micro_batch_size", "train.activation_checkpointing", "world_size")


def settings(cfg: Any, world_size: int, compile_mode: str) -> dict[str, Any]:
    """This process's settings as a run records them: `compile_mode` as its blocks run (off | layers;
    the value model's always off)."""
    t = cfg.train
    return {"train.compile": compile_mode, "train.micro_batch_size": t.micro_batch_size,
            "train.activation_checkpointing": t.activation_checkpointing, "world_size": world_size}


def before(state: dict[str, Any] | None, start_step: int) -> list[dict[str, Any]]:
    """The entries of the steps before `start_step`, from the resumed checkpoint's state: its record,
    or one entry saying the steps were not recorded (a checkpoint written before the record)."""
    if not start_step:
        return []
    recorded = (state or {}).get("step_settings")
    if not isinstance(recorded, list) or not recorded:
        return [{"first_step": 1, "last_step": start_step, "recorded": False}]
    return [e for e in recorded if isinstance(e, dict) and e.get("first_step", 0) <= start_step]


def upto(previous: list[dict[str, Any]], now: dict[str, Any], start_step: int, step: int) -> list[dict[str, Any]]:
    """The record of steps 1..`step`: `previous` (steps 1..`start_step`), then this process's settings."""
    out = [dict(e) for e in previous]
    if step > start_step:
        out.append({"first_step": start_step + 1, "last_step": step, **now})
    return out


def _describe(entry: dict[str, Any]) -> str:
    if entry.get("recorded") is False:
        return "settings not recorded (a checkpoint written before the record)"
    return ", ".join(f"{k} {entry.get(k)}" for k in SETTINGS)


def mixed_line(previous: list[dict[str, Any]], now: dict[str, Any], start_step: int) -> str | None:
    """One line when the steps before `start_step` ran under other settings than `now`; else None."""
    other = [e for e in previous if e.get("recorded") is False or any(e.get(k) != now[k] for k in SETTINGS)]
    if not other:
        return None
    before_text = "; ".join(f"steps {e['first_step']}-{e['last_step']}: {_describe(e)}" for e in other)
    return (f"this run mixes settings: {before_text}; steps from {start_step + 1}: {_describe(now)} "
            "(recorded in train_summary.json and pisft_model.json, `step_settings`)")
