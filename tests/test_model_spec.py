"""The model registry (pisft.model.registry, pisft.model.spec): a throwaway model of another shape
registers its spec, as tests/test_stages.py registers a throwaway stage, and config validation (its
preset a valid `model.preset` with its action chunk while it is registered, refused after), pisft's
training step, its FLOP count, its FSDP2 units (pisft.train.fsdp shards what the spec's `fsdp_units`
lists, and a step of the sharded toy is the unsharded one's), its trainable modes (the parts its spec's
`trainable` entry has: `all`, `no_vision`), the memory estimate's step on fake tensors (pisft.introspect.
simulated_step, against the toy's step measured on real tensors), the weight export (pisft.train.
export_weights: trained, frozen from the base file, sharded or not), the compiled chunk, the precision
records and real-time chunking reach it through the registry alone. So does whatever finds the model
from a config: the memory estimate's entry (`estimate.estimate_memory`: the preset, or the fetched base
folder through the spec's `load.structure`, in the config's trainable mode), the mode read off a config
(`job.frozen_in_bf16`, `trainable.spec_for`), and the smoke gate (`smoke.run_smoke` in-process, through
the real `job.build`: the base folder loaded by the spec's `load.policy`, `job.load_model`, its
processors by `load.processors`, the steps, checks, projections and report).

Not followed here: the smoke gate's data (the dataset folder's readers are stand-ins in its test: a
converted LeRobot dataset is an integration-size fixture) and its estimate from a process that holds a
process group (the stage's own: `estimate._simulate_elsewhere` runs it in a fresh interpreter, where only
the built-in models are registered; the test hands the gate the estimate its `_estimate` made in-process
before the group); the launcher and torchrun (their workers are fresh interpreters too); train_8card's
run after `job.build` (its data loader's collate runs the preprocessor's host steps apart from its
device step, `PolicyTask.collate`, which asks for LeRobot's pipeline, and its export writes LeRobot's
layout: pisft.model.policy.save_model's config.json, the tokenizer, LeRobot's processor files) and so
the LoRA adapter's export (`export_weights.write_adapter` writes LeRobot's config.json); the stages that
load a model otherwise than `job.build` (the RECAP value model's `value_model.load`, evaluation, serving,
fetch_base: pisft.model.policy); LoRA itself (the toy offers no target preset: `lora_spec` refuses it,
which is followed); the training blocks (pisft.train.blocks: the toy's units hold no block, so per-block
runners, activation checkpointing and torch.compile are not run on it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from pisft.errors import PisftError
from pisft.model import registry
from pisft.model.spec import ChunkEntry, LoadEntry, ModelSpec, TrainableEntry
from pisft.model.units import Unit

NAME, PRESET = "toy_flow", "toy_small"
CHUNK, ACTION_DIM, WIDTH, VOCAB = 4, 7, 16, 11  # 7: the synthetic batch's actions (pisft.introspect.synthetic)


@dataclasses.dataclass
class ToyConfig:
    """What pisft reads of a LeRobot policy config, for a model LeRobot does not have."""

    type: str = NAME
    chunk_size: int = CHUNK
    max_action_dim: int = ACTION_DIM
    time_sampling_beta_alpha: float = 1.5
    time_sampling_beta_beta: float = 1.0
    time_sampling_scale: float = 0.999
    time_sampling_offset: float = 0.001
    num_inference_steps: int = 3
    image_features: dict = dataclasses.field(default_factory=lambda: {"observation.images.cam": None})
    image_resolution: tuple[int, int] = (8, 8)  # what the synthetic batch reads (the memory estimate's)
    tokenizer_max_length: int = 5
    device: str = "cpu"


class ToyCore(nn.Module):
    """Flow matching with one MLP over pooled image features, a token embedding and (x_t, t): no
    VLM, no expert, no attention."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.image = nn.Linear(3, WIDTH)
        self.net = nn.Sequential(nn.Linear(2 * WIDTH + CHUNK * ACTION_DIM + 1, 32), nn.GELU(),
                                 nn.Linear(32, CHUNK * ACTION_DIM))

    def sample_noise(self, shape, device):  # LeRobot's names: PolicyTask injects the draws here
        return torch.randn(shape, device=device)

    def sample_time(self, bsize, device):
        return torch.rand(bsize, device=device)

    def velocity(self, images, tokens, masks, x_t, time):
        img = self.image(torch.stack([i.mean(dim=(2, 3)) for i in images]).mean(0))
        emb = (self.embed(tokens) * masks[..., None]).sum(1) / masks.sum(1, keepdim=True).clamp(min=1)
        out = self.net(torch.cat([img, emb, x_t.flatten(1), time[:, None]], dim=1))
        return out.view(-1, CHUNK, ACTION_DIM)

    def forward(self, images, img_masks, tokens, masks, actions, noise, time):
        t = time[:, None, None]
        x_t = t * noise + (1 - t) * actions
        return F.mse_loss(noise - actions, self.velocity(images, tokens, masks, x_t, time), reduction="none")

    def denoise_step(self, images, tokens, masks, x_t, timestep):
        return self.velocity(images, tokens, masks, x_t, timestep)

    def sample_actions(self, images, img_masks, tokens, masks, noise=None, num_steps=None, **kwargs):
        steps = num_steps or 3
        x_t = noise if noise is not None else torch.zeros(tokens.shape[0], CHUNK, ACTION_DIM)
        for i in range(steps):
            time = torch.full((tokens.shape[0],), 1.0 - i / steps)
            x_t = x_t - self.denoise_step(images, tokens, masks, x_t, time) / steps
        return x_t


class ToyPolicy(nn.Module):
    """A LeRobot-shaped policy: `config`, the core as `.model`, `forward(batch) -> (loss, logs)`,
    `predict_action_chunk(batch)` through `self.model.sample_actions`."""

    def __init__(self) -> None:
        super().__init__()
        self.config = ToyConfig()
        self.model = ToyCore()

    @staticmethod
    def inputs(batch):
        images = [batch[k] for k in sorted(batch) if k.startswith("observation.images.")]  # every camera
        return (images, [torch.ones(batch["action"].shape[0], dtype=torch.bool)] * len(images),
                batch["observation.language.tokens"], batch["observation.language.attention_mask"])

    def loss(self, batch):
        actions = batch["action"]
        noise = self.model.sample_noise(actions.shape, actions.device)
        time = self.model.sample_time(actions.shape[0], actions.device)
        return self.model(*self.inputs(batch), actions, noise, time).mean()

    def forward(self, batch):
        loss = self.loss(batch)
        return loss, {"loss": loss.item()}  # the host sync the spec's training_loss leaves out

    def predict_action_chunk(self, batch, noise=None):
        return self.model.sample_actions(*self.inputs(batch), noise=noise, num_steps=self.config.num_inference_steps)


def build(preset, *, seed, device="cpu", dtype=None):
    if preset != PRESET:
        raise ValueError(preset)
    torch.manual_seed(seed)
    policy = ToyPolicy().to(device)
    return policy.to(torch.bfloat16) if dtype in ("bf16", "bfloat16", torch.bfloat16) else policy


@contextlib.contextmanager
def training_loss(policy, *, frozen_prefix=None):
    assert frozen_prefix is None  # the toy has no prefix to freeze
    policy.forward = policy.loss
    try:
        yield
    finally:
        del policy.forward


def flops(policy, *, lang_tokens):
    return 6.0 * sum(p.numel() for p in policy.parameters()) + lang_tokens


@contextlib.contextmanager
def no_pieces(policy, pieces):
    yield False


def load(model_dir, *, device="cpu", dtype=None, preset=None, hold_bf16=None):
    """The toy's folder (`save_folder`) loaded strictly; `hold_bf16`'s parameters held in bf16 before the
    file's values are copied in (as pi0.5's load_policy)."""
    info = json.loads((Path(model_dir) / INFO_FILE).read_text())
    if preset is not None and info["preset"] != preset:
        raise PisftError(f"{model_dir}: holds {info['preset']!r}, not {preset!r}")
    policy = build(info["preset"], seed=0, device=device, dtype=dtype)
    for name, p in policy.named_parameters():
        if hold_bf16 is not None and hold_bf16(name):
            p.data = torch.empty_like(p, dtype=torch.bfloat16)
    policy.load_state_dict(load_file(Path(model_dir) / WEIGHTS), strict=True)
    policy.pisft_model_info = info  # what the training job records in it (the prompt's form)
    return policy


def structure(model_dir, *, device="cpu", dtype=None):
    return build(json.loads((Path(model_dir) / INFO_FILE).read_text())["preset"], seed=0, device=device, dtype=dtype)


def processors(policy, model_dir, dataset_stats=None):
    """(preprocessor, postprocessor): the prompt's characters as tokens (5, padded with 0), actions
    normalised by the dataset's mean and std."""
    mean, std = (torch.as_tensor(dataset_stats["action"][k], dtype=torch.float32) for k in ("mean", "std"))

    def pre(batch):
        out = dict(batch)
        prompts = out.pop("task")
        ids = [[ord(c) % VOCAB for c in text[:5]] + [0] * (5 - len(text[:5])) for text in prompts]
        out["observation.language.tokens"] = torch.tensor(ids)
        out["observation.language.attention_mask"] = out["observation.language.tokens"] > 0
        out["action"] = (out["action"] - mean) / std
        return out

    return pre, lambda actions: actions * std + mean


def toy_units(policy):
    """The toy's FSDP2 units in forward order: the image projection, then the MLP; the token
    embedding stays in the root."""
    return [Unit("model.image", "vision", (policy.model.image,)), Unit("model.net", "decoder", (policy.model.net,))]


def no_rtc(policy, settings):
    raise PisftError(f"{NAME} has no real-time chunking")


TOY = ModelSpec(
    name=NAME, presets={PRESET: CHUNK}, build=build,
    prepare_for_training=lambda policy, *, checkpointing: setattr(policy, "prepared", checkpointing),
    set_layer_checkpointing=lambda policy, on: setattr(policy, "prepared", on),
    training_loss=training_loss, non_blocking_transfers=lambda pre: None, training_flops_per_sample=flops,
    fused_attention=lambda enabled=True: contextlib.nullcontext(),
    chunk=ChunkEntry(install=lambda policy, fn: setattr(policy.model, "sample_actions", fn),
                     own=lambda policy: type(policy.model).sample_actions.__get__(policy.model),
                     pieces=lambda policy: {"denoise_step": policy.model.denoise_step},
                     pieces_installed=no_pieces, velocity_hooked=lambda policy: False),
    configure_rtc=no_rtc,
    weights_dtype=lambda policy: policy.model.net[0].weight.dtype,
    bf16_layout=lambda policy: 0,
    float32_parts=lambda policy: {"model": sum(p.numel() for p in policy.parameters() if p.dtype == torch.float32)},
    prefix_frozen=lambda policy: False, fsdp_units=toy_units, fuse_projections=lambda policy: 0,
    prefix_tokens=lambda policy: len(policy.config.image_features) + 1,  # each camera and the prompt pooled to one
    vocab_size=lambda policy: policy.model.embed.num_embeddings, rtc_source="none (the toy has no RTC)",
    fused_rows=lambda module_of, name: None,
    # its one part a mode may freeze: the image projection, as `no_vision` freezes pi0.5's vision tower
    # (no LeRobot flags, no LoRA presets, nothing kept in float32)
    trainable=TrainableEntry(parts={"vision": lambda dotted: ".model.image." in dotted}, lora_presets=(), lora=None,
                             freeze_flags=None, keep_fp32=()),
    load=LoadEntry(policy=load, structure=structure, processors=processors),
)
INFO_FILE, WEIGHTS = "pisft_model.json", "model.safetensors"


def save_folder(folder, seed: int = 1):
    """The toy's model folder: its config, pisft_model.json (the preset) and its weights at `seed`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(ToyConfig())))
    (folder / INFO_FILE).write_text(json.dumps({"format_version": 1, "preset": PRESET}))
    save_file(build(PRESET, seed=seed).state_dict(), str(folder / WEIGHTS))
    return folder


@contextlib.contextmanager
def gloo_process():
    """A gloo process group of world size 1 (FSDP2 needs one) for one test's block: the memory
    estimate's simulation needs a process without one, so none outlives its test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def toy():
    registry.register(TOY)
    try:
        yield TOY
    finally:
        registry.unregister(NAME)


def _base_file(spec, folder):
    """The base model's weights file (what an export copies frozen tensors from): the toy at seed 0."""
    path = folder / "base.safetensors"
    save_file(spec.build(PRESET, seed=0).state_dict(), str(path))
    return path


def _batch(n: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    batch = {"observation.images.cam": torch.rand(n, 3, 8, 8, generator=g),
             "observation.language.tokens": torch.randint(0, VOCAB, (n, 5), generator=g),
             "observation.language.attention_mask": torch.ones(n, 5, dtype=torch.bool),
             "action": torch.randn(n, CHUNK, ACTION_DIM, generator=g)}
    rand = {"noise": torch.randn(n, CHUNK, ACTION_DIM, generator=g), "time": torch.rand(n, generator=g)}
    return batch, rand


def test_a_registered_model_is_found_by_name_preset_and_policy(toy):
    assert registry.model_spec(NAME) is toy and registry.spec_for_preset(PRESET) is toy
    policy = toy.build(PRESET, seed=0)
    assert registry.spec_of(policy) is toy
    assert {NAME, "pi05"} <= set(registry.names())
    assert registry.spec_for_preset("tiny").name == "pi05"  # pi0.5's presets stay its own
    with pytest.raises(ValueError, match="registered already"):
        registry.register(toy)
    with pytest.raises(ValueError, match="belong to 'pi05'"):
        registry.register(dataclasses.replace(toy, name="other", presets={"tiny": 10}))


ROOT = Path(__file__).resolve().parents[1]


def _toy_config(tmp_path, *sets: str):
    from pisft import config

    return config.load(ROOT / "config" / "config.yaml",
                       [f"results_dir={tmp_path / 'results'}", f"model.preset={PRESET}", *sets])


def test_config_validation_follows_the_registered_presets(tmp_path):
    """`model.preset: toy_small` validates while the toy is registered, its action chunk (4) read by the
    config's chunk check (the closed loop's replan steps), and is refused after, in the words of any
    unknown preset; pi0.5's presets and their chunks stay the config's own."""
    from pisft import config

    unknown = f"model.preset: '{PRESET}' is not one of tiny, small, pi05"
    with pytest.raises(config.ConfigError, match=unknown):
        _toy_config(tmp_path, "eval.replan_steps=4")
    registry.register(TOY)
    try:
        assert config.presets() == ("tiny", "small", "pi05", PRESET)
        cfg = _toy_config(tmp_path, "eval.replan_steps=4")
        assert cfg.model.preset == PRESET and config.preset_chunk_size(PRESET) == CHUNK
        with pytest.raises(config.ConfigError, match=f"exceed model.preset {PRESET}'s chunk of {CHUNK} actions"):
            _toy_config(tmp_path)  # the default eval.replan_steps, 5, against the toy's chunk of 4
        with pytest.raises(ValueError, match="presets already"):  # the config refuses a preset twice
            config.add_presets({PRESET: CHUNK})
    finally:
        registry.unregister(NAME)
    with pytest.raises(config.ConfigError, match=unknown + "$"):
        _toy_config(tmp_path, "eval.replan_steps=4")
    assert config.preset_chunk_size(PRESET) is None and config.presets() == config.PRESETS


def test_the_built_in_models_presets_are_the_configs_table():
    """A driver validates a config without importing the registry: the built-in specs' presets and chunks
    are the config's own table (pisft.config.PRESETS, PRESET_CHUNK_SIZES), in its order."""
    from pisft import config

    built_in = {p: n for spec in registry._BUILT_IN for p, n in spec.presets.items()}
    assert list(built_in) == list(config.PRESETS) and built_in == config.PRESET_CHUNK_SIZES


def test_an_unknown_model_is_refused_by_name():
    with pytest.raises(PisftError, match="no model 'pi0' is registered"):
        registry.model_spec("pi0")
    with pytest.raises(PisftError, match="no registered model has the preset 'huge'"):
        registry.spec_for_preset("huge")


def test_the_training_step_and_its_flops_follow_the_spec(toy):
    from pisft.train.policy_task import PolicyTask
    from pisft.train.step import StepSettings, train_step

    cpu = torch.device("cpu")
    policy = registry.spec_for_preset(PRESET).build(PRESET, seed=0)
    reference = toy.build(PRESET, seed=0)  # the same weights: the same seed
    batch, rand = _batch()
    with torch.no_grad():  # the loss with the task's own draws, computed by hand on the twin
        inputs = ToyPolicy.inputs(batch)
        expected = reference.model(*inputs, batch["action"], rand["noise"], rand["time"]).mean()
    toy.prepare_for_training(policy, checkpointing=False)
    task = PolicyTask(policy, None, cpu)
    assert task.spec is toy
    before = [p.detach().clone() for p in policy.parameters()]
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    out = train_step(policy, optimizer, task, lambda: (batch, rand), StepSettings(1, 1.0, "cpu", cpu))
    assert bool(out.finite) and float(out.loss_sum) == pytest.approx(float(expected), rel=1e-6)
    assert "forward" not in vars(policy)  # the spec's training loss undid its patch
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
    assert task.flops_per_sample(batch) == flops(policy, lang_tokens=5)


def test_a_compiled_chunk_and_the_precision_records_follow_the_spec(toy):
    from pisft.policy import compiled, precision

    policy = toy.build(PRESET, seed=0).eval()
    batch, rand = _batch(3, seed=1)
    with torch.no_grad():
        eager = policy.predict_action_chunk(batch, noise=rand["noise"])
        chunk = compiled.install(policy, compiled.CompileChoice(True, backend="eager"), on_fallback=pytest.fail)
        assert policy.model.sample_actions is chunk
        actions = policy.predict_action_chunk(batch, noise=rand["noise"])
    assert chunk.compile_s and not chunk.fallen_back  # the chunk ran compiled
    assert compiled.tolerance(policy) == compiled.ACTIONS_ATOL[torch.float32]
    torch.testing.assert_close(actions, eager, rtol=0, atol=compiled.tolerance(policy))
    record = precision.apply(policy, precision.PrecisionChoice("float32", "float32", "test", "float32"))
    assert record["float32_parameters"] == {"model": sum(p.numel() for p in policy.parameters())}


def test_real_time_chunking_asks_the_spec(toy):
    from pisft.policy import rtc

    with pytest.raises(PisftError, match=f"{NAME} has no real-time chunking"):
        rtc.configure(toy.build(PRESET, seed=0), rtc.RtcSettings())


def test_the_memory_estimate_of_the_toy_is_its_measured_step(toy):
    """The memory estimate's step on fake tensors (pisft.introspect.simulated_step) builds, prepares,
    shards and steps the toy through its spec alone; its peak is the toy's step measured on real tensors
    (StepMemory on one gloo process, as pisft.introspect.measure measures pi0.5's) to the byte, less the
    two float32 scalars only the training step holds (tests/test_train_estimate.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    from pisft.introspect.measure import training_step
    from pisft.introspect.simulated_step import simulate_step
    from pisft.introspect.step_memory import StepMemory
    from pisft.introspect.synthetic import synthetic_batch
    from pisft.tensors import local_bytes, optimizer_state
    from pisft.train import fsdp, optim
    from pisft.train.policy_task import PolicyTask

    micro, cpu = 3, torch.device("cpu")
    est = simulate_step(lambda: toy.build(PRESET, seed=0, device="meta"), world_size=1, micro_batch=micro,
                        precision="fp32", checkpointing=False)
    plain = toy.build(PRESET, seed=0)
    total = sum(p.numel() for p in plain.parameters())
    assert est["params_total"] == est["params_trained"] == total
    assert est["fsdp"] == {"units": 2, "params_root_unit": VOCAB * WIDTH,
                           "params_largest_unit": sum(p.numel() for p in plain.model.net.parameters()),
                           "params_kept_unsharded_until_backward": 0}
    assert est["sequence"] == {"prefix_tokens": 2, "suffix_tokens": CHUNK}
    with gloo_process():  # after the simulation, which needs a process without a process group
        policy = toy.build(PRESET, seed=0)
        toy.prepare_for_training(policy, checkpointing=False)
        fsdp.shard(policy, init_device_mesh("cpu", (1,)), "fp32")
        optimizer = optim.build_optimizer(policy.parameters(), lr=1e-4, weight_decay=1e-10, fused=True)
        task = PolicyTask(policy, None, cpu, "fp32")
        batch, rand = synthetic_batch(policy, micro, cpu, seed=0)
        policy.train()
        training_step(policy, optimizer, task, *synthetic_batch(policy, 1, cpu, seed=0))  # optimizer state made
        tracker = StepMemory()
        with tracker:
            training_step(policy, optimizer, task, batch, rand)
        measured = tracker.peak()[0]
        state = {"params": local_bytes(policy.parameters()), "optimizer": local_bytes(optimizer_state(optimizer))}
    assert measured - est["step_peak_bytes"] == 2 * 4, (measured, est["step_peak_bytes"])
    assert state == {"params": 4 * total, "optimizer": est["state_bytes"]["optimizer"]}
    assert est["state_bytes"]["params"] == 4 * total and est["state_bytes"]["optimizer"] >= 2 * 4 * total  # AdamW


def test_the_fsdp_units_are_the_specs_and_a_sharded_step_is_the_unsharded_one(toy, tmp_path):
    """pisft.train.fsdp shards the units the toy's spec lists (in its order, the embedding left to the
    root); a training step of the sharded toy (world size 1) gives the unsharded twin's loss and
    weights, and the weight export (pisft.train.export_weights) writes the same file from either."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from pisft.train import fsdp
    from pisft.train.export_weights import write_policy_weights
    from pisft.train.policy_task import PolicyTask
    from pisft.train.step import StepSettings, train_step

    cpu = torch.device("cpu")
    base = _base_file(toy, tmp_path)
    sharded, plain = (toy.build(PRESET, seed=0) for _ in range(2))
    with gloo_process():
        units = fsdp.distribute(sharded, init_device_mesh("cpu", (1,)), "fp32", cpu, keep_sharded=True,
                                min_params=0)
        assert [(u.name, u.group) for u in units] == [("model.image", "vision"), ("model.net", "decoder")]
        assert [u.modules for u in units] == [(sharded.model.image,), (sharded.model.net,)]
        assert all(isinstance(m, FSDPModule) for m in (sharded, sharded.model.image, sharded.model.net))
        assert not isinstance(sharded.model.embed, FSDPModule)
        assert all(isinstance(p, DTensor) for p in sharded.parameters())
        report = fsdp.sharding_report(sharded, None, units)
        assert report["root_only_params"] == VOCAB * WIDTH  # the token embedding
        # the CPU's floor merges within a group only: each of the toy's two groups alone is left to the root
        assert fsdp.choose_units(plain, 10_000) == []
        assert [u.name for u in fsdp.choose_units(plain, 1)] == ["model.image", "model.net"]
        outcomes = []
        for policy in (sharded, plain):
            toy.prepare_for_training(policy, checkpointing=False)
            batch, rand = _batch()
            optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
            outcomes.append(train_step(policy, optimizer, PolicyTask(policy, None, cpu),
                                       lambda b=batch, r=rand: (b, r), StepSettings(1, 1.0, "cpu", cpu)))
        counts = [write_policy_weights(policy, base, tmp_path / f"{i}.safetensors", is_main=True)
                  for i, policy in enumerate((sharded, plain))]
    assert float(outcomes[0].loss_sum) == float(outcomes[1].loss_sum)
    assert float(outcomes[0].grad_norm) == pytest.approx(float(outcomes[1].grad_norm), rel=1e-6)
    for (name, got), want in zip(sharded.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-6, atol=1e-7, msg=name)
    assert not torch.equal(plain.model.net[0].weight, toy.build(PRESET, seed=0).model.net[0].weight)  # it trained
    assert counts[0] == counts[1] == {"trained": len(list(plain.parameters()))}
    exported = [load_file(tmp_path / f"{i}.safetensors") for i in range(2)]
    assert set(exported[1]) == {n for n, _ in plain.named_parameters()}
    assert all(torch.equal(exported[1][n], p) for n, p in plain.named_parameters())
    for name, got in exported[0].items():
        torch.testing.assert_close(got, exported[1][name], rtol=1e-6, atol=1e-7, msg=name)


def test_the_trainable_modes_follow_the_specs_parts(toy):
    """pisft.train.trainable applies the modes whose parts the toy's spec has (`all`, and `no_vision`
    on its image projection), refuses those it lacks (`expert`'s VLM, any LoRA preset), holds what a
    mode froze in bf16, and a training step leaves the frozen part alone."""
    from pisft.train import trainable
    from pisft.train.policy_task import PolicyTask
    from pisft.train.step import StepSettings, train_step

    image = {"model.image.weight": 3 * WIDTH, "model.image.bias": WIDTH}
    policy = toy.build(PRESET, seed=0)
    applied = trainable.apply_mode(policy, "all")
    assert applied.trainable == applied.total == sum(p.numel() for p in policy.parameters())
    applied = trainable.apply_mode(policy, "no_vision")
    assert {n for n, p in policy.named_parameters() if not p.requires_grad} == set(image)
    assert applied.trainable == applied.total - sum(image.values())
    assert not trainable.is_trainable("model.image.weight", "no_vision", model=toy)
    assert trainable.is_trainable("model.net.0.weight", "no_vision", model=toy)
    with pytest.raises(ValueError, match="part 'vlm', which model 'toy_flow' does not have"):
        trainable.apply_mode(toy.build(PRESET, seed=0), "expert")
    with pytest.raises(ValueError, match="model 'toy_flow' has no LoRA preset 'openpi'"):
        trainable.lora_spec("openpi", model=toy)
    cpu = torch.device("cpu")
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    batch, rand = _batch()
    toy.prepare_for_training(policy, checkpointing=False)
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.1)
    train_step(policy, optimizer, PolicyTask(policy, None, cpu), lambda: (batch, rand),
               StepSettings(1, 1.0, "cpu", cpu))
    changed = {n for n, p in policy.named_parameters() if not torch.equal(p, before[n])}
    assert changed and not changed & set(image)
    assert trainable.hold_frozen_in(policy, "bf16") == sum(image.values())  # nothing kept in float32
    assert {n for n, p in policy.named_parameters() if p.dtype == torch.bfloat16} == set(image)


def test_the_weight_export_takes_what_the_toy_froze_from_the_base_file(toy, tmp_path):
    """pisft.train.export_weights writes the toy's file in its own names: a trained parameter as it
    trained, a frozen one (`no_vision`'s image projection, held in bf16 by training) as the base
    file's bytes, in the base's dtype."""
    from pisft.train import trainable
    from pisft.train.export_weights import write_policy_weights

    base = _base_file(toy, tmp_path)
    policy = toy.build(PRESET, seed=0)
    trainable.apply_mode(policy, "no_vision")
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)  # stands for training: every parameter now differs from the base's
    assert trainable.hold_frozen_in(policy, "bf16") == 4 * WIDTH
    counts = write_policy_weights(policy, base, tmp_path / "out.safetensors", is_main=True)
    assert counts == {"frozen": 2, "trained": len(list(policy.parameters())) - 2}
    out, before = load_file(tmp_path / "out.safetensors"), load_file(base)
    assert set(out) == set(before)
    for name, p in policy.named_parameters():
        want = before[name] if name.startswith("model.image.") else p.detach()
        assert out[name].dtype == torch.float32 and torch.equal(out[name], want), name


# The modules outside pisft/model/ that import pi0.5's folder on purpose: the doctor's attention check
# and the benches that measure pi0.5 itself (docs/development.md), each import with its reason.
PI05_ON_PURPOSE = {"doctor/checks.py", "bench/host_overhead.py", "bench/data_loader_bench.py",
                   "bench/train_structure.py"}


def test_outside_the_model_folder_only_pi05s_own_benches_and_doctor_import_it():
    """What a model offers is asked of its spec (pisft.model.registry): training, inference, RECAP and
    the inspection tools never import pisft.model.pi05, so a registered model reaches them all."""
    import ast
    from pathlib import Path

    import pisft

    src = Path(pisft.__file__).resolve().parent
    found = set()
    for f in sorted(src.rglob("*.py")):
        rel = f.relative_to(src)
        if rel.parts[0] == "model":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
            else:
                continue
            if any(n == "pisft.model.pi05" or n.startswith("pisft.model.pi05.") for n in names):
                found.add(rel.as_posix())
    assert found == PI05_ON_PURPOSE


def _sim(world: int, micro: int, precision: str = "fp32", mode: str = "all"):
    """The toy's step on fake tensors at these settings, built as training builds it."""
    from pisft.introspect.simulated_step import simulate_step, with_mode
    from pisft.train.fsdp import min_unit_params

    make = with_mode(lambda: TOY.build(PRESET, seed=0, device="meta"), mode, None, precision)
    return simulate_step(make, world_size=world, micro_batch=micro, precision=precision, checkpointing=False,
                         min_unit_params=min_unit_params("cpu", -1))


def test_the_memory_estimate_finds_the_toy_from_its_config(toy, tmp_path):
    """`estimate.estimate_memory(cfg)` builds model.preset's model through its spec: the toy's preset (on
    the meta device), or the fetched base folder of that preset (the spec's `load.structure`), with the
    config's trainable mode (`no_vision` in bf16: the image projection held in bf16); its figures are
    the simulated step of the toy at the config's settings. The mode read off the config
    (`job.frozen_in_bf16`, `trainable.spec_for`) is the toy's too."""
    from pisft import layout
    from pisft.introspect.estimate import estimate_memory
    from pisft.train import job, trainable

    cfg = _toy_config(tmp_path, "eval.replan_steps=4", "train.micro_batch_size=2", "device=cpu")
    total = sum(p.numel() for p in toy.build(PRESET, seed=0).parameters())
    for world in (1, cfg.world_size):
        est, sim = estimate_memory(cfg, world_size=world), _sim(world, 2)
        assert (est["model"], est["world_size"], est["params_total"]) == (f"preset {PRESET}", world, total)
        assert (est["total_bytes"], est["step_peak_bytes"]) == (sim["bytes"]["total"], sim["step_peak_bytes"])
    base = save_folder(layout.base_model(cfg))
    est = estimate_memory(cfg, world_size=1)
    assert est["model"] == str(base) and est["total_bytes"] == int(_sim(1, 2)["bytes"]["total"])
    bf16 = _toy_config(tmp_path, "eval.replan_steps=4", "train.micro_batch_size=2", "device=cpu",
                       "train.precision=bf16", "train.trainable=no_vision")
    est = estimate_memory(bf16, world_size=1)
    assert est["params_bf16"] == 4 * WIDTH and est["params_trained"] == total - 4 * WIDTH
    assert est["total_bytes"] == int(_sim(1, 2, "bf16", "no_vision")["bytes"]["total"])
    hold = job.frozen_in_bf16(bf16)
    assert hold("model.image.weight") and hold("model.image.bias") and not hold("model.net.0.weight")
    assert trainable.spec_for(bf16) is None and job.frozen_in_bf16(cfg) is None


def test_the_smoke_gate_runs_the_toy_from_its_config(toy, tmp_path, monkeypatch):
    """`smoke.run_smoke` on a toy config, in-process on one gloo process, through the real `job.build`:
    the toy's base folder loaded through its spec (`job.load_model`: strictly, `no_vision`'s image
    projection held in bf16 from the load, prepared, the mode applied, sharded), its processors made by
    its spec, the smoke steps, the checks, the projections and the report. Stand-ins: the dataset folder's
    readers (a converted LeRobot dataset is an integration-size fixture): the stats, the train split (8
    in-memory samples of the toy's shapes), the prompt conditioning; and the estimate, which a process
    holding a process group makes in a fresh interpreter, where only built-in models are registered: it
    is the gate's own `_estimate`, run in this process before the group exists."""
    import numpy as np

    from pisft import device as devices
    from pisft import layout
    from pisft.data import dataset, prompts
    from pisft.gates import smoke
    from pisft.train import job

    cfg = _toy_config(tmp_path, "eval.replan_steps=4", "device=cpu", "train.micro_batch_size=2",
                      "train.compile=off", "train.precision=bf16", "train.trainable=no_vision", "train.lr=0.01",
                      "smoke.steps=3")
    base = save_folder(layout.base_model(cfg))
    split = layout.iteration(cfg).split
    split.parent.mkdir(parents=True, exist_ok=True)
    split.write_text("{}")  # what require_inputs looks for; the split itself is the stand-in below
    g = torch.Generator().manual_seed(0)
    samples = [{"observation.images.cam": torch.rand(3, 8, 8, generator=g), "action": torch.randn(CHUNK, ACTION_DIM,
                generator=g), "task": f"task {i % 3}"} for i in range(8)]
    stats = {"action": {"mean": np.full(ACTION_DIM, 0.5, np.float32), "std": np.full(ACTION_DIM, 2.0, np.float32)}}
    monkeypatch.setattr(dataset, "load_stats", lambda data: stats)
    monkeypatch.setattr(dataset, "load_split", lambda data, split, *, chunk_size: samples[:8] if chunk_size == CHUNK
                        else pytest.fail(f"chunk {chunk_size}"))
    monkeypatch.setattr(prompts, "training_prompt_fn", lambda data: None)
    monkeypatch.setattr(job, "conditioning_of", lambda cfg, data: None)
    estimate = smoke._estimate(smoke._estimated(cfg))  # before the process group: in this process
    assert all("total_bytes" in estimate[w] for w in ("1", str(cfg.world_size)))
    monkeypatch.setattr(smoke, "_estimate", lambda cfg: estimate)
    built = []
    monkeypatch.setattr(smoke, "build", lambda ctx: built.append(job.build(ctx)) or built[-1])
    info = devices.DeviceInfo(kind="cpu", backend="gloo", device=torch.device("cpu"), name="cpu")
    with gloo_process():
        assert smoke.run_smoke(job.Context(cfg, "smoke_1card", info, 0, 1)) == 0
    report = json.loads(layout.smoke_report(cfg).read_text())
    assert report["passed"] and report["optimizer"] == "adamw" and len(report["losses"]) == 3
    assert report["last_loss"] < report["first_loss"] and report["flops_per_sample"] == flops(built[0].model,
                                                                                               lang_tokens=5)
    assert report["estimate"] == estimate and report["trainable"] == "no_vision"
    assert report["tensors_vs_estimate"]["params"]["frozen"] == 4 * WIDTH
    policy = built[0].model
    assert policy.prepared is False and [u.name for u in built[0].units] == []  # the CPU's floor: left to the root
    assert {n: p.dtype for n, p in policy.named_parameters() if not p.requires_grad} == {
        "model.image.weight": torch.bfloat16, "model.image.bias": torch.bfloat16}
    on_file = load_file(base / WEIGHTS)
    assert torch.equal(policy.model.image.weight.full_tensor(), on_file["model.image.weight"].bfloat16())  # frozen
    assert not torch.equal(policy.model.net[0].weight.full_tensor(), on_file["model.net.0.weight"])  # it trained
