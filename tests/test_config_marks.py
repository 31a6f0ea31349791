"""A key's roles are marks on its field (pisft.config): every list of keys by role is read off
them, and no module keeps one of its own. A number's kind and a text's choices are marks on its field
too: a key added with its marks is validated with no other edit."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import yaml

from pisft import config
from pisft.stages import STAGES
from pisft.train import launch

ROOT = Path(__file__).resolve().parents[1]


def test_a_mark_names_a_known_role():
    with pytest.raises(ValueError, match="unknown role.*the roles are"):
        config.marked(1, "reruns everything")
    with pytest.raises(ValueError, match="unknown role"):
        config.keys_marked("training stepp")
    with pytest.raises(ValueError, match="unknown number kind 'counted'; the kinds are count, "):
        config.marked(1, kind="counted")
    with pytest.raises(ValueError, match="what= and note= belong to a kind="):
        config.marked("a", what="a thing")  # a text's refusal words are choices' note= or refusal=


def test_every_role_marks_a_key_and_a_marked_section_is_a_section():
    for role in config.ROLES:
        assert config.keys_marked(role), f"no key is marked {role!r}: a role nobody carries is dead"
    parts = [key.split(".") for key in config.all_keys()]
    sections = {".".join(p[:i]) for p in parts for i in range(1, len(p))}  # `eval`, `eval.rtc`
    for role in config.ROLES:
        for key in config.keys_marked(role):
            assert key in sections or key in config.all_keys(), (role, key)


def test_the_run_fingerprints_hold_what_changes_the_computation_and_not_how_it_is_split():
    policy = set(config.fingerprint_keys(config.POLICY_RUN))
    value = set(config.fingerprint_keys(config.VALUE_RUN))
    every = config.all_keys()
    # `model` and `data` enter whole, a key added there included, less the input they name or make
    # (its content is hashed: pisft.train.run_folders.inputs_fingerprint)
    for key in every:
        if key.startswith(("model.", "data.")):
            inputs = key == "data.recap_dir" or key.startswith("data.demo_")
            assert (key in policy) != inputs and (key in value) != inputs, key
    # a run resumes across the world size, the split of the batch, how often it logs or saves,
    # the loader's workers and the kernels
    for key in ("train.nproc_per_node", "train.nnodes", "train.micro_batch_size", "train.log_every",
                "train.save_every", "train.keep_last", "train.num_workers", "train.peak_flops",
                "train.tensorboard", "train.deterministic", "train.activation_checkpointing", "device"):
        assert key not in policy and key not in value, key
    # the compiled blocks compute in another order: the policy's run holds the mode it executes
    for key in ("train.global_batch_size", "train.steps", "train.trainable", "train.ema_decay", "train.lr",
                "train.compile", "train.precision"):  # precision: issue 11, a bf16 run resumed fp32 checkpoints
        assert key in policy, key
    # the value run has its own steps, learning rates, batch and mode
    assert {"recap.value_steps", "recap.value_lr", "recap.value_trainable", "recap.value_init"} <= value
    assert not {"train.steps", "train.trainable", "train.global_batch_size", "train.ema_decay"} & value


def test_the_stage_rows_and_the_smoke_gate_read_the_same_marks():
    smoke = set(STAGES["smoke_1card"].keys)
    for key in config.keys_marked(config.TRAIN_STEP):
        # a key that reruns the smoke gate is one its report must share with the training it admits
        assert key in smoke and key in launch.SMOKE_MUST_MATCH, key
    for key in config.keys_marked(config.SMOKE_MEASURED):
        assert key in launch.SMOKE_MUST_MATCH, key
    assert set(STAGES["closed_loop"].keys) == {"device", *config.keys_marked(config.CLOSED_LOOP)}
    assert set(STAGES["evaluate"].keys) == {"device", *config.keys_marked(config.OFFLINE_EVAL)}
    assert set(STAGES["convert_recap"].keys) >= set(config.keys_marked(config.CONVERSION))


def _config_key_lists(name: str, source: str, keys: set[str]) -> list[str]:
    """Module-level names in `source` bound to a tuple or list of two or more config keys."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Tuple | ast.List):
            items = node.value.elts
            if len(items) >= 2 and all(isinstance(e, ast.Constant) and e.value in keys for e in items):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [f"{name}:{node.lineno} {ast.unparse(t)}" for t in targets]
    return found


def test_no_module_keeps_a_list_of_keys_by_role():
    """Outside pisft.config and the stage table (whose rows name what each stage reads), a
    module-level tuple of config keys is a second copy of a key's role: mark the key instead."""
    keys = {key for key in config.all_keys() if "." in key}  # ("train", "eval") is a split, not a key list
    allowed = {*(ROOT / "src/pisft/config").glob("*.py"), ROOT / "src/pisft/stages.py"}
    found = [hit for path in sorted((ROOT / "src/pisft").rglob("*.py")) if path not in allowed
             for hit in _config_key_lists(str(path.relative_to(ROOT)), path.read_text(), keys)]
    assert found == []
    # and the check sees one where there is one (what checkpoint.py held before the marks)
    assert _config_key_lists("probe.py", 'import os\nFINGERPRINT_KEYS = ("train.lr", "train.seed")\n',
                             keys) == ["probe.py:2 FINGERPRINT_KEYS"]


# ---------------------------------------------------------------------- a key added with its marks
@dataclasses.dataclass
class _TrainWithMore(config.TrainConfig):
    widgets: int = config.marked(3, config.TRAIN_STEP, kind="count", what="the widgets per step",
                                 note="a throwaway key")
    flavour: str = config.marked("plain", config.TRAIN_STEP, choices=("plain", "spicy"), note="plain: as it is")
    mode: int | str = config.marked(2, kind="two_or_more", choices=("auto",), refusal="must be a number or auto")


@dataclasses.dataclass
class _SchemaWithMore(config.PisftConfig):
    train: _TrainWithMore = config.marked(_TrainWithMore, config.VALUE)


@pytest.fixture
def schema_with_more_keys(monkeypatch):
    """The schema with three throwaway train keys, added as a key is added: its field and its marks."""
    config.schema._schema.cache_clear()
    monkeypatch.setattr(config.schema, "PisftConfig", _SchemaWithMore)
    monkeypatch.setattr(config.reading, "PisftConfig", _SchemaWithMore)
    yield
    monkeypatch.undo()
    config.schema._schema.cache_clear()


def test_a_key_added_with_its_marks_is_validated_by_kind_range_and_choices_with_no_other_edit(schema_with_more_keys):
    raw = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    cfg = config.from_dict(raw, "c.yaml")  # config.yaml without the new keys: their defaults
    assert (cfg.train.widgets, cfg.train.flavour, cfg.train.mode) == (3, "plain", 2)
    assert {"train.widgets", "train.flavour"} <= set(config.keys_marked(config.TRAIN_STEP))

    def refusal(**train) -> str:
        with pytest.raises(config.ConfigError) as err:
            config.from_dict({**raw, "train": {**raw["train"], **train}}, "c.yaml")
        return str(err.value)

    # the kind's range, the choices, the refusal's own words, each in the words of every key's refusal
    assert refusal(widgets=0) == ("c.yaml: invalid configuration:\n  - train.widgets: the widgets per step must be "
                                  "at least 1 (a throwaway key), got 0")
    assert refusal(flavour="salty") == ("c.yaml: invalid configuration:\n  - train.flavour: 'salty' is not one of "
                                        "plain, spicy (plain: as it is)")
    assert refusal(mode="sometimes") == ("c.yaml: invalid configuration:\n  - train.mode: 'sometimes' must be a "
                                         "number or auto")
    assert refusal(mode=1) == "c.yaml: invalid configuration:\n  - train.mode: must be at least 2, got 1"
    assert "train.widgets" in refusal(widgets="many") and "wrong type" in refusal(widgets="many")  # the field's type
    assert "did you mean 'train.widgets'" in refusal(widget=4)  # the key is known
    assert config.from_dict({**raw, "train": {**raw["train"], "flavour": "spicy", "mode": "auto"}}).train.mode == "auto"
    # its other two places: config.yaml and config/README.md, which tests/test_config.py holds to every key
    missing = set(config.all_keys()) - set(config.flatten(raw))
    assert missing == {"train.widgets", "train.flavour", "train.mode"}
