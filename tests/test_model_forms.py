"""fetch_base with every form pi0.5 weights circulate in, each laid out as its tool writes it:
big_vision's SentencePiece tokenizer file, sharded safetensors with their index
(huggingface_hub's writer), openpi's `assets/<asset_id>/` and RLinf's `<asset_id>/` norm stats,
RLinf's FSDP checkpoint (`actor/model_state_dict/full_weights.pt`), an openpi conversion carrying
a fine-tuning config's action_horizon, a hub cache snapshot without `refs/main`.

The models are tiny (the tiny preset's sizes, recorded in pisft_model.json); a real checkpoint has
pi0.5's sizes and no pisft_model.json.
"""

from __future__ import annotations

import io
import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_fixtures import fake_batch, tiny_model_dir
from pisft.config import from_dict
from pisft.errors import ModelLoadError
from pisft.model import fetch
from pisft.model.norm_stats import STATS_FILE, load_stats
from pisft.model.policy import load_policy, make_processors
from pisft.model.tokenizer import load_tokenizer, tiny_vocab_size

LIBERO_ASSET = "physical-intelligence/libero"
SHA_A = "0123456789abcdef0123456789abcdef01234567"
SHA_B = "89abcdef0123456789abcdef0123456789abcdef"


def _cfg(tmp_path, **model):
    extra = {k: model.pop(k) for k in (fetch.ASSET_ID_KEY, fetch.FOLLOW_CHUNK_KEY) if k in model}
    cfg = from_dict({"results_dir": str(tmp_path / "results"), "model": model})
    for key, value in extra.items():  # keys the config does not declare yet: read with getattr
        setattr(cfg.model, key, value)
    return cfg


def _record(out):
    return json.loads((out / "SOURCE.json").read_text())


def _values_equal(a_dir, b_dir) -> bool:
    a, b = load_policy(a_dir).state_dict(), load_policy(b_dir).state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture()
def src(tmp_path_factory, tmp_path):
    """A modifiable copy of a tiny model directory in LeRobot layout (with tokenizer/ and stats)."""
    return tiny_model_dir(tmp_path_factory, tmp_path / "src")


# ------------------------------------------------------------------ the SentencePiece tokenizer

_CORPUS = [
    "put both moka pots on the stove", "turn on the stove and put the moka pot on it",
    "pick up the book and place it in the back compartment of the caddy",
    "put the black bowl in the bottom drawer of the cabinet and close it",
    "Task: put both the alphabet soup and the cream cheese box in the basket, State: 12 200 7 0 255 128;\nAction: ",
    "Advantage: positive", "Advantage: negative",
]


def train_sentencepiece(path, vocab_size: int, extra_symbols: int = 0):
    """A SentencePiece model trained as big_vision's PaliGemma tokenizer is configured (BPE, byte
    fallback, no dummy prefix, identity normalisation, split digits, pad 0 / eos 1 / bos 2 /
    unk 3, user-defined <mask> and <locNNNN> pieces), written where the test says."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 30), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, add_dummy_prefix=False, normalization_rule_name="identity", split_digits=True,
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, character_coverage=1.0,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", user_defined_symbols=["<mask>"] + [f"<loc{i:04d}>" for i in range(extra_symbols)],
        minloglevel=2)
    path.write_bytes(model.getvalue())
    return sentencepiece.SentencePieceProcessor(model_file=str(path))


def test_big_vision_sentencepiece_file_as_model_tokenizer(tmp_path, src, capsys):
    shutil.rmtree(src / "tokenizer")
    spm_file = tmp_path / "paligemma_tokenizer.model"
    sp = train_sentencepiece(spm_file, 320)
    out = fetch.run(_cfg(tmp_path, source=str(src), tokenizer=str(spm_file)))
    record = _record(out)["tokenizer"]
    assert (record["form"], record["vocabulary"], record["embedding_rows"]) == ("sentencepiece", 320, tiny_vocab_size())
    assert "sentencepiece, 320 tokens; embedding rows 510" in capsys.readouterr().out
    # The saved tokenizer (transformers format) gives SentencePiece's own ids, BOS first, as openpi's
    # PaligemmaTokenizer (encode(..., add_bos=True)).
    tokenizer = load_tokenizer(out / "tokenizer")
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    for text in ("Task: turn on the stove, State: 3 141 59 26;\nAction: ", "ÜBER 7 tabs\t\tand  spaces 🤖"):
        assert tokenizer(text)["input_ids"] == [sp.bos_id(), *sp.encode(text)]
    assert tokenizer.pad_token_id == sp.pad_id() == 0
    # LeRobot's pi0.5 preprocessor runs with it (prompt with the discretised state, padded).
    policy = load_policy(out)
    pre, _ = make_processors(policy, out)
    batch = pre(fake_batch(2))
    tokens = batch["observation.language.tokens"][0].tolist()
    assert tokens[0] == sp.bos_id() and max(tokens) < 320
    assert sp.decode([t for t in tokens if t > 3]).startswith("Task: put both moka pots on the stove, State: ")


def test_sentencepiece_file_found_in_the_source_or_in_a_directory(tmp_path, src):
    shutil.rmtree(src / "tokenizer")
    train_sentencepiece(src / "paligemma_tokenizer.model", 300)
    out = fetch.run(_cfg(tmp_path, source=str(src)))
    assert _record(out)["tokenizer"]["from"] == "source paligemma_tokenizer.model"
    (src / "paligemma_tokenizer.model").rename(tmp_path / "big_vision.model")
    (tmp_path / "tok").mkdir()
    (tmp_path / "big_vision.model").rename(tmp_path / "tok" / "paligemma_tokenizer.model")
    out = fetch.run(_cfg(tmp_path, source=str(src), tokenizer=str(tmp_path / "tok")))
    assert _record(out)["tokenizer"]["form"] == "sentencepiece"


def test_a_vocabulary_larger_than_the_embedding_is_refused_naming_both_sizes(tmp_path, src):
    spm_file = tmp_path / "paligemma_tokenizer.model"
    train_sentencepiece(spm_file, 600, extra_symbols=200)
    with pytest.raises(ModelLoadError, match=r"has 600 tokens; the model's embedding has 510 rows"):
        fetch.run(_cfg(tmp_path, source=str(src), tokenizer=str(spm_file)))
    assert not (tmp_path / "results" / "base_model").exists()


def test_unusable_tokenizer_files_are_clear_errors(tmp_path, src, monkeypatch):
    bad = tmp_path / "paligemma_tokenizer.model"
    bad.write_bytes(b"this is no SentencePiece model")
    with pytest.raises(ModelLoadError, match="not a SentencePiece model"):
        fetch.run(_cfg(tmp_path, source=str(src), tokenizer=str(bad)))
    with pytest.raises(ModelLoadError, match="model.tokenizer '.*nowhere.model': not found"):
        fetch.run(_cfg(tmp_path, source=str(src), tokenizer=str(tmp_path / "nowhere.model")))
    train_sentencepiece(bad, 300)
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # an environment without the package
    with pytest.raises(ModelLoadError, match="needs the `sentencepiece` package.*make setup"):
        fetch.run(_cfg(tmp_path, source=str(src), tokenizer=str(bad)))


def test_a_conversion_that_does_not_reproduce_sentencepiece_is_refused(tmp_path, src):
    import sentencepiece

    model = io.BytesIO()  # a Unigram model: GemmaTokenizer's BPE cannot reproduce it
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS[:2] * 50), model_writer=model, model_type="unigram", vocab_size=24,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2)
    (tmp_path / "unigram.model").write_bytes(model.getvalue())
    with pytest.raises(ModelLoadError, match="the transformers conversion does not reproduce SentencePiece"):
        fetch.run(_cfg(tmp_path, source=str(src), tokenizer=str(tmp_path / "unigram.model")))


def test_no_tokenizer_anywhere_says_where_each_form_comes_from(tmp_path, src):
    shutil.rmtree(src / "tokenizer")
    with pytest.raises(ModelLoadError, match="has no tokenizer") as err:
        fetch.run(_cfg(tmp_path, source=str(src)))
    assert "paligemma_tokenizer.model" in str(err.value) and "hf://google/paligemma-3b-pt-224" in str(err.value)


def test_both_locks_pin_what_the_sentencepiece_conversion_needs():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for lock in ("cpu-cuda.lock.txt", "ascend-aarch64.lock.txt"):
        lines = (root / "workflow" / "envs" / lock).read_text().splitlines()
        assert any(line.startswith("sentencepiece==") for line in lines), lock
        assert any(line.startswith("protobuf==") for line in lines), lock


# ------------------------------------------------------------------ sharded safetensors

def _as_shards(src, dest, max_shard_size="1MB"):
    """`src` with its weights re-saved as huggingface_hub writes shards (model-0000x-of-0000y +
    model.safetensors.index.json; save_pretrained uses the same writer)."""
    from huggingface_hub import save_torch_state_dict

    shutil.copytree(src, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    (dest / "model.safetensors").unlink()
    save_torch_state_dict(tensors, dest, max_shard_size=max_shard_size)
    return dest


def test_sharded_safetensors_load_strictly_with_equal_values(tmp_path, src):
    d = _as_shards(src, tmp_path / "sharded")
    shards = sorted(p.name for p in d.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (d / "model.safetensors.index.json").is_file()
    out = fetch.run(_cfg(tmp_path, source=str(d)))
    record = _record(out)
    assert record["weights_form"] == "sharded safetensors"
    assert record["files"]["model.safetensors"]["how"].startswith(f"merged from {len(shards)} shards")
    assert _values_equal(out, src)
    assert fetch.source_files(_cfg(tmp_path, source=str(d)))[-len(shards):] == [str(d / s) for s in shards]


def test_shards_that_disagree_with_their_index_are_refused(tmp_path, src):
    d = _as_shards(src, tmp_path / "sharded")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name, shard = next(iter(index["weight_map"].items()))
    tensors = load_file(str(d / shard))
    save_file({**tensors, "model.stray.weight": torch.zeros(2)}, str(d / shard))
    with pytest.raises(ModelLoadError, match=r"holds 1 tensor\(s\) the index does not list"):
        fetch.run(_cfg(tmp_path, source=str(d)))
    del tensors[name]
    save_file(tensors, str(d / shard))
    with pytest.raises(ModelLoadError, match=rf"lacks 1 tensor\(s\) the index puts there:\s+{name}"):
        fetch.run(_cfg(tmp_path, source=str(d)))
    (d / shard).unlink()
    with pytest.raises(ModelLoadError, match=f"shards named by the index are missing: {shard}"):
        fetch.run(_cfg(tmp_path, source=str(d)))
    shutil.copy(src / "model.safetensors", d)
    with pytest.raises(ModelLoadError, match="more than one form"):
        fetch.run(_cfg(tmp_path, source=str(d)))


# ------------------------------------------------------------------ openpi conversions, norm stats

def _openpi_stats(q99: float) -> dict:
    # openpi's norm_stats.json: stats padded to the model's 32 dims (q01 == q99 there)
    return {"norm_stats": {
        "state": {"mean": [0] * 8, "std": [1] * 8, "q01": [-1] * 8, "q99": [1] * 8},
        "actions": {"mean": [0] * 32, "std": [1] * 32, "q01": [-q99] * 7 + [0] * 25, "q99": [q99] * 7 + [0] * 25}}}


def _as_openpi(src, dest, horizon=10, shards=False):
    """The tiny model as openpi's examples/convert_jax_model_to_pytorch.py writes it: config.json
    {action_dim, action_horizon, paligemma_variant, action_expert_variant, precision}, weights
    without LeRobot's `model.` prefix (safetensors.save_model), assets/ copied from the checkpoint."""
    dest.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k[len("model."):]: v for k, v in tensors.items()}, str(dest / "model.safetensors"))
    if shards:
        tensors = load_file(str(dest / "model.safetensors"))
        (dest / "model.safetensors").unlink()
        from huggingface_hub import save_torch_state_dict

        save_torch_state_dict(tensors, dest, max_shard_size="1MB")
    (dest / "config.json").write_text(json.dumps({"action_dim": 32, "action_horizon": horizon,
                                                  "paligemma_variant": "gemma_2b",
                                                  "action_expert_variant": "gemma_300m",
                                                  "precision": "float32"}, indent=2))
    shutil.copy(src / "pisft_model.json", dest)  # tiny sizes; a real openpi checkpoint is pi05-sized
    return dest


def _write_stats(directory, rel, q99):
    path = directory / rel / "norm_stats.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_openpi_stats(q99), indent=2))


def test_norm_stats_found_in_openpi_assets_and_in_rlinf_asset_folders(tmp_path, src, capsys):
    spm = tmp_path / "paligemma_tokenizer.model"
    train_sentencepiece(spm, 300)
    d = _as_openpi(src, tmp_path / "openpi")
    # RLinf: <model_path>/<asset_id>/norm_stats.json
    _write_stats(d, LIBERO_ASSET, 2.0)
    out = fetch.run(_cfg(tmp_path, source=str(d), tokenizer=str(spm)))
    assert load_stats(out / STATS_FILE)["action"]["q99"].tolist() == [2.0] * 7
    detail = _record(out)["normalization_stats_detail"]
    assert (detail["asset_id"], detail["used"]) == (LIBERO_ASSET, f"{LIBERO_ASSET}/norm_stats.json")
    printed = capsys.readouterr().out
    assert f"imported {LIBERO_ASSET} ({LIBERO_ASSET}/norm_stats.json) (the only one in the source)" in printed
    assert "Fine-tuning normalises with the dataset's own statistics" in printed
    # openpi: assets/<asset_id>/norm_stats.json; the same asset in both places, same values: one
    _write_stats(d, f"assets/{LIBERO_ASSET}", 2.0)
    out = fetch.run(_cfg(tmp_path, source=str(d), tokenizer=str(spm)))
    assert _record(out)["normalization_stats_detail"]["used"] == f"assets/{LIBERO_ASSET}/norm_stats.json"
    _write_stats(d, f"assets/{LIBERO_ASSET}", 3.0)
    with pytest.raises(ModelLoadError, match="differing norm_stats.json files"):
        fetch.run(_cfg(tmp_path, source=str(d), tokenizer=str(spm)))


def test_several_norm_stats_are_listed_and_one_is_chosen_by_its_asset_id(tmp_path, src, capsys):
    spm = tmp_path / "paligemma_tokenizer.model"
    train_sentencepiece(spm, 300)
    d = _as_openpi(src, tmp_path / "openpi")
    _write_stats(d, "assets/droid", 5.0)  # pi05_base's assets hold several embodiments' stats
    _write_stats(d, f"assets/{LIBERO_ASSET}", 2.0)
    _write_stats(d, "trossen", 4.0)  # and an RLinf-placed one
    out = fetch.run(_cfg(tmp_path, source=str(d), tokenizer=str(spm)))
    assert not (out / STATS_FILE).exists()
    printed = capsys.readouterr().out
    assert "NOT imported: the source holds several" in printed
    for asset in ("droid", LIBERO_ASSET, "trossen"):
        assert asset in printed
    assert f"Set model.{fetch.ASSET_ID_KEY} to one of" in printed and "uses the dataset's" in printed
    assert _record(out)["normalization_stats_detail"]["used"] is None
    out = fetch.run(_cfg(tmp_path, source=str(d), tokenizer=str(spm), asset_id="trossen"))
    assert load_stats(out / STATS_FILE)["action"]["q99"].tolist() == [4.0] * 7
    assert "(model.asset_id)" in capsys.readouterr().out
    with pytest.raises(ModelLoadError, match="model.asset_id 'aloha': no norm_stats.json for it.*found: droid"):
        fetch.run(_cfg(tmp_path, source=str(d), tokenizer=str(spm), asset_id="aloha"))


def test_the_chunk_size_a_source_carries_must_match_the_config_or_be_followed(tmp_path, src, capsys):
    spm = tmp_path / "paligemma_tokenizer.model"
    train_sentencepiece(spm, 300)
    d = _as_openpi(src, tmp_path / "openpi", horizon=8)  # a fine-tuning config's action_horizon
    with pytest.raises(ModelLoadError, match=r"chunk size is 8 \(openpi config.json action_horizon\) but "
                                             r"model.preset 'tiny' has 10.*follow_source_chunk_size: true"):
        fetch.run(_cfg(tmp_path, source=str(d), tokenizer=str(spm)))
    out = fetch.run(_cfg(tmp_path, source=str(d), tokenizer=str(spm), follow_source_chunk_size=True))
    assert load_policy(out).config.chunk_size == 8 and load_policy(out).config.n_action_steps == 8
    settings = _record(out)["settings"]
    assert settings["chunk_size"]["from"] == "openpi config.json action_horizon"
    assert "follow_source_chunk_size is true" in settings["chunk_size"]["note"]
    assert settings["max_action_dim"] == {"value": 32, "from": "openpi config.json action_dim"}
    assert settings["dtype"]["from"].startswith("model.preset 'tiny' (openpi config.json precision 'float32'")
    assert settings["weights_dtypes"]["value"] == {"F32": len(load_file(str(d / "model.safetensors")))}
    printed = capsys.readouterr().out
    assert "chunk_size 8 (openpi config.json action_horizon)" in printed
    assert "max_state_dim 32 (openpi config.json action_dim (openpi pads the state to it))" in printed


def test_openpi_sharded_conversion_with_equal_values(tmp_path, src):
    spm = tmp_path / "paligemma_tokenizer.model"
    train_sentencepiece(spm, 300)
    d = _as_openpi(src, tmp_path / "openpi", shards=True)
    out = fetch.run(_cfg(tmp_path, source=str(d), tokenizer=str(spm)))
    assert _record(out)["layout"] == "openpi" and _values_equal(out, src)


def test_safetensors_without_config_json_take_the_preset_settings_and_say_so(tmp_path, src, capsys):
    (src / "config.json").unlink()  # as a folder RLinf loads by its own config_name may be
    out = fetch.run(_cfg(tmp_path, source=str(src)))
    record = _record(out)
    assert record["layout"] == "safetensors without config.json"
    assert record["settings"]["chunk_size"]["from"].startswith("model.preset 'tiny' (the source has no config.json")
    assert "chunk_size 10 (model.preset 'tiny' (the source has no config.json" in capsys.readouterr().out
    assert load_policy(out).config.chunk_size == 10


# ------------------------------------------------------------------ RLinf's FSDP checkpoint

def _as_rlinf(src, dest, rel="actor/model_state_dict/full_weights.pt", extra=None):
    """An RLinf runner checkpoint (global_step_N/): `actor/model_state_dict/full_weights.pt`, a
    torch.save of the full state dict of openpi's PI0Pytorch (names without LeRobot's `model.`;
    tied names all present, as nn.Module.state_dict lists them), no config.json."""
    policy = load_policy(src)
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}
    # RLinf trains with the VLM in bf16 (to_bfloat16_for_selected_params): mixed dtypes in the file
    for name in [n for n in state if ".language_model.layers." in n and n.endswith("mlp.up_proj.weight")]:
        state[name] = state[name].to(torch.bfloat16)
    state.update(extra or {})
    path = dest / rel
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    shutil.copy(src / "pisft_model.json", dest)  # tiny sizes; RLinf's real checkpoints are pi05-sized
    return dest, state


def test_rlinf_sft_checkpoint_loads_strictly_into_the_lerobot_layout(tmp_path, src, capsys):
    spm = tmp_path / "paligemma_tokenizer.model"
    train_sentencepiece(spm, 300)
    d, state = _as_rlinf(src, tmp_path / "global_step_2000")
    _write_stats(d, LIBERO_ASSET, 2.0)  # RLinf: <model_path>/<asset_id>/norm_stats.json
    out = fetch.run(_cfg(tmp_path, source=str(d), tokenizer=str(spm)))
    record = _record(out)
    assert (record["layout"], record["weights_form"]) == ("rlinf", "torch state dict")
    assert record["settings"]["chunk_size"]["from"].startswith("model.preset 'tiny' (the source has no config.json")
    assert record["settings"]["weights_dtypes"]["value"]["bfloat16"] == 2
    loaded = load_policy(out).model.state_dict()
    assert all(torch.equal(loaded[k], state[k].to(loaded[k].dtype)) for k in state)
    assert _record(out)["normalization_stats_detail"]["asset_id"] == LIBERO_ASSET
    assert "rlinf checkpoint, torch state dict (actor/model_state_dict/full_weights.pt)" in capsys.readouterr().out
    # RLinf also takes the actor folder itself (model_state_dict/full_weights.pt)
    shutil.copy(d / "pisft_model.json", d / "actor")
    out = fetch.run(_cfg(tmp_path, source=str(d / "actor"), tokenizer=str(spm)))
    assert _record(out)["files"]["model.safetensors"]["from"].endswith("actor/model_state_dict/full_weights.pt")


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (shutil.copy, (__file__, self.marker))


def test_rlinf_checkpoint_is_never_unpickled_beyond_tensors(tmp_path, src):
    marker = tmp_path / "code_ran"
    d, _ = _as_rlinf(src, tmp_path / "evil", extra={"hook": _RunsCode(str(marker))})
    with pytest.raises(ModelLoadError, match="refused: the file holds more than tensors"):
        fetch.run(_cfg(tmp_path, source=str(d), tokenizer=str(src / "tokenizer")))
    assert not marker.exists()
    d, _ = _as_rlinf(src, tmp_path / "nested")
    path = d / "actor/model_state_dict/full_weights.pt"
    torch.save({"model": torch.load(path), "step": 3}, path)
    with pytest.raises(ModelLoadError, match="(?s)not a flat state dict of tensors.*'model': dict"):
        fetch.run(_cfg(tmp_path, source=str(d), tokenizer=str(src / "tokenizer")))


def test_rlinf_rl_heads_are_not_dropped_silently(tmp_path, src):
    d, _ = _as_rlinf(src, tmp_path / "rl", extra={"value_head.mlp.0.weight": torch.zeros(4, 4)})
    with pytest.raises(ModelLoadError, match=r"(?s)model.value_head.mlp.0.weight.*RLinf's RL heads"):
        fetch.run(_cfg(tmp_path, source=str(d), tokenizer=str(src / "tokenizer")))
    d = tmp_path / "pointed_at_the_file_folder"
    d.mkdir()
    torch.save({}, d / "full_weights.pt")
    with pytest.raises(ModelLoadError, match="RLinf's model_state_dict/ folder: point model.source at the"):
        fetch.run(_cfg(tmp_path, source=str(d), tokenizer=str(src / "tokenizer")))


# ------------------------------------------------------------------ the hub cache

def _hub_cache(tmp_path, monkeypatch, src, shas):
    from huggingface_hub import constants

    cache = tmp_path / "hf_cache"
    for sha in shas:  # what `hf download --revision <sha>` leaves: snapshots/<sha>/, no refs/main
        shutil.copytree(src, cache / "models--someone--pi05_tiny" / "snapshots" / sha)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_cached_snapshot_without_its_ref_is_found_with_a_note(tmp_path, src, monkeypatch, capsys):
    _hub_cache(tmp_path, monkeypatch, src, [SHA_A])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = fetch.run(_cfg(tmp_path, source="hf://someone/pi05_tiny"))
    assert f"Pass hf://someone/pi05_tiny@{SHA_A} to name it" in capsys.readouterr().out
    record = _record(out)
    assert record["revision"] == SHA_A and "no refs/main" in record["hub_note"]
    # named by its sha, with the hub unreachable (not offline): found too
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    out = fetch.run(_cfg(tmp_path, source=f"hf://someone/pi05_tiny@{SHA_A}"))
    assert _record(out)["revision"] == SHA_A


def test_several_cached_snapshots_without_a_ref_name_the_choice(tmp_path, src, monkeypatch):
    _hub_cache(tmp_path, monkeypatch, src, [SHA_A, SHA_B])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=f"holds 2 snapshot.*{SHA_A}, {SHA_B}.*no ref for 'main'.*@<sha>"):
        fetch.run(_cfg(tmp_path, source="hf://someone/pi05_tiny"))
    with pytest.raises(ModelLoadError, match="no ref for 'v1'"):
        fetch.run(_cfg(tmp_path, source="hf://someone/pi05_tiny@v1"))
    with pytest.raises(ModelLoadError, match=f"{SHA_A}, {SHA_B} of someone/pi05_tiny, not {'f' * 40}"):
        fetch.run(_cfg(tmp_path, source=f"hf://someone/pi05_tiny@{'f' * 40}"))
