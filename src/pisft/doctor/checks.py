"""The doctor's checks (see pisft.doctor): each takes the `Node` and returns a `Check`."""

from __future__ import annotations

import math
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pisft import device as devices
from pisft.doctor import versions
from pisft.errors import DeviceError

GIB = 2**30
# A card the training will use must have this fraction of its memory free before training:
# less means another process holds it (npu-smi / nvidia-smi shows which).
MIN_FREE_FRACTION = 0.9
# bf16 attention against float32: bf16 keeps 8 significant bits (2**-8 = 3.9e-3 relative); the
# outputs are averages of N(0, 1) values, so a few units of that is the kernel's rounding.
ATTENTION_ATOL = 3e-2


@dataclass(frozen=True)
class Check:
    status: str  # pass | fail | skip
    detail: str


def ok(detail: str) -> Check:
    return Check("pass", detail)


def fail(detail: str) -> Check:
    return Check("fail", detail)


def skip(detail: str) -> Check:
    return Check("skip", detail)


@dataclass
class Node:
    """What the checks share: the configured training and the device kind found here."""

    cfg: Any
    requested: str
    kind: str | None  # None: the configured device is not usable here (`problem` says why)
    problem: str | None = None
    cards: int = 0
    facts: dict[str, Any] = field(default_factory=dict)  # e.g. the CANN version, read once

    @property
    def row(self) -> devices.DeviceRow | None:
        """The device kind's row (None: no usable kind here)."""
        return None if self.kind is None else devices.row(self.kind)

    @property
    def accelerator(self) -> bool:
        return self.row is not None and self.row.accelerator

    def device(self, index: int = 0) -> torch.device:
        return devices.row(self.kind).torch_device(index)


def inspect_node(cfg: Any) -> Node:
    try:
        kind = devices.resolve_kind(cfg.device)
    except DeviceError as exc:
        return Node(cfg, cfg.device, None, str(exc))
    cards = devices.device_count(kind) if devices.row(kind).accelerator else 0
    return Node(cfg, cfg.device, kind, cards=cards)


def _unusable(node: Node) -> Check | None:
    return fail(f"device {node.requested!r} is not usable here: {node.problem}") if node.kind is None else None


def _npu():
    return devices.npu_module()


def _on_cann(kind: str | None) -> bool:
    """Whether a device kind (resolved, or as configured: `auto` and None say no) runs on CANN."""
    found = devices.ROWS.get(kind) if kind is not None else None
    return found is not None and found.cann


def _cann_version(node: Node, module: str = "CANN") -> str | None:
    key = f"cann:{module}"
    if key not in node.facts:
        try:
            node.facts[key] = str(_npu().utils.get_cann_version(module=module))
        except Exception:  # noqa: BLE001 - an old torch_npu or a broken CANN: no version
            node.facts[key] = None
    return node.facts[key]


# ------------------------------------------------------------------------------- the checks
def check_versions(node: Node) -> Check:
    if not _on_cann(node.kind) and not _on_cann(node.requested):
        release = versions.release(torch.__version__)
        runtime = node.row.runtime_version if node.row is not None else None
        extra = f", {runtime()}" if runtime is not None else ""
        if release != versions.TORCH_RELEASE:
            return fail(f"torch {torch.__version__}{extra}: the lock pins torch {versions.TORCH_RELEASE}; "
                        "rebuild .venv with `make setup`")
        return ok(f"torch {torch.__version__}{extra} (CANN / torch-npu pairs: Ascend only)")
    if node.kind is None:
        return _unusable(node)
    torch_npu_version = versions.installed_version("torch-npu") or getattr(
        sys.modules.get("torch_npu"), "__version__", None)
    cann, driver = _cann_version(node), _cann_version(node, "DRIVER")
    problems = versions.pair_problems(torch.__version__, torch_npu_version, cann)
    if (driver_problem := versions.driver_problem(cann, driver)) is not None:
        problems.append(driver_problem)
    missing = versions.python_dependency_problems(versions.ascend_python_requirements())
    if missing:
        problems.append("Python packages CANN / torch_npu load at run time: " + ", ".join(missing)
                        + " (`make setup DEVICE=npu` installs them)")
    found = f"torch {torch.__version__}, torch-npu {torch_npu_version}, CANN {cann}, driver {driver}"
    return fail(f"{found}: " + "; ".join(problems)) if problems else ok(f"{found}: a supported combination")


def check_numpy(node: Node) -> Check:
    import numpy

    have = numpy.__version__
    problems = []
    lerobot = versions.lerobot_numpy_spec()
    if lerobot is not None and not lerobot.contains(have):
        problems.append(f"LeRobot needs numpy {lerobot}")
    python = sys.version_info[:2]
    if not _on_cann(node.kind):
        rule = "; CANN's rule applies on Ascend only"
        if problems:
            return fail(f"numpy {have}: " + "; ".join(problems))
        return ok(f"numpy {have} within LeRobot's {lerobot}{rule}")
    cann = _cann_version(node)
    cann_rule = versions.numpy_rule(cann, python)
    if cann_rule is None:
        problems.append(f"no numpy rule known for CANN {cann} (pisft knows {sorted(versions.NUMPY_RULES)})")
    elif not cann_rule.contains(have):
        problems.append(f"CANN {cann} on Python {python[0]}.{python[1]} needs numpy {cann_rule} "
                        "(else set_device fails with AclSetCompileopt(ACL_PRECISION_MODE) error 500001); "
                        f"use CANN {versions.CANN_RELEASE}")
    if problems:
        return fail(f"numpy {have}: " + "; ".join(problems))
    return ok(f"numpy {have} within LeRobot's {lerobot} and CANN {cann}'s {cann_rule}")


def _free_and_total(node: Node, index: int) -> tuple[int, int]:
    free, total = devices.accelerator_module(node.kind).mem_get_info(index)
    return int(free), int(total)


def check_devices(node: Node) -> Check:
    if (bad := _unusable(node)) is not None:
        return bad
    need = node.cfg.train.nproc_per_node
    if not node.accelerator:
        return skip(f"no accelerator: the CPU trains ({devices.usable_cores()} usable cores, "
                    f"{need} processes)")
    cards = []
    problems = []
    if node.cards < need:
        problems.append(f"{node.cards} {node.kind} card(s) visible, train.nproc_per_node is {need} "
                        "(check ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES, or lower it)")
    for i in range(node.cards):
        free, total = _free_and_total(node, i)
        cards.append(f"{node.kind}:{i} {free / GIB:.1f}/{total / GIB:.1f} GiB free")
        if i < need and free < MIN_FREE_FRACTION * total:
            problems.append(f"{node.kind}:{i} has only {free / GIB:.1f} of {total / GIB:.1f} GiB free "
                            f"(< {MIN_FREE_FRACTION:.0%}): another process holds it (npu-smi info / nvidia-smi)")
    detail = f"{node.cards} visible, {need} used: " + ", ".join(cards)
    return fail(detail + "; " + "; ".join(problems)) if problems else ok(detail)


def check_device_op(node: Node) -> Check:
    if (bad := _unusable(node)) is not None:
        return bad
    if not node.accelerator:
        return skip("no accelerator: nothing to select")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
    want = a @ b
    for i in range(node.cards):
        devices.local_device(node.kind, i)  # set_device, as a training process does
        got = (a.to(node.device(i), torch.bfloat16) @ b.to(node.device(i), torch.bfloat16)).float().cpu()
        devices.synchronize(node.kind)
        err = float((got - want).abs().max() / want.abs().max())
        if not math.isfinite(err) or err > 2e-2:
            return fail(f"{node.kind}:{i}: bf16 matmul off by {err:.3g} (relative) against the CPU")
    return ok(f"set_device and a bf16 matmul on {node.cards} card(s)")


def check_collectives(node: Node) -> Check:
    from pisft.doctor import collectives

    if (bad := _unusable(node)) is not None:
        return bad
    world = node.cards if node.accelerator else collectives.CPU_PROCESSES
    if world < 1:
        return fail("no card to run a collective on")
    passed, detail = collectives.run(node.kind, world, deterministic=node.cfg.train.deterministic)
    return ok(detail) if passed else fail(detail)


def pi05_attention_inputs(prefix: int = 304, padded: int = 8, actions: int = 50, seed: int = 0):
    """q (1, 8, S, 256), k and v (1, 1, S, 256), LeRobot's additive mask (1, 1, S, S), the real
    rows: a prefix (image + prompt tokens, the last `padded` of them padding) attending to the
    whole prefix, then an action block attending to the prefix and to itself."""
    s = prefix + actions
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 8, s, 256, generator=g)
    k, v = torch.randn(1, 1, s, 256, generator=g), torch.randn(1, 1, s, 256, generator=g)
    pad = torch.ones(s, dtype=torch.bool)
    pad[prefix - padded:prefix] = False
    block = torch.zeros(s, dtype=torch.long)
    block[prefix:] = 1  # LeRobot's att_masks: [0]*prefix + [1] + [0]*(actions-1), cumulated
    allowed = (block[None, :] <= block[:, None]) & pad[None, :] & pad[:, None]
    mask = torch.where(allowed, 0.0, -2.3819763e38)[None, None]  # OPENPI_ATTENTION_MASK_VALUE
    return q, k, v, mask, pad


def reference_attention(q, k, v, mask, scale):
    """Eager float32 attention (K/V repeated to every query head), as LeRobot's eager path."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale + mask
    return torch.softmax(scores, dim=-1) @ v.float()


def check_attention(node: Node) -> Check:
    # pi0.5's folder by design: this check runs pi0.5's attention kernels at pi0.5's shapes
    from pisft.model.pi05 import attention

    if (bad := _unusable(node)) is not None:
        return bad
    q, k, v, mask, real = pi05_attention_inputs()
    scale = q.shape[-1] ** -0.5
    want = reference_attention(q, k, v, mask, scale).transpose(1, 2)  # (B, S, H, D)
    dev = node.device(0)
    devices.local_device(node.kind, 0)  # set_device on an accelerator; the CPU selects nothing
    qd, kd, vd = (t.to(dev, torch.bfloat16) for t in (q, k, v))
    kernel = attention.kernel_for(qd)
    module = torch.nn.Module().eval()
    got, _ = attention.fused_attention_forward(module, qd, kd, vd, mask.to(dev, torch.bfloat16), scale)
    got = got.float().cpu()
    err = float((got[:, real] - want[:, real]).abs().max())  # padded rows differ by design
    detail = (f"{kernel} in bf16 on {dev}, pi0.5-shaped (8 query heads, 1 K/V head, head_dim 256, "
              f"{q.shape[2]} tokens): max abs error {err:.2e} against float32 (tolerance {ATTENTION_ATOL:g})")
    wanted = node.row.attention_kernel
    if wanted is not None and kernel != wanted:
        return fail(detail + f"; the {node.kind.upper()} did not take {wanted}")
    return ok(detail) if math.isfinite(err) and err <= ATTENTION_ATOL else fail(detail)


def _adamw_pair(dev: torch.device, fused: bool):
    from pisft.train import optim

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64, generator=g).to(dev)),
              torch.nn.Parameter(torch.randn(1000, generator=g).to(dev))]
    opt = optim.build_optimizer(params, lr=1e-3, weight_decay=0.01, fused=fused)
    return params, opt


def check_fused_adamw(node: Node) -> Check:
    from pisft.train.step import skip_if_nonfinite_step

    if (bad := _unusable(node)) is not None:
        return bad
    if not devices.fused_adamw_supported(node.kind):
        return fail(f"torch has no fused AdamW for {node.kind}: training would take the foreach "
                    "optimizer and a host sync per step (torch-npu provides the NPU kernel: check its install)")
    dev = node.device(0)
    devices.local_device(node.kind, 0)  # set_device on an accelerator; the CPU selects nothing
    (fused, f_opt), (plain, p_opt) = _adamw_pair(dev, True), _adamw_pair(dev, False)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g).to(dev) for p in fused]
        for ps, opt in ((fused, f_opt), (plain, p_opt)):
            for p, gr in zip(ps, grads, strict=True):
                p.grad = gr.clone()
            opt.step()
    err = max(float((a - b).detach().abs().max()) for a, b in zip(fused, plain, strict=True))
    if not err <= 1e-5:
        return fail(f"fused AdamW differs from foreach AdamW by {err:.2e} after 3 steps on {dev}")
    before = [p.detach().clone() for p in fused]
    for p in fused:
        p.grad = torch.full_like(p, float("nan"))
    skip_if_nonfinite_step(f_opt, torch.tensor(False, device=dev), node.kind, fused)
    finite = all(bool(torch.isfinite(p).all()) for p in fused)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, fused, strict=True))
    if not finite:
        return fail(f"a non-finite step left NaN in the parameters on {dev} (skip_if_nonfinite_step)")
    how = "skipped on the device" if unchanged else "gradients zeroed on the device"
    return ok(f"fused AdamW on {dev} equals foreach AdamW (max diff {err:.1e}); a non-finite step: {how}")


def check_checkpoint_round_trip(node: Node) -> Check:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if (bad := _unusable(node)) is not None:
        return bad
    dev = node.device(0)
    devices.local_device(node.kind, 0)  # set_device on an accelerator; the CPU selects nothing

    def model_and_optimizer(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(4, 32, device=dev)).sum().backward()
        opt.step()
        return model, opt

    saved_model, saved_opt = model_and_optimizer(0)
    with tempfile.TemporaryDirectory(prefix="pisft-doctor-dcp-") as tmp, warnings.catch_warnings():
        # no process group here: DCP says it saves/loads as one process, which is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        msd, osd = get_state_dict(saved_model, saved_opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
        model, opt = model_and_optimizer(1)
        msd, osd = get_state_dict(model, opt)
        target = {"model": msd, "optim": osd}
        dcp.load(target, checkpoint_id=tmp)
        set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    same = all(torch.equal(a, b) for a, b in zip(saved_model.state_dict().values(),
                                                    model.state_dict().values(), strict=True))
    states = [(saved_opt.state[a], opt.state[b]) for a, b in zip(saved_model.parameters(),
                                                                  model.parameters(), strict=True)]
    same_opt = all(torch.equal(x[key], y[key]) for x, y in states for key in ("exp_avg", "exp_avg_sq"))
    if not (same and same_opt):
        return fail(f"DCP save + load on {dev}: the loaded {'model' if not same else 'optimizer'} "
                    "state differs from the saved one")
    return ok(f"DCP save + load of model and AdamW state on {dev}: identical")


def check_environment(node: Node) -> Check:
    if (bad := _unusable(node)) is not None:
        return bad
    cfg = node.cfg
    try:
        env = devices.process_env(node.kind, os.environ, nproc_per_node=cfg.train.nproc_per_node,
                                  force_threads=True)
    except DeviceError as exc:
        return fail(str(exc))
    if cfg.train.deterministic:
        env = {**devices.deterministic_env(node.kind), **env}
    shown = ["JAX_PLATFORMS", *devices.THREAD_VARS[:1]]
    problems = []
    row = node.row
    if row.cann and not (os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")):
        problems.append("no CANN environment sourced (ASCEND_HOME_PATH unset): "
                        "source /usr/local/Ascend/ascend-toolkit/set_env.sh")
    shown += list(row.env_defaults)
    for key in row.whole_number_env:
        value = env.get(key)
        if value is not None and not value.strip().isdigit():
            problems.append(f"{key}={value!r} is not a whole number")
    if cfg.train.deterministic:
        shown += list(devices.deterministic_env(node.kind))
    parts = []
    for key in dict.fromkeys(shown):
        who = "yours" if key in os.environ and os.environ[key] == env.get(key) else "pisft"
        parts.append(f"{key}={env.get(key)} ({who})")
    for key in row.runtime_default_env:  # the CANN rows' (HCCL_EXEC_TIMEOUT)
        parts.append(f"{key}={os.environ.get(key, 'CANN default')}")
    detail = "training processes get " + ", ".join(parts)
    return fail(detail + "; " + "; ".join(problems)) if problems else ok(detail)


CHECKS: tuple[tuple[str, Callable[[Node], Check]], ...] = (
    ("versions", check_versions),
    ("numpy", check_numpy),
    ("devices", check_devices),
    ("device_op", check_device_op),
    ("collectives", check_collectives),
    ("attention", check_attention),
    ("fused_adamw", check_fused_adamw),
    ("checkpoint_round_trip", check_checkpoint_round_trip),
    ("environment", check_environment),
)
