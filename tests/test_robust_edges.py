"""Issue 33, item 3: a key whose edge value would make a stage's output constant is refused by
validate (and where the stage could still be reached, by the stage), with a message naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pisft import config as C
from pisft.recap.advantages import LabellingError, label
from pisft.recap.value_data import ReturnRange

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config/config.yaml"
LOOP = ["recap.iterations=1", "eval.closed_loop=true"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["recap.lookahead=0"], r"recap.lookahead: .* at least 1 .*every frame's advantage is 0.*, got 0"),
    (["recap.lookahead=-3"], r"recap.lookahead: .* at least 1 .*, got -3"),
    ([*LOOP, "recap.lookahead=0"], r"recap.lookahead: .* at least 1"),
    ([*LOOP, "data.unconditional_prob=1.0"], r"data.unconditional_prob: 1.0 drops every advantage label"),
    (["data.advantage_tag=recap", "data.unconditional_prob=1"], r"data.unconditional_prob: 1.0 drops every"),
    # the edges already refused stay refused (the same class: a constant labelling)
    ([*LOOP, "recap.positive_quantile=0"], r"recap.positive_quantile: .* in \(0, 1\)"),
    ([*LOOP, "recap.positive_quantile=1"], r"recap.positive_quantile: .* in \(0, 1\)"),
    ([*LOOP, "recap.value_bins=1"],
     r"recap.value_bins: must be at least 2 \(a distribution needs at least 2 bins\), got 1"),
    ([*LOOP, "recap.gamma=0"], r"recap.gamma: the discount must be in \(0, 1\]"),
])
def test_constant_output_edges_are_refused(overrides, message):
    with pytest.raises(C.ConfigError, match=message):
        C.load(CONFIG, overrides)


def test_validate_exits_non_zero_on_lookahead_0(tmp_path):
    text = CONFIG.read_text().replace("  lookahead: 10", "  lookahead: 0")
    assert text != CONFIG.read_text()
    path = tmp_path / "config.yaml"
    path.write_text(text)
    out = subprocess.run([sys.executable, "-m", "pisft", "validate", str(path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode != 0 and "recap.lookahead" in out.stderr and "OK" not in out.stdout


def test_the_values_next_to_the_edges_pass():
    C.load(CONFIG, [*LOOP, "recap.lookahead=1", "data.unconditional_prob=0.99"])
    C.load(CONFIG, ["recap.iterations=0", "data.unconditional_prob=1.0"])  # no labels: the key is unused


def test_the_labelling_refuses_lookahead_0_when_called_directly():
    frames = pd.DataFrame({"episode_index": np.repeat([0, 1], 4), "frame_index": np.tile(np.arange(4), 2),
                           "return": -np.tile(np.arange(4, 0, -1), 2).astype(float), "reward": -1.0,
                           "value": np.linspace(-1, 0, 8), "task_index": 0, "source_type": "rollout"})
    with pytest.raises(LabellingError, match="recap.lookahead must be at least 1, got 0"):
        label(frames, scale=ReturnRange(-4.0, 0.0), lookahead=0, gamma=1.0, positive_quantile=0.3, scope="global")
    label(frames, scale=ReturnRange(-4.0, 0.0), lookahead=1, gamma=1.0, positive_quantile=0.3, scope="global")
