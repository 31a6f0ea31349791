"""The checks of a config the schema accepted, each problem worded for the user: unknown keys,
list lengths, every number against the rule of its kind, the choices, and the combinations of
keys (`cross_check` gathers them all)."""

from __future__ import annotations

import difflib
import math
from dataclasses import fields, is_dataclass
from typing import Any

from pisft.config.choices import (
    AUGMENTS,
    AUTO,
    COLUMN_KEYS,
    DEVICES,
    INFERENCE_PRECISIONS,
    LIBERO_INIT_STATES,
    LIBERO_SUITES,
    LORA_TARGETS,
    PERTURBATIONS,
    PRECISIONS,
    PRESET_CHUNK_SIZES,
    PRESETS,
    RECAP_INITS,
    RTC_SCHEDULES,
    SOURCE_TYPES,
    THRESHOLD_SCOPES,
    TRAIN_COMPILE,
    TRAINABLE_MODE_TABLE,
    TRAINABLE_MODELS,
    VALUE_INITS,
    is_lora_mode,
    trainable_modes,
)
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
# Every number a user can write has a kind, and each kind one rule (`NUMBER_RULES`), applied where
# the config is validated: YAML's `.nan` and `.inf` and absurd sizes passed the schema, then failed
# deep inside a stage (a NaN learning rate blamed on the loss by the smoke gate, a 1 px image
# cropped to nothing by the augmentation). A float that is not finite is refused whatever its key,
# one added later included; `NUMBER_KINDS` gives every int and float key its kind (a test fails for
# a key without one), and what the key is, for the message.
MIN_SIDE = 16  # px: an image side below it keeps nothing of a LIBERO frame (256 px) a policy sees
MAX_SIDE = 4096  # px: frames are held whole (H x W x 3 bytes each); a larger side is a typo
MAX_LORA_RANK = 1024  # pi0.5's action expert is 1024 wide: a rank reaching a layer's width is not low-rank
MAX_FAILURE_PENALTY = 1e6  # returns are float32: beyond this a failure's reward drowns the -1 per step
SEED_LIMIT = 2**32  # numpy's seeds

NUMBER_RULES: dict[str, tuple[Any, str]] = {
    "count": (lambda v: v >= 1, "must be at least 1"),
    "count_or_zero": (lambda v: v >= 0, "must be 0 or more"),
    "two_or_more": (lambda v: v >= 2, "must be at least 2"),
    "auto_or_count": (lambda v: v >= -1, "must be >= 0, or -1 to choose automatically"),
    "seed": (lambda v: 0 <= v < SEED_LIMIT, "must be a seed in [0, 2^32)"),
    "side": (lambda v: MIN_SIDE <= v <= MAX_SIDE, f"must be an image side in [{MIN_SIDE}, {MAX_SIDE}] px"),
    "side_or_keep": (lambda v: v == 0 or MIN_SIDE <= v <= MAX_SIDE,
                     f"must be 0 (keep the input's) or an image side in [{MIN_SIDE}, {MAX_SIDE}] px"),
    "lora_rank": (lambda v: 0 <= v <= MAX_LORA_RANK,
                  f"must be 0 (the preset's own) or a rank in [1, {MAX_LORA_RANK}] (pi0.5's action expert is "
                  f"{MAX_LORA_RANK} wide: a rank reaching a layer's width is not low-rank)"),
    "positive": (lambda v: v > 0, "must be > 0"),
    "weight": (lambda v: v > 0, "must be > 0"),
    "non_negative": (lambda v: v >= 0, "must be >= 0"),
    "fraction": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "open_fraction": (lambda v: 0 < v < 1, "must be in (0, 1)"),
    "probability": (lambda v: 0 <= v <= 1, "must be a probability in [0, 1]"),
    "discount": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "penalty": (lambda v: -MAX_FAILURE_PENALTY <= v <= 0, f"must be in [-{MAX_FAILURE_PENALTY:.0f}, 0]"),
    "at_least_one": (lambda v: v >= 1, "must be >= 1"),
    "decay_or_off": (lambda v: v is None or 0 <= v < 1, "must be in [0, 1)"),
}
# key -> (kind, what it is: the start of the message, may be ""; a note after the rule, may be "").
NUMBER_KINDS: dict[str, tuple[str, str, str]] = {
    "model.init_seed": ("seed", "", ""),
    "data.demo_episodes_per_task": ("count", "", ""),
    "data.demo_episode_length": ("count", "", ""),
    "data.demo_failure_fraction": ("fraction", "", ""),
    "data.demo_image_size": ("side", "", ""),
    "data.demo_seed": ("seed", "", ""),
    "data.unconditional_prob": ("probability", "", ""),
    "data.image_size": ("side_or_keep", "", ""),
    "data.eval_fraction": ("fraction", "", "0: every episode trains and `evaluate` writes a \"not run\" result"),
    "data.split_seed": ("seed", "", ""),
    "smoke.steps": ("two_or_more", "", "the smoke run checks the loss falls"),
    "smoke.min_memory_headroom": ("fraction", "", ""),
    "train.nproc_per_node": ("count", "", ""),
    "train.nnodes": ("count", "", ""),
    "train.node_rank": ("count_or_zero", "", ""),
    "train.micro_batch_size": ("count", "", ""),
    "train.global_batch_size": ("count", "", ""),
    "train.steps": ("count", "", ""),
    "train.save_every": ("count", "", ""),
    "train.keep_last": ("count", "", ""),
    "train.seed": ("seed", "", ""),
    "train.lr": ("positive", "the peak learning rate", ""),
    "train.warmup_steps": ("count_or_zero", "", ""),
    "train.decay_lr": ("non_negative", "the learning rate the schedule decays to", ""),
    "train.weight_decay": ("non_negative", "", ""),
    "train.grad_clip": ("positive", "the gradient-norm limit", ""),
    "train.ema_decay": ("decay_or_off", "the EMA's decay", "0 or null: no EMA; openpi's pi05_libero: 0.999"),
    "train.peak_flops": ("non_negative", "", "0: the device table's figure"),
    "train.num_workers": ("auto_or_count", "data-loader processes per training process", ""),
    "train.prefetch_factor": ("count", "micro-batches each data-loader worker prepares ahead", ""),
    "train.fsdp_min_unit_params": ("auto_or_count", "the smallest FSDP unit in parameters", ""),
    "train.log_every": ("count", "", ""),
    "train.lora_rank": ("lora_rank", "", ""),
    "train.lora_alpha": ("non_negative", "", "0: the preset's own"),
    "eval.max_episodes": ("count_or_zero", "", "0: every held-out episode"),
    "eval.batch_size": ("count", "", ""),
    "eval.frame_stride": ("count", "", ""),
    "eval.seed": ("seed", "", ""),
    "eval.bootstrap_samples": ("count_or_zero", "", ""),
    "eval.trials_per_task": ("count", "", ""),
    "eval.replan_steps": ("count", "", ""),
    "eval.num_wait_steps": ("count_or_zero", "", ""),
    "eval.closed_loop_seed": ("seed", "", ""),
    "eval.seeds": ("seed", "", ""),  # each of them
    "eval.resize_size": ("side", "", ""),
    "eval.max_steps": ("count_or_zero", "", "0: openpi's limit per suite"),
    "eval.task_ids": ("count_or_zero", "", ""),
    "eval.num_envs": ("count_or_zero", "", "0: one per available core"),
    "eval.policy_batch": ("count", "the rows of every policy forward",
                          "0, every environment waiting, is gone: a forward's rows change its rounding, so they are "
                          "fixed; e.g. 2, or about eval.num_envs per policy replica; docs/libero.md"),
    "eval.rtc.delay_steps": ("count_or_zero", "the inference delay in control steps", "0: openpi's synchronous loop"),
    "eval.rtc.execution_horizon": ("count", "", "LeRobot's default: 10"),
    "eval.rtc.max_guidance_weight": ("positive", "", "LeRobot's default: 10.0"),
    "eval.policy_batch_wait_ms": ("non_negative", "", "0: measured"),
    "eval.policy_devices": ("count_or_zero", "", "0: every visible device"),
    "eval.shards": ("count", "the jobs the rollouts are scattered over", "1: one job"),
    "eval.cfg_scale": ("at_least_one", "the guidance scale", "1: the positive prompt alone"),
    "recap.iterations": ("count_or_zero", "", ""),
    "recap.task_ids": ("count_or_zero", "", ""),
    "recap.episodes_per_task": ("count", "", ""),
    "recap.max_steps": ("count_or_zero", "", "0: the suite's limit"),
    "recap.collect_seed": ("seed", "", ""),
    "recap.gamma": ("discount", "the discount", ""),
    "recap.failure_reward": ("penalty", "the reward of a failed episode's last step",
                             "RLinf: -300; returns are float32, a larger penalty drowns the -1 of each step"),
    "recap.value_bins": ("two_or_more", "", "a distribution needs at least 2 bins"),
    "recap.value_steps": ("count", "", ""),
    "recap.value_lr": ("positive", "", ""),
    "recap.value_head_lr": ("positive", "", ""),
    "recap.value_global_batch_size": ("count_or_zero", "", "0: train.global_batch_size"),
    "recap.lookahead": ("count", "the N of the N-step advantage",
                        "with 0 every frame's advantage is 0: no labelling can tell frames apart"),
    "recap.positive_quantile": ("open_fraction", "the fraction of frames labelled positive", ""),
    "recap.holdout_fraction": ("fraction", "", "0: the value model trains on the whole pool and its held-out "
                                               "figures are skipped"),
    "recap.policy_steps": ("count_or_zero", "", "0: train.steps"),
}


def number_line(key: str, value: Any, kind: str, what: str = "", note: str = "") -> str | None:
    """The problem with one number of `kind` (None: it is right): not finite, or outside its kind's rule."""
    rule, text = NUMBER_RULES[kind]
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key}: {value} is not a finite number; {what or 'it'} {text}" + (f" ({note})" if note else "")
    if rule(value):
        return None
    return f"{key}: {what + ' ' if what else ''}{text}" + (f" ({note})" if note else "") + f", got {value!r}"


def _numbers(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every number in the config (each item of a list of numbers)."""
    out: list[tuple[str, Any]] = []
    for f in fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            out += _numbers(value, key + ".")
        elif isinstance(value, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            out += [(key, v) for v in value]
        elif isinstance(value, int | float) and not isinstance(value, bool) or (value is None and key in NUMBER_KINDS):
            out.append((key, value))
    return out


def number_problems(cfg: PisftConfig) -> list[str]:
    """Every number of `cfg` against the rule of its kind (`NUMBER_KINDS`); a float with no kind
    yet is still refused when not finite."""
    problems = []
    for key, value in _numbers(cfg):
        kind, what, note = NUMBER_KINDS.get(key, ("", "", ""))
        if not kind:
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{key}: {value} is not a finite number; write a number")
            continue
        line = number_line(key, value, kind, what, note)
        if line:
            problems.append(line)
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


def _choice_problems(cfg: PisftConfig) -> list[str]:
    problems: list[str] = []
    if cfg.device not in DEVICES:
        problems.append(f"device: '{cfg.device}' is not one of {', '.join(DEVICES)}")
    if cfg.model.preset not in PRESETS:
        problems.append(f"model.preset: '{cfg.model.preset}' is not one of {', '.join(PRESETS)}")
    if cfg.train.precision not in PRECISIONS:
        problems.append(f"train.precision: '{cfg.train.precision}' is not one of {', '.join(PRECISIONS)}")
    if cfg.train.compile not in TRAIN_COMPILE:
        problems.append(f"train.compile: '{cfg.train.compile}' is not one of {', '.join(TRAIN_COMPILE)}")
    t = cfg.train
    if isinstance(t.micro_batch_size, str) and t.micro_batch_size != AUTO:
        problems.append(f"train.micro_batch_size: '{t.micro_batch_size}' must be a number of samples or auto "
                        "(the largest that fits the device, chosen by smoke_1card)")
    if isinstance(t.activation_checkpointing, str) and t.activation_checkpointing != AUTO:
        problems.append(f"train.activation_checkpointing: '{t.activation_checkpointing}' must be true, false or "
                        "auto (off where the memory allows it, chosen by smoke_1card)")
    return problems + _trainable_problems(cfg)


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
    if t.lora_targets not in LORA_TARGETS:
        problems.append(f"train.lora_targets: '{t.lora_targets}' is not one of {', '.join(LORA_TARGETS)}")
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


def _smoke_and_data_problems(cfg: PisftConfig) -> list[str]:
    problems: list[str] = []
    if cfg.data.augment not in AUGMENTS:
        problems.append(f"data.augment: '{cfg.data.augment}' is not one of {', '.join(AUGMENTS)} (none: the "
                        f"images as they are; openpi: openpi's training-time crop, rotation and colour jitter)")
    return problems + _data_problems(cfg.data)


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
    if e.precision not in INFERENCE_PRECISIONS:
        problems.append(f"eval.precision: '{e.precision}' is not one of {', '.join(INFERENCE_PRECISIONS)} (auto: bf16 "
                        "on an accelerator, the model's own on the CPU)")
    return problems + _rtc_problems(e)


def _rtc_problems(e: EvalConfig) -> list[str]:
    """eval.rtc's keys beyond their numbers' kinds (`NUMBER_KINDS`): the delay against the chunk's
    executed steps, the schedule's name."""
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
    if r.schedule not in RTC_SCHEDULES:
        problems.append(f"eval.rtc.schedule: '{r.schedule}' is not one of {', '.join(RTC_SCHEDULES)} (LeRobot's "
                        "RTCAttentionSchedule; its default: LINEAR)")
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
    chunk = PRESET_CHUNK_SIZES.get(cfg.model.preset)
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
    if r.threshold_scope not in THRESHOLD_SCOPES:
        problems.append(f"recap.threshold_scope: '{r.threshold_scope}' is not one of {', '.join(THRESHOLD_SCOPES)} "
                        "(global: one threshold over all frames, as RLinf; task: one per task, as the paper)")
    if r.init not in RECAP_INITS:
        problems.append(f"recap.init: '{r.init}' is not one of {', '.join(RECAP_INITS)}")
    if r.value_init not in VALUE_INITS:
        problems.append(f"recap.value_init: '{r.value_init}' is not one of {', '.join(VALUE_INITS)} (base: the "
                        "value model starts from the base model, as RLinf's from its pretrained backbone; "
                        "previous: from the policy of iteration k - 1)")
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
    problems = _choice_problems(cfg) + _layout_problems(cfg) + _smoke_and_data_problems(cfg)
    problems += _value_problems(cfg) + _eval_problems(cfg.eval) + _source_problems(cfg.data) + _recap_problems(cfg)
    problems += _robustness_problems(cfg.eval) + _closed_loop_problems(cfg)
    if problems:
        raise ConfigError(f"{source}: invalid configuration:\n  - " + "\n  - ".join(problems))
