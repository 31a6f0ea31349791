"""The config schema: unknown keys, wrong types and failed cross-checks are clear errors."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pisft import config as C
from pisft import layout

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, data) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_embedded_default_is_valid_and_matches_the_schema_defaults():
    cfg = C.load(ROOT / "config/config.yaml")
    assert cfg.world_size == 2
    assert cfg.grad_accum_steps == cfg.train.global_batch_size // (cfg.train.micro_batch_size * 2)
    # config.yaml spells out every key of the schema, so users see them all.
    raw = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    flat = set(C.flatten(raw))
    assert flat == set(C.all_keys())


# A row of config/README.md's tables: | `key` | default | meaning |. The default cell is the
# schema's default, which config.yaml also has, unless it says otherwise:
#   `v`   `v` (`w` in config.yaml)   `v`; `w` (code; config.yaml)   `v` (profiles: `p`)
README_ROW = re.compile(r"^\| `(?P<key>[a-z_.0-9]+)` \| (?P<cell>.*?) \| .*\|$", re.M)
DEFAULT_CELL = re.compile(r"`(?P<code>[^`]*)`(?: \(`(?P<yaml>[^`]*)` in config\.yaml\)|; `(?P<yaml2>[^`]*)`"
                          r"| \(profiles: `(?P<profiles>[^`]*)`\))?")


def test_config_readme_documents_every_key_with_its_default():
    rows = {m["key"]: m["cell"] for m in README_ROW.finditer((ROOT / "config/README.md").read_text())}
    missing = [k for k in C.all_keys() if k not in rows]
    assert not missing, f"undocumented keys: {missing}"
    code = C.flatten(C.to_dict(C.from_dict({})))
    embedded = C.flatten(yaml.safe_load((ROOT / "config/config.yaml").read_text()))
    profiles = [C.flatten(yaml.safe_load(p.read_text())) for p in sorted((ROOT / "config/profiles").glob("*.yaml"))]
    wrong = []
    for key in C.all_keys():
        cell = DEFAULT_CELL.fullmatch(rows[key])
        assert cell, f"config/README.md, {key}: the default cell {rows[key]!r} is not in a checkable form"
        documented = yaml.safe_load(cell["code"])
        in_yaml = yaml.safe_load(next((v for v in (cell["yaml"], cell["yaml2"]) if v is not None), cell["code"]))
        if documented != code[key]:
            wrong.append(f"{key}: README {documented!r}, schema default {code[key]!r}")
        if in_yaml != embedded[key]:
            wrong.append(f"{key}: README {in_yaml!r} in config.yaml, which has {embedded[key]!r}")
        if cell["profiles"] is not None:
            setting = [p[key] for p in profiles if key in p]
            if not setting or any(v != yaml.safe_load(cell["profiles"]) for v in setting):
                wrong.append(f"{key}: README {cell['profiles']!r} in the profiles, which have {setting}")
    assert not wrong, "config/README.md gives stale defaults:\n" + "\n".join(wrong)


def test_unknown_key_names_file_key_and_nearest_valid_key(tmp_path):
    path = write(tmp_path, {"train": {"micro_batch": 2}})
    with pytest.raises(C.ConfigError) as err:
        C.load(path)
    msg = str(err.value)
    assert str(path) in msg and "train.micro_batch" in msg and "train.micro_batch_size" in msg


def test_unknown_section_suggests_the_right_one(tmp_path):
    with pytest.raises(C.ConfigError, match="did you mean 'train.steps'"):
        C.load(write(tmp_path, {"trian": {"steps": 3}}))


def test_wrong_type_names_the_key(tmp_path):
    with pytest.raises(C.ConfigError, match="train.steps.*wrong type"):
        C.load(write(tmp_path, {"train": {"steps": "many"}}))


def test_global_batch_must_divide_by_micro_times_world(tmp_path):
    path = write(tmp_path, {"train": {"nproc_per_node": 8, "micro_batch_size": 4, "global_batch_size": 100}})
    with pytest.raises(C.ConfigError, match=r"global_batch_size: 100 is not divisible by .* 4 × 8 = 32"):
        C.load(path)


@pytest.mark.parametrize(
    "patch, fragment",
    [
        ({"device": "tpu"}, "device: 'tpu'"),
        ({"model": {"preset": "pi0"}}, "model.preset"),
        ({"train": {"precision": "fp16"}}, "train.precision"),
        ({"train": {"nnodes": 2, "node_rank": 2}}, "train.node_rank: must be in [0, train.nnodes), got 2"),
        ({"data": {"eval_fraction": 1.5}}, "data.eval_fraction"),
        ({"smoke": {"steps": 1}}, "smoke.steps"),
        ({"train": {"log_every": 0}}, "train.log_every: must be at least 1, got 0"),
        ({"data": {"augment": "randaugment"}}, "data.augment: 'randaugment' is not one of none, openpi"),
    ],
)
def test_cross_checks(tmp_path, patch, fragment):
    with pytest.raises(C.ConfigError) as err:
        C.load(write(tmp_path, patch))
    assert fragment in str(err.value)


def test_log_every_and_deterministic(tmp_path):
    cfg = C.load(ROOT / "config/config.yaml")
    assert cfg.train.log_every == 10 and cfg.train.deterministic is False
    cfg = C.load(write(tmp_path, {"train": {"log_every": 50, "deterministic": True}}))
    assert cfg.train.log_every == 50 and cfg.train.deterministic is True
    with pytest.raises(C.ConfigError, match="train.deterministic.*wrong type"):
        C.load(write(tmp_path, {"train": {"deterministic": "sometimes"}}))
    with pytest.raises(C.ConfigError, match="train.log_every.*wrong type"):
        C.load(write(tmp_path, {"train": {"log_every": 2.5}}))


def test_training_stages_track_log_every_and_deterministic():
    from pisft.stages import STAGE_KEYS

    for key in ("train.log_every", "train.deterministic"):
        assert key in STAGE_KEYS["smoke_1card"]
        assert "train" in STAGE_KEYS["train_8card"]  # the whole section, these keys included
    dvc = (ROOT / "dvc.yaml").read_text()
    assert "- train.log_every" in dvc and "- train.deterministic" in dvc


def test_data_augment_is_a_training_key_of_every_stage_that_trains():
    from pisft.train.run_folders import run_fingerprint
    from pisft.train.run_folders import value_fingerprint
    from pisft.stages import STAGE_KEYS, TRAINING_STAGES

    assert C.load(ROOT / "config/config.yaml").data.augment == "none"
    for stage in TRAINING_STAGES:  # smoke_1card, train_8card, smoke_value, train_value
        assert "data.augment" in STAGE_KEYS[stage], stage
    for stage in ("fetch_base", "convert_recap", "evaluate", "closed_loop", "advantages", "collect_rollouts"):
        assert "data.augment" not in STAGE_KEYS[stage], stage  # read by the training loaders only
    assert (ROOT / "dvc.yaml").read_text().count("- data.augment") >= 4
    on = C.from_dict({"data": {"augment": "openpi"}})
    off = C.from_dict({})
    assert run_fingerprint(on)["data.augment"] == "openpi" and run_fingerprint(off)["data.augment"] == "none"
    assert value_fingerprint(on)["data.augment"] == "openpi"


def test_overrides_apply_and_are_validated(tmp_path):
    cfg = C.load(ROOT / "config/config.yaml", ["train.steps=7", "data.tasks=[0, 3]"])
    assert cfg.train.steps == 7 and cfg.data.tasks == ["0", "3"]
    with pytest.raises(C.ConfigError, match="expected KEY=VALUE"):
        C.load(ROOT / "config/config.yaml", ["train.steps"])
    # YAML 1.1's yes/no/on/off are text on the command line, as YAML 1.2 (DVC) reads them: `off` was
    # False, refused as "train.compile: 'False' is not one of auto, off, layers"
    # (a flag still takes them: OmegaConf reads the text "off" as false)
    cfg = C.load(ROOT / "config/config.yaml", ["train.compile=off", "eval.videos=off", "train.tensorboard=True"])
    assert (cfg.train.compile, cfg.eval.videos, cfg.train.tensorboard) == ("off", False, True)


def test_resolved_config_carries_derived_values():
    cfg = C.from_dict({})
    res = C.resolved(cfg)
    assert res["derived"] == {"world_size": 2, "grad_accum_steps": 2}


def test_profiles_are_valid():
    for profile in sorted((ROOT / "config/profiles").glob("*.yaml")):
        base = yaml.safe_load((ROOT / "config/config.yaml").read_text())
        over = yaml.safe_load(profile.read_text())
        merged = C.to_dict(C.from_dict(_merge(base, over), str(profile)))
        if over.get("device") in ("npu", "cuda"):  # an 8-card node's profile (pi05-cpu.yaml: this host;
            # libero-full-eval.yaml sets the evaluation alone)
            assert merged["train"]["nproc_per_node"] == 8
            # real LIBERO data keeps its resolution: config.yaml's 64 px is the embedded demo's
            assert merged["data"]["image_size"] == 0 and merged["data"]["recap_dir"] != base["data"]["recap_dir"]


def _merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
    return out


def test_cli_validate_exit_codes(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "pisft", "validate", str(ROOT / "config/config.yaml")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "pisft", "validate", str(write(tmp_path, {"train": {"lr": "x"}}))],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert "train.lr" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    "patch, fragment",
    [  # each of these failed only after work had started (issue 11, item 8)
        ({"train": {"decay_lr": -1}}, "train.decay_lr"),
        ({"train": {"decay_lr": 0.5}}, "train.decay_lr"),  # above train.lr: not a decay
        ({"train": {"grad_clip": -1}}, "train.grad_clip"),
        ({"train": {"grad_clip": 0}}, "train.grad_clip"),
        ({"train": {"weight_decay": -0.1}}, "train.weight_decay"),
        ({"train": {"num_workers": -2}}, "train.num_workers"),
        ({"train": {"peak_flops": -1}}, "train.peak_flops"),
        ({"data": {"demo_episode_length": 0}}, "data.demo_episode_length: must be at least 1, got 0"),
        ({"data": {"demo_image_size": 0}}, "data.demo_image_size: must be an image side in [16, 4096] px, got 0"),
        ({"data": {"demo_episodes_per_task": 0}}, "data.demo_episodes_per_task"),
        ({"results_dir": "my results"}, "results_dir: 'my results' contains ' '"),
        ({"results_dir": "res;ults"}, "results_dir"),
    ],
)
def test_bad_values_are_refused_before_work_starts(tmp_path, patch, fragment):
    with pytest.raises(C.ConfigError) as err:
        C.load(write(tmp_path, patch))
    assert fragment in str(err.value)


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"])
def test_an_empty_config_file_is_refused(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(C.ConfigError, match="empty"):
        C.load(path)
    out = subprocess.run([sys.executable, "-m", "pisft", "validate", str(path)], capture_output=True, text=True)
    assert out.returncode == 2 and "empty" in out.stderr


def test_a_bad_config_leaves_the_previous_stage_log_alone(tmp_path):
    log = tmp_path / "logs" / "evaluate.log"
    log.parent.mkdir()
    log.write_text("the previous run's log\n")
    bad = write(tmp_path, {"results_dir": str(tmp_path), "train": {"grad_clip": -1}})
    out = subprocess.run([sys.executable, "-m", "pisft", "evaluate", "--config", str(bad), "--log", str(log)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "train.grad_clip" in out.stderr
    assert log.read_text() == "the previous run's log\n"


def test_a_log_that_cannot_be_written_keeps_the_console_message(tmp_path):
    """/dev/full: every write fails with ENOSPC (a full disk); the error still reaches the console."""
    cfg = write(tmp_path, {"results_dir": str(tmp_path / "results")})
    out = subprocess.run([sys.executable, "-m", "pisft", "evaluate", "--config", str(cfg), "--log", "/dev/full"],
                         capture_output=True, text=True, timeout=300)
    console = out.stdout + out.stderr  # the tee forwards both streams to the console's stdout
    assert out.returncode == 2, console
    assert "error: " in console and "not found" in console  # the stage's own message
    assert "/dev/full could not be written" in out.stderr and "Traceback" not in console


def test_disk_full_and_read_only_end_in_one_line(tmp_path):
    from pisft import cli

    for code, words in ((28, "no space left"), (30, "read-only filesystem")):  # ENOSPC, EROFS
        line = cli._storage_error_line(OSError(code, "x", str(tmp_path / "results" / "f")))
        assert words in line and str(tmp_path / "results" / "f") in line and "\n" not in line


def test_the_value_model_starts_from_the_base_model_unless_recap_value_init_says_previous():
    loop = {"results_dir": "r", "eval": {"closed_loop": True, "trials_per_task": 1}}
    cfg = C.from_dict({**loop, "recap": {"iterations": 2}})
    assert cfg.recap.value_init == "base"  # RLinf's value model starts from the pretrained backbone
    assert [layout.value_init_model(cfg.at_iteration(k)) for k in (0, 1, 2)] == [Path("r/base_model")] * 3
    assert layout.init_model(cfg.at_iteration(2)) == Path("r/recap/iter_1/train/model")  # recap.init: its own key
    prev = C.from_dict({**loop, "recap": {"iterations": 2, "value_init": "previous", "init": "base"}})
    assert [layout.value_init_model(prev.at_iteration(k)) for k in (1, 2)] == [
        Path("r/train/model"), Path("r/recap/iter_1/train/model")]
    assert layout.init_model(prev.at_iteration(2)) == Path("r/base_model")
    with pytest.raises(C.ConfigError, match=r"recap.value_init: 'policy' is not one of base, previous"):
        C.from_dict({**loop, "recap": {"iterations": 1, "value_init": "policy"}})


def test_a_recap_iteration_sees_its_own_folders_and_retraining_length():
    cfg = C.from_dict({"results_dir": "r", "eval": {"closed_loop": True, "trials_per_task": 1},
                       "train": {"steps": 150}, "recap": {"iterations": 2, "policy_steps": 60}})
    it2 = cfg.at_iteration(2)
    assert layout.results(it2, "train", "model") == Path("r/recap/iter_2/train/model")
    assert layout.results(it2, "base_model") == Path("r/base_model")  # shared
    assert layout.results(it2, "smoke", "report.json") == Path("r/smoke/report.json")  # iteration 0's gate
    assert layout.init_model(it2) == Path("r/recap/iter_1/train/model")  # recap.init: previous
    assert it2.train.steps == 60 and cfg.train.steps == 150  # a copy: iteration 0 keeps its own
    assert cfg.at_iteration(0).train.steps == 150
    with pytest.raises(C.ConfigError, match="iterations 0..2 exist"):
        cfg.at_iteration(3)
    overlapping = {"eval": {"closed_loop": True, "trials_per_task": 49}, "recap": {"iterations": 1}}
    with pytest.raises(C.ConfigError, match="initial states"):
        C.from_dict(overlapping)


@pytest.mark.parametrize(("weight", "shown"), [
    (0, "weight 0"), (-1.5, "weight -1.5"), ("heavy", "weight 'heavy'"), (True, "weight True"),
    (None, "weight None"), (float("inf"), "weight inf"),
])
def test_a_source_weight_must_be_a_positive_number(tmp_path, weight, shown):
    """Issue 32, item 6: a source's weight that is not a number > 0 is refused, naming the entry."""
    sources = [{"path": "demos"}, {"path": "rollouts", "type": "rollout", "weight": weight}]
    with pytest.raises(C.ConfigError) as err:
        C.load(write(tmp_path, {"data": {"recap_dir": sources}}))
    msg = str(err.value)
    assert f"data.recap_dir[1]: {shown} is not a positive number" in msg
    assert "give a number > 0" in msg and "leave the source out of data.recap_dir" in msg


def test_source_weights_default_to_one_and_are_read(tmp_path):
    sources = ["demos", {"path": "rollouts", "type": "rollout", "weight": 0.25}, {"path": "more", "weight": 3}]
    cfg = C.load(write(tmp_path, {"data": {"recap_dir": sources, "balance_source_weights": False}}))
    assert [(s.path, s.type, s.weight) for s in C.data_sources(cfg)] == [
        ("demos", "sft", 1.0), ("rollouts", "rollout", 0.25), ("more", "sft", 3.0)]
    assert cfg.data.balance_source_weights is False
    assert C.DataConfig().balance_source_weights is True  # RLinf's balance_dataset_weights default
    single = C.load(write(tmp_path, {"data": {"recap_dir": "demos"}}))
    assert C.data_sources(single) == [C.DataSource("demos", "sft", 1.0)]
