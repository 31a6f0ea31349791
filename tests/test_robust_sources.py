"""Issue 22, item 11: an hf:// source with an invalid repository id says so."""

from __future__ import annotations

import pytest
from test_model_fetch import _cfg

from pisft.errors import ModelLoadError
from pisft.model import fetch, sources


@pytest.mark.parametrize(("repo", "why"), [
    ("lerobot/pi05--base", "Cannot have -- or .."),
    ("lerobot/-pi05_base", "must use alphanumeric chars"),
    ("lerobot/" + "p" * 100, "maximum length is 96"),
])
@pytest.mark.parametrize("offline", ["1", ""])
def test_an_invalid_repository_id_is_named_as_such_not_a_cache_miss(tmp_path, monkeypatch, repo, why, offline):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: no network either way
    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    with pytest.raises(ModelLoadError) as err:
        fetch.run(_cfg(tmp_path, source=f"hf://{repo}"))
    msg = str(err.value)
    assert f"'{repo}' is not a valid Hugging Face repository id" in msg and why in msg
    assert "local Hugging Face cache" not in msg and "unreachable" not in msg
    assert "Correct model.source" in msg
    assert not (tmp_path / "results" / "base_model").exists()


def test_valid_ids_and_an_empty_revision():
    assert sources.parse_source("hf://lerobot/pi05_base@main").repo_id == "lerobot/pi05_base"
    assert sources.repo_id_problem("physical-intelligence/pi0.5-libero") is None
    with pytest.raises(ModelLoadError, match="empty revision after '@'"):
        sources.parse_source("hf://lerobot/pi05_base@")
