"""An audited process group: every collective counted by operation and dtype, optionally checked
against a per-operation dtype table (HCCL's, for the Ascend path), on the CPU over gloo.

`AuditedProcessGroup` is a Python `torch.distributed.ProcessGroup` that forwards every operation
to a real gloo process group and, on the way, (a) counts it by (operation, dtype), (b) checks the
dtypes (and the reduce op) against a `DtypeTable`. With `enforce=True` an operation the table
rejects raises a RuntimeError naming the operation, the dtype and the source of the rule; with
`enforce=False` it is recorded in `violations` and still runs (counting mode, for benchmarks).

Register it under a backend name with `register(name, table=..., enforce=...)`; then
`dist.init_process_group(name)` creates one per group. Every collective reaches it: those torch
calls on the process-group object from Python (`torch.distributed.*`: FSDP2's all-gathers and
reduce-scatters, DCP's object collectives and barriers, our loop's all-reduces) and those the
C++ side calls through the virtual methods that torch 2.11 lets Python override (the functional
collectives behind DTensor: all_reduce in clip_grad_norm_, all_gather in `full_tensor()` and
reduce-scatter arrive as allreduce / allgather_into_tensor_coalesced /
reduce_scatter_tensor_coalesced). The group registers no C++ backend of its own, so a C++ caller
of a non-overridable method would fail loudly ("no backend for cpu") rather than bypass the audit.

`HCCL_TABLE` is torch_npu 2.11's rule set (see the comment above it); the stand-in `torch_npu`
of the tests registers the "hccl" backend as this process group with that table enforced, so
a collective that HCCL would refuse on an Ascend 910B fails a CPU test.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------------------------
# HCCL's dtype table, torch_npu v2.11.0-26.1.0 (github.com/Ascend/pytorch, branch v2.11.0-26.1.0).
#
# torch_npu/csrc/distributed/HCCLUtils.cpp, `kScalarTypeToHcclDataType` / `getHcclDataType`:
#   the dtypes HCCL can carry at all; any other (complex, float8_e4m3fnuz, ...) raises
#   "Unsupported data type for HCCL process group" in every operation. bool and uint8 both map
#   to HCCL_DATA_TYPE_UINT8, float64 to HCCL_DATA_TYPE_FP64.
# torch_npu/csrc/distributed/ProcessGroupHCCL.cpp, `checkSupportedDataType` (line ~174, comment
#   "AllGather & Broadcast support all data type, no need do more check"): the reductions accept
#   only INT8, INT16, INT32, FP16, FP32, BFP16, INT64. It is called by allreduce,
#   allreduce_coalesced, reduce, _reduce_oop, reduce_scatter, _reduce_scatter_base and
#   reduce_scatter_tensor_coalesced. float64 (FP64) and uint8/bool (UINT8) are therefore refused
#   by the reductions, on every chip (the check has no SoC condition in this version)...
# ...except that allreduce, allreduce_coalesced, reduce and _reduce_oop first cast a bool or
#   uint8 tensor to int32 in their pre-processing step (`_npu_dtype_cast(..., at::kInt)`, before
#   the check runs on the cast copy), so bool/uint8 all-reduces and reduces are accepted; the
#   reduce-scatters have no such cast and refuse bool/uint8.
# allgather, _allgather_base, allgather_into_tensor_coalesced, broadcast, gather, scatter,
#   alltoall(_base), send, recv only call getHcclDataType: every mapped dtype is accepted.
# ReduceOp (ProcessGroupHCCL.cpp, `hcclOp`, `unsupportedOp`, `getHcclReduceOp`): BAND, BOR,
#   BXOR are refused; AVG runs as SUM then a division; PREMUL_SUM needs half/float/bf16/double.
# ---------------------------------------------------------------------------------------------
HCCL_VERSION = "torch_npu v2.11.0-26.1.0"
_HCCLUTILS = f"{HCCL_VERSION} torch_npu/csrc/distributed/HCCLUtils.cpp kScalarTypeToHcclDataType"
_CHECK = f"{HCCL_VERSION} torch_npu/csrc/distributed/ProcessGroupHCCL.cpp checkSupportedDataType"

HCCL_MAPPED: frozenset[torch.dtype] = frozenset({
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
    torch.uint16, torch.uint32, torch.uint64, torch.float64, torch.bool, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2,
})
HCCL_REDUCIBLE: frozenset[torch.dtype] = frozenset({
    torch.int8, torch.int16, torch.int32, torch.float16, torch.float32, torch.bfloat16, torch.int64,
})
# bool/uint8 are cast to int32 before the check by these operations only.
_CAST_TO_INT32 = frozenset({torch.bool, torch.uint8})

# Operation names are those of torch's ProcessGroup methods.
ALL_GATHER_OPS = ("allgather", "_allgather_base", "allgather_coalesced",
                  "allgather_into_tensor_coalesced")
REDUCE_SCATTER_OPS = ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced")
ALL_REDUCE_OPS = ("allreduce", "allreduce_coalesced")
OTHER_OPS = ("broadcast", "reduce", "gather", "scatter", "alltoall", "alltoall_base", "send",
             "recv", "recv_anysource", "barrier")
ALL_OPS = ALL_GATHER_OPS + REDUCE_SCATTER_OPS + ALL_REDUCE_OPS + OTHER_OPS


@dataclass(frozen=True)
class DtypeRule:
    allowed: frozenset[torch.dtype]
    source: str


@dataclass(frozen=True)
class DtypeTable:
    """Per-operation dtype rules; operations without a rule accept every dtype."""

    name: str
    rules: dict[str, DtypeRule]
    unsupported_reduce_ops: frozenset[str] = frozenset()
    reduce_op_source: str = ""

    def problem(self, op: str, dtype: torch.dtype) -> str | None:
        rule = self.rules.get(op)
        if rule is None or dtype in rule.allowed:
            return None
        allowed = ", ".join(sorted(str(d).replace("torch.", "") for d in rule.allowed))
        return (f"{self.name} {op}: dtype {str(dtype).replace('torch.', '')} is not supported "
                f"(accepted: {allowed}; rule: {rule.source})")

    def reduce_op_problem(self, op: str, reduce_op: str | None) -> str | None:
        if reduce_op is not None and reduce_op in self.unsupported_reduce_ops:
            return (f"{self.name} {op}: ReduceOp.{reduce_op} is not supported "
                    f"({self.reduce_op_source})")
        return None


def _hccl_rules() -> dict[str, DtypeRule]:
    rules: dict[str, DtypeRule] = {}
    for op in ("allreduce", "allreduce_coalesced", "reduce"):
        rules[op] = DtypeRule(HCCL_REDUCIBLE | _CAST_TO_INT32,
                              f"{_CHECK} (bool/uint8 cast to int32 first by {op}); {_HCCLUTILS}")
    for op in REDUCE_SCATTER_OPS:
        rules[op] = DtypeRule(HCCL_REDUCIBLE, f"{_CHECK}; {_HCCLUTILS}")
    for op in ALL_GATHER_OPS + ("broadcast", "gather", "scatter", "alltoall", "alltoall_base",
                                "send", "recv", "recv_anysource"):
        rules[op] = DtypeRule(HCCL_MAPPED, f"{_HCCLUTILS} (getHcclDataType; no further check)")
    return rules


HCCL_TABLE = DtypeTable(
    name="HCCL",
    rules=_hccl_rules(),
    unsupported_reduce_ops=frozenset({"BAND", "BOR", "BXOR"}),
    reduce_op_source=(f"{HCCL_VERSION} torch_npu/csrc/distributed/ProcessGroupHCCL.cpp "
                      "unsupportedOp"),
)


# ---------------------------------------------------------------------------------------------
# The record of one process's collectives.
# ---------------------------------------------------------------------------------------------
@dataclass
class CollectiveLog:
    counts: Counter = field(default_factory=Counter)  # (op, dtype name) -> calls
    violations: list[str] = field(default_factory=list)

    def reset(self) -> None:
        self.counts.clear()
        self.violations.clear()

    def snapshot(self) -> Counter:
        return Counter(self.counts)

    def total(self, ops: Iterable[str] | None = None, dtype: str | None = None,
              since: Counter | None = None) -> int:
        wanted = None if ops is None else set(ops)
        n = 0
        for (op, dt), c in self.counts.items():
            if (wanted is None or op in wanted) and (dtype is None or dt == dtype):
                n += c - (since or {}).get((op, dt), 0)
        return n

    def as_dict(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (op, dt), c in sorted(self.counts.items()):
            out.setdefault(op, {})[dt] = c
        return out


LOG = CollectiveLog()  # shared by every audited group of this process
_LOCK = threading.Lock()


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else str(dtype).replace("torch.", "")


def _flat(tensors: Any) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    out: list[torch.Tensor] = []
    for t in tensors or ():
        out.extend(_flat(t))
    return out


def _reduce_op_name(opts: Any) -> str | None:
    if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        op = opts
    else:
        op = getattr(opts, "reduceOp", None)
    if op is None:
        return None
    name = str(getattr(op, "op", op))  # ReduceOp -> RedOpType
    return name.rsplit(".", 1)[-1].split(":")[0].strip("<> ")


def _fwd(method: Any, opts: Any, *args: Any) -> Any:
    return method(*args) if opts is None else method(*args, opts)


# ---------------------------------------------------------------------------------------------
# The process group.
# ---------------------------------------------------------------------------------------------
def _gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A plain ProcessGroup with one gloo backend for the CPU (what init_process_group builds)."""
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
    gloo._set_sequence_number_for_group()
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    return pg


class AuditedProcessGroup(dist.ProcessGroup):
    """Counts and checks every collective, then runs it on the wrapped gloo process group."""

    def __init__(self, inner: dist.ProcessGroup, *, backend_name: str,
                 table: DtypeTable | None = None, enforce: bool = True,
                 log: CollectiveLog | None = None) -> None:
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.backend_name = backend_name
        self.table = table
        self.enforce = enforce
        self.log = LOG if log is None else log
        self._name = ""
        self._desc = ""

    # -- identity: DeviceMesh and the functional collectives look groups up by name --
    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return self.backend_name

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name
        super()._set_group_name(name)

    @property
    def group_desc(self) -> str:
        return self._desc

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc
        super()._set_group_desc(desc)

    def _get_backend(self, device: torch.device) -> Any:
        # FSDP2's allocator and a few torch utilities ask for the backend object (to ask what it
        # supports); collectives called on it would bypass the audit, which nothing in torch's
        # FSDP2/DCP/loop paths does.
        return self.inner._get_backend(device)

    # -- the audit --
    def _audit(self, op: str, tensors: Any, opts: Any = None) -> None:
        flat = _flat(tensors)
        dtypes = sorted({t.dtype for t in flat}, key=str) or [None]
        problems = []
        with _LOCK:
            for dt in dtypes:
                self.log.counts[(op, _dtype_name(dt))] += 1
            if self.table is not None:
                for dt in dtypes:
                    if dt is not None and (p := self.table.problem(op, dt)):
                        problems.append(p)
                if (p := self.table.reduce_op_problem(op, _reduce_op_name(opts))):
                    problems.append(p)
            self.log.violations.extend(problems)
        if problems and self.enforce:
            raise RuntimeError("; ".join(problems))

    # -- collectives (the same arguments as torch's ProcessGroup, forwarded unchanged) --
    def allreduce(self, tensors, opts=None):
        self._audit("allreduce", tensors, opts)
        return _fwd(self.inner.allreduce, opts, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        self._audit("allreduce_coalesced", tensors, opts)
        return _fwd(self.inner.allreduce_coalesced, opts, tensors)

    def reduce(self, tensors, opts=None):
        self._audit("reduce", tensors, opts)
        return _fwd(self.inner.reduce, opts, tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        self._audit("allgather", input_tensors)
        return _fwd(self.inner.allgather, opts, output_tensors, input_tensors)

    def _allgather_base(self, output, input, opts=None):  # noqa: A002
        self._audit("_allgather_base", input)
        return _fwd(self.inner._allgather_base, opts, output, input)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        self._audit("allgather_coalesced", input_list)
        return _fwd(self.inner.allgather_coalesced, opts, output_lists, input_list)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        self._audit("allgather_into_tensor_coalesced", inputs)
        return _fwd(self.inner.allgather_into_tensor_coalesced, opts, outputs, inputs)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        self._audit("reduce_scatter", input_tensors, opts)
        return _fwd(self.inner.reduce_scatter, opts, output_tensors, input_tensors)

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002
        self._audit("_reduce_scatter_base", input, opts)
        return _fwd(self.inner._reduce_scatter_base, opts, output, input)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        self._audit("reduce_scatter_tensor_coalesced", inputs, opts)
        return _fwd(self.inner.reduce_scatter_tensor_coalesced, opts, outputs, inputs)

    def broadcast(self, tensors, opts=None):
        self._audit("broadcast", tensors)
        return _fwd(self.inner.broadcast, opts, tensors)

    def gather(self, output_tensors, input_tensors, opts=None):
        self._audit("gather", input_tensors)
        return _fwd(self.inner.gather, opts, output_tensors, input_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        self._audit("scatter", output_tensors)
        return _fwd(self.inner.scatter, opts, output_tensors, input_tensors)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes,  # noqa: A002
                      opts=None):
        self._audit("alltoall_base", input)
        return _fwd(self.inner.alltoall_base, opts, output, input, output_split_sizes,
                    input_split_sizes)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        self._audit("alltoall", input_tensors)
        return _fwd(self.inner.alltoall, opts, output_tensors, input_tensors)

    def send(self, tensors, dst_rank, tag=0):
        self._audit("send", tensors)
        return self.inner.send(tensors, dst_rank, tag)

    def recv(self, tensors, src_rank, tag=0):
        self._audit("recv", tensors)
        return self.inner.recv(tensors, src_rank, tag)

    def recv_anysource(self, tensors, tag=0):
        self._audit("recv_anysource", tensors)
        return self.inner.recv_anysource(tensors, tag)

    def barrier(self, opts=None):
        self._audit("barrier", ())
        return _fwd(self.inner.barrier, opts)

    def _start_coalescing(self, device):
        return self.inner._start_coalescing(device)

    def _end_coalescing(self, device):
        return self.inner._end_coalescing(device)

    def _set_sequence_number_for_group(self) -> None:
        self.inner._set_sequence_number_for_group()

    def _get_sequence_number_for_group(self) -> int:
        return self.inner._get_sequence_number_for_group()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def abort(self) -> None:
        self.inner.abort()


def register(name: str, *, table: DtypeTable | None = None, enforce: bool = True,
             log: CollectiveLog | None = None) -> None:
    """Make `dist.init_process_group(name)` build an AuditedProcessGroup over gloo (CPU)."""

    def create(opts: Any, backend_options: Any = None) -> AuditedProcessGroup:  # noqa: ARG001 - torch's creator signature
        inner = _gloo_group(opts.store, opts.group_rank, opts.group_size, opts.timeout)
        return AuditedProcessGroup(inner, backend_name=name, table=table, enforce=enforce, log=log)

    if name.upper() in dist.Backend._plugins:  # re-registering (tests, benches): replace it
        del dist.Backend._plugins[name.upper()]
        if hasattr(dist.Backend, name.upper()):
            delattr(dist.Backend, name.upper())
        dist.Backend.backend_list = [b for b in dist.Backend.backend_list if b != name.lower()]
        dist.Backend.backend_capability.pop(name.lower(), None)
        dist.Backend.default_device_backend_map = {
            k: v for k, v in dist.Backend.default_device_backend_map.items() if v != name.lower()}
    dist.Backend.register_backend(name, create, extended_api=True, devices=["cpu"])


def summarize(log: CollectiveLog = LOG, *, since: Counter | None = None) -> dict[str, Any]:
    """Totals by family (all_gather, reduce_scatter, all_reduce, other) and float64 count."""
    return {
        "all_gather": log.total(ALL_GATHER_OPS, since=since),
        "reduce_scatter": log.total(REDUCE_SCATTER_OPS, since=since),
        "all_reduce": log.total(ALL_REDUCE_OPS, since=since),
        "float64": log.total(dtype="float64", since=since),
        "total": log.total(since=since),
    }


