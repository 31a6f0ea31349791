"""Issue 47, item 6, "a model's record read loosely": pisft's own records are type-checked where
they are read (pisft.records). Each case edits a real record the way a hand edit or another tool
writes it, refreshes the manifest (so the integrity check passes), and reads it with the reader
the stages use."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from data_fixtures import convert, make_recap

from pisft import config as config_mod
from pisft import integrity, layout, records
from pisft import io as io_mod
from pisft.bench.closed_loop_bench import write_tiny_model
from pisft.data import dataset as dataset_mod
from pisft.data import prompts
from pisft.data.source_weights import SAMPLING_FILE, SourceSampling
from pisft.model.policy import MODEL_INFO_FILE, load_policy
from pisft.policy.libero import LiberoPolicy
from pisft.records import RecordError
from pisft.train import launch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(integrity.CACHE_ENV, str(tmp_path / "verify-cache"))


def edit(path: Path, change, *, rule: str, command: str) -> None:
    """Change a JSON record in place, then rewrite the folder's manifest as its stage would."""
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))
    folder = path.parent if (path.parent / "MANIFEST.json").is_file() else path.parent.parent
    with integrity.writing_as(rule, command):
        io_mod.write_manifest(folder)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    model = write_tiny_model(tmp_path_factory.mktemp("export") / "results" / "train" / "model")
    (model / "pisft_config.json").write_text("{}\n")
    with integrity.writing_as("train_8card", "python -m pisft launch train_8card"):
        io_mod.write_manifest(model)
    return model


def test_state_in_prompt_written_as_a_string_is_refused_not_taken_for_true(exported, tmp_path):
    """"false" is a non-empty string: Python takes it for true, and serve prompted with the state."""
    model = Path(shutil.copytree(exported, tmp_path / "results" / "train" / "model"))
    edit(model / MODEL_INFO_FILE, lambda r: r.update(state_in_prompt="false"), rule="train_8card",
         command="python -m pisft launch train_8card")
    integrity.verify_read(model, what="t")  # the manifest matches: only the record's type is wrong
    for load in (lambda: load_policy(model), lambda: LiberoPolicy.from_model_dir(model, device="cpu")):
        with pytest.raises(RecordError) as err:
            load()
        msg = str(err.value)
        assert f"{model / MODEL_INFO_FILE}: 'state_in_prompt' is \"false\" (str), but must be true/false" in msg
        assert "train_8card" in msg and "\n" not in msg
    edit(model / MODEL_INFO_FILE, lambda r: r.update(state_in_prompt=False), rule="train_8card",
         command="python -m pisft launch train_8card")
    assert load_policy(model).pisft_model_info["state_in_prompt"] is False  # the real flag is followed


@pytest.mark.parametrize(("field", "value"), [("format_version", "1"), ("preset", 1), ("arch", []),
                                              ("augment", "none"), ("weights", None)])
def test_every_field_of_the_model_record_is_checked(exported, tmp_path, field, value):
    model = Path(shutil.copytree(exported, tmp_path / "results" / "train" / "model"))
    edit(model / MODEL_INFO_FILE, lambda r: r.update({field: value}), rule="train_8card", command="c")
    with pytest.raises(RecordError, match=f"'{field}' is "):
        load_policy(model)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("converted")
    out = root / "dataset"
    with integrity.writing_as("convert_recap", "python -m pisft convert_recap"):
        convert(make_recap(root / "recap", n_tasks=2, per_task=2), out, advantage_tag="demo")
    return out


DATASET_EDITS = {  # record -> (its file, the change, the read, what the message names)
    "split.json: episode ids as strings": (
        "split.json", lambda r: r.update(train=[str(i) for i in r["train"]]),
        lambda d: dataset_mod.split_episodes(d), "'train' is"),
    "source_sampling.json: a flag as a string": (
        SAMPLING_FILE, lambda r: r.update(balance_source_weights="false"),
        lambda d: SourceSampling.read(d), "'balance_source_weights' is \"false\""),
    "prompt_conditioning.json: a flag as a string": (
        f"meta/{prompts.CONDITIONING_FILE}", lambda r: r.update(positive_only_conditional="false"),
        lambda d: prompts.for_dataset(d), "'positive_only_conditional' is \"false\""),
    "conversion_report.json: an outcome as text": (
        "conversion_report.json", lambda r: r["episodes"][0].update(success="yes"),
        lambda d: dataset_mod.episode_success(d), "'success' is \"yes\""),
}


@pytest.mark.parametrize("case", list(DATASET_EDITS))
def test_a_datasets_records_are_type_checked_on_read(converted, tmp_path, case):
    name, change, read, expected = DATASET_EDITS[case]
    dataset = Path(shutil.copytree(converted, tmp_path / "dataset"))
    read(dataset)  # as convert_recap wrote it
    edit(dataset / name, change, rule="convert_recap", command="python -m pisft convert_recap")
    with pytest.raises(RecordError) as err:
        read(dataset)
    assert expected in str(err.value) and "convert_recap" in str(err.value)


def test_a_smoke_report_that_says_passed_as_text_does_not_open_the_gate(tmp_path):
    cfg = config_mod.load(ROOT / "config/config.yaml", [f"results_dir={tmp_path}"])
    path = layout.smoke_report(cfg)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"passed": "false", "pisft_config": config_mod.resolved(cfg)}))
    with pytest.raises(RecordError, match=r"'passed' is \"false\" \(str\), but must be true/false.*smoke_1card"):
        launch.check_smoke_report(cfg)


@pytest.mark.parametrize(("value", "spec", "ok"), [
    (True, bool, True), ("true", bool, False), (1, bool, False), (1, int, True), (True, int, False),
    (1.5, int, False), (1, float, True), ("1.0", float, False), ([1, 2], (list, int), True),
    ([1, "2"], (list, int), False), (None, (None, dict), True), ({}, (None, dict), True), ([], (None, dict), False),
])
def test_a_field_holds_its_writers_type_strictly(value, spec, ok):
    if ok:
        records.check({"f": value}, {"f": spec}, path="r.json", writer="w")
    else:
        with pytest.raises(RecordError, match="r.json: 'f' is "):
            records.check({"f": value}, {"f": spec}, path="r.json", writer="w")
