"""Issue 47, item 6, "exports other people cannot read" and "LeRobot's own tools on pisft's
export": every file of a model pisft writes has the user's usual mode (0644 under umask 022), and
the export carries LeRobot 0.6.1's processor files, which LeRobot's own entry point
(`make_pre_post_processors(pretrained_path=...)`) loads and which give `serve`'s actions, the
state left out of the prompt where the model was trained without it."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from test_serve_openpi_client import SERVE_STATS, libero_request

from pisft import config as config_mod
from pisft.model import fetch
from pisft.model.lerobot_processors import POSTPROCESSOR_FILE, PREPROCESSOR_FILE, write_processors
from pisft.model.policy import STATE_IN_PROMPT_KEY, build_policy, load_policy, save_model
from pisft.model.tokenizer import save_tiny_tokenizer
from pisft.policy.libero import LiberoPolicy

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def umask():
    def set_to(mask: int) -> None:
        os.umask(mask)

    before = os.umask(0o022)
    yield set_to
    os.umask(before)


def export(project: Path, *, state_in_prompt: bool) -> Path:
    """A tiny model written as train_8card's export writes it (save_model, then LeRobot's processor
    files, the tokenizer inside them), under `project`."""
    tok = project / "tokenizer-src"
    save_tiny_tokenizer(tok)
    policy = build_policy("tiny", seed=0)
    policy.pisft_model_info[STATE_IN_PROMPT_KEY] = state_in_prompt
    model = project / "results" / "train" / "model"
    model.mkdir(parents=True)
    save_model(policy, model, tokenizer_dir=tok, dataset_stats=SERVE_STATS)
    write_processors(model)
    return model


def modes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix() or ".": stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize(("mask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775)])
def test_every_file_of_an_export_and_of_the_base_model_has_the_users_mode(tmp_path, umask, mask, file_mode, dir_mode):
    """normalization_stats.safetensors was written 0600 (safetensors' own mode): on a shared
    cluster the next user's serve failed on a model that looked complete."""
    umask(mask)
    model = export(tmp_path, state_in_prompt=True)
    cfg = config_mod.load(ROOT / "config/config.yaml", [f"results_dir={tmp_path / 'results'}"])
    base = fetch.run(cfg)  # fetch_base's output: the other model folder pisft writes
    for root in (model, base):
        found = modes(root)
        wrong = {rel: oct(m) for rel, m in found.items()
                 if m != (dir_mode if (root / rel).is_dir() else file_mode)}
        assert not wrong, wrong
    written = set(modes(model))  # the stats (safetensors' 0600 before), LeRobot's processors and their state
    assert {"normalization_stats.safetensors", PREPROCESSOR_FILE, POSTPROCESSOR_FILE} <= written
    assert any(name.endswith("normalizer_processor.safetensors") for name in written)


@pytest.mark.parametrize("state_in_prompt", [True, False])
def test_lerobots_processors_from_the_export_give_serves_actions(tmp_path, monkeypatch, state_in_prompt):
    from lerobot.policies.factory import make_pre_post_processors

    model = export(tmp_path, state_in_prompt=state_in_prompt)
    monkeypatch.chdir(tmp_path)  # the project root
    served = LiberoPolicy.from_model_dir(model, device="cpu", seed=0)
    batch = served.prepare(libero_request(3))
    expected = served.predict(batch, served.new_noise(5))["actions"]

    policy = load_policy(model)  # LeRobot's PI05Policy (the tiny sizes pisft builds it with)
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(model))
    noise = torch.randn((1, policy.config.chunk_size, policy.config.max_action_dim), generator=served.new_noise(5))
    with torch.no_grad():
        got = post(policy.predict_action_chunk(pre(dict(batch)), noise=noise)).numpy()[0]
    np.testing.assert_array_equal(got, expected)

    prompt_steps = [s for s in json.loads((model / PREPROCESSOR_FILE).read_text())["steps"]
                    if "prompt" in s.get("class", "").lower() or "prepare_state" in s.get("registry_name", "")]
    if state_in_prompt:  # LeRobot's own step, by its registry name
        assert prompt_steps == [{"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}}]
    else:  # LeRobot's step would write the state: pisft's step, by its import path
        assert prompt_steps == [{"class": "pisft.model.lerobot_processors.PromptWithoutStateStep",
                                 "config": {"task_key": "task"}}]
        from lerobot.utils.constants import OBS_LANGUAGE_TOKENS

        from pisft.model.tokenizer import load_tokenizer

        prompt = load_tokenizer(model / "tokenizer").decode(pre(dict(batch))[OBS_LANGUAGE_TOKENS][0],
                                                             skip_special_tokens=True)
        assert "State" not in prompt and "put the bowl on the plate" in prompt
        # where pisft is not installed LeRobot refuses the step, naming it, rather than write the state
        import sys

        monkeypatch.setitem(sys.modules, "pisft.model.lerobot_processors", None)
        with pytest.raises(ImportError, match="pisft.model.lerobot_processors"):
            make_pre_post_processors(policy.config, pretrained_path=str(model))


def test_the_processors_find_the_models_tokenizer_from_any_working_directory(tmp_path, monkeypatch):
    """The files named the tokenizer `results/train/model/tokenizer`, read from the working directory:
    from another project's root LeRobot loaded that project's tokenizer without a word. The tokenizer is
    the tokenizer step's state, which LeRobot reads from the model folder itself; moved, the model still
    gives serve's actions, and the files name no path."""
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.utils.constants import OBS_LANGUAGE_TOKENS

    from pisft.model.lerobot_processors import ModelTokenizerStep

    model = export(tmp_path / "project", state_in_prompt=True)
    served = LiberoPolicy.from_model_dir(model, device="cpu", seed=0)
    batch = served.prepare(libero_request(3))
    expected = served.predict(batch, served.new_noise(5))["actions"]
    moved = tmp_path / "elsewhere" / "model"
    moved.parent.mkdir()
    model.rename(moved)
    other = tmp_path / "other-project"  # another project's root, with a tokenizer of its own at that path
    (other / "results/train/model/tokenizer").mkdir(parents=True)
    (other / "results/train/model/tokenizer/tokenizer_config.json").write_text('{"tokenizer_class": "NoSuch"}')
    monkeypatch.chdir(other)

    text = (moved / PREPROCESSOR_FILE).read_text()
    assert "results/" not in text and "tokenizer_name" not in text
    [step] = [s for s in json.loads(text)["steps"] if "Tokenizer" in s.get("class", s.get("registry_name", ""))]
    assert step["class"] == "pisft.model.lerobot_processors.ModelTokenizerStep" and "state_file" in step
    policy = load_policy(moved)
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(moved))
    assert any(isinstance(s, ModelTokenizerStep) for s in pre.steps)
    noise = torch.randn((1, policy.config.chunk_size, policy.config.max_action_dim), generator=served.new_noise(5))
    with torch.no_grad():
        tokens = pre(dict(batch))
        got = post(policy.predict_action_chunk(tokens, noise=noise)).numpy()[0]
    np.testing.assert_array_equal(got, expected)
    assert tokens[OBS_LANGUAGE_TOKENS].shape[-1] == policy.config.tokenizer_max_length

    (moved / step["state_file"]).unlink()  # the tokenizer gone from the folder: named, not looked for elsewhere
    with pytest.raises(FileNotFoundError, match=f"{re.escape(step['state_file'])}.* at '{re.escape(str(moved))}"):
        make_pre_post_processors(policy.config, pretrained_path=str(moved))
