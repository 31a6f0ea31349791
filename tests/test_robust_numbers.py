"""Issue 47, item 6, "numbers the schema lets through": every number a user can write is checked
where the config is validated, by the one rule of its kind (marked on its field: `marked(..., kind=)`,
pisft.config.NUMBER_RULES). YAML's own spellings (`.nan`, `.inf`, `-.inf`) are written into a real config file
and read by both drivers' readers, as a user would write them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
import yaml
from data_fixtures import make_recap

from pisft import config as C
from pisft.data.convert import Options, convert_recap

ROOT = Path(__file__).resolve().parents[1]


def number_keys(schema=C.PisftConfig, prefix: str = "") -> dict[str, object]:
    """Every int and float key of the schema (lists of ints included) and its type."""
    hints = typing.get_type_hints(schema)
    out: dict[str, object] = {}
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out.update(number_keys(kind, f"{prefix}{f.name}."))
        elif any(t in (int, float) for t in (kind, *typing.get_args(kind))):
            out[f"{prefix}{f.name}"] = kind
    return out


def marked_kinds(schema=C.PisftConfig, prefix: str = "") -> dict[str, str]:
    """Every key whose field is marked with a number's kind, and the kind."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(schema):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(section := f.default_factory()):
            out.update(marked_kinds(type(section), f"{prefix}{f.name}."))
        elif (number := C.number_on(f)) is not None:
            out[f"{prefix}{f.name}"] = number.kind
    return out


def test_every_number_key_of_the_schema_has_a_kind_and_every_kind_a_rule():
    keys, kinds = number_keys(), marked_kinds()
    assert set(keys) == set(kinds), (sorted(set(keys) - set(kinds)), sorted(set(kinds) - set(keys)))
    assert set(kinds.values()) | {"weight"} == set(C.NUMBER_RULES)


def write(tmp_path: Path, text: str) -> Path:
    """config/config.yaml with the `section:` blocks of `text` appended over its own."""
    base = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    for section, values in yaml.safe_load(text).items():
        base.setdefault(section, {}).update(values) if isinstance(values, dict) else base.update({section: values})
    # written back as YAML text, the non-finite floats in YAML's spelling (.nan, .inf)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


CASES = {  # what the issue found passing `validate`, then failing deep inside a stage
    "train.lora_alpha: .nan": ("train: {trainable: lora, lora_alpha: .nan}", "train.lora_alpha: nan is not a finite"),
    "train.lora_alpha: .inf": ("train: {trainable: lora, lora_alpha: .inf}", "train.lora_alpha: inf is not a finite"),
    "train.lr: .inf": ("train: {lr: .inf}", "train.lr: inf is not a finite number; the peak learning rate must be > 0"),
    "train.weight_decay: .nan": ("train: {weight_decay: .nan}", "train.weight_decay: nan is not a finite number"),
    "recap.failure_reward: .nan": ("recap: {failure_reward: .nan}", "recap.failure_reward: nan is not a finite"),
    "recap.failure_reward: -.inf": ("recap: {failure_reward: -.inf}", "recap.failure_reward: -inf is not a finite"),
    "recap.failure_reward: -1.0e+300": ("recap: {failure_reward: -1.0e+300}",
                                        "recap.failure_reward: the reward of a failed episode's last step must be "
                                        "in [-1000000, 0]"),
    "train.lora_rank: 100000": ("train: {trainable: lora, lora_rank: 100000}", "train.lora_rank: must be 0"),
    "data.image_size: 1 with data.augment: openpi": ("data: {image_size: 1, augment: openpi}",
                                                     "data.image_size: must be 0 (keep the input's) or an image side"),
    # held-out cases of the same class
    "train.grad_clip: .inf": ("train: {grad_clip: .inf}", "train.grad_clip: inf is not a finite number"),
    "eval.policy_batch_wait_ms: .nan": ("eval: {policy_batch_wait_ms: .nan}", "eval.policy_batch_wait_ms: nan"),
    "recap.value_head_lr: .inf": ("recap: {value_head_lr: .inf}", "recap.value_head_lr: inf is not a finite"),
    "train.peak_flops: .inf": ("train: {peak_flops: .inf}", "train.peak_flops: inf is not a finite number"),
    "train.seed: -1": ("train: {seed: -1}", "train.seed: must be a seed in [0, 2^32), got -1"),
    "eval.closed_loop_seed: 2^40": ("eval: {closed_loop_seed: 1099511627776}", "eval.closed_loop_seed: must be a seed"),
    "eval.resize_size: 100000": ("eval: {resize_size: 100000}", "eval.resize_size: must be an image side"),
    "data.demo_image_size: 2": ("data: {demo_image_size: 2, augment: openpi}", "data.demo_image_size: must be an"),
    "a source weight: .inf": ("data: {recap_dir: [{path: results/demo_recap, weight: .inf}]}",
                              "data.recap_dir[0]: weight inf is not a positive number"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_number_no_run_can_use_is_refused_where_the_config_is_validated(tmp_path, case):
    text, expected = CASES[case]
    path = write(tmp_path, text)
    with pytest.raises(C.ConfigError) as err:
        C.load(path)
    assert expected in str(err.value), str(err.value)


def test_validate_names_every_bad_number_at_once(tmp_path):
    path = write(tmp_path, "train: {lr: .inf, weight_decay: .nan}\nrecap: {failure_reward: -.inf}\n")
    out = subprocess.run([sys.executable, "-m", "pisft", "validate", str(path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    for key in ("train.lr: inf", "train.weight_decay: nan", "recap.failure_reward: -inf"):
        assert key in out.stderr, out.stderr


@pytest.mark.parametrize(("kind", "good", "bad"), [
    ("count", [1, 10**6], [0, -1]), ("count_or_zero", [0, 7], [-1]), ("two_or_more", [2], [1]),
    ("auto_or_count", [-1, 0, 3], [-2]), ("seed", [0, 2**32 - 1], [-1, 2**32]),
    ("side", [16, 4096], [15, 4097]), ("side_or_keep", [0, 64], [1, 8, 5000]), ("lora_rank", [0, 16, 1024], [-1, 1025]),
    ("positive", [1e-9, 1.0], [0.0, -1.0]), ("weight", [0.5, 1e300], [0.0, -1.0]),
    ("non_negative", [0.0, 3.0], [-1e-12]), ("fraction", [0.0, 0.99], [1.0, -0.1]),
    ("open_fraction", [0.3], [0.0, 1.0]), ("probability", [0.0, 1.0], [1.5, -0.1]),
    ("discount", [1.0, 0.5], [0.0, 1.1]), ("penalty", [0.0, -300.0, -1e6], [1.0, -1.1e6]),
    ("at_least_one", [1.0, 3.5], [0.9]), ("decay_or_off", [None, 0.0, 0.999], [1.0, -0.1]),
])
def test_each_kind_is_one_rule_and_no_kind_takes_a_non_finite_float(kind, good, bad):
    for value in good:
        assert C.number_line("k", value, kind) is None, (kind, value)
    for value in [*bad, float("nan"), float("inf"), float("-inf")]:
        line = C.number_line("k", value, kind)
        assert line is not None and line.startswith("k: ") and "\n" not in line, (kind, value)


def test_a_source_weight_of_1e308_is_made_right_not_nan(tmp_path):
    """weight x frames overflowed to inf and every share became NaN ("nan% of the policy's samples",
    then `Probabilities contain NaN` in training): the shares are now taken relative to the largest."""
    from pisft.config import DataSource
    from pisft.train.sampler import SourceMixture

    a = make_recap(tmp_path / "a", n_tasks=1, per_task=2, length=6)
    b = make_recap(tmp_path / "b", n_tasks=1, per_task=2, length=6, seed=3)
    report = convert_recap([DataSource(str(a), weight=1.0e308), DataSource(str(b), weight=1.0)], tmp_path / "out",
                           Options(eval_fraction=0.0))
    shares = [s["share_all"] for s in report["sources"]]
    assert all(np.isfinite(shares)) and shares[0] == 1.0 and 0 < shares[1] < 1e-300
    rows = np.repeat([0, 1], [report["sampling"]["frames"]["all"][0], report["sampling"]["frames"]["all"][1]])
    mixture = SourceMixture.of(rows, [1.0e308, 1.0], balance=True)
    assert np.isfinite(mixture.probs).all() and set(mixture.draw(0, 0, 8)) <= set(range(len(rows)))
