"""Guards on pisft.model.pi05 (pisft's knowledge of LeRobot's pi0.5 internals): fail loudly if LeRobot's
pi0.5 changes underneath."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from pisft.model.pi05 import checks, construction, embedding, forward, parts, processors
from pisft.model.policy import build_policy
from pisft.model.pi05.presets import PRESETS


@pytest.fixture(scope="module")
def tiny():
    return build_policy("tiny", seed=0)


def test_lerobot_version_is_the_one_the_internals_were_written_for():
    assert importlib.metadata.version("lerobot") == "0.6.1", (
        "pisft.model.pi05 was written against LeRobot 0.6.1: re-check every assumption in it")


def test_every_patched_assumption_still_holds():
    assert checks.structure_problems() == []


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


def test_each_named_part_is_lerobots_module_of_that_kind(tiny):
    """pi0.5's parts by name (pisft.model.pi05 13.): each path reaches the module it names, from
    the policy and from its core, and every name a parameter of the policy has starts at one."""
    from lerobot.policies.pi05.modeling_pi05 import PaliGemmaWithExpertModel, PI05Pytorch
    from lerobot.policies.pi_gemma import PaliGemmaForConditionalGenerationWithPiGemma, PiGemmaForCausalLM

    kinds = {parts.CORE: PI05Pytorch, parts.PALIGEMMA_WITH_EXPERT: PaliGemmaWithExpertModel,
             parts.PALIGEMMA: PaliGemmaForConditionalGenerationWithPiGemma, parts.EXPERT: PiGemmaForCausalLM}
    for path, kind in kinds.items():
        assert type(parts.part(tiny, path)) is kind, path
    assert type(parts.part(tiny, parts.VISION_MODEL)).__name__ == "SiglipVisionTransformer"
    assert type(parts.part(tiny, parts.VLM_MODEL)).__name__ == "PaliGemmaModelWithPiGemma"
    arch = PRESETS["tiny"].arch
    assert len(parts.part(tiny, parts.VLM_LAYERS)) == arch.vlm.depth
    assert len(parts.part(tiny, parts.EXPERT_LAYERS)) == arch.expert.depth
    expert_layers = parts.part(tiny, parts.EXPERT_LAYERS)
    assert parts.part(tiny.model, parts.EXPERT_LAYERS, core=True) is expert_layers
    names = dict(tiny.named_parameters())
    assert parts.EXPERT_HEAD in names
    assert any(n.startswith(parts.VISION_TOWER + ".") for n in names)
    assert any(n.startswith(parts.PROJECTOR + ".") for n in names)
    assert parts.below(parts.VISION_TOWER, parts.PALIGEMMA_WITH_EXPERT) == "paligemma.model.vision_tower"
    with pytest.raises(ValueError, match="is not below"):
        parts.below(parts.EXPERT, parts.PALIGEMMA)


def test_no_other_module_spells_pi05s_module_paths():
    """pi0.5's structure lives in pisft.model.pi05: training, the value model, the estimate and
    the benches ask it for a part (13.) instead of spelling LeRobot's module paths."""
    import re
    from pathlib import Path

    pi05 = Path(parts.__file__).resolve().parent
    src = pi05.parents[1]
    spelled = re.compile(r"paligemma_with_expert|gemma_expert|vision_tower|language_model\.layers")
    found = sorted(str(f.relative_to(src)) for f in src.rglob("*.py")
                   if pi05 not in f.parents and spelled.search(f.read_text()))
    assert found == []


def test_only_the_model_folder_imports_lerobots_modeling_or_reads_its_source():
    """LeRobot's policies (`lerobot.policies.*`: pi0.5's modeling, its Gemma, its processors, its RTC)
    are imported, and their source read (`inspect.getsource`), in pisft.model only; the rest asks
    the model registry (pisft.model.spec) or the model's folder. LeRobot's datasets and processor
    steps (`lerobot.datasets`, `lerobot.processor`) are not modeling and may be used anywhere."""
    import ast
    from pathlib import Path

    src = Path(parts.__file__).resolve().parents[2]
    found = []
    for f in sorted(src.rglob("*.py")):
        if (src / "model") in f.parents:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            names += [node.attr] if isinstance(node, ast.Attribute) else []
            names += [node.id] if isinstance(node, ast.Name) else []
            found += [f"{f.relative_to(src)}:{node.lineno}: {n}" for n in names
                      if n.startswith("lerobot.policies") or n in ("getsource", "modeling_gemma", "modeling_pi05")]
    assert found == []


def test_no_tensor_of_the_tiny_model_inherits_a_hard_coded_lerobot_size(tiny):
    banned = {257152, 4304, 2048, 1152, 16384}
    for name, tensor in tiny.state_dict().items():
        assert not banned.intersection(tensor.shape), f"{name} has a LeRobot pi0.5 size: {tuple(tensor.shape)}"
    total = sum(p.numel() for p in tiny.parameters())
    assert 1_000_000 <= total <= 8_000_000


def test_vlm_embeddings_are_tied_and_the_patch_is_undone(tiny):
    from lerobot.policies.pi05 import modeling_pi05, processor_pi05

    assert construction.vlm_embeddings_tied(tiny)
    before = (modeling_pi05.get_gemma_config, modeling_pi05.PaliGemmaForConditionalGenerationWithPiGemma,
              modeling_pi05.PiGemmaForCausalLM, processor_pi05.TokenizerProcessorStep)
    with pytest.raises(RuntimeError), construction.sized_construction(PRESETS["tiny"].arch):
        assert modeling_pi05.get_gemma_config is not before[0]
        raise RuntimeError("boom")
    after = (modeling_pi05.get_gemma_config, modeling_pi05.PaliGemmaForConditionalGenerationWithPiGemma,
             modeling_pi05.PiGemmaForCausalLM, processor_pi05.TokenizerProcessorStep)
    assert before == after
    assert modeling_pi05.get_gemma_config("gemma_300m").width == 1024  # LeRobot's own again


def test_arch_validation_enforces_lerobot_constraints():
    arch = PRESETS["tiny"].arch
    bad_heads = construction.Arch(vlm=construction.GemmaSize(64, 2, 128, 4, 1, 16), expert=arch.expert,
                               vision=arch.vision, vocab_size=arch.vocab_size)
    with pytest.raises(ValueError, match="8 \\* head_dim"):
        bad_heads.validate()
    bad_depth = construction.Arch(vlm=arch.vlm, expert=construction.GemmaSize(64, 3, 128, 8, 1, 32),
                               vision=arch.vision, vocab_size=arch.vocab_size)
    with pytest.raises(ValueError, match="depth"):
        bad_depth.validate()


def test_processors_are_lerobots_pipeline_with_a_local_tokenizer(tiny):
    from lerobot.processor import TokenizerProcessorStep

    from pisft.model.tokenizer import build_tiny_tokenizer
    from model_fixtures import fake_stats

    tokenizer = build_tiny_tokenizer()
    pre, post = processors.pi05_processors(tiny.config, fake_stats(), tokenizer)
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
    assert construction.vlm_embeddings_tied(policy)
    assert policy.config.device == "meta"


# ------------------------------------------------------------------ no host copy, no float64
class _StepCensus(torch.overrides.TorchFunctionMode):
    """Counts tensors built from Python data (`torch.tensor(<list or number>)`) and ops with a
    float64 result, as one training forward of the tiny model makes them."""

    def __init__(self) -> None:
        super().__init__()
        self.from_python = 0
        self.float64 = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in ("tensor", "as_tensor") and args \
                and not isinstance(args[0], torch.Tensor):
            self.from_python += 1
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dtype == torch.float64:
            self.float64 += 1
        return out


def _forward_both_ways(seed: int = 0):
    """LeRobot's own PI05Policy.forward and `sync_free_forward`'s on the same batch and draws."""
    from pisft.train.policy_task import injected_flow_samples
    from pisft.introspect.synthetic import synthetic_batch

    policy = build_policy("tiny", seed=0)
    policy.train()
    batch, rand = synthetic_batch(policy, 3, torch.device("cpu"), seed=seed)
    batch["observation.language.attention_mask"][:, -5:] = False  # padded prompt tails
    out = {}
    for name in ("lerobot", "sync_free"):
        census = _StepCensus()
        with injected_flow_samples(policy.model, rand["noise"], rand["time"]), census:
            if name == "lerobot":
                loss, _ = policy.forward(batch)
            else:
                with forward.sync_free_forward(policy):
                    loss = policy(batch)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
        policy.zero_grad(set_to_none=True)
        out[name] = (loss.detach(), grads, census)
    return out


def test_sync_free_forward_keeps_lerobots_loss_without_host_copies_or_float64():
    runs = _forward_both_ways()
    (loss0, grads0, plain), (loss1, grads1, ours) = runs["lerobot"], runs["sync_free"]
    assert float(loss1) == pytest.approx(float(loss0), rel=1e-5)
    torch.testing.assert_close(grads1, grads0, rtol=1e-4, atol=1e-6)
    # LeRobot: embed_prefix's and embed_suffix's mask rows from Python lists; a float64 sinusoid
    assert plain.from_python == 2 and plain.float64 > 0
    assert ours.from_python == 0 and ours.float64 == 0


def test_embeddings_match_lerobots_outside_the_time_embedding_rounding(tiny):
    from lerobot.policies.common.vla_utils import create_sinusoidal_pos_embedding

    core = tiny.model
    g = torch.Generator().manual_seed(0)
    actions = torch.randn(2, tiny.config.chunk_size, tiny.config.max_action_dim, generator=g)
    time = torch.tensor([0.001, 0.999])
    ours = embedding._embed_suffix(core, actions, time)
    theirs = core.embed_suffix(actions, time)
    for a, b in zip(ours[:3], theirs[:3], strict=True):  # action embedding, pad and att masks
        assert a.dtype == b.dtype and torch.equal(a, b)
    torch.testing.assert_close(ours[3], theirs[3], rtol=1e-4, atol=1e-5)  # the time MLP's output
    # pi0.5's sizes (expert width 1024, periods 4e-3..4): float32 against LeRobot's float64
    t = torch.linspace(0.0, 1.0, 257)
    ref = create_sinusoidal_pos_embedding(t.double(), 1024, 4e-3, 4.0, device=torch.device("cpu"))
    emb = embedding.sinusoidal_time_embedding(t, 1024, 4e-3, 4.0)
    assert emb.dtype == torch.float32
    assert (emb.double() - ref).abs().max() < 5e-4
    with pytest.raises(ValueError, match="divisible by 2"):
        embedding.sinusoidal_time_embedding(t, 1023, 4e-3, 4.0)


def test_sync_free_forward_undoes_its_patches(tiny):
    core = tiny.model
    with forward.sync_free_forward(tiny):
        assert core.embed_prefix.__func__ is embedding._embed_prefix
    assert "embed_prefix" not in vars(core) and "embed_suffix" not in vars(core)
    assert "forward" not in vars(tiny)
