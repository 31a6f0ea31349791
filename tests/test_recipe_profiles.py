"""The two recipe profiles (config/profiles/openpi-pi05-libero.yaml, rlinf-recap-libero10.yaml) are
the published recipes key by key: each value is held against the source's, written here with its
file and config name, after a device profile (the recipes set nothing of the machine)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from pisft import config as C
from pisft.workflow import profile as profile_mod

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "config/profiles"
DEVICES = ("ascend-8card.yaml", "cuda-8gpu.yaml")

# Physical-Intelligence/openpi @ 15a9616, src/openpi/training/config.py, TrainConfig "pi05_libero":
#   Pi0Config(pi05=True, action_horizon=10, discrete_state_input=False), batch_size=256,
#   CosineDecaySchedule(warmup_steps=10_000, peak_lr=5e-5, decay_steps=1_000_000, decay_lr=5e-5),
#   AdamW(clip_gradient_norm=1.0) (src/openpi/training/optimizer.py: weight_decay=1e-10,
#   b1 0.9, b2 0.95, eps 1e-8), ema_decay=0.999, num_train_steps=30_000; training-time
#   augmentation in src/openpi/models/model.py preprocess_observation(train=True); the whole
#   dataset trains; Pi0Config.dtype "bfloat16".
OPENPI = {
    ("model", "state_in_prompt"): False,
    ("data", "augment"): "openpi",
    ("data", "eval_fraction"): 0.0,
    ("train", "trainable"): "all",
    ("train", "precision"): "bf16",
    ("train", "global_batch_size"): 256,
    ("train", "steps"): 30_000,
    ("train", "lr"): 5e-5,
    ("train", "warmup_steps"): 10_000,
    ("train", "decay_lr"): 5e-5,
    ("train", "weight_decay"): 1e-10,
    ("train", "grad_clip"): 1.0,
    ("train", "ema_decay"): 0.999,
    ("recap", "iterations"): 0,
}
OPENPI_ADAMW = {"b1": 0.9, "b2": 0.95, "eps": 1e-8}

# RLinf/RLinf @ a3816b5, examples/offline_rl/config/: recap_value_model_sft.yaml (201 atoms on
# [-1, 0], lr 5e-5, head lr 1e-4, batch 256, 8k steps), recap_compute_returns.yaml (gamma 1,
# failure -300), recap_compute_advantages.yaml (N 10, positive_quantile 0.3; one threshold over all
# frames: rlinf/algorithms/offline/process/advantage.py), cfg_rl_openpi.yaml (openpi.config_name
# pi05_libero, train_expert_only False, lr 1e-5 cosine with 5000 warmup steps to min_lr 0,
# weight_decay 1e-10, clip_grad 1.0, batch 512, 30k steps, positive_only_conditional true, unconditional_prob
# 0.1, cfgrl_guidance_scale 1.0, balance_dataset_weights true, from pi0.5 base); the value model
# from pretrained weights (rlinf/models/embodiment/value_model/recap/__init__.py, get_model);
# rlinf/envs/libero/libero_env.py (15 wait
# steps); examples/embodiment/config/env/libero_10.yaml (512 steps); the guide
# (docs/source-en/rst_source/examples/embodied/recap.rst): one iteration, LIBERO-10 task 0.
RLINF = {
    ("model", "state_in_prompt"): False,
    ("data", "augment"): "openpi",
    ("data", "eval_fraction"): 0.0,
    ("data", "positive_only_conditional"): True,
    ("data", "unconditional_prob"): 0.1,
    ("data", "balance_source_weights"): True,
    ("train", "trainable"): "all",
    ("train", "global_batch_size"): 512,
    ("train", "steps"): 30_000,
    ("train", "lr"): 1e-5,
    ("train", "warmup_steps"): 5000,
    ("train", "decay_lr"): 0.0,
    ("train", "weight_decay"): 1e-10,
    ("train", "grad_clip"): 1.0,
    ("eval", "cfg_scale"): 1.0,
    ("eval", "libero_suites"): ["libero_10"],
    ("eval", "task_ids"): [0],
    ("eval", "max_steps"): 512,
    ("eval", "num_wait_steps"): 15,
    ("recap", "iterations"): 1,
    ("recap", "suite"): "libero_10",
    ("recap", "task_ids"): [0],
    ("recap", "max_steps"): 512,
    ("recap", "gamma"): 1.0,
    ("recap", "failure_reward"): -300.0,
    ("recap", "value_bins"): 201,
    ("recap", "value_steps"): 8000,
    ("recap", "value_lr"): 5e-5,
    ("recap", "value_head_lr"): 1e-4,
    ("recap", "value_global_batch_size"): 256,
    ("recap", "lookahead"): 10,
    ("recap", "positive_quantile"): 0.3,
    ("recap", "threshold_scope"): "global",
    ("recap", "holdout_fraction"): 0.0,
    ("recap", "init"): "base",
    ("recap", "value_init"): "base",
}
RECIPES = {"openpi-pi05-libero.yaml": OPENPI, "rlinf-recap-libero10.yaml": RLINF}


def _applied(tmp_path: Path, *profiles: str) -> C.PisftConfig:
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "config/config.yaml", tmp_path / "config.yaml")
    for name in profiles:
        profile_mod.switch(PROFILES / name, tmp_path / "config.yaml", tmp_path / "dvc.yaml")
    return C.load(tmp_path / "config.yaml")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_each_recipe_value_is_the_sources_over_a_device_profile(tmp_path, recipe, device):
    cfg = _applied(tmp_path, device, recipe)
    got = {(section, key): getattr(getattr(cfg, section), key) for section, key in RECIPES[recipe]}
    assert got == RECIPES[recipe]
    # the recipe sets nothing of the machine: the device profile's keys stay
    machine = yaml.safe_load((PROFILES / device).read_text())
    assert cfg.device == machine["device"] and cfg.model.source == machine["model"]["source"]
    assert cfg.train.nproc_per_node == machine["train"]["nproc_per_node"]
    assert cfg.train.micro_batch_size == machine["train"]["micro_batch_size"]
    # and the recipe's batch divides into the device's processes and micro batch (accumulation)
    assert cfg.train.global_batch_size % (cfg.train.micro_batch_size * cfg.world_size) == 0


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_recipe_sets_only_recipe_keys_each_with_its_source(recipe):
    """Every key the profile writes is one the test holds against the source (no uncited value),
    and no key of the machine (device, paths, processes, micro batch)."""
    text = (PROFILES / recipe).read_text()
    profile = yaml.safe_load(text)
    written = {(s, k) for s, keys in profile.items() for k in keys}
    assert written - set(RECIPES[recipe]) <= {("recap", "suite"), ("recap", "episodes_per_task"),
                                              ("recap", "policy_steps"), ("eval", "closed_loop"),
                                              ("eval", "trials_per_task")}
    assert not written & {("model", "source"), ("model", "tokenizer"), ("data", "recap_dir"),
                          ("train", "nproc_per_node"), ("train", "micro_batch_size")}
    for line in text.splitlines():  # each value's line names its source
        if line.startswith("  ") and ":" in line and not line.strip().startswith("#"):
            assert "#" in line, line


def test_pisfts_adamw_is_openpis():
    from pisft.train import optim

    assert (OPENPI_ADAMW["b1"], OPENPI_ADAMW["b2"]) == optim.ADAM_BETAS and OPENPI_ADAMW["eps"] == optim.ADAM_EPS


def test_pisfts_warmup_starts_where_optax_does():
    """openpi's CosineDecaySchedule: optax.warmup_cosine_decay_schedule(init_value=peak_lr /
    (warmup_steps + 1), ...); with decay_lr = peak_lr the rate is constant after the warmup."""
    from pisft.train.optim import lr_at

    peak, warm = OPENPI[("train", "lr")], OPENPI[("train", "warmup_steps")]
    assert lr_at(0, lr=peak, warmup_steps=warm, decay_lr=peak, steps=30_000) == pytest.approx(peak / (warm + 1))
    assert lr_at(20_000, lr=peak, warmup_steps=warm, decay_lr=peak, steps=30_000) == pytest.approx(peak)


def documented_compositions() -> dict[str, list[list[str]]]:
    """The `python -m pisft profile` commands of each fenced block of docs/recipes.md, per recipe
    the block applies (a line's `# or ...` alternatives: each is applied in its own run)."""
    import re

    text = (ROOT / "docs/recipes.md").read_text()
    out: dict[str, list[list[str]]] = {}
    for block in re.findall(r"```\n(.*?)```", text, re.S):
        lines = [line for line in block.splitlines() if line.startswith("python -m pisft profile ")]
        if not lines:
            continue
        runs: list[list[str]] = [[]]
        for line in lines:
            first = line.split()[4]
            names = [Path(first).name] + re.findall(r"(\S+\.yaml)", line.split("#", 1)[1] if "#" in line else "")
            runs = [[*run, name] for run in runs for name in dict.fromkeys(names)]
        recipe = next(n for n in runs[0] if n in RECIPES)
        out.setdefault(recipe, []).extend(runs)
    return out


def test_the_composition_docs_recipes_gives_yields_each_recipe_whole(tmp_path, capsys):
    compositions = documented_compositions()
    assert set(compositions) == set(RECIPES)
    for recipe, runs in compositions.items():
        for i, run in enumerate(runs):
            cfg = _applied(tmp_path / f"{recipe}-{i}", *run)
            got = {(section, key): getattr(getattr(cfg, section), key) for section, key in RECIPES[recipe]}
            assert got == RECIPES[recipe], (run, {k: v for k, v in got.items() if RECIPES[recipe][k] != v})
            notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
            assert not [n for n in notes if f"that {PROFILES / recipe}" in n], notes  # nothing of the recipe replaced


def test_a_profile_that_replaces_a_recipes_keys_says_so(tmp_path, capsys):
    """RLinf's recipe, then a device profile: the recipe's batch, learning rate and iterations were
    replaced without a word; now a note names each key and both values."""
    cfg = _applied(tmp_path / "a", "rlinf-recap-libero10.yaml", "cuda-8gpu.yaml")
    assert (cfg.train.global_batch_size, cfg.train.lr, cfg.recap.iterations) == (128, 5e-5, 0)  # the later wins
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1, notes
    note = notes[0]
    assert note.startswith(f"note: {PROFILES / 'cuda-8gpu.yaml'} replaces ") and f"that {PROFILES / RLINF_FILE}" in note
    for fragment in ("train.global_batch_size 512 -> 128", "train.lr 1e-05 -> 5e-05", "recap.iterations 1 -> 0"):
        assert fragment in note, note
    recorded = profile_mod.applied_profiles((tmp_path / "a" / "config.yaml").read_text())
    assert recorded == [str(PROFILES / "rlinf-recap-libero10.yaml"), str(PROFILES / "cuda-8gpu.yaml")]
    # a key set to the value the earlier profile set is not a replacement; a key the user edited
    # after a profile is no longer that profile's
    text = (tmp_path / "a" / "config.yaml").read_text().replace("  global_batch_size: 128", "  global_batch_size: 64")
    (tmp_path / "a" / "config.yaml").write_text(text)
    profile_mod.switch(PROFILES / RLINF_FILE, tmp_path / "a" / "config.yaml", tmp_path / "a" / "dvc.yaml")
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "global_batch_size" not in notes[0] and "train.lr 5e-05 -> 1e-05" in notes[0]


RLINF_FILE = "rlinf-recap-libero10.yaml"
