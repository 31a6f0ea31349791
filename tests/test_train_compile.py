"""train.compile: layers against the eager step, on the tiny model on the CPU (inductor).

The compiled blocks (pisft.train.blocks: each decoder layer pair, or with a frozen VLM each VLM
and each expert layer, and each SigLIP layer; the checkpoint inside the compiled region) inside
FSDP2's units, with LoRA, frozen parameters held in bf16 and the EMA, run the training's step
(pisft.train.step) from the same weights on the same batches as the eager step.

Tolerance: in fp32 the compiled step computes the same arithmetic (inductor fuses element-wise
work, keeps fp32): losses agree to 1e-6 relative and gradient norms to 1e-5. In bf16 inductor
keeps some intermediates in fp32 where eager rounds them to bf16 (its 8-bit mantissa: 3.9e-3
relative): losses agree to 2e-3 relative over three optimizer steps.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from pisft.introspect.host_ops import DispatchedOps
from pisft.introspect.synthetic import build_random_policy, synthetic_batch
from pisft.train import blocks, fsdp, optim, trainable
from pisft.model.pi05.attention import fused_joint_attention
from pisft.train.ema import make_ema
from pisft.train.policy_task import PolicyTask
from pisft.train.step import StepSettings, micro_step, train_step

pytestmark = pytest.mark.usefixtures("one_process_group")  # gloo, world size 1 (conftest)

CPU = torch.device("cpu")
STEPS = 3


def _build(mode: str, precision: str, compile_mode: str):
    policy = build_random_policy("tiny", CPU, checkpointing=True, seed=0)
    trainable.apply_mode(policy, mode, trainable.spec_for_mode(mode, "openpi"), seed=0)
    trainable.hold_frozen_in(policy, precision)
    fsdp.distribute(policy, init_device_mesh("cpu", (1,)), precision, CPU, keep_sharded=True, min_params=0,
                    compiler=blocks.Compiler(compile_mode, "cpu"))
    return policy


def _train(mode: str, precision: str, compile_mode: str) -> dict:
    policy = _build(mode, precision, compile_mode)
    optimizer = optim.build_optimizer(policy.parameters(), lr=1e-3, weight_decay=1e-2, fused=True)
    ema = make_ema(policy, 0.9)
    task = PolicyTask(policy, None, CPU, precision)
    settings = StepSettings(accum=2, grad_clip=1.0, kind="cpu", device=CPU)
    policy.train()
    losses, norms = [], []
    with fused_joint_attention():
        for _ in range(STEPS):
            draws = iter([synthetic_batch(policy, 2, CPU, seed=i) for i in range(settings.accum)])  # fixed: it learns
            outcome = train_step(policy, optimizer, task, lambda d=draws: next(d), settings, ema=ema)
            losses.append(float(outcome.loss_sum) / settings.accum)
            norms.append(float(outcome.grad_norm))
        counter = DispatchedOps()
        batch, rand = synthetic_batch(policy, 2, CPU, seed=0)
        with counter:
            micro_step(policy, task, batch, rand, 1)
    return {"losses": losses, "norms": norms, "ops": counter.summary()}


@pytest.mark.integration  # ~1-3 min: inductor compiles each block function once (cached after)
@pytest.mark.parametrize(("mode", "precision"), [("all", "fp32"), ("expert", "bf16"), ("lora", "bf16")],
                         ids=["all-fp32", "expert-bf16", "lora-bf16"])
def test_the_compiled_step_equals_the_eager_one(mode, precision):
    from torch._dynamo.utils import counters

    eager = _train(mode, precision, "off")
    counters.clear()
    compiled = _train(mode, precision, "layers")
    # every block one graph: a graph break would run part of a block (or all of a checkpointed one) eagerly
    assert dict(counters["graph_break"]) == {}
    rel = 1e-6 if precision == "fp32" else 2e-3
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=rel)
    assert compiled["norms"] == pytest.approx(eager["norms"], rel=1e-5 if precision == "fp32" else 2e-2)
    assert eager["losses"][-1] < eager["losses"][0]  # it trains
    # the compiled micro-step dispatches its blocks' element-wise work as a few generated kernels
    assert eager["ops"]["compiled_kernels"] == 0 < compiled["ops"]["compiled_kernels"]
    assert compiled["ops"]["total"] < 0.6 * eager["ops"]["total"]


def test_a_missing_backend_falls_back_in_one_line(monkeypatch, tmp_path):
    """(`auto` is the smoke gate's to decide: tests/test_gate_decisions.py)"""
    lines: list[str] = []
    assert not blocks.compiler_for("off", "cpu", tmp_path, lines.append).enabled
    assert blocks.compiler_for("layers", "cpu", tmp_path, lines.append).mode == "layers"
    assert blocks.compiler_for("layers", "cuda", tmp_path, lines.append).mode == "layers"
    assert lines == []

    def missing(kind):
        raise ImportError("No module named 'torchair'")

    monkeypatch.setitem(blocks.COMPILE_BACKENDS, "torchair", missing)  # the NPU row's
    compiler = blocks.compiler_for("layers", "npu", tmp_path, lines.append)
    assert not compiler.enabled and len(lines) == 1
    assert "torchair" in lines[0] and "runs eagerly" in lines[0]
    assert not blocks.compiler_for("layers", "mps", tmp_path, lines.append).enabled
    assert len(lines) == 2 and "no compiler backend for mps" in lines[1]


def test_the_compiled_code_is_cached_under_the_results(monkeypatch, tmp_path):
    import os

    monkeypatch.setenv(blocks.CACHE_ENV, "set-by-the-test")  # undone after the test: the variable goes
    monkeypatch.delenv(blocks.CACHE_ENV)
    blocks.compiler_for("layers", "cpu", tmp_path / "cache" / "inductor", print)
    assert os.environ[blocks.CACHE_ENV] == str(tmp_path / "cache" / "inductor")
    blocks.compiler_for("layers", "cpu", tmp_path / "elsewhere", print)  # a user's choice stays
    assert os.environ[blocks.CACHE_ENV] == str(tmp_path / "cache" / "inductor")


def test_an_npu_compiles_through_torchairs_backend(monkeypatch, tmp_path):
    """device: npu: train.compile's backend is torchair's (`torch_npu.dynamo.torchair.get_npu_backend`
    with a CompilerConfig: Ascend/torchair, python/torchair/npu_fx_compiler.py, bundled with
    torch-npu 2.11.0). A stand-in torchair records the call and hands Dynamo a backend that runs
    the captured graph; a block compiled with it computes the eager block's values."""
    import importlib.machinery
    import sys
    import types

    from pisft.model.pi05.forward import prefix_layer
    from pisft.model.policy import build_policy

    made: list = []

    class CompilerConfig:
        pass

    def get_npu_backend(compiler_config=None):
        assert isinstance(compiler_config, CompilerConfig)

        def backend(gm, example_inputs):
            made.append(len(list(gm.graph.nodes)))
            return gm.forward

        return backend

    policy = build_policy("tiny", seed=0)  # before the stand-in: transformers looks for torch_npu once
    torchair = types.ModuleType("torch_npu.dynamo.torchair")
    torchair.CompilerConfig, torchair.get_npu_backend = CompilerConfig, get_npu_backend
    for name, module in (("torch_npu", types.ModuleType("torch_npu")),
                         ("torch_npu.dynamo", types.ModuleType("torch_npu.dynamo")),
                         ("torch_npu.dynamo.torchair", torchair)):
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)
    compiler = blocks.compiler_for("layers", "npu", tmp_path, print)
    assert compiler.mode == "layers" and compiler.describe() == "compiled per block (torchair)"
    layer = policy.model.paligemma_with_expert.paligemma.model.language_model.layers[0]
    rotary = policy.model.paligemma_with_expert.paligemma.model.language_model.rotary_emb
    hidden = torch.randn(2, 5, layer.self_attn.q_proj.in_features)
    mask = torch.zeros(2, 1, 5, 5)
    pos = torch.arange(5)[None].expand(2, 5)
    with torch.no_grad(), fused_joint_attention():
        eager = prefix_layer(layer, hidden, mask, pos, rotary)
        compiled = compiler(prefix_layer)(layer, hidden, mask, pos, rotary)
    assert made, "torchair's backend compiled nothing"
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(b, a)


def test_a_block_may_compile_once_per_kind_shape_and_flag():
    """Every checkpointed block kind runs through one code object (`checkpointed`), compiled per kind,
    shape and last-layer flag: at dynamo's default limit of 8 the tiny model's blocks at micro batches
    1 to 5 hit it ("torch._dynamo hit config.recompile_limit (8)") and ran eagerly from then on, silently.
    Compiling raises the limit to RECOMPILE_LIMIT."""
    from torch._dynamo import config as dynamo_config

    with dynamo_config.patch(recompile_limit=8):  # torch's own patch (pytest's undo deletes a config key)
        blocks.Compiler("layers", "cpu")(lambda x: x + 1)
        assert dynamo_config.recompile_limit == blocks.RECOMPILE_LIMIT == 64


def test_blocks_left_to_the_root_unit_are_compiled_too():
    """On the CPU units under 16M parameters are merged, and the tiny model's groups are all below it:
    its blocks stay in the root unit. Each still gets its runner (and its compiled forward), so
    train.compile: layers compiles them; before, it compiled none and the smoke report said compiled."""
    from pisft.model.units import BLOCK_RUNNER

    policy = build_random_policy("tiny", CPU, checkpointing=True, seed=0)
    blocks_of = fsdp.choose_units(policy)
    assert fsdp.choose_units(policy, fsdp.min_unit_params("cpu")) == []  # every group left to the root
    fsdp.distribute(policy, init_device_mesh("cpu", (1,)), "fp32", CPU, compiler=blocks.Compiler("layers", "cpu"))
    anchors = [a for u in blocks_of for a in u.anchors]
    modules = [m for u in blocks_of for m in u.compiled_modules]
    assert anchors and modules
    assert all(getattr(a, BLOCK_RUNNER).compiler.enabled for a in anchors)
    assert all("forward" in vars(m) for m in modules)  # the compiled forward, per layer
