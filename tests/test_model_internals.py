"""Guards on pisft.model.lerobot_internals: fail loudly if LeRobot's pi0.5 changes underneath."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from pisft.model import lerobot_internals as internals
from pisft.model.policy import build_policy
from pisft.model.presets import PRESETS


@pytest.fixture(scope="module")
def tiny():
    return build_policy("tiny", seed=0)


def test_lerobot_version_is_the_one_the_internals_were_written_for():
    assert importlib.metadata.version("lerobot") == "0.6.1", (
        "lerobot_internals.py was written against LeRobot 0.6.1: re-check every assumption in it")


def test_every_patched_assumption_still_holds():
    assert internals.structure_problems() == []


def test_tiny_policy_has_the_expected_module_tree(tiny):
    from lerobot.policies.pi05.modeling_pi05 import PaliGemmaWithExpertModel, PI05Pytorch
    from lerobot.policies.pi_gemma import (PaliGemmaForConditionalGenerationWithPiGemma, PiGemmaForCausalLM,
                                           PiGemmaRMSNorm)

    arch = PRESETS["tiny"].arch
    core = tiny.model
    assert isinstance(core, PI05Pytorch)
    pwe = core.paligemma_with_expert
    assert type(pwe) is PaliGemmaWithExpertModel
    assert type(pwe.paligemma) is PaliGemmaForConditionalGenerationWithPiGemma
    assert type(pwe.gemma_expert) is PiGemmaForCausalLM
    vision = pwe.paligemma.model.vision_tower.vision_model
    assert len(vision.encoder.layers) == arch.vision.num_hidden_layers
    assert vision.embeddings.patch_embedding.weight.shape == (arch.vision.hidden_size, 3, 16, 16)
    assert vision.encoder.layers[0].mlp.fc1.out_features == arch.vision.intermediate_size
    assert pwe.paligemma.model.multi_modal_projector.linear.weight.shape == (arch.vlm.width, arch.vision.hidden_size)
    lm = pwe.paligemma.model.language_model
    assert len(lm.layers) == arch.vlm.depth and lm.embed_tokens.weight.shape == (arch.vocab_size, arch.vlm.width)
    assert lm.layers[0].mlp.up_proj.out_features == arch.vlm.mlp_dim
    assert lm.layers[0].self_attn.q_proj.out_features == 8 * arch.vlm.head_dim
    expert = pwe.gemma_expert.model
    assert expert.embed_tokens is None and len(expert.layers) == arch.expert.depth
    norm = expert.layers[0].input_layernorm
    assert isinstance(norm, PiGemmaRMSNorm) and norm.dense is not None  # adaRMS on the expert
    assert norm.dense.weight.shape == (3 * arch.expert.width, arch.expert.width)
    assert lm.layers[0].input_layernorm.dense is None  # plain RMSNorm on the VLM
    for name in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"):
        assert isinstance(getattr(core, name), torch.nn.Linear)
    assert core.action_in_proj.weight.shape == (arch.expert.width, tiny.config.max_action_dim)
    assert core.time_mlp_in.weight.shape == (arch.expert.width, arch.expert.width)


def test_no_tensor_of_the_tiny_model_inherits_a_hard_coded_lerobot_size(tiny):
    banned = {257152, 4304, 2048, 1152, 16384}
    for name, tensor in tiny.state_dict().items():
        assert not banned.intersection(tensor.shape), f"{name} has a LeRobot pi0.5 size: {tuple(tensor.shape)}"
    total = sum(p.numel() for p in tiny.parameters())
    assert 1_000_000 <= total <= 8_000_000


def test_vlm_embeddings_are_tied_and_the_patch_is_undone(tiny):
    from lerobot.policies.pi05 import modeling_pi05, processor_pi05

    assert internals.vlm_embeddings_tied(tiny)
    before = (modeling_pi05.get_gemma_config, modeling_pi05.PaliGemmaForConditionalGenerationWithPiGemma,
              modeling_pi05.PiGemmaForCausalLM, processor_pi05.TokenizerProcessorStep)
    with pytest.raises(RuntimeError), internals.sized_construction(PRESETS["tiny"].arch):
        assert modeling_pi05.get_gemma_config is not before[0]
        raise RuntimeError("boom")
    after = (modeling_pi05.get_gemma_config, modeling_pi05.PaliGemmaForConditionalGenerationWithPiGemma,
             modeling_pi05.PiGemmaForCausalLM, processor_pi05.TokenizerProcessorStep)
    assert before == after
    assert modeling_pi05.get_gemma_config("gemma_300m").width == 1024  # LeRobot's own again


def test_arch_validation_enforces_lerobot_constraints():
    arch = PRESETS["tiny"].arch
    bad_heads = internals.Arch(vlm=internals.GemmaSize(64, 2, 128, 4, 1, 16), expert=arch.expert,
                               vision=arch.vision, vocab_size=arch.vocab_size)
    with pytest.raises(ValueError, match="8 \\* head_dim"):
        bad_heads.validate()
    bad_depth = internals.Arch(vlm=arch.vlm, expert=internals.GemmaSize(64, 3, 128, 8, 1, 32),
                               vision=arch.vision, vocab_size=arch.vocab_size)
    with pytest.raises(ValueError, match="depth"):
        bad_depth.validate()


def test_processors_are_lerobots_pipeline_with_a_local_tokenizer(tiny):
    from lerobot.processor import TokenizerProcessorStep

    from pisft.model.tokenizer import build_tiny_tokenizer
    from model_fixtures import fake_stats

    tokenizer = build_tiny_tokenizer()
    pre, post = internals.pi05_processors(tiny.config, fake_stats(), tokenizer)
    names = [type(step).__name__ for step in pre.steps]
    assert names == ["RenameObservationsProcessorStep", "AddBatchDimensionProcessorStep",
                     "RelativeActionsProcessorStep", "NormalizerProcessorStep",
                     "Pi05PrepareStateTokenizerProcessorStep", "TokenizerProcessorStep", "DeviceProcessorStep"]
    step = next(s for s in pre.steps if isinstance(s, TokenizerProcessorStep))
    assert step.input_tokenizer is tokenizer and step.max_length == tiny.config.tokenizer_max_length
    assert [type(s).__name__ for s in post.steps][0] == "UnnormalizerProcessorStep"


def test_pi05_preset_builds_on_meta_without_memory():
    policy = build_policy("pi05", seed=0, device="meta")
    params = list(policy.parameters())
    assert all(p.is_meta for p in params)
    total = sum(p.numel() for p in params)
    assert 3.3e9 <= total <= 3.8e9, total
    assert internals.vlm_embeddings_tied(policy)
    assert policy.config.device == "meta"
