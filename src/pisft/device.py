"""The device layer: `auto | npu | cuda | cpu` -> backend, local device, process environment.

Rules (docs/ascend.md, "Running on an Ascend 910B node (8 cards)"):
- `npu` uses `torch_npu` and `torch.npu` explicitly. `torch_npu.contrib.transfer_to_npu` is never
  imported: it rewrites `torch.cuda` globally and code then believes it runs on CUDA.
- torch-npu is only imported when it is installed (it is never installed off Ascend: without
  CANN it breaks `import torch`).
- `LOCAL_RANK` (set by torchrun) picks the device of a process.
- The Ascend runtime settings below are defaults: a value already in the user's environment wins.
- Training processes get `JAX_PLATFORMS=cpu`: JAX, imported by some dependency only for
  bookkeeping, must not try to start CUDA on an NPU host.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from pathlib import Path
import resource
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from types import ModuleType
from typing import NoReturn

import torch

from pisft.errors import DeviceError

KINDS = ("npu", "cuda", "cpu")
BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}

# Ascend runtime defaults for training processes (each overridable by the user's environment).
ASCEND_ENV_DEFAULTS: dict[str, str] = {
    # Level-2 task queue: host-side operator dispatch pipelined with device execution.
    "TASK_QUEUE_ENABLE": "2",
    # Bind each process's operator-dispatch threads to CPU cores near its card (coarse binding).
    "CPU_AFFINITY_CONF": "1",
    # Expandable segments: less fragmentation of device memory with varying activation sizes.
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    # HCCL link set-up timeout (s): 8 processes loading a 3.6B model can take minutes to meet.
    "HCCL_CONNECT_TIMEOUT": "1200",
    # HCCL_EXEC_TIMEOUT is deliberately NOT set: CANN's own default on Atlas A2 (1836 s) is longer
    # than the 1800 s this table used to set (CANN environment-variable reference, HCCL_EXEC_TIMEOUT),
    # and long enough for a checkpoint save between steps
    # (all ranks take part in a DCP save). A value in the user's environment still reaches HCCL.
    # The next two are the values of Huawei's pi0.5 training recipe for Atlas A2 (910B) cards:
    # hicann/cann-recipes-embodied-ai, manipulation/pi05/train/src/scripts/run_train.sh.
    # Host-side cache of aclnn operator information (workspace size, executor, tiling), entries
    # per dispatch thread; CANN's default is 10000. A cached operator/shape skips that host-side
    # preparation when it is dispatched again. Memory bound: ~2 KB per entry and thread, plus
    # ~20 KB per fused-operator entry per process; only distinct operator shapes fill it (CANN
    # 8.5.0 environment variable reference, ACLNN_CACHE_LIMIT: range [1, 10000000]; Huawei's
    # msprof-analyze advisor suggests 100000 when host dispatch is slow).
    "ACLNN_CACHE_LIMIT": "100000",
    # Dynamic-shape data cache: keep host-side execution data of the 20 most frequent input
    # shapes, so a recurring shape skips that preparation; CANN's default 0 disables it; host
    # memory grows with the value and the model (CANN application development guide, "Setting
    # Shape Data Cache to Improve Performance"; Huawei's msprof-analyze advisor suggests 20).
    "HOST_CACHE_CAPACITY": "20",
}

# Set for every training process, whatever the device (forced, not a default: no training
# process needs a JAX accelerator, and a JAX that grabs CUDA/NPU crashes the run).
TRAINING_ENV_FORCED: dict[str, str] = {"JAX_PLATFORMS": "cpu"}

# `train.deterministic: true`: the environment of deterministic collectives and kernels, per kind.
# Read when the communicator / library handle is created, so it must be in the environment before
# `init_process_group` and the first matmul. Defaults: a value already set by the user wins
# (e.g. HCCL_DETERMINISTIC=strict, or the smaller CUBLAS_WORKSPACE_CONFIG=:16:8).
DETERMINISTIC_ENV: dict[str, dict[str, str]] = {
    # Deterministic AllReduce / ReduceScatter / Reduce; slower collectives (CANN 8.5.0 HCCL guide,
    # HCCL_DETERMINISTIC: values false (default), true, strict).
    "npu": {"HCCL_DETERMINISTIC": "true"},
    # cuBLAS is deterministic only with a fixed workspace configuration (CUDA docs, "Results
    # reproducibility"); torch.use_deterministic_algorithms(True) raises without it.
    "cuda": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
    "cpu": {},
}


def deterministic_env(kind: str) -> dict[str, str]:
    """The environment variables `train.deterministic` sets for training processes of `kind`."""
    return dict(DETERMINISTIC_ENV[kind])


def enable_determinism(kind: str, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """In a training process, before `init_process_group`: deterministic collectives and kernels.

    Sets the missing variables of `deterministic_env(kind)` (the user's values win) and calls
    `torch.use_deterministic_algorithms(True)`: an operator without a deterministic
    implementation then raises instead of silently varying. torch_npu honours the same switch for
    NPU operators, and only its first effective setting per thread counts (torch_npu docs,
    deterministic computation API list), so call this before the first operator runs. Returns
    the variables it set.
    """
    env = os.environ if env is None else env
    changed = {k: v for k, v in deterministic_env(kind).items() if k not in env}
    env.update(changed)
    torch.use_deterministic_algorithms(True)
    return changed


def _torch_npu_installed() -> bool:
    if "torch_npu" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


def _import_torch_npu() -> ModuleType:
    """Import torch_npu (which registers `torch.npu`) and return `torch.npu`."""
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken CANN install raising anything
        raise DeviceError(
            "device 'npu' requested but torch_npu cannot be imported "
            f"({type(exc).__name__}: {exc}). On an Ascend host: install torch-npu matching "
            "torch 2.11 and CANN (see docs/ascend.md) and `source "
            "/usr/local/Ascend/ascend-toolkit/set_env.sh`; elsewhere set `device: cpu` or `cuda`."
        ) from None
    npu = getattr(torch, "npu", None)
    if npu is None:
        raise DeviceError(
            "torch_npu was imported but did not register torch.npu; check that torch-npu "
            f"matches torch {torch.__version__}"
        )
    return npu


def npu_module() -> ModuleType:
    return _import_torch_npu()


def _npu_available() -> bool:
    if not _torch_npu_installed():
        return False
    try:
        npu = _import_torch_npu()
        return bool(npu.is_available()) and npu.device_count() > 0
    except DeviceError:
        return False


def resolve_kind(requested: str) -> str:
    """`auto | npu | cuda | cpu` -> the device kind to use here; DeviceError if unavailable."""
    if requested == "auto":
        if _npu_available():
            return "npu"
        if torch.cuda.is_available():
            return "cuda"
        return "cpu"
    if requested == "npu":
        npu = _import_torch_npu()
        if not npu.is_available() or npu.device_count() == 0:
            raise DeviceError(
                "device 'npu' requested but no Ascend NPU is visible (torch.npu.is_available() "
                "is False). Check `npu-smi info`, ASCEND_RT_VISIBLE_DEVICES and the CANN "
                "environment; or set `device: cpu`."
            )
        return "npu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                "device 'cuda' requested but torch.cuda.is_available() is False here. Check "
                "`nvidia-smi`, CUDA_VISIBLE_DEVICES and that torch was built with CUDA; or set "
                "`device: cpu`."
            )
        return "cuda"
    if requested == "cpu":
        return "cpu"
    raise DeviceError(f"device: '{requested}' is not one of auto, npu, cuda, cpu")


def backend_for(kind: str) -> str:
    return BACKENDS[kind]


def device_count(kind: str) -> int:
    if kind == "npu":
        return int(_import_torch_npu().device_count())
    if kind == "cuda":
        return torch.cuda.device_count()
    return 1


def local_rank(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    value = env.get("LOCAL_RANK", "0")
    try:
        return int(value)
    except ValueError:
        raise DeviceError(f"LOCAL_RANK='{value}' is not an integer (it is set by torchrun)") from None


def local_device(kind: str, rank: int | None = None) -> torch.device:
    """The device of this process (`npu:<LOCAL_RANK>`, `cuda:<LOCAL_RANK>` or cpu); selects it."""
    rank = local_rank() if rank is None else rank
    if kind == "cpu":
        return torch.device("cpu")
    count = device_count(kind)
    if rank >= count:
        raise DeviceError(
            f"LOCAL_RANK {rank} has no {kind} device: only {count} visible on this host; lower "
            f"train.nproc_per_node to at most {count}"
        )
    if kind == "npu":
        _import_torch_npu().set_device(rank)
        return torch.device(f"npu:{rank}")
    torch.cuda.set_device(rank)
    return torch.device(f"cuda:{rank}")


THREADS_ENV = "PISFT_NUM_THREADS"  # the one knob: CPU threads per training process
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, e.g. a Slurm or taskset limit)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) and the like: None


def available_memory(meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/sys/fs/cgroup") -> int | None:
    """Bytes this process can still take: the host's MemAvailable, capped by what is left under
    its cgroup's memory limit (v2 `memory.max` - `memory.current`, v1 `memory.limit_in_bytes` -
    `memory.usage_in_bytes`: a container's or a Slurm job's limit). None when unknown."""
    available = None
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        available = None
    cgroup = Path(cgroup)
    for limit_name, usage_name in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit, usage = _read_int(cgroup / limit_name), _read_int(cgroup / usage_name)
        if limit is not None and usage is not None and limit < (1 << 60):  # v1 "no limit" is ~2^63
            left = max(0, limit - usage)
            available = left if available is None else min(available, left)
            break
    return available


def threads_per_process(nproc_per_node: int, base: Mapping[str, str] | None = None) -> int:
    """CPU threads of each training process: PISFT_NUM_THREADS, else the usable cores / processes."""
    base = os.environ if base is None else base
    if base.get(THREADS_ENV, "").strip():
        try:
            return max(1, int(base[THREADS_ENV]))
        except ValueError:
            raise DeviceError(f"{THREADS_ENV}={base[THREADS_ENV]!r}: must be a whole number of threads") from None
    return max(1, usable_cores() // max(1, nproc_per_node))


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """torch's intra-op CPU threads at `threads` inside, the caller's count back after (also when
    what runs inside fails). Threads started inside keep the count they started with."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def process_env(kind: str, base: Mapping[str, str] | None = None, *,
                nproc_per_node: int = 1, force_threads: bool = False) -> dict[str, str]:
    """The environment for training processes: `base` plus device defaults (base wins).

    CPU: OMP_NUM_THREADS defaults to the host's cores divided among the node's processes
    (torchrun would otherwise set 1 for several processes, leaving most cores idle).
    force_threads (the launcher): the thread counts come from `threads_per_process` only, on
    every device, whatever the driver exported: Snakemake exports OMP_NUM_THREADS=<the rule's
    threads> (all cores, for each of the processes: oversubscribed), DVC nothing; the same
    count under both gives the same bytes. PISFT_NUM_THREADS sets it by hand.
    """
    env = dict(os.environ if base is None else base)
    if kind == "npu":
        for key, value in ASCEND_ENV_DEFAULTS.items():
            env.setdefault(key, value)
    if force_threads:
        threads = str(threads_per_process(nproc_per_node, env))
        env.update({var: threads for var in THREAD_VARS})
        env[THREADS_ENV] = threads
    elif kind == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(threads_per_process(nproc_per_node, env)))
    env.update(TRAINING_ENV_FORCED)
    return env


def apply_process_env(kind: str) -> dict[str, str]:
    """Inside a training process: set the defaults that are missing; return what was set."""
    wanted = process_env(kind, os.environ)
    changed = {k: v for k, v in wanted.items() if os.environ.get(k) != v}
    os.environ.update(changed)
    return changed


def exit_process(code: int) -> NoReturn:
    """End a distributed worker (a torchrun process) with `code` once its work is done: what Python
    does when it exits up to its teardown (`threading._shutdown`: the threading module's exit calls,
    which tell idle `concurrent.futures` workers such as inductor's compile pool to stop, then the
    other non-daemon threads joined; the `atexit` handlers run, the streams flushed), then the exit
    itself (`os._exit`), without the teardown. Joining the threads without those calls first waited
    forever on a compiled run's idle pool workers.

    Why (issue 47): the process group outlives `destroy_process_group`, since torch's DTensor
    caches keep FSDP2's device mesh and through it the group, so gloo's worker threads are still
    alive when the interpreter tears down. One that then drops the last reference to a
    collective's tensor needs the GIL, and Python 3.12 ends a thread that asks for it during the
    teardown from inside that C++ destructor: std::terminate, "terminate called without an active
    exception", SIGABRT, a failed torchrun after a finished run. Seen on a loaded host, where a
    worker thread can be descheduled between finishing a collective and releasing it;
    `tests/test_collective_audit.py` reproduces it with collectives still in flight.
    """
    import atexit
    import threading

    threading._shutdown()  # noqa: SLF001 - what Py_FinalizeEx calls first (CPython 3.12 Lib/threading.py)
    atexit._run_exitfuncs()  # noqa: SLF001 - the handlers Python runs at exit (logging, multiprocessing, ...)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to flush
            pass
    try:  # C's stdio buffers too (a library's log lines to a pipe: NCCL_DEBUG), which os._exit skips
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask: nothing of C's to flush
        pass
    os._exit(code)


@dataclass(frozen=True)
class DeviceInfo:
    kind: str
    backend: str
    device: torch.device
    name: str


def device_name(kind: str, device: torch.device) -> str:
    if kind == "npu":
        return str(_import_torch_npu().get_device_name(device.index or 0))
    if kind == "cuda":
        return torch.cuda.get_device_name(device.index or 0)
    return "cpu"


def setup(requested: str) -> DeviceInfo:
    """For a training process: resolve the device, apply the environment, select the device."""
    kind = resolve_kind(requested)
    apply_process_env(kind)
    dev = local_device(kind)
    return DeviceInfo(kind=kind, backend=backend_for(kind), device=dev, name=device_name(kind, dev))


def _accel(kind: str) -> ModuleType | None:
    if kind == "npu":
        return _import_torch_npu()
    if kind == "cuda":
        return torch.cuda
    return None


def synchronize(kind: str) -> None:
    accel = _accel(kind)
    if accel is not None:
        accel.synchronize()


def reset_peak_memory(kind: str) -> None:
    accel = _accel(kind)
    if accel is not None:
        accel.reset_peak_memory_stats()


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is the device running out of memory: torch's OutOfMemoryError (CUDA), or an
    error whose text says so (torch_npu raises a RuntimeError with "out of memory" in it)."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def peak_memory_bytes(kind: str) -> int:
    """Peak device memory allocated by this process (CPU: peak resident set size)."""
    accel = _accel(kind)
    if accel is not None:
        return int(accel.max_memory_allocated())
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss_kib) * (1 if sys.platform == "darwin" else 1024)


def peak_reserved_bytes(kind: str) -> int:
    """Peak device memory reserved by this process's caching allocator (CPU: peak RSS).

    Reserved is what the allocator holds from the driver: allocated tensors plus cached free
    blocks and fragmentation. It is the part of npu-smi's / nvidia-smi's figure that this process's
    tensors account for; HCCL/NCCL buffers, the runtime context and kernel workspaces outside the
    allocator come on top (docs/memory.md). The CPU has no caching allocator: the same peak
    resident set size as `peak_memory_bytes`.
    """
    accel = _accel(kind)
    if accel is not None:
        return int(accel.max_memory_reserved())
    return peak_memory_bytes(kind)


def empty_cache(kind: str) -> None:
    """Return the caching allocator's free blocks to the device (no-op on CPU)."""
    accel = _accel(kind)
    if accel is not None:
        accel.empty_cache()


# A stand-in capacity in bytes: the device (the CPU too) reports at most this much memory, total and
# free. For the tests of what the smoke gate decides from memory (the CPU has no fixed capacity),
# and for a CPU run that must keep within a budget; an accelerator's own figures still bound it.
MEMORY_CAP_ENV = "PISFT_DEVICE_MEMORY_BYTES"


def _memory_cap() -> int | None:
    raw = os.environ.get(MEMORY_CAP_ENV, "").strip()
    if not raw:
        return None
    try:
        return max(0, int(float(raw)))
    except ValueError:
        raise ValueError(f"{MEMORY_CAP_ENV}={raw!r}: give a number of bytes") from None


def _capped(value: int | None) -> int | None:
    cap = _memory_cap()
    return value if cap is None else (cap if value is None else min(value, cap))


def capacity_bytes(kind: str, device: torch.device) -> int | None:
    """Total memory of the device; None on CPU (no fixed capacity to check against), unless
    MEMORY_CAP_ENV gives one."""
    accel = _accel(kind)
    if accel is None:
        return _capped(None)
    return _capped(int(accel.get_device_properties(device.index or 0).total_memory))


def free_memory_bytes(kind: str, device: torch.device) -> int | None:
    """The memory the device reports free now (`mem_get_info`: the driver's view, after the
    runtime context, other processes and this process's allocator); None on the CPU, or when
    the device's runtime cannot say. MEMORY_CAP_ENV bounds it (on the CPU it is then the cap:
    the process's whole budget, as its peak resident set size counts the process whole)."""
    accel = _accel(kind)
    if accel is None or not hasattr(accel, "mem_get_info"):
        return _capped(None)
    free, _total = accel.mem_get_info(device.index or 0)
    return _capped(int(free))


def fused_adamw_supported(kind: str) -> bool:
    """Whether `torch.optim.AdamW(fused=True)` has a kernel for this device kind.

    torch lists the device types with fused optimizer kernels; torch_npu renames the
    PrivateUse1 backend to `npu`, so the NPU appears there when torch-npu provides them.
    """
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # pragma: no cover - torch internals moved
        return kind == "cuda"
    return kind in _get_fused_kernels_supported_devices()


# HCCL's buffers outside the caching allocator: 2 x HCCL_BUFFSIZE per communicator, 200 MB by
# default (CANN documentation, HCCL_BUFFSIZE; docs/memory.md, "What a device adds").
HCCL_BUFFSIZE_DEFAULT_MB = 200


def hccl_buffer_bytes(kind: str, env: dict[str, str] | None = None) -> int:
    """The send and receive buffers of the training's one HCCL communicator (0 off the NPU)."""
    if kind != "npu":
        return 0
    raw = (os.environ if env is None else env).get("HCCL_BUFFSIZE", "")
    try:
        mb = int(raw) if raw.strip() else HCCL_BUFFSIZE_DEFAULT_MB
    except ValueError:
        mb = HCCL_BUFFSIZE_DEFAULT_MB
    return 2 * mb * 2**20
