"""What the smoke gate decided for the run it guards, and how training follows it.

`train.compile: auto` (pisft.gates.compile_trial), `train.micro_batch_size: auto` and
`train.activation_checkpointing: auto` (pisft.gates.micro_batch) are decided by `smoke_1card` on the
run's device: its report (`results/smoke/report.json`) holds a `decisions` section, one entry per decided key:

    "decisions": {"train.compile": {"setting": "auto", "chosen": "off", "line": "why, in one line",
                                    ...the figures behind it}}

`setting` is the key as the config has it, `chosen` what the run executes. A key set explicitly is
run as written (`chosen` equals `setting`). `train_8card`'s workers read the report and run the
chosen values (`for_training`), and so do the RECAP value model's stages, which train a smaller
model (the policy's VLM prefix with a head) on the same device after it; the launcher refused the
run before if the report is missing, failed or was made with other settings
(pisft.train.launch.check_smoke_report). The chosen compile mode is part of the run's identity
(pisft.train.run_folders.run_fingerprint, `resolved_compile`); the micro batch and checkpointing
are recorded per step range (pisft.train.step_record), and a resumed `auto` run keeps the micro
batch it started with where it fits (pisft.train.run).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from pisft import layout, logs
from pisft.config import PisftConfig
from pisft.errors import PisftError

COMPILE = "train.compile"
MICRO_BATCH = "train.micro_batch_size"
CHECKPOINTING = "train.activation_checkpointing"
AUTO = "auto"
DECISIONS = "decisions"  # the smoke report's section
# The train keys the gate decides, by their field in TrainConfig.
DECIDED = {COMPILE: "compile", MICRO_BATCH: "micro_batch_size", CHECKPOINTING: "activation_checkpointing"}


def decision(setting: Any, chosen: Any, line: str, **figures: Any) -> dict[str, Any]:
    """One entry of the report's `decisions` section (the gate writes it)."""
    return {"setting": setting, "chosen": chosen, "line": line, **figures}


def read_decisions(cfg: PisftConfig) -> dict[str, Any]:
    """The smoke report's `decisions` section (an error naming the report and the stage to rerun
    when it is missing or has none)."""
    path = layout.smoke_report(cfg)
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise PisftError(f"{path} not found: `auto` train keys are decided by the smoke gate on this node; run "
                         "smoke_1card first (python -m pisft launch smoke_1card, or let the workflow do it)") from None
    except (OSError, ValueError) as exc:
        raise PisftError(f"{path}: unreadable ({exc}); rerun smoke_1card") from None
    found = report.get(DECISIONS) if isinstance(report, dict) else None
    if not isinstance(found, dict):
        raise PisftError(f"{path} records no decisions (written before the gate decided `auto` train keys); "
                         "rerun smoke_1card")
    return found


def chosen_value(cfg: PisftConfig, key: str, decisions: dict[str, Any] | None = None) -> Any:
    """What the run executes for `key`: the config's value when set, else the gate's choice."""
    setting = getattr(cfg.train, DECIDED[key])
    if setting != AUTO:
        return setting
    entry = (decisions if decisions is not None else read_decisions(cfg)).get(key)
    if not isinstance(entry, dict) or entry.get("chosen") in (None, AUTO):
        raise PisftError(f"{layout.smoke_report(cfg)} holds no decision for {key}: rerun smoke_1card")
    return entry["chosen"]


def resolved_compile(cfg: PisftConfig) -> str:
    """train.compile as the run executes it (off | layers): the config's, or the gate's choice."""
    return str(chosen_value(cfg, COMPILE))


def with_train(cfg: PisftConfig, **values: Any) -> PisftConfig:
    """A copy of `cfg` with these train keys replaced (the iteration kept)."""
    import copy

    out = copy.copy(cfg)
    out.train = dataclasses.replace(cfg.train, **values)
    return out


def for_training(cfg: PisftConfig, log: Callable[[str], None]) -> PisftConfig:
    """`cfg` with every `auto` the gate decides replaced by the report's choice (train_8card's
    workers); a config without `auto` is returned as it is, without reading the report."""
    if all(getattr(cfg.train, field) != AUTO for field in DECIDED.values()):
        return cfg
    decisions = read_decisions(cfg)
    values = {}
    for key, field in DECIDED.items():
        if getattr(cfg.train, field) == AUTO:
            values[field] = chosen_value(cfg, key, decisions)
            # in the stage's log, not the console: the smoke gate said it there when it measured, and
            # the stage's settings line shows what runs (a run's console stays one line per stage event)
            with logs.only_in_stage_log():
                log(f"{key}: auto -> {values[field]} (smoke gate: {decisions[key].get('line')})")
    out = with_train(cfg, **values)
    if "micro_batch_size" in values:  # the gate chose among divisors: a report of another batch is refused
        per_step = out.train.micro_batch_size * out.world_size
        batches = [("train.global_batch_size", out.train.global_batch_size)]
        if out.recap.iterations:
            batches.append(("recap.value_global_batch_size", out.value_global_batch_size))
        for key, batch in batches:
            if batch % per_step:
                raise PisftError(f"{key}: {batch} is not divisible by the smoke gate's micro batch "
                                 f"{out.train.micro_batch_size} x world size {out.world_size}; rerun smoke_1card")
    return out


def resolved_for_folders(cfg: PisftConfig) -> PisftConfig:
    """`for_training`'s config where the smoke report says; `cfg` as it is where there is no report
    to read (its launch is refused then: pisft.train.launch.check_smoke_report). For finding the run
    folder outside the workers (the CLI's lock check, the launcher's advice), never for training."""
    try:
        return for_training(cfg, log=lambda _line: None)
    except PisftError:
        return cfg
