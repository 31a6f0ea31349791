"""The audited process group: counting by operation and dtype, the stand-in torch_npu's "hccl"
backend refusing what torch_npu v2.11.0-26.1.0 refuses (checked against its behaviour, each
collective with each dtype, not against the table it is built from), and the real training loop
and checkpoint under that backend."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from train_fixtures import CONFIG, ROOT, results_dir

from pisft.introspect import collective_audit as ca

STAND_INS = Path(__file__).resolve().parent / "stand_ins"
WORKERS = Path(__file__).resolve().parent / "hccl_workers.py"


# ------------------------------------------------------------------ counting, in this process
@pytest.fixture
def world_of_one(tmp_path):
    """An audited group of one process over gloo, used directly (no global process group)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)

    def make(table=None, enforce=True):
        log = ca.CollectiveLog()
        inner = ca._gloo_group(store, 0, 1, timedelta(seconds=30))
        return ca.AuditedProcessGroup(inner, backend_name="audited", table=table, enforce=enforce,
                                      log=log), log

    return make


def test_counts_by_operation_and_dtype(world_of_one):
    pg, log = world_of_one()
    pg.allreduce([torch.ones(2)]).wait()
    pg.allreduce([torch.ones(2, dtype=torch.float64)]).wait()
    out = torch.zeros(2)
    pg._allgather_base(out, torch.ones(2)).wait()
    pg._reduce_scatter_base(torch.zeros(2), torch.ones(2)).wait()
    pg.broadcast([torch.ones(1, dtype=torch.uint8)]).wait()
    pg.barrier().wait()
    assert log.as_dict() == {
        "allreduce": {"float32": 1, "float64": 1},
        "_allgather_base": {"float32": 1},
        "_reduce_scatter_base": {"float32": 1},
        "broadcast": {"uint8": 1},
        "barrier": {"none": 1},
    }
    assert torch.equal(out, torch.ones(2))  # the collective really ran
    assert ca.summarize(log) == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2,
                                 "float64": 1, "total": 6}
    before = log.snapshot()
    pg.allreduce([torch.ones(1)]).wait()
    assert log.total(ca.ALL_REDUCE_OPS, since=before) == 1


# ------------------------------------------------------------------ HCCL's refusals, as behaviour
# What torch_npu v2.11.0-26.1.0 refuses, read from its source (github.com/Ascend/pytorch, branch
# v2.11.0-26.1.0), written here once and independently of pisft's table:
# - torch_npu/csrc/distributed/ProcessGroupHCCL.cpp `checkSupportedDataType`: the reductions
#   (allreduce, allreduce_coalesced, reduce, reduce_scatter, _reduce_scatter_base, ...) take int8,
#   int16, int32, float16, float32, bfloat16, int64 only; allreduce and reduce cast bool and
#   uint8 to int32 before that check (`_npu_dtype_cast(..., at::kInt)`), the reduce-scatters do not;
# - torch_npu/csrc/distributed/HCCLUtils.cpp `kScalarTypeToHcclDataType`: complex dtypes cannot
#   travel at all; gathers and broadcast check nothing more;
# - ProcessGroupHCCL.cpp `unsupportedOp`: ReduceOp BAND, BOR, BXOR are refused.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.float64,
          torch.bool, torch.uint8, torch.complex64)
REFUSED = {
    "allreduce": {torch.float64, torch.complex64},
    "allreduce_coalesced": {torch.float64, torch.complex64},
    "reduce": {torch.float64, torch.complex64},
    "reduce_scatter": {torch.float64, torch.bool, torch.uint8, torch.complex64},
    "_reduce_scatter_base": {torch.float64, torch.bool, torch.uint8, torch.complex64},
    "allgather": {torch.complex64},
    "_allgather_base": {torch.complex64},
    "broadcast": {torch.complex64},
}


def _collective(pg, op: str, x: torch.Tensor) -> torch.Tensor:
    """`op` on the one-process group `pg` with input `x`; what the collective put out."""
    out = torch.zeros_like(x)
    if op == "allreduce":
        pg.allreduce([x]).wait()
        return x
    if op == "allreduce_coalesced":
        pg.allreduce_coalesced([x]).wait()
        return x
    if op == "reduce":
        opts = dist.ReduceOptions()
        opts.rootRank = 0
        pg.reduce([x], opts).wait()
        return x
    if op == "reduce_scatter":
        pg.reduce_scatter([out], [[x]]).wait()
    elif op == "_reduce_scatter_base":
        pg._reduce_scatter_base(out, x).wait()
    elif op == "allgather":
        pg.allgather([[out]], [x]).wait()
    elif op == "_allgather_base":
        pg._allgather_base(out, x).wait()
    elif op == "broadcast":
        pg.broadcast([x]).wait()
        return x
    return out


@pytest.mark.parametrize("op", sorted(REFUSED))
def test_the_stand_in_hccl_refuses_what_torch_npu_refuses(world_of_one, op):
    """Each collective, each dtype, through the process group the stand-in torch_npu registers as
    "hccl" (pisft's table, enforced): refused exactly where torch_npu refuses, naming the operation,
    the dtype and the rule's source; otherwise the collective runs (world of one: out = in)."""
    pg, log = world_of_one(table=ca.HCCL_TABLE, enforce=True)
    for dtype in DTYPES:
        x = torch.ones(4, dtype=dtype)
        if dtype in REFUSED[op]:
            with pytest.raises(RuntimeError) as exc:
                _collective(pg, op, x)
            name = str(dtype).replace("torch.", "")
            assert f"HCCL {op}: dtype {name} is not supported" in str(exc.value)
            assert ca.HCCL_VERSION in str(exc.value)
        else:
            assert torch.equal(_collective(pg, op, x), torch.ones(4, dtype=dtype)), (op, dtype)
    assert len(log.violations) == len(REFUSED[op])
    if op in ("allreduce", "reduce_scatter"):
        for bad in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
            opts = dist.AllreduceOptions() if op == "allreduce" else dist.ReduceScatterOptions()
            opts.reduceOp = bad
            with pytest.raises(RuntimeError, match=r"ReduceOp\.B(AND|OR|XOR) is not supported"):
                (pg.allreduce([torch.ones(1, dtype=torch.int32)], opts) if op == "allreduce" else
                 pg.reduce_scatter([torch.zeros(1, dtype=torch.int32)], [[torch.ones(1, dtype=torch.int32)]], opts))


def test_enforced_table_raises_with_op_dtype_and_source(world_of_one):
    pg, log = world_of_one(table=ca.HCCL_TABLE, enforce=True)
    t = torch.ones(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"HCCL allreduce: dtype float64 is not supported.*"
                                           r"ProcessGroupHCCL\.cpp checkSupportedDataType"):
        pg.allreduce([t])
    with pytest.raises(RuntimeError, match="HCCL _reduce_scatter_base: dtype bool"):
        pg._reduce_scatter_base(torch.zeros(1, dtype=torch.bool), torch.ones(1, dtype=torch.bool))
    out = torch.zeros(2, dtype=torch.float64)
    pg._allgather_base(out, t).wait()  # gathers accept float64
    assert torch.equal(out, t)
    assert len(log.violations) == 2


def test_counting_mode_records_violations_and_runs(world_of_one):
    pg, log = world_of_one(table=ca.HCCL_TABLE, enforce=False)
    t = torch.ones(2, dtype=torch.float64)
    pg.allreduce([t]).wait()
    assert log.counts[("allreduce", "float64")] == 1
    assert len(log.violations) == 1 and "float64" in log.violations[0]


def test_registering_again_replaces_the_backend():
    ca.register("pisft_test_twice")
    ca.register("pisft_test_twice", table=ca.HCCL_TABLE)
    assert dist.Backend.backend_list.count("pisft_test_twice") == 1
    assert dist.Backend.backend_capability["pisft_test_twice"] == ["cpu"]


# ------------------------------------------------------------------ the stand-in, 2 processes
def _failure(proc: subprocess.CompletedProcess, logs: Path) -> str:
    """What a failed torchrun says and, rank by rank, the end of each worker's own stderr (with
    PYTHONFAULTHANDLER, an abort leaves every thread's Python stack there; a thread with `<no
    Python frame>` is a native one, e.g. gloo's)."""
    parts = [f"torchrun exited {proc.returncode}; its summary (which rank, which exit code):",
             proc.stderr[-3000:]]
    for err in sorted(logs.glob("*/attempt_*/*/stderr.log")):
        parts.append(f"--- rank {err.parent.name}'s stderr ({err}):\n{err.read_text()[-4000:]}")
    return "\n".join(parts)


def _torchrun(out: Path, *args: str, timeout: float = 120) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join([str(STAND_INS), os.environ.get("PYTHONPATH", "")])}
    logs = out / "torchrun_logs"  # each rank's stdout and stderr, also on the console (--tee)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "--log-dir", str(logs), "--tee", "3", str(WORKERS), str(out),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, _failure(proc, logs)
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]


@pytest.mark.integration  # ~25 s: gloo worker processes
def test_stand_in_hccl_refuses_what_hccl_refuses(tmp_path):
    for r in _torchrun(tmp_path / "out", "collectives"):
        assert r["backend"] == "hccl" and r["stand_in"] is True
        assert "HCCL allreduce: dtype float64 is not supported" in r["all_reduce_float64"]
        assert "checkSupportedDataType" in r["all_reduce_float64"]
        assert "_reduce_scatter_base: dtype uint8" in r["reduce_scatter_uint8"]
        assert "_reduce_scatter_base: dtype bool" in r["reduce_scatter_bool"]
        assert "ReduceOp.BAND" in r["all_reduce_band"]
        ok = r["accepted"]
        for key in ("all_reduce_float32", "all_reduce_int64", "all_reduce_bool",
                    "all_gather_float64", "broadcast_float64", "all_gather_object", "barrier",
                    "reduce", "gather", "scatter", "all_to_all_single", "send_recv",
                    "reduce_scatter_float32"):
            assert ok[key] is None, (key, ok[key])
        for op in ("reduce", "gather", "scatter", "alltoall_base", "reduce_scatter", "barrier",
                   "allreduce", "allgather", "broadcast"):
            assert op in r["counted"], op
        assert ok["all_reduce_float32_value"] == 2.0
        assert ok["all_gather_float64_values"] == [0.0, 1.0]


@pytest.mark.integration
def test_training_loop_and_checkpoint_pass_hccl_dtype_table(tmp_path_factory, tmp_path):
    """The real path (stage.build: FSDP2 shard + AdamW; loop.run; CheckpointManager.save) on
    2 processes over the stand-in "hccl": every collective has a dtype HCCL accepts."""
    res = results_dir(tmp_path_factory, "hccl_train")
    ranks = _torchrun(tmp_path / "out", "train", str(CONFIG), str(res), str(tmp_path / "ckpt"), timeout=300)
    for r in ranks:
        assert r["backend"] == "hccl"
        assert r["violations"] == []
        assert r["steps"] == [1, 2] and r["accum"] == 2
        assert all(math.isfinite(loss) for loss in r["losses"]), r["losses"]  # not inf, not nan
        assert r["collectives"]["_allgather_base"]["float32"] > 0  # FSDP2 ran through the audit
        assert r["collectives"]["_reduce_scatter_base"]["float32"] > 0
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert (Path(ranks[0]["checkpoint"]) / "COMPLETE.json").is_file()


@pytest.mark.integration  # ~10 s: gloo worker processes
def test_a_worker_ending_with_collectives_in_flight_exits_cleanly(tmp_path):
    """Issue 47: rank 1 aborted with "terminate called without an active exception" after a
    finished run. The process group outlives `destroy_process_group` (torch's DTensor caches hold
    FSDP2's mesh), so gloo's worker threads are alive at the interpreter's teardown, and one that
    drops the last reference to a collective's tensor then needs the GIL: Python 3.12 ends it
    inside that C++ destructor (gdb on the core: ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork
    -> TensorImpl::decref_pyobject -> take_gil -> pthread_exit -> std::terminate). Here each rank
    leaves 1,000 all-reduces of temporaries in flight with its group held and ends as pisft's
    workers end (`pisft.device.exit_process`); through the teardown the same run aborted 6 times
    in 8 on this host."""
    ranks = _torchrun(tmp_path / "out", "in_flight", "exit_process")
    assert [(r["rank"], r["held"], r["ending"]) for r in ranks] == [
        (0, "AuditedProcessGroup", "exit_process"), (1, "AuditedProcessGroup", "exit_process")]
