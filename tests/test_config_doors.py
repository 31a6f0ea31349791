"""Issue 56, item 2: a value is refused at the door it came through, as early as possible.

Snakemake's `--config` values are read as config.yaml and `--set` read theirs; what the closed loop would
refuse about its suites, perturbations, seeds or chunks given the config alone is refused by `validate`,
by Snakemake's parse and by DVC's first stage (config_check); strengths equal as numbers are one
condition; a list of seeds has a bound, checked before the schema reads it."""

from __future__ import annotations

import copy
import math
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from pisft import cli
from pisft import config as C
from pisft.errors import PisftError

ROOT = Path(__file__).resolve().parents[1]


def snakemake_dry_run(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("snakemake")
    return subprocess.run([str(exe), "-n", "-p", "--cores", "1", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_snakemakes_config_values_are_read_as_config_yaml_reads_them():
    """Snakemake read `strength: 5` as the text '5' (refused, naming config/config.yaml and suggesting
    what was typed) and `compile: null` as the text 'null' (a wrong type): both plan now."""
    ok = snakemake_dry_run("--config", "eval={perturbations: [{name: camera, strength: 5}], compile: null}")
    assert ok.returncode == 0, ok.stderr + ok.stdout
    assert "--config results/config/effective.yaml" in ok.stdout  # the stages read the merged config


def test_config_entries_as_pisft_reads_them():
    from snakemake.cli import parse_config
    from snakemake.settings.types import ConfigSettings

    from pisft.workflow.snakemake_support import workflow_config

    def workflow(entries):
        settings = ConfigSettings(config=parse_config(entries), config_args=entries)
        return types.SimpleNamespace(config_settings=settings, configfiles=[])

    base = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    entries = ["eval={perturbations: [{name: camera, strength: 5}]}", "eval={compile: null, seeds: [7, 8]}",
               "device=cpu"]
    snakemakes = C.merge_into(yaml.safe_load((ROOT / "config/config.yaml").read_text()), parse_config(entries))
    assert snakemakes["eval"]["perturbations"] == [{"name": "camera", "strength": "5"}]  # Snakemake's reading
    read = workflow_config(snakemakes, workflow(entries))
    assert read["eval"]["perturbations"] == [{"name": "camera", "strength": 5}]
    assert read["eval"]["compile"] is None and read["eval"]["seeds"] == [7, 8] and read["device"] == "cpu"
    assert read["train"] == base["train"]  # the rest of config.yaml as it was
    cfg = C.from_dict(read)
    assert C.perturbation_conditions(cfg.eval) == [("camera", 5.0)] and cfg.eval.compile is None
    # a config given to Snakemake's API as values (no entries typed) is taken as it is
    typed = {"eval": {"compile": None}}
    api = types.SimpleNamespace(config_settings=ConfigSettings(config=typed), configfiles=[])
    assert workflow_config(C.merge_into(copy.deepcopy(base), typed), api)["eval"]["compile"] is None
    with pytest.raises(C.ConfigError, match=r"--config eval=\{seeds: \[7: not valid YAML"):
        workflow_config(base, workflow(["eval={seeds: [7"]))


def test_what_is_refused_at_snakemakes_parse_names_the_config_entry(capsys):
    from snakemake.cli import parse_config
    from snakemake.settings.types import ConfigSettings

    from pisft.workflow.snakemake_support import validated_config

    entry = "eval={perturbations: [language], libero_suites: [libero_90]}"
    settings = ConfigSettings(config=parse_config([entry]), config_args=[entry])
    config = C.merge_into(yaml.safe_load((ROOT / "config/config.yaml").read_text()), parse_config([entry]))
    with pytest.raises(SystemExit):
        validated_config(config, types.SimpleNamespace(config_settings=settings, configfiles=[]))
    err = capsys.readouterr().err
    assert f"error: config/config.yaml + --config {entry}: invalid configuration" in err
    assert "language at strength 1 does not apply to libero_90" in err


def test_a_number_yaml_1_1_reads_as_text_is_named_with_how_to_write_it():
    with pytest.raises(C.ConfigError, match=r"strength '1e1' is not a number .* \('1e1' was read as text: YAML 1.1 "
                                            r"reads an exponent as a number only with a dot and a sign, so write 10 "
                                            r"or 1.0e\+01\)"):
        C.load(ROOT / "config/config.yaml", ["eval.perturbations=[{name: camera, strength: 1e1}]"])
    with pytest.raises(C.ConfigError, match=r"strength '5' is not a number .* \('5' is text: write the number"):
        C.load(ROOT / "config/config.yaml", ["eval.perturbations=[{name: camera, strength: '5'}]"])


def test_set_reads_values_alike_and_names_a_value_used_as_a_section():
    cfg = C.load(ROOT / "config/config.yaml", ["eval.perturbations=[{name: camera, strength: 5}]", "eval.compile=null",
                                               "train.compile=off"])
    assert C.perturbation_conditions(cfg.eval) == [("camera", 5.0)] and cfg.eval.compile is None
    assert cfg.train.compile == "off"
    with pytest.raises(C.ConfigError, match=r"--set train.steps.x=1: 'train.steps' is a value, not a section"):
        C.load(ROOT / "config/config.yaml", ["train.steps.x=1"])
    with pytest.raises(C.ConfigError, match=r"--set eval.seeds=\[7: not valid YAML"):
        C.load(ROOT / "config/config.yaml", ["eval.seeds=[7"])


def write_config(tmp_path: Path, **sections) -> Path:
    raw = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    for section, keys in sections.items():
        if isinstance(keys, dict):
            raw[section].update(keys)
        else:
            raw[section] = keys
    raw["results_dir"] = str(tmp_path / "results")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# What the closed loop refused only after fetch, conversion, the smoke gate and training.
REFUSED_BY_THE_CLOSED_LOOP = [
    ({"eval": {"perturbations": ["language"], "libero_suites": ["libero_90"]}},
     r"eval.perturbations: language at strength 1 does not apply to libero_90: it exists for libero_spatial, "
     r"libero_object, libero_goal, libero_10 alone"),
    ({"eval": {"closed_loop": True, "replan_steps": 8, "rtc": {"delay_steps": 3}}},
     r"eval.replan_steps \(8\) \+ eval.rtc.delay_steps \(3\) exceed model.preset tiny's chunk of 10 actions"),
    ({"eval": {"closed_loop": True, "replan_steps": 11}},
     r"eval.replan_steps \(11\) \+ eval.rtc.delay_steps \(0\) exceed model.preset tiny's chunk of 10"),
    ({"eval": {"closed_loop": True, "trials_per_task": 51}},
     r"eval.trials_per_task: 51 episodes per task need as many initial states; LIBERO keeps 50"),
    ({"device": "cpu", "eval": {"closed_loop": True, "policy_devices": 2}},
     r"eval.policy_devices: 2 policy replicas asked for, but the policy runs on the CPU, where it is one"),
]


@pytest.mark.parametrize(("sections", "message"), REFUSED_BY_THE_CLOSED_LOOP)
def test_validate_and_the_first_stage_refuse_what_the_closed_loop_would(tmp_path, monkeypatch, capsys, sections,
                                                                       message):
    from pisft.workflow import drivers

    with pytest.raises(C.ConfigError, match=message):  # Snakemake's parse-time check
        C.from_dict(sections)
    path = write_config(tmp_path, **sections)
    monkeypatch.chdir(tmp_path)  # config_check writes nothing here when it refuses
    assert cli.main(["validate", str(path)]) == 2
    assert drivers.run_check(str(path)) == 2  # DVC's first stage
    err = capsys.readouterr().err
    assert len(re.findall(message, err)) == 2, err
    assert not (tmp_path / "results").exists()


def test_a_model_keeping_its_sources_chunk_is_checked_by_the_closed_loop_alone():
    C.from_dict({"model": {"follow_source_chunk_size": True}, "eval": {"closed_loop": True, "replan_steps": 11}})
    C.from_dict({"eval": {"closed_loop": False, "replan_steps": 11}})  # no rollouts: nothing executes a chunk
    assert C.chunk_problems(11, 0, 50, "the model's") == []


def test_the_closed_loop_asks_the_same_question():
    from pisft import rollout
    from pisft.evaluate import robustness
    from pisft.rollout import perturb

    settings = rollout.Settings(suites=("libero_90",), trials_per_task=1, replan_steps=5, num_wait_steps=0, seed=7,
                                resize_size=224)
    with pytest.raises(PisftError, match="language at strength 1 does not apply to libero_90"):
        robustness._check(None, settings, [perturb.Perturbation("language", 1.0)])
    robustness._check(None, settings, [perturb.Perturbation("language", 0.0)])  # strength 0: nothing


def test_strengths_equal_as_numbers_are_one_condition():
    """`strength: 0` beside `strength: -0.0` ran the unperturbed episodes twice, as camera_0 and camera_-0."""
    with pytest.raises(C.ConfigError, match=r"eval.perturbations\[1\]: camera at strength -0 is listed twice .*"
                                            r"share the key 'camera_0'"):
        C.from_dict({"eval": {"perturbations": [{"name": "camera", "strength": 0},
                                                {"name": "camera", "strength": -0.0}]}})
    with pytest.raises(C.ConfigError, match="listed twice"):
        C.from_dict({"eval": {"perturbations": [{"name": "lighting", "strength": 0.5},
                                                {"name": "lighting", "strength": 0.50}, "lighting"]}})
    e = C.from_dict({"eval": {"perturbations": [{"name": "camera", "strength": -0.0}]}}).eval
    [(name, strength)] = C.perturbation_conditions(e)
    assert (name, strength) == ("camera", 0.0) and math.copysign(1.0, strength) == 1.0
    assert C.perturbation_key("camera", -0.0) == "camera_0"


def test_a_list_of_seeds_has_a_bound_checked_before_the_schema_reads_it(monkeypatch):
    """10^6 seeds took minutes in validate (OmegaConf makes a node per item)."""
    C.from_dict({"eval": {"seeds": list(range(7, 7 + C.MAX_SEEDS))}})
    with pytest.raises(C.ConfigError, match=rf"eval.seeds: a list of {C.MAX_SEEDS + 1} items, more than the "
                                            rf"{C.MAX_SEEDS} it takes \(each seed runs the whole closed-loop"):
        C.from_dict({"eval": {"seeds": list(range(7, 8 + C.MAX_SEEDS))}})

    def merge(*args, **kwargs):
        raise AssertionError("the schema read the list")

    monkeypatch.setattr(C.OmegaConf, "merge", merge)
    for key, section in (("seeds", "eval"), ("perturbations", "eval"), ("task_ids", "recap"), ("tasks", "data")):
        with pytest.raises(C.ConfigError, match=rf"{section}.{key}: a list of 1000000 items, more than the"):
            C.from_dict({section: {key: [7] * 10**6}})


def test_a_config_file_too_long_for_any_config_is_refused_before_it_is_parsed(tmp_path, monkeypatch, capsys):
    """A file of 10^5 seeds took both YAML readers 30 s before the list's bound was seen."""
    import yaml as pyyaml

    seeds = "[" + ", ".join(map(str, range(7, 7 + 10**5))) + "]"
    path = tmp_path / "config.yaml"
    path.write_text((ROOT / "config/config.yaml").read_text().replace("  seeds: []", f"  seeds: {seeds}", 1))
    assert path.stat().st_size > C.MAX_CONFIG_BYTES

    def parse(*args, **kwargs):
        raise AssertionError("parsed")

    monkeypatch.setattr(pyyaml, "load", parse)
    assert cli.main(["validate", str(path)]) == 2
    assert f"{path}: {path.stat().st_size // 1024} KiB of YAML; a run config is a few KiB" in capsys.readouterr().err


def test_the_facts_the_config_check_keeps_agree_with_their_owners():
    """The suites LIBERO-Pro paraphrases, and each preset's chunk (LeRobot's PI05Config default for pi05)."""
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    from pisft.model.pi05.presets import PRESETS
    from pisft.rollout.paraphrases import PARAPHRASES

    assert {suite for suite, _ in PARAPHRASES} == set(C.PERTURBATIONS["language"].suites)
    assert set(C.PRESET_CHUNK_SIZES) == set(C.PRESETS) == set(PRESETS)
    for name, preset in PRESETS.items():
        assert preset.config.get("chunk_size", PI05Config().chunk_size) == C.PRESET_CHUNK_SIZES[name]
