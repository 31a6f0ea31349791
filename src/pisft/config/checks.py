"""The checks of a config the schema accepted, each problem worded for the user: unknown keys,
list lengths, every number against the rule of its kind, the choices, and the combinations of
keys (`cross_check` gathers them all)."""

from __future__ import annotations

import difflib
import math
from dataclasses import Field, fields, is_dataclass
from typing import Any

from pisft.config.choices import (
    AUTO,
    COLUMN_KEYS,
    LIBERO_INIT_STATES,
    LIBERO_SUITES,
    PERTURBATIONS,
    SOURCE_TYPES,
    TRAINABLE_MODE_TABLE,
    TRAINABLE_MODELS,
    is_lora_mode,
    preset_chunk_size,
    trainable_modes,
)
from pisft.config.marks import NUMBER_RULES, Number, choice_on, number_on
from pisft.config.schema import ConfigError, DataConfig, EvalConfig, PisftConfig, all_keys, flatten, nearest_key


def check_unknown_keys(raw: dict, source: str) -> None:
    known = set(all_keys())
    sections = {k.split(".")[0] for k in known if "." in k}
    for key in flatten(raw):
        if key in known:
            continue
        top = key.split(".")[0]
        if top in sections and key.count(".") == 0:
            continue
        hint = nearest_key(key)
        hint_text = f"; did you mean '{hint}'?" if hint else ""
        raise ConfigError(
            f"{source}: unknown key '{key}'{hint_text} "
            f"(every key is listed in config/README.md)"
        )


# ---------------------------------------------------------------------------------- numbers
# Each number is checked by the rule of the kind marked on its field (`pisft.config.marks`:
# `marked(..., kind=...)`, `NUMBER_RULES`); a float is refused when not finite whatever its key.


def number_line(key: str, value: Any, kind: str, what: str = "", note: str = "") -> str | None:
    """The problem with one number of `kind` (None: it is right): not finite, or outside its kind's rule."""
    rule, text = NUMBER_RULES[kind]
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key}: {value} is not a finite number; {what or 'it'} {text}" + (f" ({note})" if note else "")
    if rule(value):
        return None
    return f"{key}: {what + ' ' if what else ''}{text}" + (f" ({note})" if note else "") + f", got {value!r}"


def _marked_values(node: Any, prefix: str = "") -> list[tuple[str, Any, Field]]:
    """(dotted key, value, schema field) of every key of the config, in the schema's order."""
    out: list[tuple[str, Any, Field]] = []
    for f in fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            out += _marked_values(value, key + ".")
        else:
            out.append((key, value, f))
    return out


def _numbers(cfg: PisftConfig) -> list[tuple[str, Any, Number | None]]:
    """(dotted key, value, its kind) of every number in the config (each item of a list of numbers)."""
    out: list[tuple[str, Any, Number | None]] = []
    for key, value, f in _marked_values(cfg):
        number = number_on(f)
        if isinstance(value, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            out += [(key, v, number) for v in value]
        elif isinstance(value, int | float) and not isinstance(value, bool) or (value is None and number):
            out.append((key, value, number))
    return out


def number_problems(cfg: PisftConfig) -> list[str]:
    """Every number of `cfg` against the rule of the kind marked on its field; a float with no kind
    is still refused when not finite."""
    problems = []
    for key, value, number in _numbers(cfg):
        if number is None:
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{key}: {value} is not a finite number; write a number")
            continue
        line = number_line(key, value, number.kind, number.what, number.note)
        if line:
            problems.append(line)
    return problems


def choice_problems(cfg: PisftConfig) -> list[str]:
    """Every text of `cfg` against the choices marked on its field, in the schema's order."""
    problems = []
    for key, value, f in _marked_values(cfg):
        choice = choice_on(f)
        if choice is None or not isinstance(value, str) or value in choice.values:
            continue
        if choice.refusal:
            problems.append(f"{key}: '{value}' {choice.refusal}")
        else:
            problems.append(f"{key}: '{value}' is not one of {', '.join(choice.values)}"
                            + (f" ({choice.note})" if choice.note else ""))
    return problems


def _data_problems(d: DataConfig) -> list[str]:
    problems: list[str] = []
    tag = d.advantage_tag
    if tag and (tag != tag.strip() or "/" in tag or "\\" in tag):
        problems.append(f"data.advantage_tag: '{tag}' must be a bare tag (meta/advantages_<tag>.parquet) or "
                        "the file name advantages.parquet, without spaces around it or a path")
    for key, column in d.columns.items():
        if key not in COLUMN_KEYS:
            hint = difflib.get_close_matches(key, COLUMN_KEYS, n=1, cutoff=0.5)
            problems.append(f"data.columns: unknown key '{key}'"
                            + (f"; did you mean '{hint[0]}'?" if hint else "")
                            + f" (keys: {', '.join(COLUMN_KEYS)})")
        elif not isinstance(column, str) or not column.strip():
            problems.append(f"data.columns.{key}: must name a column (feature) of the dataset, got '{column}'")
    used = [c for k, c in d.columns.items() if k in COLUMN_KEYS]
    dup = sorted({c for c in used if used.count(c) > 1})
    if dup:
        problems.append(f"data.columns: column(s) {dup} given for more than one key; each key needs its own column")
    return problems


# Characters that the rules' shell commands would split or interpret (paths go unquoted).
_SHELL_UNSAFE = set(" \t\n\"'`$\\;&|<>()*?[]{}!#~")


def _value_problems(cfg: PisftConfig) -> list[str]:
    """Values that would only fail (or silently misbehave) after work has started."""
    t = cfg.train
    problems: list[str] = []
    if not t.decay_lr <= t.lr:
        problems.append(f"train.decay_lr: the learning rate the schedule decays to must be in "
                        f"[0, train.lr = {t.lr}], got {t.decay_lr}")
    bad = sorted({c for c in cfg.results_dir if c in _SHELL_UNSAFE})
    if not cfg.results_dir.strip() or bad:
        problems.append(f"results_dir: '{cfg.results_dir}' "
                        + (f"contains {' '.join(repr(c) for c in bad)}; " if bad else "is empty; ")
                        + "the workflow passes paths to shell commands unquoted: pick a path "
                        "without spaces or shell characters (or a symlink to it)")
    return problems


def _trainable_problems(cfg: PisftConfig) -> list[str]:
    """train.trainable, recap.value_trainable and the LoRA keys (pisft.train.trainable)."""
    t, r = cfg.train, cfg.recap
    chosen = {"policy": t.trainable, "value": r.value_trainable}
    problems: list[str] = []
    for model, key in TRAINABLE_MODELS.items():
        name = chosen[model]
        if name not in trainable_modes(model):
            entry = TRAINABLE_MODE_TABLE.get(name)
            hint = f" ({entry.other_model_hint})" if entry is not None and entry.other_model_hint else ""
            problems.append(f"{key}: '{name}' is not one of {', '.join(trainable_modes(model))}{hint}")
    uses_lora = any(is_lora_mode(name, model) for model, name in chosen.items())
    set_keys = [k for k, v, default in (("train.lora_rank", t.lora_rank, 0), ("train.lora_alpha", t.lora_alpha, 0.0),
                                         ("train.lora_targets", t.lora_targets, "openpi")) if v != default]
    if set_keys and not uses_lora:
        lora = {model: " | ".join(n for n in trainable_modes(model) if is_lora_mode(n, model))
                for model in TRAINABLE_MODELS}
        problems.append(f"{', '.join(set_keys)}: only meaningful with train.trainable: {lora['policy']} (or "
                        f"recap.value_trainable: {lora['value']}); train.trainable is '{t.trainable}' and "
                        f"recap.value_trainable '{r.value_trainable}': remove them or set a lora mode")
    if is_lora_mode(r.value_trainable, "value") and t.lora_targets == "lerobot":
        problems.append(f"recap.value_trainable: {r.value_trainable} with train.lora_targets: lerobot adapts only "
                        "the action expert and the action projections, which the value model does not have; set "
                        "train.lora_targets: openpi or rlinf")
    return problems


def _layout_problems(cfg: PisftConfig) -> list[str]:
    """Counts, nodes and the batch split of the training run."""
    t = cfg.train
    problems: list[str] = []
    if not 0 <= t.node_rank < max(t.nnodes, 1):
        problems.append(f"train.node_rank: must be in [0, train.nnodes), got {t.node_rank}")
    # train.nnodes > 1 with train.rdzv_endpoint empty: the nodes and the rendezvous come from the Slurm
    # job the launcher runs in (profiles/slurm); outside one it refuses, naming the by-hand keys
    # (pisft.train.slurm_nodes.for_training): where it will run is not known here
    if t.micro_batch_size == AUTO:
        # smoke_1card chooses among the micro batches that divide a process's share of the global
        # batch: the division below holds by construction for its choice
        if cfg.world_size >= 1 and t.global_batch_size % cfg.world_size:
            problems.append(f"train.global_batch_size: {t.global_batch_size} is not divisible by the world size "
                            f"{cfg.world_size}, so no micro batch (train.micro_batch_size: auto) splits it evenly")
        return problems
    if not isinstance(t.micro_batch_size, int):
        return problems
    per_step = t.micro_batch_size * max(cfg.world_size, 1)
    if t.micro_batch_size >= 1 and cfg.world_size >= 1 and t.global_batch_size % per_step:
        example = per_step * max(1, round(t.global_batch_size / per_step))
        problems.append(
            f"train.global_batch_size: {t.global_batch_size} is not divisible by "
            f"train.micro_batch_size × world size = {t.micro_batch_size} × {cfg.world_size} = "
            f"{per_step}; pick a multiple of {per_step} (e.g. {example})"
        )
    return problems


def _eval_problems(e: EvalConfig) -> list[str]:
    problems: list[str] = []
    for suite in e.libero_suites:
        if suite not in LIBERO_SUITES:
            problems.append(f"eval.libero_suites: unknown suite '{suite}'; one of {', '.join(LIBERO_SUITES)}")
    if not e.libero_suites:
        problems.append("eval.libero_suites: an empty list names no suite to roll out; give one or more of "
                        f"{', '.join(LIBERO_SUITES)} (eval.closed_loop: false turns the rollouts off)")
    repeated = sorted({s for s in e.libero_suites if list(e.libero_suites).count(s) > 1})
    if repeated:
        problems.append(f"eval.libero_suites: {repeated} listed more than once; each suite once (a repeat "
                        "would run the same episodes twice, narrow the interval and write one video twice)")
    n_tasks = min((LIBERO_SUITES.get(s, 90) for s in e.libero_suites), default=90)
    bad_ids = [t for t in e.task_ids if not 0 <= t < n_tasks]
    if bad_ids or len(set(e.task_ids)) != len(e.task_ids):
        problems.append(f"eval.task_ids: {list(e.task_ids)}: task ids must be distinct and in 0..{n_tasks - 1} "
                        "(the tasks of every suite in eval.libero_suites); [] evaluates every task")
    return problems + _rtc_problems(e)


def _rtc_problems(e: EvalConfig) -> list[str]:
    """eval.rtc's keys beyond their marks (a number's kind, the schedule's choices): the delay against
    the chunk's executed steps and the guidance window."""
    r = e.rtc
    problems: list[str] = []
    if r.delay_steps > e.replan_steps:
        problems.append(f"eval.rtc.delay_steps: {r.delay_steps} is more than eval.replan_steps ({e.replan_steps}): "
                        "the next chunk is asked for while the current one is still executing, so the delay "
                        "must fit in the steps executed per chunk; lower eval.rtc.delay_steps or raise "
                        "eval.replan_steps")
    if r.enabled and r.delay_steps >= r.execution_horizon:
        problems.append(f"eval.rtc.delay_steps: {r.delay_steps} is not below eval.rtc.execution_horizon "
                        f"({r.execution_horizon}): LeRobot's RTC pulls the new chunk towards the current one only "
                        "before the horizon, and the environment executes the new chunk from index delay_steps on, "
                        "so real-time chunking would change nothing executed; raise eval.rtc.execution_horizon")
    return problems


def closed_loop_seeds(e: EvalConfig) -> list[int]:
    """The closed loop's seeds, in order: eval.seeds, or [eval.closed_loop_seed] when it is empty."""
    return [int(s) for s in e.seeds] or [e.closed_loop_seed]


def perturbation_key(name: str, strength: float) -> str:
    """A perturbation's name in metrics.json and its videos' folder: `camera_10`, `lighting_-0.5`.
    Strengths equal as numbers have one key: -0.0 is `camera_0` (adding 0.0 turns -0.0 into 0.0, IEEE 754)."""
    return f"{name}_{float(strength) + 0.0:g}"


def perturbation_conditions(e: EvalConfig) -> list[tuple[str, float]]:
    """eval.perturbations as (name, strength) pairs in the order given: a bare name, or an entry whose
    strength is empty (YAML's null), gets its default; -0.0 is 0.0 (the same condition, recorded alike)."""
    out = []
    for item in e.perturbations:
        name, strength = (item, None) if isinstance(item, str) else (item["name"], item.get("strength"))
        out.append((name, float(PERTURBATIONS[name].default if strength is None else strength) + 0.0))
    return out


def perturbation_suite_problems(conditions: list[tuple[str, float]], suites: list[str] | tuple[str, ...],
                                where: str = "eval.perturbations") -> list[str]:
    """A perturbation at a strength other than 0 on a suite it does not apply to (`PerturbationRange.suites`:
    `language` on LIBERO-90, which LIBERO-Pro does not paraphrase). The config check and the closed loop
    (`pisft.evaluate.robustness`, before any rollout) both ask this."""
    problems = []
    for name, strength in dict.fromkeys((n, s) for n, s in conditions if s != 0):
        covered = PERTURBATIONS[name].suites
        outside = [suite for suite in suites if covered and suite not in covered]
        if outside:
            problems.append(f"{where}: {name} at strength {strength:g} does not apply to {', '.join(outside)}: it "
                            f"exists for {', '.join(covered)} alone (docs/robustness.md); leave {name} out, or "
                            f"evaluate eval.libero_suites without {', '.join(outside)}")
    return problems


def chunk_problems(replan_steps: int, delay_steps: int, chunk_size: int, chunk_from: str) -> list[str]:
    """The closed loop executes eval.replan_steps actions of each chunk, a chunk after an episode's first
    from index eval.rtc.delay_steps on: both must fit in the model's chunk (`chunk_from` says whose
    chunk it is). The config check (model.preset's chunk) and the closed loop (the loaded model's) both
    ask this."""
    if replan_steps + delay_steps <= chunk_size:
        return []
    return [f"eval.replan_steps ({replan_steps}) + eval.rtc.delay_steps ({delay_steps}) exceed {chunk_from} chunk of "
            f"{chunk_size} actions (a chunk after an episode's first is executed from index delay_steps on, "
            "replan_steps of it); lower one of them"]


def cpu_replicas_problem(wanted: int) -> str | None:
    """eval.policy_devices on the CPU, where the closed loop's policy is one replica (the environments
    take the cores): the config check (device: cpu) and `pisft.policy.replicas` (the device resolved) ask it."""
    if wanted <= 1:
        return None
    return (f"eval.policy_devices: {wanted} policy replicas asked for, but the policy runs on the CPU, where it "
            "is one (the environments take the cores); set eval.policy_devices: 0, or run on accelerators "
            "(device: cuda or npu)")


def _closed_loop_problems(cfg: PisftConfig) -> list[str]:
    """What the closed loop would refuse, before any rollout, that the config alone decides: the
    model's chunk against the steps executed of it (model.preset's chunk, unless the model keeps its
    source's, model.follow_source_chunk_size), the policy's replicas on the CPU (device: cpu; `auto`
    is decided on the node), LIBERO's initial states per task."""
    e = cfg.eval
    if not e.closed_loop:
        return []
    problems: list[str] = []
    chunk = preset_chunk_size(cfg.model.preset)
    if chunk is not None and not cfg.model.follow_source_chunk_size:
        problems += chunk_problems(e.replan_steps, e.rtc.delay_steps, chunk, f"model.preset {cfg.model.preset}'s")
    if cfg.device == "cpu" and cpu_replicas_problem(e.policy_devices):
        problems.append(cpu_replicas_problem(e.policy_devices))
    if e.trials_per_task > LIBERO_INIT_STATES:
        problems.append(f"eval.trials_per_task: {e.trials_per_task} episodes per task need as many initial states; "
                        f"LIBERO keeps {LIBERO_INIT_STATES} per task (openpi's protocol runs all 50): lower it")
    return problems


def _text_number_hint(value: Any) -> str:
    """For a number YAML 1.1 (Snakemake's reading, and `--set`'s) took for text, such as `1e1`: how to write it."""
    if not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if "e" not in value.lower() or not math.isfinite(number):
        return f" ({value!r} is text: write the number without quotes)"
    return (f" ({value!r} was read as text: YAML 1.1 reads an exponent as a number only with a dot and a sign, "
            f"so write {number:g} or {number:.1e})")


def _robustness_problems(e: EvalConfig) -> list[str]:
    """eval.seeds and eval.perturbations (docs/robustness.md)."""
    problems: list[str] = []
    seeds = list(e.seeds)
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        problems.append(f"eval.seeds: {seeds}: give distinct seeds >= 0 (each is an environment seed and the root of "
                        "the policy's noise seeds)")
    elif seeds and seeds[0] != e.closed_loop_seed:
        problems.append(f"eval.seeds: {seeds} starts with {seeds[0]} but eval.closed_loop_seed is "
                        f"{e.closed_loop_seed}: the first seed is the closed loop's own (the one a single-seed run "
                        f"uses; its videos are recorded at it): start eval.seeds with {e.closed_loop_seed} or set "
                        f"eval.closed_loop_seed: {seeds[0]}")
    known = ", ".join(PERTURBATIONS)
    seen: set[str] = set()
    before = len(problems)
    for i, item in enumerate(e.perturbations):
        where = f"eval.perturbations[{i}]"
        if isinstance(item, dict):
            unknown = sorted(set(item) - {"name", "strength"})
            if unknown:
                problems.append(f"{where}: unknown key(s) {unknown}; an entry is a name or {{name: NAME, strength: S}}")
                continue
            name, strength = item.get("name"), item.get("strength")
        else:
            name, strength = item, None
        if not isinstance(name, str) or name not in PERTURBATIONS:
            hint = difflib.get_close_matches(str(name), list(PERTURBATIONS), n=1, cutoff=0.5)
            problems.append(f"{where}: unknown perturbation {name!r}" + (f"; did you mean '{hint[0]}'?" if hint else "")
                            + f" (one of {known}; docs/robustness.md)")
            continue
        r = PERTURBATIONS[name]
        if strength is None:
            strength = r.default
        number = isinstance(strength, int | float) and not isinstance(strength, bool)
        if not number or not math.isfinite(strength) or not r.low <= strength <= r.high:
            problems.append(f"{where}: {name}'s strength {strength!r} is not a number in [{r.low:g}, {r.high:g}]"
                            + (f" ({r.unit})" if r.unit else "") + f"; e.g. {{name: {name}, strength: {r.default:g}}}"
                            + _text_number_hint(strength))
            continue
        if name == "language" and strength not in (0, 1):
            problems.append(f"{where}: language's strength {strength!r} must be 0 (the task's own instruction) or 1 "
                            "(LIBERO-Pro's paraphrase of it): there is one cited paraphrase per task")
            continue
        key = perturbation_key(name, float(strength))
        if key in seen:
            problems.append(f"{where}: {name} at strength {strength:g} is listed twice (strengths equal as numbers, "
                            f"0 and -0.0 too, or to six significant digits share the key {key!r} in metrics.json "
                            "and its videos); each perturbation and strength once")
        seen.add(key)
    if len(problems) == before:  # every entry well formed: where they apply
        problems += perturbation_suite_problems(perturbation_conditions(e), list(e.libero_suites))
    return problems


def _source_problems(d: DataConfig) -> list[str]:
    value = d.recap_dir
    items = value if isinstance(value, list | tuple) else [value]
    if not items:
        return ["data.recap_dir: an empty list names no dataset; give a directory or a list of "
                "{path: DIR, type: sft|rollout}"]
    problems: list[str] = []
    paths: list[str] = []
    for i, item in enumerate(items):
        where = "data.recap_dir" + (f"[{i}]" if isinstance(value, list | tuple) else "")
        if isinstance(item, dict):
            unknown = sorted(set(item) - {"path", "type", "weight"})
            if unknown:
                problems.append(f"{where}: unknown key(s) {unknown}; a source is "
                                "{path: DIR, type: sft|rollout, weight: W}")
            path, kind = item.get("path"), item.get("type", "sft")
            problems += _weight_problems(where, item.get("weight", 1.0))
        else:
            path, kind = item, "sft"
        if not isinstance(path, str) or not path.strip():
            problems.append(f"{where}: needs a dataset directory (a non-empty string), got {path!r}")
            continue
        if kind not in SOURCE_TYPES:
            problems.append(f"{where}: type '{kind}' is not one of {', '.join(SOURCE_TYPES)} "
                            "(sft: demonstrations, all positive; rollout: policy rollouts with is_success)")
        bad = sorted({c for c in path if c in _SHELL_UNSAFE})
        if bad:
            problems.append(f"{where}: '{path}' contains {' '.join(repr(c) for c in bad)}; the workflow "
                            "passes paths to shell commands unquoted")
        paths.append(path.rstrip("/"))
    dup = sorted({p for p in paths if paths.count(p) > 1})
    if dup:
        problems.append(f"data.recap_dir: {dup} listed more than once; each dataset once")
    return problems


def _weight_problems(where: str, weight: Any) -> list[str]:
    """A source's sampling weight (RLinf's `weight` of a train_data_paths entry): the `weight` kind."""
    number = isinstance(weight, int | float) and not isinstance(weight, bool)
    if number and math.isfinite(weight) and NUMBER_RULES["weight"][0](weight):
        return []
    return [f"{where}: weight {weight!r} is not a positive number; a source's weight is its relative share of "
            "the samples (default 1.0; data.balance_source_weights multiplies it by the source's frames): "
            "give a number > 0, e.g. weight: 0.5, or leave the source out of data.recap_dir"]


def _recap_problems(cfg: PisftConfig) -> list[str]:
    r, e = cfg.recap, cfg.eval
    problems: list[str] = []
    if cfg.data.unconditional_prob >= 1 and (r.iterations or cfg.data.advantage_tag):
        problems.append(f"data.unconditional_prob: {cfg.data.unconditional_prob} drops every advantage label "
                        "during training (every prompt is the plain task, the labels are never seen); "
                        "use a value below 1 (RLinf: 0.1)")
    if r.suite not in LIBERO_SUITES:
        problems.append(f"recap.suite: unknown suite '{r.suite}'; one of {', '.join(LIBERO_SUITES)}")
    n_tasks = LIBERO_SUITES.get(r.suite, 90)
    if not r.task_ids or any(not 0 <= t < n_tasks for t in r.task_ids) or len(set(r.task_ids)) != len(r.task_ids):
        problems.append(f"recap.task_ids: {list(r.task_ids)}: give distinct task ids in 0..{n_tasks - 1} "
                        f"of {r.suite}")
    # train.micro_batch_size: auto: checked against the gate's choice where the value model trains
    micro = cfg.train.micro_batch_size if isinstance(cfg.train.micro_batch_size, int) else 0
    per_step = micro * max(cfg.world_size, 1)
    if r.iterations and per_step >= 1 and cfg.value_global_batch_size % per_step:
        problems.append(f"recap.value_global_batch_size: {cfg.value_global_batch_size} is not divisible by "
                        f"train.micro_batch_size × world size = {per_step}; pick a multiple of {per_step}")
    # LIBERO keeps 50 fixed initial states per task: the evaluation takes the first
    # eval.trials_per_task, collection the next ones, so the two never share a start.
    if r.iterations and e.trials_per_task + r.episodes_per_task > LIBERO_INIT_STATES:
        problems.append(f"recap.episodes_per_task: {r.episodes_per_task} collection episodes after the "
                        f"evaluation's {e.trials_per_task} exceed the {LIBERO_INIT_STATES} initial states "
                        "LIBERO keeps per task; lower one of them")
    if r.iterations and r.collect_seed == e.closed_loop_seed:
        problems.append("recap.collect_seed: equals eval.closed_loop_seed; collection and evaluation must "
                        "draw different seeds")
    if r.iterations and not e.closed_loop:
        problems.append("recap.iterations > 0 needs eval.closed_loop: true (every iteration is evaluated "
                        "in the simulator, and rollouts are collected there)")
    return problems

# The longest list each list key takes, and why; checked before the schema reads the config (OmegaConf
# makes a node per item: 10^5 seeds took 35 s to be read, 10^6 minutes), so an absurd list is refused at
# once. Each seed and each perturbation is the whole closed-loop evaluation again (openpi's protocol:
# 2000 episodes), hence their bounds.
MAX_SEEDS = 100
MAX_PERTURBATIONS = 100
MAX_LIST_ITEMS = 1000  # a list key without a bound of its own (data.tasks, data.recap_dir)
MAX_CONFIG_BYTES = 128 << 10  # a config file's text (yaml_text), refused before it is parsed: 28x config.yaml
LIST_LIMITS: dict[str, tuple[int, str]] = {
    "eval.seeds": (MAX_SEEDS, "each seed runs the whole closed-loop evaluation again (openpi's protocol: "
                              "2000 episodes per seed)"),
    "eval.perturbations": (MAX_PERTURBATIONS, "each runs the whole closed-loop evaluation again, at every seed"),
    "eval.libero_suites": (len(LIBERO_SUITES), "each suite once"),
    "eval.task_ids": (max(LIBERO_SUITES.values()), "distinct task ids of a suite"),
    "recap.task_ids": (max(LIBERO_SUITES.values()), "distinct task ids of a suite"),
}


def check_list_lengths(raw: dict, source: str) -> None:
    """A list longer than its key takes (`LIST_LIMITS`), refused before the schema reads it."""
    for key, value in flatten(raw).items():
        if not isinstance(value, list | tuple):
            continue
        limit, why = LIST_LIMITS.get(key, (MAX_LIST_ITEMS, "no list key needs more"))
        if len(value) > limit:
            raise ConfigError(f"{source}: {key}: a list of {len(value)} items, more than the {limit} it takes "
                              f"({why}); shorten it")


def cross_check(cfg: PisftConfig, source: str) -> None:
    """Every problem of a schema-valid config at once: values, ranges, their combinations."""
    numbers = number_problems(cfg)
    if numbers:  # the ranges and combinations below assume numbers of the right kind
        raise ConfigError(f"{source}: invalid configuration:\n  - " + "\n  - ".join(numbers))
    problems = choice_problems(cfg) + _trainable_problems(cfg) + _layout_problems(cfg) + _data_problems(cfg.data)
    problems += _value_problems(cfg) + _eval_problems(cfg.eval) + _source_problems(cfg.data) + _recap_problems(cfg)
    problems += _robustness_problems(cfg.eval) + _closed_loop_problems(cfg)
    if problems:
        raise ConfigError(f"{source}: invalid configuration:\n  - " + "\n  - ".join(problems))
