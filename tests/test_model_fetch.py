"""The fetch_base stage: every source, strict checks, linking, MANIFEST, clear errors."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_fixtures import tiny_model_dir
from pisft.config import from_dict
from pisft.errors import ModelLoadError
from pisft.io import sha256_file, verify_manifest
from pisft.model import fetch
from pisft.model.policy import load_policy
from pisft.model.norm_stats import STATS_FILE, load_stats


def _cfg(tmp_path, **model):
    return from_dict({"results_dir": str(tmp_path / "results"), "model": model})


@pytest.fixture()
def src(tmp_path_factory, tmp_path):
    """A modifiable copy of a tiny model directory in LeRobot layout."""
    return tiny_model_dir(tmp_path_factory, tmp_path / "src")


def _sha(out, name="model.safetensors"):
    return json.loads((out / "MANIFEST.json").read_text())["files"][name]["sha256"]


def test_tiny_writes_a_complete_verified_output_deterministically(tmp_path):
    cfg = _cfg(tmp_path)
    out = fetch.run(cfg)
    listed = set(json.loads((out / "MANIFEST.json").read_text())["files"])
    assert {"config.json", "model.safetensors", "pisft_model.json", "SOURCE.json", "pisft_config.json",
            "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"} <= listed
    assert verify_manifest(out) == []
    source = json.loads((out / "SOURCE.json").read_text())
    assert source["kind"] == "tiny" and source["verified"].startswith("full strict load")
    assert json.loads((out / "pisft_config.json").read_text())["model"]["source"] == "tiny"
    first = {n: _sha(out, n) for n in ("model.safetensors", "tokenizer/tokenizer.json", "config.json")}
    fetch.run(cfg)
    assert first == {n: _sha(out, n) for n in first}
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".base_model")]  # no temp leftovers


def test_tiny_source_needs_the_tiny_preset_and_its_own_tokenizer(tmp_path):
    with pytest.raises(ModelLoadError, match="model.preset is 'pi05'"):
        fetch.run(_cfg(tmp_path, preset="pi05"))
    with pytest.raises(ModelLoadError, match="model.tokenizer: must be empty"):
        fetch.run(_cfg(tmp_path, tokenizer="/some/dir"))
    assert not (tmp_path / "results" / "base_model").exists()


def test_local_lerobot_directory(tmp_path, src):
    out = fetch.run(_cfg(tmp_path, source=str(src)))
    assert verify_manifest(out) == []
    assert _sha(out) == sha256_file(src / "model.safetensors")
    source = json.loads((out / "SOURCE.json").read_text())
    assert source["layout"] == "lerobot" and source["directory"] == str(src.resolve())
    assert load_policy(out, preset="tiny").config.chunk_size == 10
    assert (out / STATS_FILE).is_file()  # the source's stats travel with the model
    assert fetch.source_files(_cfg(tmp_path, source=str(src)))[:2] == [str(src / "config.json"),
                                                                         str(src / "model.safetensors")]


def test_large_weights_are_linked_not_copied(tmp_path, src, monkeypatch):
    monkeypatch.setattr(fetch, "LINK_THRESHOLD", 0)
    out = fetch.run(_cfg(tmp_path, source=str(src)))
    how = json.loads((out / "SOURCE.json").read_text())["files"]["model.safetensors"]["how"]
    assert how in ("hardlink", "symlink")
    assert os.path.samefile(out / "model.safetensors", src / "model.safetensors")


def test_a_failed_fetch_leaves_the_previous_output_untouched(tmp_path, src):
    out = fetch.run(_cfg(tmp_path))
    before = _sha(out)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.time_mlp_in.bias"]
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.time_mlp_in.bias"):
        fetch.run(_cfg(tmp_path, source=str(src)))
    assert _sha(out) == before and verify_manifest(out) == []


def test_corrupt_local_sources_fail_clearly(tmp_path, src):
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        fetch.run(_cfg(tmp_path, source=str(src)))
    weights.unlink()
    (src / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelLoadError, match="lacks model.safetensors.*never loaded"):
        fetch.run(_cfg(tmp_path, source=str(src)))
    with pytest.raises(ModelLoadError, match="directory not found"):
        fetch.run(_cfg(tmp_path, source=str(tmp_path / "nowhere")))
    assert not (tmp_path / "results" / "base_model").exists()


def test_a_source_that_disagrees_with_its_manifest_is_refused(tmp_path, src):
    out = fetch.run(_cfg(tmp_path, source=str(src)))  # a pisft output has a MANIFEST.json
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "pisft_model.json").write_text((copy / "pisft_model.json").read_text() + " ")
    with pytest.raises(ModelLoadError, match="does not match its MANIFEST.json"):
        fetch.run(_cfg(tmp_path, source=str(copy)))


def test_preset_mismatch_with_a_local_source(tmp_path, src):
    with pytest.raises(ModelLoadError, match="holds a 'tiny' model but model.preset is 'pi05'"):
        fetch.run(_cfg(tmp_path, source=str(src), preset="pi05"))


def _as_openpi(src, tmp_path, horizon=10):
    """The tiny model in openpi's converted layout (openpi's config.json, names without `model.`)."""
    d = tmp_path / "openpi"
    d.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k[len("model."):]: v for k, v in tensors.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"action_dim": 32, "action_horizon": horizon,
                                               "paligemma_variant": "gemma_2b",
                                               "action_expert_variant": "gemma_300m",
                                               "precision": "float32"}))
    shutil.copy(src / "pisft_model.json", d)  # tiny sizes; a real openpi checkpoint is pi05-sized
    shutil.copytree(src / "tokenizer", d / "tokenizer")
    (d / "assets" / "physical-intelligence" / "libero").mkdir(parents=True)
    return d


def test_openpi_converted_checkpoint(tmp_path, src):
    d = _as_openpi(src, tmp_path)  # horizon 10, the tiny preset's chunk (tests/test_model_forms.py: others)
    stats = {"norm_stats": {
        "state": {"mean": [0] * 8, "std": [1] * 8, "q01": [-1] * 8, "q99": [1] * 8},
        "actions": {"mean": [0] * 32, "std": [1] * 32, "q01": [-2] * 7 + [0] * 25, "q99": [2] * 7 + [0] * 25}}}
    (d / "assets" / "physical-intelligence" / "libero" / "norm_stats.json").write_text(json.dumps(stats))
    out = fetch.run(_cfg(tmp_path, source=str(d)))
    policy = load_policy(out)
    reference = load_policy(src)
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), reference.state_dict().values()))
    assert policy.config.chunk_size == 10
    record = json.loads((out / "SOURCE.json").read_text())
    assert record["layout"] == "openpi" and record["normalization_stats"].startswith("imported")
    assert record["settings"]["chunk_size"] == {"value": 10, "from": "openpi config.json action_horizon"}
    assert load_stats(out / STATS_FILE)["action"]["q99"].tolist() == [2.0] * 7


def test_openpi_checkpoint_of_another_model_is_refused(tmp_path, src):
    d = _as_openpi(src, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["paligemma_variant"] = "gemma_300m"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="not pi0.5's"):
        fetch.run(_cfg(tmp_path, source=str(d)))


def test_hub_source_downloads_through_huggingface_hub(tmp_path, src, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(src)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setenv("HF_ENDPOINT", "https://mirror.example")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    out = fetch.run(_cfg(tmp_path, source="hf://someone/pi05_tiny@v1.2"))
    (repo_id, kwargs), = calls
    assert repo_id == "someone/pi05_tiny" and kwargs["revision"] == "v1.2"
    assert kwargs["endpoint"] == "https://mirror.example" and kwargs["token"] == "hf_secret"
    assert kwargs["local_files_only"] is False and "*.safetensors" in kwargs["allow_patterns"]
    record = json.loads((out / "SOURCE.json").read_text())
    assert (record["kind"], record["repo_id"], record["revision"]) == ("hf", "someone/pi05_tiny", "v1.2")


def test_hub_tokenizer(tmp_path, src, monkeypatch):
    import huggingface_hub

    tokenizer_dir = src / "tokenizer"
    shutil.move(tokenizer_dir, tmp_path / "tok")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(tmp_path / "tok"))
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        fetch.run(_cfg(tmp_path, source=str(src)))
    out = fetch.run(_cfg(tmp_path, source=str(src), tokenizer="hf://google/paligemma-3b-pt-224"))
    assert json.loads((out / "SOURCE.json").read_text())["tokenizer"]["from"] == "hf://google/paligemma-3b-pt-224"


def test_unreachable_hub_is_a_clear_error(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ModelLoadError, match="127.0.0.1:9 is unreachable") as err:
        fetch.run(_cfg(tmp_path, source="hf://lerobot/pi05_base"))
    assert "set model.source" in str(err.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set"):
        fetch.run(_cfg(tmp_path, source="hf://lerobot/pi05_base"))
    with pytest.raises(ModelLoadError, match="expected hf://<owner>/<name>"):
        fetch.run(_cfg(tmp_path, source="hf://pi05_base"))
    assert not (tmp_path / "results" / "base_model").exists()


def test_cli_reports_a_fetch_error_without_traceback(tmp_path, capsys):
    from pisft import cli

    config = tmp_path / "c.yaml"
    config.write_text(f"results_dir: {tmp_path / 'results'}\nmodel:\n  source: {tmp_path / 'nowhere'}\n")
    assert cli.main(["fetch_base", "--config", str(config)]) == 2
    assert "directory not found" in capsys.readouterr().err


def test_light_source_file_list_names_the_stats_file():
    from pisft.model import sources

    assert STATS_FILE in sources.LOCAL_SOURCE_FILES


def test_the_base_models_identity_is_its_weights_and_source_not_the_config_that_fetched_it(tmp_path, src):
    """Issue 56: the run fingerprint hashed the base folder's MANIFEST.json, which lists
    pisft_config.json (every key): a fetch_base rerun after an unrelated change started a fresh
    training run, and the checkpoint's base record would have called it another model."""
    from pisft.base_identity import base_record, same_base
    from pisft.train.run_folders import checkpoint_root, run_fingerprint

    def cfg(**eval_keys):
        return from_dict({"results_dir": str(tmp_path / "results"), "model": {"source": str(src)},
                          "eval": eval_keys})

    out = fetch.run(cfg())
    before = (run_fingerprint(cfg()), checkpoint_root(cfg()), base_record(out),
              (out / "MANIFEST.json").read_bytes())
    fetch.run(cfg(batch_size=3))  # a key fetch_base does not read; the rule reruns on any config
    assert (out / "MANIFEST.json").read_bytes() != before[3]  # the record of the config changed...
    assert json.loads((out / "pisft_config.json").read_text())["eval"]["batch_size"] == 3
    assert run_fingerprint(cfg()) == before[0] and checkpoint_root(cfg()) == before[1]  # ...the model not
    assert same_base(before[2], base_record(out))
    # one weight of the source changes: another model, another run
    tensors = load_file(src / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, str(src / "model.safetensors"))
    fetch.run(cfg())
    assert run_fingerprint(cfg())["base_model"] != before[0]["base_model"]
    assert checkpoint_root(cfg()) != before[1]
    assert not same_base(before[2], base_record(out))
