"""A stand-in for torch_npu, for tests on machines without Ascend hardware (never install the
real torch-npu there: without CANN it makes `import torch` fail).

Put `tests/stand_ins` on PYTHONPATH (a fresh interpreter: the rename below is once per process)
and `import torch_npu` does what the real package does on import, as far as pisft relies on it:
- renames the PrivateUse1 backend to "npu" and registers `torch.npu` (8 visible "Ascend910B2"
  cards of 64 GiB; `torch.npu.calls` records `set_device`); tensors stay on the CPU;
- provides `npu_fusion_attention` (a CPU reference; calls recorded in `fusion_attention_calls`),
  which transformers imports as soon as it sees torch_npu;
- registers the "npugraph_ex" torch.compile backend, as the real package does on import
  (torch_npu/dynamo/__init__.py, `_register_backends`, torch_npu v2.11.0): the real one captures the
  graph for ACLGraph replay; here it runs the captured FX graph as it is on the CPU and records it
  in `npugraph_ex_graphs`, so a test sees which backend pisft compiles with and how many graphs;
- registers the "hccl" process-group backend. Here it is gloo on the CPU, wrapped by
  `pisft.introspect.collective_audit.AuditedProcessGroup` with HCCL's per-operation dtype table
  enforced (torch_npu v2.11.0-26.1.0, see `collective_audit.HCCL_TABLE`): a collective that
  HCCL refuses on a 910B (e.g. an all_reduce of float64) raises here too.
"""

import contextlib
import sys
import types

import torch

torch.utils.rename_privateuse1_backend("npu")


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    """The real package registers C++ hooks for its device. Here no tensor lives on an "npu", so
    torch's own accelerator detection (e.g. the device `dist.barrier()` picks) stays on the CPU;
    without any hooks it would raise "Please register PrivateUse1HooksInterface"."""

    def is_available(self) -> bool:
        return False

    def has_primary_context(self, dev_id) -> bool:
        return False

    def is_built(self) -> bool:
        return True


torch._C._acc.register_python_privateuseone_hook(_Hooks())

class _Stream:
    """The stream API torch's own code uses when it sees an accelerator (e.g. DCP's
    _OverlappingCpuLoader: current_stream, stream(...), wait_stream, synchronize); host tensors,
    so every operation is already complete."""

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return types.SimpleNamespace(synchronize=lambda: None, wait=lambda stream=None: None)


_STREAM = _Stream()

__version__ = "2.11.0.post3"  # the Ascend lock's pin

# What torch_npu.npu.utils.get_cann_version(module) answers; tests change it to play other nodes.
cann_versions = {"CANN": "9.1.0", "DRIVER": "26.0.rc1"}
# (free, total) bytes per card, as torch.npu.mem_get_info(device) answers.
memory = {i: (60 * 2**30, 64 * 2**30) for i in range(8)}

calls: list = []
npu = types.ModuleType("torch.npu")  # a module (torch.compile imports torch.<device>) with these attributes
npu.__dict__.update(
    is_available=lambda: True,
    device_count=lambda: 8,
    set_device=lambda i: calls.append(("set_device", i)),
    get_device_name=lambda i=0: "Ascend910B2",
    synchronize=lambda: None,
    reset_peak_memory_stats=lambda: None,
    max_memory_allocated=lambda: 123,
    get_device_properties=lambda i: types.SimpleNamespace(total_memory=64 * 2**30),
    mem_get_info=lambda device=None: memory[0 if device is None else int(getattr(device, "index", device) or 0)],
    utils=types.SimpleNamespace(get_cann_version=lambda module="CANN": cann_versions[module]),
    is_bf16_supported=lambda: True,
    current_stream=lambda device=None: _STREAM,
    stream=lambda s=None: contextlib.nullcontext(),
    Stream=_Stream,
    calls=calls,
)
torch.npu = npu
sys.modules["torch.npu"] = npu
# torch.accelerator's stream API asks the device's C++ guard, which the real package registers; the
# tensors here are host tensors, so the current stream is the CPU's (torch.compile asks for it).
torch.accelerator.current_stream = lambda device=None: torch.Stream("cpu")

fusion_attention_calls: list = []


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1.0, keep_prob=1.0, *args, **kwargs):
    """A CPU reference of torch_npu.npu_fusion_attention for layouts BNSD and BSND: atten_mask
    is bool/uint8 with True = NOT attended, K/V may have fewer heads (Nq a multiple of Nkv).
    Returns (attention_out, softmax_max, softmax_sum, softmax_in, seed, offset, numels) like the
    real operator (only the first is meaningful here). Every call is recorded."""
    fusion_attention_calls.append({
        "layout": input_layout, "head_num": head_num, "dtype": query.dtype,
        "mask_dtype": None if atten_mask is None else atten_mask.dtype, "keep_prob": keep_prob,
    })
    if input_layout not in ("BNSD", "BSND"):
        raise NotImplementedError(f"stand-in npu_fusion_attention: layout {input_layout}")
    if input_layout == "BSND":
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    if head_num != query.shape[1] or head_num % key.shape[1]:
        raise RuntimeError(f"npu_fusion_attention: head_num {head_num}, query heads "
                           f"{query.shape[1]}, key heads {key.shape[1]}")
    group = head_num // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = (query.float() @ key.float().transpose(-1, -2)) * scale
    if atten_mask is not None:
        scores = scores.masked_fill(atten_mask.bool(), float("-inf"))
    out = (torch.softmax(scores, dim=-1) @ value.float()).to(query.dtype)
    if input_layout == "BSND":
        out = out.transpose(1, 2)
    return out, None, None, None, 0, 0, 0

STAND_IN = True

npugraph_ex_graphs: list = []


def _npugraph_ex(gm, example_inputs, **kwargs):
    npugraph_ex_graphs.append(gm)
    return gm.forward


def _register_npugraph_ex() -> None:
    from torch._dynamo import register_backend

    register_backend(_npugraph_ex, "npugraph_ex")


_register_npugraph_ex()


def _register_hccl() -> None:
    from pisft.introspect import collective_audit

    collective_audit.register("hccl", table=collective_audit.HCCL_TABLE, enforce=True)


_register_hccl()
