"""The compiled action chunk (`eval.compile`, pisft.policy.compiled): inductor on the CPU, torch_npu's
npugraph_ex on an NPU (the stand-in), a failed compile falling back, and the same actions as eager
within the stated tolerance, for plain, guided and real-time-chunking chunks padded to their bucket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from model_fixtures import fake_batch
from pisft.bench.closed_loop_bench import tiny_stats
from pisft.model import guidance
from pisft.model.policy import build_policy, save_model
from pisft.model.tokenizer import save_tiny_tokenizer
from pisft.policy import compiled
from pisft.policy.predictor import ChunkPredictor, frame_noise
from pisft.policy.rtc import RtcSettings

STAND_INS = Path(__file__).resolve().parent / "stand_ins"


@pytest.fixture(scope="module")
def two_step_model(tmp_path_factory) -> Path:
    """The tiny model with 2 denoising steps instead of 10: the same program, a fifth of the graph
    for inductor to generate and compile (what the tests check is the mechanism)."""
    out = tmp_path_factory.mktemp("compiled") / "tiny_2steps"
    out.mkdir()
    save_tiny_tokenizer(out / "tokenizer")
    policy = build_policy("tiny", seed=0)
    policy.config.num_inference_steps = 2
    save_model(policy, out, tokenizer_dir=out / "tokenizer", dataset_stats=tiny_stats())
    return out


def _inputs(n: int):
    batch = fake_batch(4)
    batch = {k: v[:n] for k, v in batch.items()}
    return batch, frame_noise([(0, i) for i in range(n)], seed=0, chunk_size=10, max_action_dim=32)


def test_choose_and_buckets():
    assert [compiled.bucket(n) for n in (1, 2, 3, 5, 8, 9, 32, 33)] == [1, 2, 4, 8, 8, 16, 32, 64]
    with pytest.raises(ValueError):
        compiled.bucket(0)
    assert not compiled.choose(False, "cuda").enabled
    cuda = compiled.choose(True, "cuda")
    assert (cuda.enabled, cuda.backend, cuda.mode) == (True, "inductor", "reduce-overhead")
    cpu = compiled.choose(True, "cpu")
    assert (cpu.backend, cpu.mode) == ("inductor", None)
    # null: on the CPU eager without a trial (the compile costs more than it saves); on an accelerator the
    # stage's first chunk decides (the compiled path prepared, the decision not yet made)
    cpu_default = compiled.choose(None, "cpu")
    assert (cpu_default.enabled, cpu_default.decided_by, cpu_default.why) == (False, "no trial", compiled.CPU_DEFAULT)
    cuda_default = compiled.choose(None, "cuda")
    assert (cuda_default.enabled, cuda_default.trial, cuda_default.mode) == (True, True, "reduce-overhead")
    assert cuda_default.record()["compiled"] is None and "first chunk decides" in cuda_default.why
    # without torch_npu, asking for it on an NPU falls back with the reason in one line
    npu = compiled.choose(True, "npu")
    assert not npu.enabled and "falling back" in npu.why and "\n" not in npu.why


def test_guidance_blends_the_two_halves_and_leaves_padding_rows_alone():
    """A compiled chunk pads the doubled batch to its bucket: the padding rows after the two halves
    keep their own velocity (they are dropped), the halves are blended as RLinf does."""
    v = torch.arange(5 * 2, dtype=torch.float32).reshape(5, 2)  # 2 requests: cond 0-1, uncond 2-3, 1 padding row
    guided = guidance.blend(3.0, 2)(lambda x, t: v)(None, None)
    blended = (1 - 3.0) * v[2:4] + 3.0 * v[0:2]
    assert torch.equal(guided, torch.cat([blended, blended, v[4:]]))
    exact = guidance.blend(3.0)(lambda x, t: v[:4])(None, None)  # no padding: the halves of the batch
    assert torch.equal(exact, torch.cat([blended, blended]))


@pytest.mark.integration  # ~60-120 s: inductor generates and compiles two programs on 2 cores
def test_inductor_chunk_equals_eager_within_tolerance_padded_to_its_bucket(two_step_model):
    eager = ChunkPredictor.load(two_step_model)
    fast = ChunkPredictor.load(two_step_model, compiled=True, note=lambda line: None)
    for p in (eager, fast):
        p.enable_rtc(RtcSettings())
    batch, noise = _inputs(3)  # bucket 4: one padding row
    plain = eager.predict(batch, noise)
    assert compiled.tolerance(fast.policy) == 1e-4  # a float32 model
    assert (fast.predict(batch, noise) - plain).abs().max() <= 1e-4
    prev = plain[:, 4:]  # real-time chunking: the previous chunk's rest, 2 steps executed meanwhile
    rtc = eager.predict(batch, noise, prev_actions=prev, delay=2)
    assert (rtc[:, :2] - prev[:, :2]).abs().max() < 0.05 < (plain[:, :2] - prev[:, :2]).abs().max()
    assert (fast.predict(batch, noise, prev_actions=prev, delay=2) - rtc).abs().max() <= 1e-4
    record = fast.describe()["compile"]
    assert record["compiled"] and record["backend"] == "inductor" and record["fell_back"] is None
    assert set(record["first_call_s"]) == {"chunk@4", "rtc@4"}  # one whole-chunk graph, the RTC pieces


def test_a_compile_that_fails_falls_back_to_eager_with_one_line(two_step_model):
    def broken(gm, example_inputs):
        raise RuntimeError("no code generator for this device")

    lines: list[str] = []
    predictor = ChunkPredictor.load(two_step_model)
    batch, noise = _inputs(2)
    reference = predictor.predict(batch, noise)
    chunk = compiled.install(predictor.policy, compiled.CompileChoice(True, backend=broken), on_fallback=lines.append)
    assert torch.equal(predictor.predict(batch, noise), reference)  # the request is answered eagerly
    assert torch.equal(predictor.predict(batch, noise), reference)
    assert len(lines) == 1 and "falling back to eager" in lines[0] and "\n" not in lines[0]
    assert chunk.fallen_back and "no code generator" in chunk.fallen_back


def _trial(backend) -> compiled.CompileChoice:
    """eval.compile null's choice on an accelerator, with `backend` (the CPU's default runs no trial)."""
    return compiled.CompileChoice(True, backend=backend, why="eval.compile null: the first chunk decides",
                                  decided_by="trial")


@pytest.fixture
def one_rep(monkeypatch):
    """The trial with no warm-up and one timed call of each path: the decision's mechanism, cheaply."""
    monkeypatch.setattr(compiled, "TRIAL_WARMUP", 0)
    monkeypatch.setattr(compiled, "TRIAL_REPS", 1)


def test_the_default_on_the_cpu_runs_no_trial_and_the_record_says_why(two_step_model):
    predictor = ChunkPredictor.load(two_step_model, compiled=None, note=lambda line: None)
    assert predictor.compiled_chunk is None  # nothing compiled, nothing traced
    record = predictor.describe()
    assert record["compile"] == {"compiled": False, "backend": None, "mode": None, "why": compiled.CPU_DEFAULT,
                                 "decided_by": "no trial"}
    assert {k: record["precision"][k] for k in ("setting", "dtype", "decided_by")} == {
        "setting": "auto", "dtype": "float32", "decided_by": "rule"}  # the tiny model's own, by the rule


def test_a_trial_whose_compile_fails_chooses_eager_with_one_line(two_step_model, one_rep):
    def broken(gm, example_inputs):
        raise RuntimeError("no code generator for this device")

    batch, noise = _inputs(2)
    reference = ChunkPredictor.load(two_step_model).predict(batch, noise)
    lines: list[str] = []
    predictor = ChunkPredictor.load(two_step_model, compiled=_trial(broken), note=lines.append)
    assert torch.equal(predictor.predict(batch, noise), reference)  # the first chunk is answered eagerly
    assert torch.equal(predictor.predict(batch, noise), reference)
    decided = [line for line in lines if "eager, the compiled chunk failed" in line]
    assert len(decided) == 1 and "no code generator" in decided[0] and "\n" not in decided[0]
    record = predictor.describe()["compile"]
    assert (record["compiled"], record["decided_by"], record["trial"]["chose"]) == (False, "trial", "eager")
    assert "compiled_ms" not in record["trial"] and record["trial"]["eager_ms"]["median"] > 0


def test_a_trial_whose_actions_disagree_chooses_eager_for_every_replica_and_records_it(two_step_model, one_rep):
    """A compiled chunk that computes other actions (a backend that shifts them by 0.5) is not used. The
    stage's replicas share the trial: the second replica follows the decision without measuring. The
    decision is in the stage's output (policy_record); its figures, which vary run to run, in the timing."""
    from pisft.policy.libero import LiberoPolicy
    from pisft.policy.replicas import PolicyPool, inference_timing, policy_record

    def shifted(gm, example_inputs):
        def run(*args):
            return [out + 0.5 for out in gm(*args)]
        return run

    batch, noise = _inputs(2)
    reference = ChunkPredictor.load(two_step_model).predict(batch, noise)
    lines: list[str] = []
    shared = compiled.Trial()
    first, second = (ChunkPredictor.load(two_step_model, compiled=_trial(shifted), note=lines.append, trial=shared)
                     for _ in range(2))
    assert torch.equal(first.predict(batch, noise), reference)
    decided = [line for line in lines if "differ from eager's by more than 0.0001" in line]
    assert len(decided) == 1 and "\n" not in decided[0]
    assert torch.equal(second.predict(batch, noise), reference)
    assert second.compiled_chunk.compile_s == {}  # never compiled: it followed the decision
    assert len([line for line in lines if "eval.compile null: eager" in line]) == 1
    trial = first.describe()["compile"]["trial"]
    assert trial["chose"] == "eager" and trial["actions_max_abs_diff"] > trial["actions_atol"] == 1e-4
    with PolicyPool([LiberoPolicy(second)], max_batch=2) as pool:
        output, timing = policy_record(pool)["inference"]["compile"], inference_timing(pool)["compile"]
    assert (output["compiled"], output["decided_by"]) == (False, "trial") and "differ from eager" in output["why"]
    assert "trial" not in output and "first_call_s" not in output
    assert timing["trial"] == trial


@pytest.mark.integration  # ~30-45 s: a fresh interpreter traces the chunk and its RTC pieces
def test_on_an_npu_the_chunk_is_one_npugraph_ex_graph(two_step_model):
    """torch_npu 2.11.0 registers the `npugraph_ex` backend (ACLGraph capture and replay) on import;
    the stand-in registers one that runs the captured graph on the CPU and records it. On a device of
    kind npu the chunk compiles with it, whole (one graph), and an RTC chunk as its three pieces."""
    code = textwrap.dedent(f"""
        import json, sys
        import torch, torch_npu
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_policy_compiled import _inputs
        from pisft.policy import compiled
        from pisft.policy.predictor import ChunkPredictor
        from pisft.policy.rtc import RtcSettings

        choice = compiled.choose(True, "npu")
        default = compiled.choose(None, "npu")
        p = ChunkPredictor.load({str(two_step_model)!r})
        p.enable_rtc(RtcSettings())
        batch, noise = _inputs(2)
        eager = p.predict(batch, noise)
        eager_rtc = p.predict(batch, noise, prev_actions=eager[:, 5:], delay=2)
        chunk = compiled.install(p.policy, choice)
        plain = p.predict(batch, noise)
        whole = len(torch_npu.npugraph_ex_graphs)
        rtc = p.predict(batch, noise, prev_actions=eager[:, 5:], delay=2)
        print(json.dumps({{"backend": choice.backend, "enabled": choice.enabled, "default": default.why,
                           "plain": float((plain - eager).abs().max()), "rtc": float((rtc - eager_rtc).abs().max()),
                           "whole": whole, "all": len(torch_npu.npugraph_ex_graphs), "fell_back": chunk.fallen_back}}))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STAND_INS), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["backend"] == "npugraph_ex" and result["enabled"] and result["fell_back"] is None
    assert result["whole"] == 1 and result["all"] == 4  # the chunk; then embedding, prefix pass, step
    assert result["plain"] <= 1e-4 and result["rtc"] <= 1e-4
    assert "npugraph_ex" in result["default"] and "first chunk decides" in result["default"]


def test_rtc_is_refused_for_a_model_of_relative_actions():
    """A leftover is normalised with the model's stats, never made relative to the state: RTC on a
    model that predicts relative actions would pull towards actions of another space, so it is refused."""
    from pisft.errors import PisftError
    from pisft.policy import rtc

    policy = build_policy("tiny", seed=0)
    policy.config.use_relative_actions = True
    with pytest.raises(PisftError, match="relative actions .*turn eval.rtc.enabled"):
        rtc.configure(policy, RtcSettings())
