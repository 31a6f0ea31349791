"""Advantage prompts as RLinf trains and evaluates them (issue 12, item 4), and the data keys
that shape them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pisft import config
from pisft.data import prompts
from pisft.data.libero import advantage_prompt
from pisft.train.sampler import StepLayout, StepSampler, sample_rng

TASK = "put both moka pots on the stove"
POS, NEG = advantage_prompt(TASK, True), advantage_prompt(TASK, False)
RLINF = prompts.PromptConditioning("demo", positive_only_conditional=True, unconditional_prob=0.1)


def test_prompt_text_is_rlinfs():
    # rlinf/data/datasets/recap/cfg_model.py: f"{prompt}\nAdvantage: positive"
    assert f"{TASK}\nAdvantage: positive" == POS and f"{TASK}\nAdvantage: negative" == NEG


def test_frame_prompts_of_both_recipes():
    assert RLINF.frame_prompt(TASK, True) == POS
    assert RLINF.frame_prompt(TASK, False) == TASK  # negatives are always unconditioned
    both = prompts.PromptConditioning("demo", positive_only_conditional=False, unconditional_prob=0.3)
    assert both.frame_prompt(TASK, True) == POS and both.frame_prompt(TASK, False) == NEG
    assert prompts.PLAIN_PROMPTS.frame_prompt(TASK, True) == TASK


def test_training_drop_rate_and_what_it_drops():
    rng = np.random.default_rng(0)
    out = [RLINF.training_prompt(POS, rng) for _ in range(20000)]
    dropped = sum(p == TASK for p in out) / len(out)
    assert abs(dropped - 0.1) < 0.01
    assert set(out) == {POS, TASK}
    assert all(RLINF.training_prompt(TASK, rng) == TASK for _ in range(100))  # nothing to drop
    both = prompts.PromptConditioning("demo", False, 0.5)
    assert {both.training_prompt(NEG, np.random.default_rng(i)) for i in range(50)} == {NEG, TASK}
    never = prompts.PromptConditioning("demo", True, 0.0)
    assert not never.drops and never.training_prompt(POS, rng) == POS
    always = prompts.PromptConditioning("demo", True, 1.0)
    assert always.training_prompt(POS, np.random.default_rng(1)) == TASK


def test_one_draw_per_sample_whatever_the_prompt():
    """The drop consumes exactly one uniform, so draws after it do not depend on the data."""
    a, b = np.random.default_rng(7), np.random.default_rng(7)
    RLINF.training_prompt(POS, a)
    RLINF.training_prompt(TASK, b)
    assert a.random() == b.random()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_drop_is_the_same_on_any_number_of_processes(world_size):
    """The drop of a sample is drawn from sample_rng(seed, (step, position)): the union of what
    every rank sees at a step is the same prompts for the same samples."""
    prompts_of = [POS if i % 3 else TASK for i in range(48)]  # a train set of 48 frames

    def step_prompts(ws: int, step: int) -> dict[int, tuple[int, str]]:
        sampler = StepSampler(len(prompts_of), seed=5, layout=StepLayout(16, 16 // (4 * ws) or 1, ws))
        seen = {}
        for rank in range(ws):
            for micro in range(sampler.layout.accum):
                for ref in sampler.micro_batch(step, rank, micro):
                    rng = sample_rng(5, ref)
                    rng.standard_normal(3)  # the objective's draws come first (noise, time)
                    seen[ref.position] = (ref.index, RLINF.training_prompt(prompts_of[ref.index], rng))
        return seen

    for step in range(6):
        assert step_prompts(world_size, step) == step_prompts(1, step)
    dropped = sum(p == TASK and prompts_of[i] == POS for s in range(6) for i, p in step_prompts(1, s).values())
    assert dropped > 0


def test_inference_prompt_is_rlinfs_positive_prompt():
    assert RLINF.inference_prompt(TASK) == POS
    assert RLINF.inference_prompt(POS) == POS and RLINF.inference_prompt(NEG) == NEG  # as sent
    assert prompts.PLAIN_PROMPTS.inference_prompt(TASK) == TASK
    assert RLINF.eval_prompt == "positive" and prompts.PLAIN_PROMPTS.eval_prompt == "task"
    assert "Advantage: positive" in RLINF.describe() and "advantage_tag `demo`" in RLINF.describe()


def test_where_a_models_conditioning_comes_from(tmp_path):
    model, data = tmp_path / "model", tmp_path / "dataset"
    (data / "meta").mkdir(parents=True)
    model.mkdir()
    assert prompts.for_model(model, trained_on=data) == prompts.PLAIN_PROMPTS  # nothing recorded
    RLINF.write(data / "meta" / prompts.CONDITIONING_FILE)
    assert prompts.for_dataset(data) == RLINF
    assert prompts.for_model(model) == prompts.PLAIN_PROMPTS  # e.g. the base model
    assert prompts.for_model(model, trained_on=data) == RLINF  # the fine-tuned model, before export copies it
    other = prompts.PromptConditioning("x", False, 0.2)
    other.write(model / prompts.CONDITIONING_FILE)
    assert prompts.for_model(model, trained_on=data) == other  # the model's own record wins
    recorded = json.loads((model / prompts.CONDITIONING_FILE).read_text())
    assert recorded["eval_prompt"] == "positive" and recorded["eval_prompt_example"] == "<task>\nAdvantage: positive"
    assert prompts.training_prompt_fn(data).__self__ == RLINF
    (data / "meta" / prompts.CONDITIONING_FILE).write_text("{not json")
    from pisft.errors import DataError

    with pytest.raises(DataError, match="prompt_conditioning.json"):
        prompts.for_dataset(data)


class _Predictor:
    """Stands in for ChunkPredictor: records the prompts it is given."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.chunk_size, self.action_dim, self.state_dim, self.max_action_dim = 4, 7, 8, 32
        self.image_features = ["observation.images.base_0_rgb"]
        self.preprocessor = None  # no tokenizer step: prompts are not cut
        self.policy = SimpleNamespace(config=SimpleNamespace(image_resolution=None))
        self.seen: list[str] = []

    def predict(self, batch, noise):
        self.seen.extend(batch["task"])
        return torch.zeros((1, self.chunk_size, self.action_dim))

    def describe(self):
        return {"precision": "fp32", "compile": {"compiled": False}, "rtc": {"enabled": False}}


def test_served_and_closed_loop_policy_prompts_the_positive_prompt(tmp_path):
    from pisft.policy.libero import LiberoPolicy

    obs = {"observation/image": np.zeros((16, 16, 3), np.uint8), "observation/state": np.zeros(8), "prompt": TASK}
    RLINF.write(tmp_path / prompts.CONDITIONING_FILE)
    pred = _Predictor(tmp_path)
    policy = LiberoPolicy(pred)  # reads the model directory's record
    policy.infer(obs)
    policy.infer({**obs, "prompt": NEG})
    assert pred.seen == [POS, NEG]
    assert policy.metadata["prompt_conditioning"]["eval_prompt"] == "positive"
    plain = _Predictor(tmp_path / "nowhere")
    LiberoPolicy(plain).infer(obs)
    assert plain.seen == [TASK]


def test_report_shows_prompts_and_held_out_outcomes():
    from pisft.evaluate import report

    section = {m: 1.0 for m in ("action_mse", "action_l1", "action_mse_norm", "action_l1_norm")}
    metrics = {"episodes": 3, "tasks": 1, "frames": 9, "base": {**section, "per_task": {}},
               "finetuned": {**section, "per_task": {}},
               "comparison": {m: {"ratio": 1.0} for m in section}}
    info = {"frame_stride": 1, "chunk_size": 4, "seed": 0,
            "held_out": {"episodes": 3, "successes": 2, "failures": 1, "unknown": 0},
            "prompts": {"base": {"describe": prompts.PLAIN_PROMPTS.describe()},
                        "finetuned": {"describe": RLINF.describe()}}}
    from pisft.model import guidance

    info["guidance"] = {"base": guidance.record(2.0, prompts.PLAIN_PROMPTS), "finetuned": guidance.record(2.0, RLINF)}
    text = report.build(metrics=metrics, eval_info=info, train_summary={}, run_info={}, plots={},
                        resolved_config={}, closed_loop={"suites": {}, "prompt": {"describe": RLINF.describe()},
                                                         "guidance": guidance.record(3.0, RLINF)})
    assert "Held-out episodes: 2 successes, 1 failures (of 3)" in text
    assert "fine-tuned model: `<task>\\nAdvantage: positive` (RLinf's positive prompt" in text
    assert "base model: the task instruction" in text
    assert text.count("RLinf's positive prompt") == 2  # open loop and closed loop
    assert ("Guidance (eval.cfg_scale): base model: cfg_scale 2 ignored: the model was trained on plain "
            "task prompts") in text
    assert "fine-tuned model: classifier-free guidance, scale 2: v = (1 - w)·v_uncond + w·v_cond" in text
    assert "Guidance: classifier-free guidance, scale 3" in text  # the closed-loop section


# ---------------------------------------------------------------- the data keys

def test_new_data_keys_default_to_rlinfs_recipe():
    d = config.from_dict({}).data
    assert d.positive_only_conditional is True and d.unconditional_prob == 0.1 and d.columns == {}


@pytest.mark.parametrize("data,fragment", [
    ({"unconditional_prob": 1.5}, "data.unconditional_prob: must be a probability in [0, 1]"),
    ({"unconditional_prob": -0.1}, "data.unconditional_prob"),
    ({"columns": {"wrist": "cam"}}, "data.columns: unknown key 'wrist'; did you mean 'wrist_image'?"),
    ({"columns": {"image": " "}}, "data.columns.image: must name a column"),
    ({"columns": {"image": "cam", "wrist_image": "cam"}}, "column(s) ['cam'] given for more than one key"),
    ({"advantage_tag": "runs/a"}, "data.advantage_tag: 'runs/a' must be a bare tag"),
])
def test_data_keys_are_validated(data, fragment):
    with pytest.raises(config.ConfigError) as err:
        config.from_dict({"data": data}, "cfg.yaml")
    assert fragment in str(err.value) and "cfg.yaml" in str(err.value)


def test_data_columns_must_be_a_mapping():
    with pytest.raises(config.ConfigError, match="data.columns"):
        config.from_dict({"data": {"columns": "image"}})
    cfg = config.from_dict({"data": {"columns": {"image": "observation.images.front"}}})
    assert cfg.data.columns == {"image": "observation.images.front"}
    assert config.resolved(cfg)["data"]["columns"] == {"image": "observation.images.front"}


def test_convert_stage_tracks_the_new_keys():
    from pisft.stages import STAGE_KEYS

    for key in ("data.positive_only_conditional", "data.unconditional_prob", "data.columns"):
        assert key in STAGE_KEYS["convert_recap"]


@pytest.mark.integration  # ~30 s: demo, conversion, two tiny models, the evaluation
def test_offline_evaluation_prompts_each_model_as_trained(tmp_path, monkeypatch):
    """convert_recap with RLinf's recipe -> evaluate: the fine-tuned model gets the positive
    prompt on every held-out frame (never the stored per-frame labels), the base model the task;
    eval_info says so and counts the held-out successes and failures. With eval.cfg_scale 2 the
    fine-tuned model is guided against its frames' plain tasks; the base model (plain) is not."""
    from pisft.data import convert, demo
    from pisft.data import dataset as data
    from pisft.evaluate import offline
    from pisft.policy import predictor as inference
    from pisft.model.policy import build_policy, save_model
    from pisft.model.tokenizer import save_tiny_tokenizer

    root = tmp_path / "results"
    cfg = config.from_dict({
        "device": "cpu", "results_dir": str(root),
        "data": {"recap_dir": str(root / "demo_recap"), "demo_episodes_per_task": 2, "demo_episode_length": 4,
                 "demo_image_size": 16, "demo_failure_fraction": 0.5, "eval_fraction": 0.5,
                 "advantage_tag": "demo", "tasks": ["0", "1", "2"], "split_seed": 1},
        "eval": {"batch_size": 8, "frame_stride": 2, "bootstrap_samples": 0, "cfg_scale": 2.0}})
    demo.run(cfg)  # RLinf's collection; then its labelling steps, as RLinf's finished output
    demo.label(root / "demo_recap", "demo", length=4)
    convert.run(cfg)
    tok = tmp_path / "tok"
    tok.mkdir()
    save_tiny_tokenizer(tok)
    (root / "base_model").mkdir()
    (root / "train" / "model").mkdir(parents=True)
    save_model(build_policy("tiny", seed=0), root / "base_model", tokenizer_dir=tok)
    save_model(build_policy("tiny", seed=1), root / "train" / "model", tokenizer_dir=tok,
               dataset_stats=data.load_stats(root / "dataset"))
    seen: dict[str, list[str]] = {}
    guided: dict[str, list] = {}
    real = inference.ChunkPredictor.predict

    def spy(self, batch, noise, **blend):
        seen.setdefault(self.model_dir.name, []).extend(batch["task"])
        guided.setdefault(self.model_dir.name, []).append(
            (blend.get("cfg_scale"), blend.get("unconditioned_tasks"), list(batch["task"])))
        return real(self, batch, noise, **blend)

    monkeypatch.setattr(inference.ChunkPredictor, "predict", spy)
    _, _, info = offline.evaluate_models(cfg, progress=False)
    tasks = set(data.episode_tasks(root / "dataset").values())
    assert seen["model"] and all(p.endswith("\nAdvantage: positive") for p in seen["model"])
    assert set(seen["base_model"]) <= tasks
    assert info["prompts"]["finetuned"]["eval_prompt"] == "positive"
    assert info["prompts"]["base"]["eval_prompt"] == "task"
    assert all(w == 2.0 and [advantage_prompt(t, True) for t in plain] == cond
               for w, plain, cond in guided["model"])
    assert all(w is None and plain is None for w, plain, _ in guided["base_model"])
    assert info["guidance"]["finetuned"]["cfg_scale"] == 2.0 and info["guidance"]["base"]["cfg_scale"] == 1.0
    assert "cfg_scale 2 ignored" in info["guidance"]["base"]["note"]
    report = json.loads((root / "dataset" / "conversion_report.json").read_text())
    assert info["held_out"] == report["outcomes"]["eval"]
    assert info["held_out"]["failures"] >= 1 and info["held_out"]["successes"] >= 1


def test_labelled_prompts_take_each_frames_label_from_the_labels_file(tmp_path):
    """RECAP iteration k trains on labels written beside the dataset (the advantages stage): the
    frame's label picks its prompt, RLinf's drop to the plain task draws from the sample's
    generator, and a frame without a label is an error naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pisft.data.prompts import LabelledPrompts, recap_conditioning
    from pisft.errors import DataError

    path = tmp_path / "labels.parquet"
    pq.write_table(pa.table({"episode_index": [0, 0, 1], "frame_index": [0, 1, 0],
                             "advantage_continuous": [0.5, -0.2, 0.1], "advantage": [True, False, True]}), path)
    cond = recap_conditioning(1, positive_only_conditional=False, unconditional_prob=0.0)
    labelled = LabelledPrompts(path, cond)
    rng = np.random.default_rng(0)
    task = "put the bowl on the plate"
    def frame(episode, index):
        return {"task": task, "episode_index": episode, "frame_index": index}

    assert labelled.for_frame(frame(0, 0), rng) == advantage_prompt(task, True)
    assert labelled.for_frame(frame(0, 1), rng) == advantage_prompt(task, False)
    # positive_only_conditional: a negative frame trains on the plain task
    only_pos = LabelledPrompts(path, recap_conditioning(1, True, 0.0))
    assert only_pos.for_frame({"task": task, "episode_index": 0, "frame_index": 1}, rng) == task
    # unconditional_prob 1: always the plain task
    always_plain = LabelledPrompts(path, recap_conditioning(1, True, 1.0))
    assert always_plain.for_frame({"task": task, "episode_index": 1, "frame_index": 0}, rng) == task
    with pytest.raises(DataError, match="no label for episode 2, frame 0"):
        labelled.for_frame({"task": task, "episode_index": 2, "frame_index": 0}, rng)
    assert cond.conditioned and cond.eval_prompt == "positive"


def test_the_training_sample_gets_its_labelled_prompt(tmp_path):
    """StepDataset hands the whole sample to a per-frame prompt (the labels are looked up by it)."""
    from pisft.train.batches import StepDataset
    from pisft.train.sampler import SampleRef

    class Frames:
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return {"task": "t", "episode_index": 0, "frame_index": i}

    class ByFrame:
        def for_frame(self, item, rng):
            return f"{item['task']} #{item['frame_index']}"

    ds = StepDataset(Frames(), seed=0, draw=None, prompt=ByFrame())
    assert ds[SampleRef(index=1, step=0, position=0)]["task"] == "t #1"
