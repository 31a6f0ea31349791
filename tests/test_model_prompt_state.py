"""model.state_in_prompt: the prompt tokens with and without the discretised state, computed by
hand (LeRobot's Pi05PrepareStateTokenizerProcessorStep; openpi's PaligemmaTokenizer.tokenize with
state=None), and the model's record that every consumer follows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from model_fixtures import fake_batch, fake_stats, tiny_model_dir

from pisft import config as config_mod
from pisft.policy.predictor import ChunkPredictor, quantile_normalize
from pisft.model import fetch
from pisft.model.policy import (
    MODEL_INFO_FILE,
    STATE_IN_PROMPT_KEY,
    build_policy,
    load_policy,
    make_processors,
    save_model,
    state_in_prompt_of,
)
from pisft.model.tokenizer import load_tokenizer

TOKENS = "observation.language.tokens"
MASK = "observation.language.attention_mask"


def _clean(task: str) -> str:
    return task.strip().replace("_", " ").replace("\n", " ")


def _tokens(tokenizer, ids: list[int], length: int) -> list[int]:
    return ids + [tokenizer.pad_token_id] * (length - len(ids))


def test_prompt_tokens_with_and_without_the_state(tmp_path_factory):
    model_dir = tiny_model_dir(tmp_path_factory)
    policy = load_policy(model_dir)
    tokenizer = load_tokenizer(model_dir / "tokenizer")
    length = int(policy.config.tokenizer_max_length)
    batch = fake_batch(4)
    stats = fake_stats()["observation.state"]
    assert state_in_prompt_of(policy) is True  # no record: LeRobot's prompt
    with_state = make_processors(policy, model_dir)[0]({k: (list(v) if k == "task" else v.clone())
                                                        for k, v in batch.items()})
    without = make_processors(policy, model_dir, state_in_prompt=False)[0](
        {k: (list(v) if k == "task" else v.clone()) for k, v in batch.items()})
    state = quantile_normalize(batch["observation.state"].numpy(), stats["q01"], stats["q99"])
    bins = np.digitize(state, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
    bos = [tokenizer.bos_token_id]
    for i, task in enumerate(batch["task"]):
        text = f"Task: {_clean(task)}, State: {' '.join(map(str, bins[i]))};\nAction: "
        expected = tokenizer(text, add_special_tokens=True)["input_ids"][:length]
        assert with_state[TOKENS][i].tolist() == _tokens(tokenizer, expected, length)
        # openpi: encode(text, add_bos=True) + encode("\n"), no state anywhere
        plain = bos + tokenizer.encode(_clean(task), add_special_tokens=False) \
            + tokenizer.encode("\n", add_special_tokens=False)
        assert without[TOKENS][i].tolist() == _tokens(tokenizer, plain[:length], length)
        assert int(without[MASK][i].sum()) == min(len(plain), length)
        assert int(without[MASK][i].sum()) < int(with_state[MASK][i].sum())
    # the state still reaches nothing else: the rest of the batch is the same
    torch.testing.assert_close(without["observation.state"], with_state["observation.state"])


def test_the_exported_record_is_what_every_consumer_follows(tmp_path):
    tok = tmp_path / "tok"
    from pisft.model.tokenizer import save_tiny_tokenizer
    save_tiny_tokenizer(tok)
    policy = build_policy("tiny", seed=0)
    policy.pisft_model_info[STATE_IN_PROMPT_KEY] = False  # as training records it
    out = tmp_path / "model"
    out.mkdir()
    save_model(policy, out, tokenizer_dir=tok, dataset_stats=fake_stats())
    assert json.loads((out / MODEL_INFO_FILE).read_text())[STATE_IN_PROMPT_KEY] is False
    # serve, closed_loop, collect_rollouts and evaluate load models through ChunkPredictor
    predictor = ChunkPredictor.load(out)
    assert state_in_prompt_of(predictor.policy) is False
    batch = fake_batch(1)
    tokens = predictor.preprocessor(batch)[TOKENS][0].tolist()
    tokenizer = load_tokenizer(out / "tokenizer")
    assert "State" not in tokenizer.decode(tokens, skip_special_tokens=True)


def test_config_key_and_an_openpi_source_that_says(tmp_path):
    assert config_mod.from_dict({}).model.state_in_prompt is True
    cfg = config_mod.from_dict({"results_dir": str(tmp_path), "model": {"state_in_prompt": False}})
    assert cfg.model.state_in_prompt is False
    from pisft.train.run_folders import run_fingerprint  # a fresh run folder for the other form
    assert run_fingerprint(cfg)["model.state_in_prompt"] is False
    # an openpi conversion whose config.json carries discrete_state_input: recorded as the source's
    raw = {"action_horizon": 10, "action_dim": 32, "paligemma_variant": "gemma_2b",
           "action_expert_variant": "gemma_300m", "discrete_state_input": False}
    (tmp_path / "config.json").write_text(json.dumps(raw))

    class Ckpt:
        config_form = fetch.sources.OPENPI
        config = tmp_path / "config.json"

    pi05 = config_mod.from_dict({"model": {"preset": "pi05", "follow_source_chunk_size": True}})
    _, settings, _ = fetch._source_config(pi05, Ckpt, "model.source 'x'")
    assert settings["state_in_prompt"] == {"value": False, "from": "openpi config.json discrete_state_input"}


@pytest.mark.parametrize("recorded", [None, True, False])
def test_training_follows_a_starting_model_that_records_it(recorded, capsys):
    from pisft.train.job import Context, _choose_prompt_form

    policy = build_policy("tiny", seed=0)
    if recorded is not None:
        policy.pisft_model_info[STATE_IN_PROMPT_KEY] = recorded
    cfg = config_mod.from_dict({"model": {"state_in_prompt": False}})
    ctx = Context(cfg, "train_8card", None, 0, 1)
    chosen = _choose_prompt_form(ctx, policy, "base")
    assert chosen is (False if recorded is None else recorded)
    assert policy.pisft_model_info[STATE_IN_PROMPT_KEY] is chosen
    assert ("followed, model.state_in_prompt" in capsys.readouterr().err) is (recorded is True)
