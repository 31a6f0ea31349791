"""`python -m pisft doctor [--json]`: can this node run the configured training? About a minute.

Each check is a named line, pass / fail / skip with a reason; the names are stable for scripts:

  versions               torch, torch-npu, CANN and the NPU driver against the supported pairs
                         (pisft.doctor.versions); CANN's Python run-time packages
  numpy                  numpy against LeRobot's range and, on Ascend, CANN's rule
  devices                the cards visible (>= train.nproc_per_node) and their free memory
  device_op              set_device and a small bf16 matmul on every card
  collectives            all-reduce (float32, int64), reduce-scatter (float32, bfloat16) and
                         all-gather (bfloat16) over all cards, one process per card, with the
                         training's backend (hccl / nccl; gloo with 2 processes on the CPU)
  attention              the training's attention kernel (npu_fusion_attention on NPU in bf16,
                         SDPA elsewhere; pisft.model.pi05.attention) against a float32 reference on a
                         small pi0.5-shaped input (8 query heads, 1 K/V head, head_dim 256,
                         prefix + action block mask), bf16 tolerance
  fused_adamw            fused AdamW against the foreach one, and the training's skip of a
                         non-finite step (pisft.train.step.skip_if_nonfinite_step)
  checkpoint_round_trip  a DCP save and load of model + AdamW state, on the device
  environment            the environment the training processes get (pisft.device), the user's
                         overrides, the CANN environment sourced

Checks that do not apply to the device kind are skipped with the reason (no `devices` or
`device_op` on the CPU). `--json` prints {"device": ..., "checks": [{"name", "status",
"detail"}]}. Exit status 0 when no check fails, 1 otherwise.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from pisft.doctor.checks import CHECKS, Check, inspect_node

CHECK_NAMES = tuple(name for name, _ in CHECKS)
STATUSES = ("pass", "fail", "skip")


def run(cfg: Any, *, progress: bool = False) -> dict[str, Any]:
    """Every check on this node for `cfg`; {"device": kind, "checks": [...]}."""
    node = inspect_node(cfg)
    checks = []
    for name, check in CHECKS:
        t0 = time.perf_counter()
        try:
            result = check(node)
        except Exception as exc:  # noqa: BLE001 - a preflight reports what broke, it does not crash
            result = Check("fail", f"{type(exc).__name__}: {exc}")
        checks.append({"name": name, "status": result.status, "detail": result.detail})
        if progress:
            print(_line(checks[-1], time.perf_counter() - t0), flush=True)
    return {"device": node.kind or node.requested, "checks": checks}


def _line(check: dict[str, str], seconds: float | None = None) -> str:
    took = f" ({seconds:.1f} s)" if seconds is not None and seconds >= 0.5 else ""
    return f"{check['status'].upper():4}  {check['name']:<22} {check['detail']}{took}"


def passed(report: dict[str, Any]) -> bool:
    return all(c["status"] != "fail" for c in report["checks"])


def main(cfg: Any, *, as_json: bool = False) -> int:
    if not as_json:
        print(f"pisft doctor: device {cfg.device!r}, {cfg.train.nproc_per_node} processes per node "
              "(the config's train.nproc_per_node)", flush=True)
    report = run(cfg, progress=not as_json)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        failed = [c["name"] for c in report["checks"] if c["status"] == "fail"]
        print("doctor: " + ("this node can run the configured training" if not failed else
                            f"FAILED: {', '.join(failed)} (see above); fix these before training"))
    sys.stdout.flush()
    return 0 if passed(report) else 1
