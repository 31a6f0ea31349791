"""What a key does and what it may be, written on its field (`marked`): its roles, from which every
list of keys by role is read (`pisft.config.schema.keys_marked`, `fingerprint_keys`); a number's
kind (`NUMBER_RULES`: its range) and a text's choices, which the checks read
(`pisft.config.checks.number_problems`, `choice_problems`). A key added with its marks is
validated with no other edit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import Field, dataclass, field
from typing import Any

# ------------------------------------------------------------------------ what a key does: its marks
# A key's roles are marks on its field (`marked`), and every list of keys by role is read off them
# (`keys_marked`, `fingerprint_keys`): the keys each stage reads in the stage table
# (pisft.stages: a change reruns the stage under both drivers), the settings of a training run's
# fingerprint (pisft.train.checkpoint, pisft.train.run_folders), the keys a smoke report must share
# with the training it admits (pisft.train.launch), the options of a conversion (pisft.data.convert_options).
# A role that reruns stages is named for what they do, never for a stage.
DEMO = "demo data"  # demo_recap writes the synthetic demo dataset with them
CONVERSION = "conversion"  # convert_recap (at iteration k also recap.holdout_fraction, its row)
TRAIN_STEP = "training step"  # what a step does, not how long the run is: the smoke gate measures it
OFFLINE_EVAL = "offline evaluation"  # evaluate
CLOSED_LOOP = "closed loop"  # closed_loop
COLLECTION = "collection"  # collect_rollouts (RECAP iteration k >= 1)
VALUE = "value model"  # smoke_value and train_value
ADVANTAGE = "advantage labels"  # the advantages stage
RETRAINING = "retraining"  # what train_8card also reads at iteration k >= 1
# The run fingerprints (a checkpoint resumes only a run with the same settings): the policy's
# (train_8card) and the value model's (train_value). A section marked enters whole, its keys marked
# INPUT excepted: a key added there is covered by default.
POLICY_RUN = "policy run fingerprint"
VALUE_RUN = "value run fingerprint"
# The input data: the key names it (its content is hashed where it matters) or makes it (the demo
# generator): in no fingerprint, no option of a conversion.
INPUT = "input data"
# The model the smoke gate measured: a training admitted by its report has the same (the drivers
# follow the model through base_model; a training launched by hand checks the report).
SMOKE_MEASURED = "measured by the smoke gate"
# The pipeline's shape: which stages and inputs dvc.yaml has (pisft.workflow.dvc_yaml.shape reads each
# key marked so; a change runs config_check, which regenerates dvc.yaml when the shape moved).
DAG_SHAPE = "pipeline shape"
ROLES = (DEMO, CONVERSION, TRAIN_STEP, OFFLINE_EVAL, CLOSED_LOOP, COLLECTION, VALUE, ADVANTAGE, RETRAINING,
         POLICY_RUN, VALUE_RUN, INPUT, SMOKE_MEASURED, DAG_SHAPE)
_ROLES_FIELD = "pisft_roles"  # the field metadata that holds a key's roles
_NUMBER_FIELD = "pisft_number"  # ... a number's kind (`Number`)
_CHOICE_FIELD = "pisft_choice"  # ... a text's choices (`Choice`)


# ----------------------------------------------------------------- what a key may be: its kind
# Every number a user can write has a kind, and each kind one rule (`NUMBER_RULES`), applied where
# the config is validated: YAML's `.nan` and `.inf` and absurd sizes passed the schema, then failed
# deep inside a stage (a NaN learning rate blamed on the loss by the smoke gate, a 1 px image
# cropped to nothing by the augmentation). A float that is not finite is refused whatever its key,
# one added later included; every int and float key carries its kind on its field
# (`marked(..., kind=...)`; a test fails for a key without one), and what the key is, for the message.
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


@dataclass(frozen=True)
class Number:
    """A number key's kind (of `NUMBER_RULES`) and the words of its refusal: what the key is (the
    message's start, may be "") and a note after the rule (may be "")."""

    kind: str
    what: str = ""
    note: str = ""


@dataclass(frozen=True)
class Choice:
    """A text key's choices and the words of its refusal: `'VALUE' is not one of A, B`, then `note` in
    parentheses, or `'VALUE' <refusal>` for a key whose refusal has words of its own. Only a text
    value is checked against them (a key that takes a number or `auto` is a number otherwise).
    `options`: the choices, or a function giving them, read at each check (model.preset's: a model
    registered at run time adds its presets, `pisft.config.choices.presets`)."""

    options: tuple[str, ...] | Callable[[], tuple[str, ...]]
    note: str = ""
    refusal: str = ""

    @property
    def values(self) -> tuple[str, ...]:
        return tuple(self.options()) if callable(self.options) else self.options


def marked(default: Any, *roles: str, kind: str = "", what: str = "", note: str = "",
           choices: tuple[str, ...] | Callable[[], tuple[str, ...]] = (), refusal: str = "") -> Any:
    """A config field with its marks: `lr: float = marked(1e-3, TRAIN_STEP, POLICY_RUN, kind="positive",
    what="the peak learning rate")`. `roles`: what the key does (`ROLES`); `kind`: a number's rule (of
    `NUMBER_RULES`), with what the key is (`what`) and a `note` for its refusal; `choices`: the texts
    the key takes (or a function giving them when the key is checked), with a `note` or a `refusal` in
    words of its own. A list, a dict or a section (a config dataclass) as `default` is made anew for
    every config."""
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise ValueError(f"marked: unknown role(s) {unknown}; the roles are {', '.join(ROLES)}")
    if kind and kind not in NUMBER_RULES:
        raise ValueError(f"marked: unknown number kind {kind!r}; the kinds are {', '.join(NUMBER_RULES)}")
    if (what and not kind) or (note and not (kind or choices)) or (refusal and not choices):
        raise ValueError("marked: what= and note= belong to a kind= (note= also to choices=), refusal= to choices=")
    metadata: dict[str, Any] = {_ROLES_FIELD: roles}
    if kind:
        metadata[_NUMBER_FIELD] = Number(kind, what, note)
    if choices:
        options = choices if callable(choices) else tuple(choices)
        metadata[_CHOICE_FIELD] = Choice(options, "" if kind else note, refusal)
    if isinstance(default, type):
        return field(default_factory=default, metadata=metadata)
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def roles_on(f: Field) -> tuple[str, ...]:
    """The roles marked on a schema field (none for a field made without `marked`)."""
    return tuple(f.metadata.get(_ROLES_FIELD, ()))


def number_on(f: Field) -> Number | None:
    """The kind marked on a schema field (None: no number's field, or a number without a kind)."""
    return f.metadata.get(_NUMBER_FIELD)


def choice_on(f: Field) -> Choice | None:
    """The choices marked on a schema field (None: a field without choices)."""
    return f.metadata.get(_CHOICE_FIELD)
