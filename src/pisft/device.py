"""The device layer: `auto | npu | cuda | cpu` -> backend, local device, process environment.

Each device kind is one row (`DeviceRow`) in `ROWS`: what pisft decides by the kind of device (its
collective backend, environment, attention kernel, compile backend, peak FLOPs, profiler, memory
and synchronisation through its torch module, deterministic settings, the doctor's facts) is read
from the row, never from a comparison of the kind with a name. A new kind is a new row (`register`).

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
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

from pisft.errors import DeviceError

if TYPE_CHECKING:
    import torch
# torch is imported where a function needs it: the launcher reads its row here and never needs
# torch (about 2 CPU s a launch); a process that trains imports it anyway.

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

def deterministic_env(kind: str) -> dict[str, str]:
    """The environment variables `train.deterministic` sets for training processes of `kind`."""
    return dict(row(kind).deterministic_env)


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
    import torch
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
    import torch
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


def _check_npu() -> None:
    npu = _import_torch_npu()
    if not npu.is_available() or npu.device_count() == 0:
        raise DeviceError(
            "device 'npu' requested but no Ascend NPU is visible (torch.npu.is_available() "
            "is False). Check `npu-smi info`, ASCEND_RT_VISIBLE_DEVICES and the CANN "
            "environment; or set `device: cpu`."
        )


def _check_cuda() -> None:
    import torch
    if not torch.cuda.is_available():
        raise DeviceError(
            "device 'cuda' requested but torch.cuda.is_available() is False here. Check "
            "`nvidia-smi`, CUDA_VISIBLE_DEVICES and that torch was built with CUDA; or set "
            "`device: cpu`."
        )


def _npu_compile_backend_missing() -> str | None:
    """Why torch.compile has no `npugraph_ex` backend here (None: it has)."""
    try:
        import torch_npu  # noqa: F401 - registers its dynamo backends on import
    except ImportError as exc:
        return f"torch_npu cannot be imported ({exc})"
    from torch._dynamo import list_backends

    if NPU_COMPILE_BACKEND not in list_backends(exclude_tags=()):
        return f"torch_npu registered no '{NPU_COMPILE_BACKEND}' backend (torch_npu 2.11.0 registers it)"
    return None


def _cuda_profiler() -> Any:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def _npu_profiler() -> Any:
    """torch_npu.profiler mirrors torch.profiler (Ascend/pytorch, torch_npu/profiler)."""
    import torch_npu

    return torch_npu.profiler.profile(activities=[torch_npu.profiler.ProfilerActivity.CPU,
                                                  torch_npu.profiler.ProfilerActivity.NPU])


def _cuda_synchronize(device: torch.device | None) -> None:
    import torch
    torch.cuda.synchronize(device)  # None: the current device


def _npu_synchronize(device: torch.device | None) -> None:  # noqa: ARG001 - the row's signature
    # the current device (torch_npu's torch.npu mirrors torch.cuda's synchronize; the callers run
    # where their device is selected, and the stand-in takes no argument)
    _import_torch_npu().synchronize()


# HCCL's buffers outside the caching allocator: 2 x HCCL_BUFFSIZE per communicator, 200 MB by
# default (CANN documentation, HCCL_BUFFSIZE; docs/memory.md, "What a device adds").
HCCL_BUFFSIZE_DEFAULT_MB = 200


def _hccl_buffer_bytes(env: Mapping[str, str]) -> int:
    raw = env.get("HCCL_BUFFSIZE", "")
    try:
        mb = int(raw) if raw.strip() else HCCL_BUFFSIZE_DEFAULT_MB
    except ValueError:
        mb = HCCL_BUFFSIZE_DEFAULT_MB
    return 2 * mb * 2**20


def _torch() -> ModuleType:
    """torch, imported on first use (a device row's lambdas)."""
    import torch
    return torch


def _always() -> bool:
    return True


def _usable() -> None:
    return None


# torch.compile for inference (`pisft.policy.compiled`): torch_npu's ACLGraph backend on an NPU
# (torch_npu v2.11.0, torch_npu/dynamo/__init__.py `_register_backends`); on CUDA inductor in
# reduce-overhead mode, which captures CUDA graphs (torch.compile docs, `mode`).
NPU_COMPILE_BACKEND = "npugraph_ex"
CUDA_GRAPH_MODE = "reduce-overhead"


@dataclass(frozen=True)
class DeviceRow:
    """One device kind: what pisft decides by the kind of device, in one place.

    `module` is the kind's torch module (`torch.cuda`, `torch.npu`: count, selection, memory,
    synchronisation); None for the host's CPU, which has no cards: such a kind trains with the
    host's cores (OMP threads per process, loading in turns, one loader worker, FSDP units of a
    minimum size, no pinned memory) and is not an accelerator.
    """

    kind: str
    backend: str  # torch.distributed's backend for the process group
    module: Callable[[], ModuleType] | None = None
    found: Callable[[], bool] = _always  # `device: auto` takes the first row found (in ROWS order)
    check: Callable[[], None] = _usable  # `device: <kind>`: DeviceError when the kind is not usable here
    init_with_device_id: bool = False  # init_process_group(device_id=...) binds the group to the device
    env_defaults: Mapping[str, str] = field(default_factory=dict)  # for training processes; the user's win
    deterministic_env: Mapping[str, str] = field(default_factory=dict)  # train.deterministic (user's win)
    attention_kernel: str | None = None  # the fused attention kernel this kind must take (the doctor)
    train_compile_backend: str = "inductor"  # train.compile's, by name (`pisft.train.blocks.COMPILE_BACKENDS`)
    compile_backend: str = "inductor"  # eval.compile's torch.compile backend
    compile_mode: str | None = None  # its mode (CUDA_GRAPH_MODE: graph capture)
    compile_backend_missing: Callable[[], str | None] | None = None  # why the backend is absent here
    compile_trial: bool = True  # eval.compile null / train.compile auto measure compiled against eager
    bf16_inference: bool = True  # eval.precision auto: bf16 (False: the model's own dtype)
    peak_flops: tuple[tuple[str, float, str], ...] = ()  # (device-name pattern, dense bf16 FLOP/s, label)
    profiler: Callable[[], Any] | None = None  # a torch.profiler-like profile with the device's activity
    profiler_activity: str | None = None  # the torch.profiler.ProfilerActivity of its kernels
    launch_calls: tuple[str, ...] = ()  # the host's kernel-launch calls in a torch.profiler profile
    synchronize: Callable[[torch.device | None], None] | None = None
    collective_buffer_bytes: Callable[[Mapping[str, str]], int] | None = None  # outside the allocator
    runtime_version: Callable[[], str] | None = None  # shown by the doctor beside torch's version
    cann: bool = False  # runs on CANN: the doctor checks torch-npu/CANN/driver pairs and CANN's rules
    whole_number_env: tuple[str, ...] = ()  # variables the doctor requires to be whole numbers
    runtime_default_env: tuple[str, ...] = ()  # variables left to the runtime's default (shown)
    bench_profile: str = "cuda-8gpu.yaml"  # config/profiles/ file of `bench --only device`'s smoke gate

    @property
    def accelerator(self) -> bool:
        """Whether the kind has cards of its own (False: the host's CPU)."""
        return self.module is not None

    def torch_device(self, index: int = 0) -> torch.device:
        """The torch device of card `index` (the CPU: `cpu`, without an index); selects nothing."""
        import torch
        return torch.device(self.kind, index) if self.accelerator else torch.device("cpu")


# (device kind, pattern on the device name, peak dense bf16 FLOP/s, label); a row takes its kind's
# lines (`_peaks`), in order: the first match wins. Dense bf16/fp16 matrix figures per device (no
# sparsity). The Ascend figures are the commonly cited vendor numbers per SKU and vary with clocks
# and firmware: `train.peak_flops` overrides them (train/metrics.py).
PEAK_FLOPS: tuple[tuple[str, str, float, str], ...] = (
    ("npu", r"910B1", 414e12, "Ascend 910B1"),
    ("npu", r"910B2", 376e12, "Ascend 910B2"),
    ("npu", r"910B3", 313e12, "Ascend 910B3"),
    ("npu", r"910B4", 280e12, "Ascend 910B4"),
    ("npu", r"910_?93|910C", 376e12, "Ascend 910C (per die)"),
    ("npu", r"910B", 313e12, "Ascend 910B (unknown variant: 910B3 figure)"),
    ("cuda", r"H200", 989e12, "NVIDIA H200"),
    ("cuda", r"H100.*(PCIe|PCIE)", 756e12, "NVIDIA H100 PCIe"),
    ("cuda", r"H100.*NVL", 835e12, "NVIDIA H100 NVL"),
    ("cuda", r"H100|H800", 989e12, "NVIDIA H100 SXM"),
    ("cuda", r"A100|A800", 312e12, "NVIDIA A100"),
)


def _peaks(kind: str) -> tuple[tuple[str, float, str], ...]:
    return tuple((pattern, flops, label) for of, pattern, flops, label in PEAK_FLOPS if of == kind)


# The order is `device: auto`'s: an NPU, else CUDA, else the CPU.
ROWS: dict[str, DeviceRow] = {
    "npu": DeviceRow(
        "npu", "hccl", module=_import_torch_npu, found=_npu_available, check=_check_npu,
        env_defaults=ASCEND_ENV_DEFAULTS,
        # Deterministic AllReduce / ReduceScatter / Reduce; slower collectives (CANN 8.5.0 HCCL
        # guide, HCCL_DETERMINISTIC: values false (default), true, strict).
        deterministic_env={"HCCL_DETERMINISTIC": "true"},
        attention_kernel="npu_fusion_attention", train_compile_backend="torchair",
        compile_backend=NPU_COMPILE_BACKEND, compile_backend_missing=_npu_compile_backend_missing,
        peak_flops=_peaks("npu"), profiler=_npu_profiler,
        launch_calls=("aclopCompileAndExecute", "aclnnExecute"),  # Ascend's ACL
        synchronize=_npu_synchronize, collective_buffer_bytes=_hccl_buffer_bytes,
        cann=True,
        whole_number_env=("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_BUFFSIZE", "ACLNN_CACHE_LIMIT",
                          "HOST_CACHE_CAPACITY", "TASK_QUEUE_ENABLE"),
        runtime_default_env=("HCCL_EXEC_TIMEOUT",), bench_profile="ascend-8card.yaml"),
    "cuda": DeviceRow(
        "cuda", "nccl", module=lambda: _torch().cuda, found=lambda: _torch().cuda.is_available(), check=_check_cuda,
        init_with_device_id=True,
        # cuBLAS is deterministic only with a fixed workspace configuration (CUDA docs, "Results
        # reproducibility"); torch.use_deterministic_algorithms(True) raises without it.
        deterministic_env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
        compile_mode=CUDA_GRAPH_MODE, peak_flops=_peaks("cuda"), profiler=_cuda_profiler,
        profiler_activity="CUDA",
        launch_calls=("cudaLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch"),
        synchronize=_cuda_synchronize, runtime_version=lambda: f"CUDA {_torch().version.cuda}"),
    "cpu": DeviceRow("cpu", "gloo", compile_trial=False, bf16_inference=False),
}


def register(new: DeviceRow) -> None:
    """Add a device kind (a test's, or a new backend's row written here)."""
    if new.kind in ROWS or new.kind == "auto":
        raise ValueError(f"device kind {new.kind!r} is taken (a row, or `auto`): give the new row a name of its own")
    ROWS[new.kind] = new


def row(kind: str) -> DeviceRow:
    """The row of a device kind (a resolved one: not `auto`)."""
    try:
        return ROWS[kind]
    except KeyError:
        raise DeviceError(f"device kind '{kind}' is not one of {', '.join(ROWS)}") from None


def host_only(requested: str) -> bool:
    """Whether a configured `device` (`auto` unresolved) names a kind without cards (the CPU)."""
    found = ROWS.get(requested)
    return found is not None and not found.accelerator


def on_host(device: torch.device | str) -> bool:
    """Whether a torch device, a device name (`cuda:0`) or a kind is the host's CPU; False for a
    type without a row (meta)."""
    torch = sys.modules.get("torch")  # without torch imported, no torch device exists
    kind = device.type if torch is not None and isinstance(device, torch.device) else str(device).split(":")[0]
    found = ROWS.get(kind)
    return found is not None and not found.accelerator


def resolve_kind(requested: str) -> str:
    """`auto | npu | cuda | cpu` -> the device kind to use here; DeviceError if unavailable."""
    if requested == "auto":
        return next(kind for kind, r in ROWS.items() if r.found())
    if requested in ROWS:
        ROWS[requested].check()
        return requested
    raise DeviceError(f"device: '{requested}' is not one of auto, {', '.join(ROWS)}")


def backend_for(kind: str) -> str:
    return row(kind).backend


def device_count(kind: str) -> int:
    module = row(kind).module
    return 1 if module is None else int(module().device_count())


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
    import torch
    module = row(kind).module
    if module is None:
        return torch.device("cpu")
    count = device_count(kind)
    if rank >= count:
        raise DeviceError(
            f"LOCAL_RANK {rank} has no {kind} device: only {count} visible on this host; lower "
            f"train.nproc_per_node to at most {count}"
        )
    module().set_device(rank)
    return torch.device(f"{kind}:{rank}")


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
    import torch
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
    r = row(kind)
    for key, value in r.env_defaults.items():
        env.setdefault(key, value)
    if force_threads:
        threads = str(threads_per_process(nproc_per_node, env))
        env.update({var: threads for var in THREAD_VARS})
        env[THREADS_ENV] = threads
    elif not r.accelerator:
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

    @property
    def row(self) -> DeviceRow:
        return row(self.kind)


def device_name(kind: str, device: torch.device) -> str:
    module = row(kind).module
    return "cpu" if module is None else str(module().get_device_name(device.index or 0))


def setup(requested: str) -> DeviceInfo:
    """For a training process: resolve the device, apply the environment, select the device."""
    kind = resolve_kind(requested)
    apply_process_env(kind)
    dev = local_device(kind)
    return DeviceInfo(kind=kind, backend=backend_for(kind), device=dev, name=device_name(kind, dev))


def _accel(kind: str) -> ModuleType | None:
    """The kind's torch module; None for the CPU, and for a device type without a row (meta)."""
    found = ROWS.get(kind)
    return None if found is None or found.module is None else found.module()


def accelerator_module(kind: str) -> ModuleType:
    """The torch module of an accelerator kind (`torch.cuda`, `torch.npu`)."""
    accel = _accel(kind)
    if accel is None:
        raise DeviceError(f"device kind '{kind}' has no cards: no torch module to ask")
    return accel


def synchronize(kind: str, device: torch.device | None = None) -> None:
    """Wait for the device's work (`device`: which card, where the row's `synchronize` takes one;
    else the module's `synchronize()`); a no-op on the CPU and on a device type without a row."""
    found = ROWS.get(kind)
    if found is not None and found.synchronize is not None:
        found.synchronize(device)
    elif found is not None and found.module is not None:
        found.module().synchronize()


def reset_peak_memory(kind: str) -> None:
    accel = _accel(kind)
    if accel is not None:
        accel.reset_peak_memory_stats()


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is the device running out of memory: torch's OutOfMemoryError (CUDA), or an
    error whose text says so (torch_npu raises a RuntimeError with "out of memory" in it)."""
    torch = sys.modules.get("torch")  # without torch imported, no OutOfMemoryError was raised
    return (torch is not None and isinstance(exc, torch.OutOfMemoryError)) or "out of memory" in str(exc).lower()


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


def hccl_buffer_bytes(kind: str, env: Mapping[str, str] | None = None) -> int:
    """The send and receive buffers of the training's one collective communicator outside the
    caching allocator (HCCL's on the NPU; 0 where the row names none)."""
    buffers = row(kind).collective_buffer_bytes
    return 0 if buffers is None else buffers(os.environ if env is None else env)
