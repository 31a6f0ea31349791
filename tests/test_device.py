"""Device layer: kinds, backends, LOCAL_RANK, environment; NPU via a stand-in torch_npu."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from pisft import device
from pisft.errors import DeviceError

# The stand-in torch_npu package (tests/stand_ins/torch_npu), importable in a fresh interpreter:
# registers `torch.npu`, renames the PrivateUse1 backend to "npu" the way the real package does
# and registers an "hccl" backend that enforces HCCL's dtype table. Never install torch-npu here.
STAND_INS = Path(__file__).resolve().parent / "stand_ins"


@pytest.fixture
def fake_npu_path() -> Path:
    return STAND_INS


def _run_with_fake_npu(fake_npu_path: Path, code: str, **env_extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in device.ASCEND_ENV_DEFAULTS and k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake_npu_path), env.get("PYTHONPATH", "")])
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_kind_backend_and_device():
    assert device.resolve_kind("cpu") == "cpu"
    assert device.backend_for("cpu") == "gloo"
    assert device.backend_for("cuda") == "nccl"
    assert device.backend_for("npu") == "hccl"
    assert device.local_device("cpu", 1) == torch.device("cpu")
    assert device.capacity_bytes("cpu", torch.device("cpu")) is None
    assert device.peak_memory_bytes("cpu") > 0


def test_missing_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="cuda.*device: cpu"):
        device.resolve_kind("cuda")


def _without_torch_npu(monkeypatch):
    """A host without the torch_npu package (whatever this one has)."""
    real_find_spec = device.importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(device.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch_npu" else real_find_spec(name, *a))


def _with_npus(monkeypatch, count: int):
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: count > 0,
                                                            device_count=lambda: count), raising=False)


@pytest.mark.parametrize("npus,cuda,expected", [
    (None, False, "cpu"),   # neither torch_npu nor CUDA
    (None, True, "cuda"),
    (0, False, "cpu"),      # torch_npu installed, no card visible
    (0, True, "cuda"),
    (2, True, "npu"),       # an NPU host wins over CUDA
])
def test_auto_picks_npu_then_cuda_then_cpu(monkeypatch, npus, cuda, expected):
    if npus is None:
        _without_torch_npu(monkeypatch)
    else:
        _with_npus(monkeypatch, npus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert device.resolve_kind("auto") == expected


def test_missing_torch_npu_is_a_clear_error(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    real_import = __import__("importlib").import_module

    def fake_import(name, *a, **k):
        if name == "torch_npu":
            raise ImportError("No module named 'torch_npu'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(device.importlib, "import_module", fake_import)
    with pytest.raises(DeviceError, match="torch_npu cannot be imported.*set_env.sh"):
        device.resolve_kind("npu")


def test_npu_without_visible_cards_is_a_clear_error(monkeypatch):
    fake = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False,
                                                            device_count=lambda: 0),
                        raising=False)
    with pytest.raises(DeviceError, match="no Ascend NPU is visible"):
        device.resolve_kind("npu")


def test_local_rank_beyond_devices(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True,
                                                            device_count=lambda: 2),
                        raising=False)
    with pytest.raises(DeviceError, match="LOCAL_RANK 5 has no npu device.*at most 2"):
        device.local_device("npu", 5)


def test_process_env_defaults_and_overrides():
    env = device.process_env("cpu", {"PATH": "/bin", "JAX_PLATFORMS": "cuda"}, nproc_per_node=2)
    assert int(env["OMP_NUM_THREADS"]) >= 1
    assert env["JAX_PLATFORMS"] == "cpu"  # forced for training processes
    assert "TASK_QUEUE_ENABLE" not in env
    env = device.process_env("npu", {"TASK_QUEUE_ENABLE": "1"})
    assert env["TASK_QUEUE_ENABLE"] == "1"  # the user's value wins
    for key, value in device.ASCEND_ENV_DEFAULTS.items():
        if key != "TASK_QUEUE_ENABLE":
            assert env[key] == value
    assert env["JAX_PLATFORMS"] == "cpu"


def test_npu_branches_with_stand_in_torch_npu(fake_npu_path):
    result = _run_with_fake_npu(fake_npu_path, """
        import json, os, sys
        import torch
        from pisft import device
        info = device.setup("auto")
        print(json.dumps({
            "kind": info.kind, "backend": info.backend, "device": str(info.device),
            "name": info.name, "calls": torch.npu.calls,
            "env": {k: os.environ.get(k) for k in
                    list(device.ASCEND_ENV_DEFAULTS) + ["JAX_PLATFORMS", "HCCL_EXEC_TIMEOUT"]},
            "fused": device.fused_adamw_supported("npu"),
            "capacity": device.capacity_bytes("npu", info.device),
            "transfer_to_npu": any("transfer_to_npu" in m for m in sys.modules),
        }))
    """, LOCAL_RANK="3", HCCL_EXEC_TIMEOUT="999")
    assert result["kind"] == "npu"
    assert result["backend"] == "hccl"
    assert result["device"] == "npu:3"
    assert result["calls"] == [["set_device", 3]]
    assert result["name"] == "Ascend910B2"
    assert result["env"]["TASK_QUEUE_ENABLE"] == device.ASCEND_ENV_DEFAULTS["TASK_QUEUE_ENABLE"]
    assert result["env"]["HCCL_EXEC_TIMEOUT"] == "999"  # the user's value reaches HCCL
    assert result["env"]["JAX_PLATFORMS"] == "cpu"
    assert result["fused"] is True
    assert result["capacity"] == 64 * 2**30
    assert result["transfer_to_npu"] is False


def test_hccl_exec_timeout_is_left_to_cann():
    """CANN's Atlas A2 default (1836 s) is longer than the 1800 s pisft used to set."""
    assert "HCCL_EXEC_TIMEOUT" not in device.ASCEND_ENV_DEFAULTS
    assert "HCCL_EXEC_TIMEOUT" not in device.process_env("npu", {})


def test_free_memory_is_what_the_device_reports(fake_npu_path):
    assert device.free_memory_bytes("cpu", torch.device("cpu")) is None
    result = _run_with_fake_npu(fake_npu_path, """
        import json
        import torch, torch_npu
        from pisft import device
        torch_npu.memory[3] = (7 * 2**30, 64 * 2**30)
        print(json.dumps([device.free_memory_bytes("npu", torch.device("npu", i)) for i in (0, 3)]))
    """)
    assert result == [60 * 2**30, 7 * 2**30]


def test_peak_reserved_and_empty_cache():
    # CPU: no caching allocator; reserved is the same peak RSS as allocated
    assert device.peak_reserved_bytes("cpu") == device.peak_memory_bytes("cpu") > 0
    device.empty_cache("cpu")  # a no-op


def test_peak_reserved_reads_the_npu_allocator(fake_npu_path):
    result = _run_with_fake_npu(fake_npu_path, """
        import json
        import torch
        from pisft import device
        emptied = []
        npu = device.npu_module()  # imports the stand-in torch_npu, which registers torch.npu
        npu.max_memory_reserved = lambda: 456
        npu.empty_cache = lambda: emptied.append(True)
        device.empty_cache("npu")
        print(json.dumps({"allocated": device.peak_memory_bytes("npu"),
                          "reserved": device.peak_reserved_bytes("npu"), "emptied": emptied}))
    """)
    assert result == {"allocated": 123, "reserved": 456, "emptied": [True]}


def test_a_worker_ends_with_an_idle_thread_pool_alive():
    """exit_process as a compiled training worker ends: inductor's compile pool (a
    concurrent.futures executor, non-daemon threads idle on their queue) stops as at a normal exit.
    Joining its threads without threading's exit calls first waited forever (a compiled smoke run
    hung after its report)."""
    code = ("from concurrent.futures import ThreadPoolExecutor\n"
            "from pisft.device import exit_process\n"
            "pool = ThreadPoolExecutor(2)\n"
            "assert pool.submit(lambda: 7).result() == 7\n"
            "print('done', flush=True)\n"
            "exit_process(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (3, "done\n"), proc.stderr


def test_a_workers_c_level_output_to_a_pipe_is_not_lost():
    """A C library's stdio (printf to a pipe is fully buffered: NCCL_DEBUG's lines) is flushed before
    exit_process leaves through os._exit, which skips C's own exit."""
    code = ("import ctypes\n"
            "from pisft.device import exit_process\n"
            "ctypes.CDLL(None).printf(b'from C\\n')\n"
            "exit_process(0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "from C\n"), proc.stderr


def test_intra_op_threads_gives_the_callers_count_back_also_when_the_inside_fails():
    from pisft import device as device_mod

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match="the model did not load"), device_mod.intra_op_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("the model did not load")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
