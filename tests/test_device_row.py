"""A device kind is one row (`pisft.device.DeviceRow`): a throwaway kind registered here is followed
through what reads the row -- usability, backend, environment, selection, memory, synchronisation,
peak FLOPs, compile and precision choices, loader workers, FSDP units, profiler, the doctor --
with a stand-in torch module, as tests/test_stages.py follows a throwaway stage. The NPU row's
branches run with the stand-in torch_npu in tests/test_device.py, test_doctor.py and
test_policy_compiled.py."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from pisft import config as config_mod
from pisft import device
from pisft.bench import gpu_step
from pisft.doctor import checks
from pisft.errors import DeviceError
from pisft.gates import compile_trial
from pisft.policy import compiled, precision
from pisft.train import batches, blocks, fsdp, metrics

KIND = "xpu"  # a device type torch knows, which no row of pisft's uses


class StandInModule(types.ModuleType):
    """What pisft asks of a kind's torch module (`torch.cuda`'s API), with its calls recorded."""

    def __init__(self) -> None:
        super().__init__("torch.xpu_stand_in")
        self.calls: list[tuple] = []

    def device_count(self) -> int:
        return 2

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))

    def get_device_name(self, index: int = 0) -> str:
        return "Throwaway X1"

    def max_memory_allocated(self) -> int:
        return 111

    def max_memory_reserved(self) -> int:
        return 222

    def reset_peak_memory_stats(self) -> None:
        self.calls.append(("reset_peak_memory_stats",))

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache",))

    def get_device_properties(self, index: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(total_memory=16 * 2**30)

    def mem_get_info(self, index: int) -> tuple[int, int]:
        return (15 * 2**30, 16 * 2**30)


@pytest.fixture
def throwaway():
    module = StandInModule()
    synchronized: list = []
    profiled: list = []
    row = device.DeviceRow(
        KIND, "gloo", module=lambda: module, found=lambda: False,
        env_defaults={"THROWAWAY_QUEUE": "2"}, deterministic_env={"THROWAWAY_DETERMINISTIC": "1"},
        attention_kernel="throwaway_attention", compile_backend="throwaway_backend", compile_mode="capture",
        compile_backend_missing=lambda: None, peak_flops=((r"X1", 100e12, "Throwaway X1"),),
        profiler=lambda: profiled.append(True) or "a profile",
        synchronize=synchronized.append, collective_buffer_bytes=lambda env: int(env.get("THROWAWAY_BUF", "7")),
        runtime_version=lambda: "Throwaway runtime 1.0", whole_number_env=("THROWAWAY_QUEUE",))
    device.register(row)
    try:
        yield types.SimpleNamespace(row=row, module=module, synchronized=synchronized, profiled=profiled)
    finally:
        del device.ROWS[KIND]


def test_a_registered_kind_is_resolved_selected_and_asked_through_its_row(throwaway):
    assert device.resolve_kind(KIND) == KIND
    assert device.resolve_kind("auto") != KIND  # `found` says no: auto keeps to the kinds found here
    assert device.backend_for(KIND) == "gloo"
    assert device.device_count(KIND) == 2
    assert device.local_device(KIND, 1) == torch.device(KIND, 1)
    assert throwaway.module.calls == [("set_device", 1)]
    with pytest.raises(DeviceError, match=f"LOCAL_RANK 2 has no {KIND} device: only 2 visible"):
        device.local_device(KIND, 2)
    assert device.device_name(KIND, torch.device(KIND, 1)) == "Throwaway X1"
    info = device.DeviceInfo(KIND, "gloo", torch.device(KIND, 0), "Throwaway X1")
    assert info.row is throwaway.row and info.row.accelerator
    assert throwaway.row.torch_device(1) == torch.device(KIND, 1)
    assert not device.on_host(f"{KIND}:0") and not device.host_only(KIND)
    with pytest.raises(ValueError, match="is taken"):
        device.register(throwaway.row)


def test_environment_and_determinism_come_from_the_row(throwaway):
    env = device.process_env(KIND, {"PATH": "/bin"}, nproc_per_node=2)
    assert env["THROWAWAY_QUEUE"] == "2" and env["JAX_PLATFORMS"] == "cpu"
    assert "OMP_NUM_THREADS" not in env  # an accelerator: no CPU thread default
    assert device.process_env(KIND, {"THROWAWAY_QUEUE": "9"})["THROWAWAY_QUEUE"] == "9"  # the user's wins
    assert device.deterministic_env(KIND) == {"THROWAWAY_DETERMINISTIC": "1"}


def test_memory_and_synchronisation_go_to_the_rows_module(throwaway, monkeypatch):
    monkeypatch.delenv(device.MEMORY_CAP_ENV, raising=False)
    dev = torch.device(KIND, 1)
    assert device.peak_memory_bytes(KIND) == 111 and device.peak_reserved_bytes(KIND) == 222
    assert device.capacity_bytes(KIND, dev) == 16 * 2**30
    assert device.free_memory_bytes(KIND, dev) == 15 * 2**30
    device.reset_peak_memory(KIND)
    device.empty_cache(KIND)
    assert throwaway.module.calls == [("reset_peak_memory_stats",), ("empty_cache",)]
    device.synchronize(KIND, dev)
    assert throwaway.synchronized == [dev]
    assert device.hccl_buffer_bytes(KIND, {"THROWAWAY_BUF": "5"}) == 5
    device.synchronize("meta")  # a device type without a row: nothing to wait for


def test_training_decisions_read_the_row(throwaway, monkeypatch, tmp_path):
    assert metrics.peak_flops_for("Throwaway X1", KIND) == (100e12, "table: Throwaway X1")
    assert metrics.peak_flops_for("Throwaway X2", KIND)[0] is None
    assert compile_trial.wants_trial("auto", KIND)  # off the host: the gate measures compiled
    assert fsdp.min_unit_params(KIND) == 0
    assert batches.default_workers(KIND, 2, cores=8) == 3  # an accelerator's share of the cores
    assert gpu_step._profiler(KIND) == "a profile" and throwaway.profiled == [True]
    monkeypatch.setenv(blocks.CACHE_ENV, str(tmp_path))
    compiler = blocks.compiler_for("layers", KIND, tmp_path, print)  # train.compile: the row's backend
    assert compiler.enabled and compiler.describe() == "compiled per block (inductor)"


def test_inference_choices_read_the_row(throwaway):
    choice = compiled.choose(None, KIND)
    assert (choice.trial, choice.backend, choice.mode) == (True, "throwaway_backend", "capture")
    device.ROWS[KIND] = dataclasses.replace(throwaway.row, compile_backend_missing=lambda: "no backend")
    fallback = compiled.choose(True, KIND)
    assert not fallback.enabled and "falling back: no backend" in fallback.why
    assert precision.choose("auto", KIND, "float32").dtype == "bfloat16"


def test_the_doctor_reads_the_row(throwaway, monkeypatch):
    cfg = config_mod.load(config_mod.DEFAULT_CONFIG, ["device=cpu", "train.nproc_per_node=2"])
    node = checks.Node(cfg, KIND, KIND, cards=2)
    assert node.accelerator and node.device(1) == torch.device(KIND, 1)
    versions = checks.check_versions(node)
    assert "Throwaway runtime 1.0" in versions.detail
    devices_check = checks.check_devices(node)
    assert devices_check.status == "pass", devices_check.detail
    assert f"{KIND}:1 15.0/16.0 GiB free" in devices_check.detail
    monkeypatch.setenv("THROWAWAY_QUEUE", "two")
    environment = checks.check_environment(node)
    assert environment.status == "fail" and "THROWAWAY_QUEUE='two' is not a whole number" in environment.detail


def test_an_unknown_kind_names_the_rows():
    with pytest.raises(DeviceError, match="device kind 'tpu' is not one of npu, cuda, cpu"):
        device.row("tpu")
    with pytest.raises(DeviceError, match="device: 'tpu' is not one of auto, npu, cuda, cpu"):
        device.resolve_kind("tpu")
    assert device.host_only("cpu") and not device.host_only("auto") and not device.host_only("cuda")
    assert device.on_host("cpu") and device.on_host(torch.device("cpu")) and not device.on_host("meta")


def test_a_kind_without_cards_is_the_host_by_its_row_not_by_its_name(monkeypatch):
    """A second throwaway kind, without a torch module: every decision the CPU's row makes by having
    no cards, it makes too (a branch that still compared the kind with "cpu" would treat it as an
    accelerator)."""
    monkeypatch.setitem(device.ROWS, "host2", device.DeviceRow("host2", "gloo", compile_trial=False,
                                                               bf16_inference=False))
    assert device.local_device("host2", 3) == torch.device("cpu") and device.device_count("host2") == 1
    assert device.row("host2").torch_device(1) == torch.device("cpu") and device.on_host("host2")
    assert "OMP_NUM_THREADS" in device.process_env("host2", {"PATH": "/bin"}, nproc_per_node=2)
    assert device.peak_memory_bytes("host2") == device.peak_reserved_bytes("host2") > 0  # the peak RSS
    assert fsdp.min_unit_params("host2") == fsdp.min_unit_params("cpu") > 0
    assert batches.default_workers("host2", 2, cores=8) == 1
    assert not compile_trial.wants_trial("auto", "host2")
    assert not compiled.choose(None, "host2").enabled
    assert precision.choose("auto", "host2", "float32").dtype == "float32"
    assert metrics.peak_flops_for("host2", "host2") == (None, "host2: no peak figure (MFU not reported)")
    assert gpu_step._profiler("host2") is None


def test_the_configs_device_choices_are_the_rows():
    """The config (the ground floor, read by every Snakemake parse without torch) lists the kinds by
    name for `device`'s choices: they are the rows' kinds, in `auto`'s order, after `auto`. A new kind
    is its row and its name there; this test names the one that is missing."""
    assert ("auto", *device.ROWS) == config_mod.DEVICES, (
        f"config's device choices {config_mod.DEVICES} are not ('auto', *pisft.device.ROWS) "
        f"{('auto', *device.ROWS)}: add the kind to DEVICES in src/pisft/config/choices.py")
