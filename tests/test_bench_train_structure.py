"""The `train_structure` bench component: its counting machinery on toys, and one real run."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from train_fixtures import CONFIG

from pisft import config as config_mod
from pisft.bench import run as bench_run
from pisft.bench import train_structure as ts
from pisft.errors import PisftError


# ------------------------------------------------------------------ host syncs, modelled
def test_host_sync_counter_tells_device_from_host_tensors():
    device = torch.device("cpu")  # the training device object (a CPU stands in for it)
    weight = torch.ones(3)  # created outside the counter: model state, on the device
    batch = torch.arange(3.0)
    ts._set_host(batch, True)  # what the data loader delivers
    counter = ts.HostSyncCounter(device)
    with counter:
        counter.step = 0
        host_sum = batch.sum()
        host_sum.item()  # host tensor: no sync
        x = batch.to(device)  # host -> device
        assert x.device is device
        y = (x * weight).sum()
        y.item()  # 1: device scalar read by the host
        float(y)  # 2
        moved = y.cpu()  # 3: device -> host copy
        moved.tolist()  # already on the host: no sync
        (moved * 2).item()  # derived from host values only: no sync
        z = torch.zeros(2, device=x.device)  # a factory on the training device
        bool(z.any())  # 4
        torch.zeros(2).tolist()  # a host factory: no sync
        weight.to("cpu")  # 5: an explicit transfer to the host
        weight.to(x.device)  # device -> device: nothing
        counter.paused = True
        y.item()  # paused (data loading): not counted
    assert sum(counter.by_step[0].values()) == 5
    assert all("test_bench_train_structure.py" in site for site in counter.by_step[0])


def test_census_counts_device_tensors_from_python_and_float64_device_ops():
    device = torch.device("cpu")  # the training device object
    weight = torch.ones(3)  # model state: on the device
    counter = ts.HostSyncCounter(device)
    with counter:
        counter.step = 0
        rows = torch.tensor([0, 1, 1], dtype=torch.bool, device=weight.device)  # 1: from a list
        torch.tensor([1.0, 2.0])  # a host tensor from a list: no host->device copy
        torch.as_tensor(3.0, device=device)  # 2: from a Python number
        torch.zeros(3, dtype=torch.bool, device=weight.device)  # made on the device: not counted
        f = torch.linspace(0.0, 1.0, 4, dtype=torch.float64, device=weight.device)  # float64 op 1
        (4e-3 * 1000.0 ** f).sum()  # float64 ops 2, 3, 4 (pow, mul, sum)
        torch.linspace(0.0, 1.0, 4, dtype=torch.float64)  # float64 on the host: not counted
        (weight * 2).float()  # float32 on the device: not counted
        counter.paused = True
        torch.tensor([1], device=device)  # paused: not counted
        assert rows.dtype == torch.bool
    assert sum(counter.from_python_by_step[0].values()) == 2
    assert sum(counter.float64_by_step[0].values()) == 4


def test_the_bench_measures_the_accelerator_layout_on_any_host(tmp_path):
    """The CPU's FSDP floor would leave the tiny model in one root unit (fsdp_units 1)."""
    from pisft.train.fsdp import min_unit_params

    raw = ts.bench_config(config_mod.load(CONFIG), tmp_path)
    assert raw["train"]["fsdp_min_unit_params"] == min_unit_params("npu") == 0
    assert raw["device"] == "cpu" and min_unit_params("cpu") > 0


def test_host_state_of_an_object_graph_is_marked():
    class Step:
        def __init__(self):
            self.stats = {"state": {"mean": torch.zeros(2), "std": torch.ones(2)}}

    pipeline = type("Pipeline", (), {})()
    pipeline.steps = [Step(), Step()]
    assert ts.mark_host_state(pipeline) == 4
    assert ts._is_host(pipeline.steps[1].stats["state"]["std"])


# ------------------------------------------------------------------ FSDP2 state, one process
@pytest.fixture
def one_process(tmp_path):
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                                rank=0, world_size=1)
    yield
    if owns:
        dist.destroy_process_group()


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)
        self.c = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.ones(4))  # stays in the root unit

    def forward(self, x):
        return self.c(self.b(self.a(x))) * self.scale


def test_fsdp_units_and_peak_unsharded_fraction(one_process):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Toy()
    mesh = init_device_mesh("cpu", (1,))
    fully_shard([model.a, model.b], mesh=mesh)  # one unit of two modules (list form)
    fully_shard(model.c, mesh=mesh)
    fully_shard(model, mesh=mesh)
    groups, root = ts.fsdp_groups(model)
    assert len(groups) == 3 and root in groups  # (a, b), c and the root
    sizes = sorted(ts.group_numel(g) for g in groups)
    total = sum(p.numel() for p in model.parameters())
    assert sum(sizes) == total and ts.group_numel(root) == 4
    tracker = ts.UnshardTracker(groups, total)
    with tracker.installed():
        tracker.step = 0
        model(torch.randn(2, 8)).sum().backward()
    peak = tracker.peak_by_step[0]
    ab = sum(p.numel() for m in (model.a, model.b) for p in m.parameters())
    assert (ab + 4) / total <= peak <= 1.0
    tracker.step = 1
    model(torch.randn(2, 8)).sum().backward()  # uninstalled: no longer followed
    assert tracker.peak_by_step[1] == 0.0


def test_decoder_layers_are_found_by_name():
    root = nn.Module()
    for path in ("model.paligemma_with_expert.paligemma.model.language_model.layers.0",
                 "model.paligemma_with_expert.gemma_expert.model.layers.0",
                 "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder.layers.0"):
        parent = root
        for part in path.split("."):
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module("self_attn", nn.Module())
        parent.self_attn.add_module("q_proj", nn.Linear(2, 2))
    assert len(ts.decoder_q_projs(root)) == 2
    assert list(ts.vision_q_projs(root)) == [
        "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder.layers.0"]


# ------------------------------------------------------------------ the component, for real
def _expected_units(preset: str) -> dict[str, int]:
    """The accelerator's FSDP2 units of a pi0.5 preset, counted from the preset's sizes
    (pisft/model/pi05/units.py's layout): the SigLIP embeddings, the vision encoder layers
    `VISION_LAYERS_PER_UNIT` to a unit, the post-layernorm + projector, the action/time
    projections, one unit per decoder layer pair (VLM layer i with expert layer i), and the root
    (the tied token embedding lives there)."""
    from pisft.model.pi05.presets import get_preset
    from pisft.model.pi05.units import VISION_LAYERS_PER_UNIT

    arch = get_preset(preset).arch
    assert arch.vlm.depth == arch.expert.depth  # layer pairs
    vision, pairs = arch.vision.num_hidden_layers, arch.vlm.depth
    vision_units = -(-vision // VISION_LAYERS_PER_UNIT)
    return {"vision_layers": vision, "decoder_layer_pairs": pairs, "decoder_layers": 2 * pairs,
            "fsdp_units": 1 + vision_units + 1 + 1 + pairs + 1}


@pytest.mark.integration
def test_train_structure_component(tmp_path):
    r = ts.run(config_mod.load(CONFIG), tmp_path)
    assert r["world_size"] == 2 and r["micro_batch_size"] == 4 and r["activation_checkpointing"]
    assert r["ranks_agree"] is True
    # the accelerator's layout (fsdp_min_unit_params 0 on any host), unit for unit
    want = _expected_units("tiny")
    assert r["fsdp_min_unit_params"] == 0
    assert (r["vision_layers"], r["decoder_layer_pairs"]) == (want["vision_layers"], want["decoder_layer_pairs"])
    assert r["fsdp_units"] == want["fsdp_units"] <= r["fsdp_units_target"], r["fsdp_units"]  # a bound
    assert r["fsdp_units_excluding_root"] == want["fsdp_units"] - 1
    # nothing HCCL refuses and no float64 collective, in the whole loop and the build
    assert r["float64_collectives"] == 0 and r["float64_collectives_by_op"] == {}, r["float64_collectives_by_op"]
    assert r["hccl_violations"] == 0 and r["hccl_violation_messages"] == [], r["hccl_violation_messages"]
    # one checkpointing level: every decoder layer runs twice per micro-step (forward, recompute)
    fwd = r["decoder_layer_forwards_per_micro_step"]
    assert fwd["layers"] == want["decoder_layers"]
    assert set(fwd["per_layer"].values()) == {2.0}, fwd["per_layer"]
    # every unit gathered at least once per micro-step, at most twice (forward, backward)
    assert r["fsdp_units"] <= r["all_gather_per_micro_step"] <= r["all_gather_bound"] == 2 * r["fsdp_units"]
    # every unit's gradients reduce-scattered once per micro-step (the loop never skips the sync)
    assert r["reduce_scatter_per_micro_step"] == r["fsdp_units"]
    assert 0 < r["max_unsharded_param_fraction"] < 1
    # no blocking host->device copy and no float64 inside a step
    assert r["tensors_from_python_per_micro_step"] == 0, r["tensors_from_python"]
    assert r["float64_ops_per_micro_step"] == 0, r["float64_ops"]
    # no host sync inside an optimizer step (docs/ascend.md): none in a step without a metrics
    # fetch; a logging step's fetch (pisft.train.loop._fetch) moves its two results to the host,
    # the all-reduced losses and norms and the all-gathered per-rank figures: two transfers
    syncs = r["host_syncs_per_step"]
    assert len(syncs["per_step"]) == r["optimizer_steps"]
    assert syncs["other_steps"] == 0 and syncs["logging_steps"] == 2, syncs
    assert all(math.isfinite(x) for x in r["losses"])
    assert json.loads((tmp_path / "train_structure.json").read_text())["fsdp_units"] == r["fsdp_units"]


# ------------------------------------------------------------------ bench --only
def test_bench_only_runs_the_named_part_and_keeps_the_others(tmp_path, monkeypatch):
    (tmp_path / "fake_bench_part.py").write_text(
        "def run(cfg, work):\n    return {'work_exists': work.is_dir()}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(bench_run, "COMPONENT_BENCHES",
                        {**bench_run.COMPONENT_BENCHES, "fake": "fake_bench_part:run"})
    cfg = config_mod.load(CONFIG, [f"results_dir={tmp_path / 'results'}"])
    out = tmp_path / "results" / "bench" / "bench.json"
    out.parent.mkdir(parents=True)
    out.write_text(json.dumps({"pipeline": {"pipeline_wall_s": 1.0}, "fake": {"old": True}}))
    assert bench_run.main(cfg, str(CONFIG), only=["fake"]) == 0
    got = json.loads(out.read_text())
    assert got["fake"] == {"work_exists": True}
    assert got["pipeline"] == {"pipeline_wall_s": 1.0}  # not rerun, kept
    with pytest.raises(PisftError, match="unknown part.*nope.*train_structure"):
        bench_run.main(cfg, str(CONFIG), only=["nope"])
    assert "train_structure" in bench_run.part_names()
