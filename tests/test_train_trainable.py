"""train.trainable: each mode's trainable set against the library it follows, frozen parameters
in bf16, the merged LoRA export (W + (alpha / r) B A) read by pisft and by LeRobot, the adapter in
PEFT's layout loaded onto the base by peft, and a checkpoint of another base refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch
from model_fixtures import tiny_model_dir
from safetensors.torch import load_file

from pisft.model.pi05.construction import (
    detach_expert_head,
    prepare_for_training,
    sized_construction,
    tie_vlm_embeddings,
)
from pisft.model import registry
from pisft.model.pi05.forward import prefix_frozen
from pisft.model.policy import WEIGHTS_FILE, load_policy, make_config
from pisft.model.pi05.presets import get_preset
from pisft.train import trainable as tr
from pisft.train.export_weights import ADAPTER_WEIGHTS, merged_weight, write_adapter, write_policy_weights

VLM = "model.paligemma_with_expert.paligemma."
# openpi's `llm`: both Gemmas (the VLM's lm_head is its token embedding, tied: openpi's llm/embedder)
LLM = ("model.paligemma_with_expert.paligemma.model.language_model.", "model.paligemma_with_expert.gemma_expert.",
       "model.paligemma_with_expert.paligemma.lm_head.")


def _trained(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _lerobot_built(**flags):
    """A tiny PI05Policy built by LeRobot's own constructor with its freezing flags set."""
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    config = make_config("tiny")
    for key, value in flags.items():
        setattr(config, key, value)
    with sized_construction(get_preset("tiny").arch):
        policy = PI05Policy(config)
    tie_vlm_embeddings(policy)
    return policy


def _tiny(tmp_path_factory):
    policy = load_policy(tiny_model_dir(tmp_path_factory))
    detach_expert_head(policy)  # as training does (prepare_for_training)
    return policy


@pytest.mark.parametrize(("mode", "flag"), [("expert", "train_expert_only"), ("no_vision", "freeze_vision_encoder")])
def test_expert_and_no_vision_freeze_what_lerobots_own_flags_freeze(tmp_path_factory, mode, flag):
    oracle = _lerobot_built(**{flag: True})  # LeRobot's PaliGemmaWithExpertModel._set_requires_grad
    ours = _tiny(tmp_path_factory)
    applied = tr.apply_mode(ours, mode)
    detach_expert_head(oracle)
    assert _trained(ours) == _trained(oracle)
    assert applied.trainable == sum(p.numel() for n, p in ours.named_parameters() if p.requires_grad)
    if mode == "expert":
        assert _trained(ours) and all(VLM not in "." + n for n in _trained(ours))
    ours.train()  # frozen sub-models stay in eval mode (LeRobot's train() override)
    pwe = ours.model.paligemma_with_expert
    frozen_part = pwe.paligemma if mode == "expert" else pwe.paligemma.model.vision_tower
    assert not frozen_part.training and pwe.gemma_expert.training
    # a loaded model directory's own flags do not leak: `all` trains everything again
    again = _tiny(tmp_path_factory)
    tr.apply_mode(again, mode)
    tr.apply_mode(again, "all")
    assert all(p.requires_grad for p in again.parameters())


def test_lerobot_lora_trains_what_lerobots_wrap_with_peft_trains(tmp_path_factory):
    oracle = _lerobot_built()
    detach_expert_head(oracle)
    oracle.config.pretrained_path = "base"  # wrap_with_peft refuses a model without one
    import dataclasses

    from lerobot.configs.default import PeftConfig

    # as lerobot_train does (`--peft.*` defaults): r 16, lora_alpha None (peft's 8)
    wrapped = oracle.wrap_with_peft(peft_cli_overrides=dataclasses.asdict(PeftConfig()))
    theirs = {n.removeprefix("base_model.model.") for n, p in wrapped.named_parameters() if p.requires_grad}
    ours = _tiny(tmp_path_factory)
    spec = tr.lora_spec("lerobot")
    tr.apply_mode(ours, "lora", spec)
    assert _trained(ours) == theirs
    assert any("gemma_expert" in n and "q_proj.lora_A" in n for n in theirs)
    assert {n for n in theirs if "lora_A" in n and "gemma_expert" not in n} == {
        "model.action_in_proj.lora_A.default.weight", "model.action_out_proj.lora_A.default.weight"}
    lora_cfg = wrapped.peft_config["default"]
    assert (lora_cfg.r, lora_cfg.lora_alpha) == (spec.rank, spec.alpha) == (16, 8)


# RLinf's LoRA branch (rlinf/models/__init__.py @a3816b5): get_peft_model on paligemma with this list.
RLINF_TARGETS = ["proj", "qkv", "fc1", "fc2", "q", "kv", "fc3", "out_proj", "q_proj", "k_proj", "v_proj",
                 "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def test_rlinf_lora_trains_what_rlinfs_peft_call_trains_except_the_unused_lm_head(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    oracle = _tiny(tmp_path_factory)
    pwe = oracle.model.paligemma_with_expert
    pwe.paligemma = get_peft_model(pwe.paligemma, LoraConfig(r=32, lora_alpha=32, lora_dropout=0.0,
                                                             target_modules=RLINF_TARGETS,
                                                             init_lora_weights="gaussian"))
    theirs = {n.replace("paligemma.base_model.model.", "paligemma.") for n, p in oracle.named_parameters()
              if p.requires_grad and "lm_head" not in n}
    ours = _tiny(tmp_path_factory)
    spec = tr.lora_spec("rlinf")
    tr.apply_mode(ours, "lora", spec)
    assert _trained(ours) == theirs
    assert {n for n in _trained(ours) if "gemma_expert" in n and "lora" in n} == set()  # expert: in full
    assert any("vision_tower" in n and "fc1.lora_A" in n for n in _trained(ours))
    assert (spec.rank, spec.alpha, spec.init) == (32, 32.0, "gaussian")


def test_openpi_lora_follows_openpis_freeze_filter_and_variants(tmp_path_factory):
    """openpi (pi0_config.get_freeze_filter @15a9616): frozen = `.*llm.*` and not `.*lora.*`; LoRA on
    attention and FFN of both Gemmas (gemma.py gemma_2b_lora r16 a16, gemma_300m_lora r32 a32)."""
    policy = _tiny(tmp_path_factory)
    spec = tr.lora_spec("openpi")
    tr.apply_mode(policy, "lora", spec, seed=3)
    for name, p in policy.named_parameters():
        in_llm = name.startswith(LLM)
        assert p.requires_grad == (not in_llm or ".lora_" in name), name
    adapted = {n.rsplit(".", 1)[0] for n, m in policy.named_modules() if hasattr(m, "lora_A")}
    linears = {n for n, m in _tiny(tmp_path_factory).named_modules()
               if n.startswith(LLM) and re.search(r"\.layers\.\d+\.(self_attn|mlp)\.\w+_proj$", n)}
    assert {n for n, m in policy.named_modules() if hasattr(m, "lora_A")} == linears and adapted
    for name, m in policy.named_modules():
        if hasattr(m, "lora_A"):
            want = 32 if "gemma_expert" in name else 16
            assert m.r["default"] == want and m.scaling["default"] == 1.0, name
            assert m.lora_B["default"].weight.abs().sum() > 0  # openpi: A and B ~ N(0, 0.01)


def test_value_model_modes():
    from pisft.model.policy import build_policy
    from pisft.recap.value_model import ValueModel

    for mode in tr.VALUE_MODES:
        model = ValueModel(build_policy("tiny", seed=0), bins=11)
        spec = tr.lora_spec("rlinf", value_model=True) if mode == "lora" else None
        tr.apply_mode(model, mode, spec, value_model=True)
        trained = _trained(model)
        assert {"readout.weight", "head.weight", "head.bias"} <= trained
        if mode == "head":
            assert trained == {"readout.weight", "head.weight", "head.bias"}
        if mode == "no_vision":
            assert not any("vision_tower" in n for n in trained) and any("language_model" in n for n in trained)
        if mode == "lora":
            assert any(".lora_A." in n for n in trained)
            assert all(".lora_" in n or n.startswith(("readout.", "head.")) for n in trained)
    with pytest.raises(ValueError, match="value model does not have"):
        tr.lora_spec("lerobot", value_model=True)


# ------------------------------------------------------------------------------ the mode table
def test_every_entry_of_the_mode_table_is_well_formed_and_every_list_of_modes_is_read_off_it():
    from pisft import config
    from pisft.bench import real_size

    pi05 = registry.model_spec("pi05").trainable
    assert set(tr._FROZEN_PARTS) | set(pi05.parts) == set(config.FROZEN_PARTS)  # each part has its rule
    for name, mode in config.TRAINABLE_MODE_TABLE.items():
        assert mode.models and set(mode.models) <= set(config.TRAINABLE_MODELS), name
        assert mode.frozen in config.FROZEN_PARTS, name
        assert mode.lerobot_flag in ("", *config.LEROBOT_FREEZE_FLAGS), name
        assert ("policy" in mode.models) == (mode.bench_rank is not None), name
    # the order users see (messages, docs, bench rows) as it was when the table was made
    assert tr.MODES == config.TRAINABLE_MODES == ("all", "expert", "no_vision", "lora")
    assert tr.VALUE_MODES == config.VALUE_TRAINABLE_MODES == ("all", "no_vision", "head", "lora")
    assert real_size.MODES == real_size.bench_order() == ("expert", "lora", "no_vision", "all")


def test_the_mode_a_config_sets_is_read_in_one_place():
    """`configured_mode` reads the key `config.TRAINABLE_MODELS` names for the policy or the value
    model (spec_for, job.frozen_in_bf16 and job.apply_trainable ask it)."""
    from pisft import config

    cfg = config.from_dict({"train": {"trainable": "expert"}, "recap": {"value_trainable": "head"}})
    assert tr.mode_key() == "train.trainable" and tr.mode_key(value_model=True) == "recap.value_trainable"
    assert tr.configured_mode(cfg) == "expert" and tr.configured_mode(cfg, value_model=True) == "head"
    lora = config.from_dict({"train": {"trainable": "all", "lora_targets": "rlinf"},
                             "recap": {"value_trainable": "lora"}})
    assert tr.spec_for(lora) is None and tr.spec_for(lora, value_model=True).preset == "rlinf"


def _frozen_vlm_entry():
    """A mode the table does not have: the VLM frozen, for the policy and the value model."""
    from pisft import config

    return config.TrainableMode(("policy", "value"), "vlm", bench_rank=-1, lerobot_flag="train_expert_only")


def test_a_new_mode_is_one_entry_of_the_table(tmp_path_factory, monkeypatch):
    """A throwaway entry makes the config check accept the mode for both keys and list it, and the
    rule, its application, the LoRA specs and the benchmark's rows follow it: no other site names
    the modes."""
    from pisft import config
    from pisft.bench import real_size
    from pisft.model.policy import build_policy
    from pisft.recap.value_model import ValueModel

    both = {"train": {"trainable": "frozen_vlm"}, "recap": {"value_trainable": "frozen_vlm"}}
    with pytest.raises(config.ConfigError, match="'frozen_vlm' is not one of"):
        config.from_dict(both)
    monkeypatch.setitem(config.TRAINABLE_MODE_TABLE, "frozen_vlm", _frozen_vlm_entry())
    monkeypatch.setitem(config.TRAINABLE_MODE_TABLE, "lora_too",
                        config.TrainableMode(("policy",), "base", bench_rank=9, lora=True))
    cfg = config.from_dict(both)
    assert tr.spec_for(cfg) is None and tr.spec_for(cfg, value_model=True) is None
    with pytest.raises(config.ConfigError, match="one of all, expert, no_vision, lora, frozen_vlm, lora_too"):
        config.from_dict({"train": {"trainable": "nope"}})
    with pytest.raises(config.ConfigError, match="one of all, no_vision, head, lora, frozen_vlm"):
        config.from_dict({"recap": {"value_trainable": "lora_too"}})
    lora_cfg = config.from_dict({"train": {"trainable": "lora_too", "lora_rank": 4, "lora_targets": "rlinf"}})
    assert tr.spec_for(lora_cfg).rank == 4 and tr.spec_for_mode("lora_too", "rlinf").preset == "rlinf"
    assert real_size.bench_order() == ("frozen_vlm", "expert", "lora", "no_vision", "all", "lora_too")

    pi05 = registry.model_spec("pi05")
    assert not tr.is_trainable("model.paligemma_with_expert.paligemma.model.language_model.norm.weight", "frozen_vlm",
                               model=pi05)
    assert tr.is_trainable("model.action_in_proj.weight", "frozen_vlm", model=pi05)
    ours, expert = _tiny(tmp_path_factory), _tiny(tmp_path_factory)
    applied = tr.apply_mode(ours, "frozen_vlm")
    tr.apply_mode(expert, "expert")
    assert applied.mode == "frozen_vlm" and _trained(ours) == _trained(expert)
    assert prefix_frozen(ours) and ours.model.paligemma_with_expert.train_expert_only
    value, head = (ValueModel(build_policy("tiny", seed=0), bins=11) for _ in range(2))
    tr.apply_mode(value, "frozen_vlm", value_model=True)
    tr.apply_mode(head, "head", value_model=True)
    assert _trained(value) == _trained(head) == {"readout.weight", "head.weight", "head.bias"}
    lora = _tiny(tmp_path_factory)
    tr.apply_mode(lora, "lora_too", tr.lora_spec("rlinf"))
    assert any(".lora_A." in n for n in _trained(lora))


def test_an_entry_whose_rule_leaves_the_prefix_trainable_is_refused(tmp_path_factory, monkeypatch):
    """The entry's prefix fact (what the frozen-prefix forward and the FSDP units will find) is
    checked against what the mode's rule froze."""
    parts = registry.model_spec("pi05").trainable.parts
    monkeypatch.setitem(parts, "vlm", parts["vision"])  # a wrong rule
    with pytest.raises(RuntimeError, match="its entry says the VLM prefix is frozen"):
        tr.apply_mode(_tiny(tmp_path_factory), "expert")

def test_frozen_parameters_are_held_in_bf16_except_what_lerobot_keeps_in_fp32(tmp_path_factory):
    policy = _tiny(tmp_path_factory)
    tr.apply_mode(policy, "expert")
    assert tr.hold_frozen_in(policy, "bf16") > 0
    for name, p in policy.named_parameters():
        keep = p.requires_grad or any(k in name for k in registry.model_spec("pi05").trainable.keep_fp32)
        assert p.dtype == (torch.float32 if keep else torch.bfloat16), name
    assert tr.hold_frozen_in(_tiny(tmp_path_factory), "fp32") == 0


@pytest.mark.integration  # ~10 s: six pi0.5 builds on the meta device
def test_pi05_trainable_counts_on_the_meta_device():
    from pisft.model.policy import build_policy

    counts = {}
    for mode, preset in [("all", None), ("expert", None), ("no_vision", None), ("lora", "lerobot"),
                         ("lora", "openpi"), ("lora", "rlinf")]:
        policy = build_policy("pi05", seed=0, device="meta")
        detach_expert_head(policy)
        tr.apply_mode(policy, mode, tr.lora_spec(preset) if preset else None)
        counts[(mode, preset)] = tr.count_parameters(policy)["trainable"]
    assert counts[("all", None)] > 3.3e9
    assert 4.0e8 < counts[("expert", None)] < 4.5e8  # the action expert + projections: ~430M
    assert counts[("lora", "lerobot")] < 2e6 < counts[("lora", "openpi")] < counts[("no_vision", None)]


# ------------------------------------------------------------------------------------ the export
@pytest.fixture(scope="module")
def trained_lora(tmp_path_factory):
    """A tiny policy with openpi LoRA adapters (non-zero B), "trained" by one perturbation of
    every trainable parameter; its merged export and adapter written as train_8card writes them."""
    base = tiny_model_dir(tmp_path_factory)
    policy = _tiny(tmp_path_factory)
    spec = tr.lora_spec("openpi")
    tr.apply_mode(policy, "lora", spec, seed=1)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("export")
    import shutil

    shutil.copytree(base, out / "model")
    counts = write_policy_weights(policy, base / WEIGHTS_FILE, out / "model" / WEIGHTS_FILE, is_main=True)
    write_adapter(policy, spec, base, out / "adapter", is_main=True, policy_config=policy.config)
    return base, policy, spec, out, counts


def test_merged_export_is_w_plus_scaled_ba_and_frozen_tensors_are_the_bases(trained_lora):
    base, policy, spec, out, counts = trained_lora
    assert counts["merged"] > 0 and counts["frozen"] > 0 and counts["trained"] > 0
    got, base_w = load_file(out / "model" / WEIGHTS_FILE), load_file(base / WEIGHTS_FILE)
    assert set(got) == set(base_w)  # a plain pi0.5 file: same names as the base, no lora/base_layer
    adapter = load_file(out / "adapter" / ADAPTER_WEIGHTS)
    modules = {n.rsplit(".", 1)[0] for n, m in policy.named_modules() if hasattr(m, "lora_A")}
    assert modules
    for module in {n for n, m in policy.named_modules() if hasattr(m, "lora_A")}:
        a = adapter[f"base_model.model.{module}.lora_A.weight"]
        b = adapter[f"base_model.model.{module}.lora_B.weight"]
        w = base_w[f"{module}.weight"]
        r, alpha = a.shape[0], (32.0 if "gemma_expert" in module else 16.0)
        by_hand = w.double() + (alpha / r) * (b.double() @ a.double())
        torch.testing.assert_close(got[f"{module}.weight"].double(), by_hand, rtol=0, atol=1e-6)
        assert not torch.equal(got[f"{module}.weight"], w)
        assert torch.equal(merged_weight(w, a, b, spec.scaling(module)), got[f"{module}.weight"])
    frozen = [n for n, p in policy.named_parameters() if not p.requires_grad and ".base_layer." not in n]
    assert frozen
    for name in frozen:
        assert torch.equal(got[name], base_w[name]), name  # bit-identical to the base
    vision = "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.post_layernorm.weight"
    assert not torch.equal(got[vision], base_w[vision])  # trained in full (openpi)


def test_merged_export_loads_in_pisft_and_in_lerobots_from_pretrained(trained_lora):
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    _, _, _, out, _ = trained_lora
    ours = load_policy(out / "model").state_dict()
    with sized_construction(get_preset("tiny").arch):
        theirs = PI05Policy.from_pretrained(str(out / "model")).state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(theirs[key].float(), ours[key].float(), rtol=0, atol=0)


def test_adapter_in_peft_layout_loads_onto_the_base_with_peft(trained_lora):
    from peft import PeftConfig, PeftModel

    base, _, spec, out, _ = trained_lora
    config = PeftConfig.from_pretrained(str(out / "adapter"))
    assert config.base_model_name_or_path == str(base.resolve())
    assert json.loads((out / "adapter" / "config.json").read_text())["use_peft"] is True
    onto = load_policy(base)
    peft_model = PeftModel.from_pretrained(onto, str(out / "adapter"))
    merged = peft_model.merge_and_unload().state_dict()
    exported = load_policy(out / "model").state_dict()
    for key, value in exported.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-6)


def test_rlinfs_adapter_of_a_fused_expert_holds_lerobots_separate_projections(tmp_path_factory, tmp_path):
    """rlinf trains the action expert in full, so training fuses its q/k/v and gate/up; the adapter
    file names LeRobot's separate projections (PEFT's modules_to_save), each the fused rows: the base
    with the adapter loaded through PEFT is the merged export, expert included (the fused names were
    written before, which PEFT skipped: the base expert ran)."""
    from peft import PeftModel

    base = tiny_model_dir(tmp_path_factory)
    policy = _tiny(tmp_path_factory)
    spec = tr.lora_spec("rlinf")
    tr.apply_training_layout(policy, "lora", spec, precision="fp32", seed=1)
    assert any("qkv_proj" in n for n, _ in policy.named_parameters())  # the expert fused
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    import shutil

    shutil.copytree(base, tmp_path / "model")
    write_policy_weights(policy, base / WEIGHTS_FILE, tmp_path / "model" / WEIGHTS_FILE, is_main=True)
    write_adapter(policy, spec, base, tmp_path / "adapter", is_main=True, policy_config=policy.config)
    adapter = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    assert not [n for n in adapter if "qkv_proj" in n or "gate_up_proj" in n]
    assert [n for n in adapter if "gemma_expert" in n and ".q_proj." in n]
    merged = PeftModel.from_pretrained(load_policy(base), str(tmp_path / "adapter")).merge_and_unload().state_dict()
    exported = load_policy(tmp_path / "model").state_dict()
    expert_q = [k for k in exported if "gemma_expert" in k and k.endswith("q_proj.weight")]
    assert expert_q and not torch.equal(exported[expert_q[0]], load_policy(base).state_dict()[expert_q[0]])
    for key, value in exported.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-6, msg=key)


# ------------------------------------------------------------------------------------ checkpoints
@pytest.mark.usefixtures("one_process_group")
def test_a_checkpoint_of_another_base_is_refused_naming_both(tmp_path_factory, tmp_path):
    from pisft.base_identity import base_record
    from pisft.train.checkpoint import CheckpointManager, OtherBase

    from safetensors.torch import save_file

    from pisft.io import write_manifest

    base = tiny_model_dir(tmp_path_factory, tmp_path / "base")
    other = tiny_model_dir(tmp_path_factory, tmp_path / "other_base")
    tensors = load_file(other / WEIGHTS_FILE)  # another base: one of its frozen weights differs
    name = next(n for n in tensors if "language_model" in n)
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, str(other / WEIGHTS_FILE))
    write_manifest(base)
    write_manifest(other)
    policy = _tiny(tmp_path_factory)
    tr.apply_mode(policy, "expert")
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)

    def manager(b):
        return CheckpointManager(tmp_path / "ckpt", keep_last=2, rank=0, world_size=1, fingerprint={},
                                 config={}, base=base_record(b))

    path = manager(base).save(1, policy, optimizer, scheduler)
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["base"] == base_record(base)
    found = manager(base).find_resume()
    manager(base).load(found, policy, optimizer, scheduler)  # same base: resumes
    with pytest.raises(OtherBase) as err:
        manager(other).load(found, policy, optimizer, scheduler)
    assert str(base) in str(err.value) and str(other) in str(err.value)
    # what the checkpoint holds: the trained tensors only
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert model_keys == _trained(policy)


# ------------------------------------------------------------------ FSDP2 with frozen parameters
@pytest.mark.integration  # ~15 s: two sharded optimizer steps per mode
@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("mode", ["expert", "lora"])
def test_fsdp2_bf16_steps_leave_frozen_bf16_parameters_untouched_and_stateless(tmp_path_factory, mode):
    """Frozen parameters held in bf16 next to fp32 trained ones in one FSDP2 unit (MixedPrecisionPolicy
    param_dtype bf16): they get no gradient and no AdamW state, and keep their values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.utils.data import default_collate
    from train_fixtures import inputs_dir

    from pisft.data.dataset import load_split, load_stats
    from pisft.model.policy import make_processors
    from pisft.train import fsdp, optim
    from pisft.train.policy_task import PolicyTask

    root = inputs_dir(tmp_path_factory)
    policy = load_policy(root / "base_model", dtype="float32")
    pre, _ = make_processors(policy, root / "base_model", load_stats(root / "dataset"))
    ds = load_split(root / "dataset", "train", chunk_size=policy.config.chunk_size)
    prepare_for_training(policy, checkpointing=True)
    tr.apply_mode(policy, mode, tr.lora_spec("openpi") if mode == "lora" else None, seed=0)
    assert tr.hold_frozen_in(policy, "bf16") > 0
    fsdp.shard(policy, init_device_mesh("cpu", (1,)), "bf16")
    frozen = {n: p.to_local().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    assert {p.dtype for n, p in policy.named_parameters() if n in frozen} >= {torch.bfloat16}
    opt = optim.build_optimizer(policy.parameters(), lr=1e-3, weight_decay=0.0, fused=False)
    task = PolicyTask(policy, pre, torch.device("cpu"), "bf16")
    g = torch.Generator().manual_seed(0)
    b, d = policy.config.chunk_size, policy.config.max_action_dim
    policy.train()
    for step in range(2):
        batch = task.prepare(default_collate([ds[i] for i in range(4 * step, 4 * step + 4)]))
        rand = {"noise": torch.randn(4, b, d, generator=g), "time": torch.rand(4, generator=g) * 0.9 + 0.05}
        loss = task.loss(policy, batch, rand)
        assert torch.isfinite(loss)
        loss.backward()
        assert all(p.grad is None for n, p in policy.named_parameters() if n in frozen)
        assert any(p.grad is not None for p in policy.parameters() if p.requires_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
    stateful = {id(p) for p in opt.state}
    for name, p in policy.named_parameters():
        assert isinstance(p, DTensor)
        if name in frozen:
            assert id(p) not in stateful and torch.equal(p.to_local(), frozen[name]), name


def test_a_lora_value_model_exports_merged_and_loads_strictly(tmp_path_factory, tmp_path):
    from pisft.io import sha256_file
    from pisft.recap import value_model as vm

    base = tiny_model_dir(tmp_path_factory)
    model = vm.from_base(base, bins=11, preset="tiny", seed=0)
    spec = tr.lora_spec("openpi", value_model=True)
    tr.apply_mode(model, "lora", spec, seed=0, value_model=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    config = vm.ValueModelConfig(base_model=str(base), preset="tiny", bins=11, return_min=-1.0, return_max=0.0,
                                 base_config_sha256=sha256_file(base / "config.json"))
    vm.save(model, tmp_path, config, write_weights=lambda path: write_policy_weights(
        model, base / WEIGHTS_FILE, path, is_main=True, prefix="policy."))
    loaded, _ = vm.load(tmp_path)  # strict: the plain value model's names, no adapter left
    module = next(n for n, m in model.named_modules() if hasattr(m, "lora_A"))
    lora = dict(model.get_submodule(module).named_parameters())
    want = merged_weight(lora["base_layer.weight"], lora["lora_A.default.weight"], lora["lora_B.default.weight"],
                         spec.scaling(module))
    torch.testing.assert_close(loaded.get_submodule(module).weight, want, rtol=0, atol=0)
    torch.testing.assert_close(loaded.head.weight, model.head.weight, rtol=0, atol=0)
