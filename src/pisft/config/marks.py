"""What a key does, written on its field: its roles (`marked`), from which every list of keys by
role is read (`pisft.config.schema.keys_marked`, `fingerprint_keys`)."""

from __future__ import annotations

from dataclasses import Field, field
from typing import Any

# ------------------------------------------------------------------------ what a key does: its marks
# A key's roles are marks on its field (`marked`), and every list of keys by role is read off them
# (`keys_marked`, `fingerprint_keys`): the keys each stage reads in the stage table
# (pisft.stages: a change reruns the stage under both drivers), the settings of a training run's
# fingerprint (pisft.train.checkpoint, pisft.train.run_folders), the keys a smoke report must share
# with the training it admits (pisft.train.launch), the options of a conversion (pisft.data.convert).
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
_ROLES_FIELD = "pisft_roles"  # the field metadata that holds a key's marks


def marked(default: Any, *roles: str) -> Any:
    """A config field with its roles: `lr: float = marked(1e-3, TRAIN_STEP, POLICY_RUN)`. A list,
    a dict or a section (a config dataclass) as `default` is made anew for every config."""
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise ValueError(f"marked: unknown role(s) {unknown}; the roles are {', '.join(ROLES)}")
    metadata = {_ROLES_FIELD: roles}
    if isinstance(default, type):
        return field(default_factory=default, metadata=metadata)
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def roles_on(f: Field) -> tuple[str, ...]:
    """The roles marked on a schema field (none for a field made without `marked`)."""
    return tuple(f.metadata.get(_ROLES_FIELD, ()))
