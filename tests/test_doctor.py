"""`python -m pisft doctor`: the real checks on this CPU host, the Ascend rules, and the NPU
branch with the stand-in torch_npu (tests/stand_ins; version and numpy rules, cards, environment).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

from pisft import config as config_mod
from pisft import device as devices
from pisft import doctor
from pisft.doctor import checks, versions

ROOT = Path(__file__).resolve().parents[1]
STAND_INS = Path(__file__).resolve().parent / "stand_ins"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in devices.ASCEND_ENV_DEFAULTS and k not in ("JAX_PLATFORMS", "HCCL_EXEC_TIMEOUT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return {**env, **extra}


# ------------------------------------------------------------------ this CPU host, for real
def test_doctor_json_on_this_cpu_host_runs_the_checks_that_apply():
    """gloo collectives in 2 processes, SDPA against float32, fused AdamW, DCP to a tmp dir."""
    out = subprocess.run([sys.executable, "-m", "pisft", "doctor", "--json", "--set", "device=cpu"],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["device"] == "cpu"
    assert [c["name"] for c in report["checks"]] == list(doctor.CHECK_NAMES) == [
        "versions", "numpy", "devices", "device_op", "collectives", "attention", "fused_adamw",
        "checkpoint_round_trip", "environment"]
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {"versions": "pass", "numpy": "pass", "devices": "skip", "device_op": "skip",
                      "collectives": "pass", "attention": "pass", "fused_adamw": "pass",
                      "checkpoint_round_trip": "pass", "environment": "pass"}
    detail = {c["name"]: c["detail"] for c in report["checks"]}
    assert detail["collectives"].startswith("gloo, 2 processes") and detail["collectives"].endswith("exact")
    assert detail["attention"].startswith("sdpa in bf16")
    assert all(set(c) == {"name", "status", "detail"} for c in report["checks"])


def test_a_failing_or_crashing_check_fails_the_doctor(monkeypatch, capsys):
    cfg = config_mod.load(config_mod.DEFAULT_CONFIG, ["device=cpu"])

    def crashes(node):
        raise RuntimeError("AclSetCompileopt error code 500001")

    monkeypatch.setattr(doctor, "CHECKS", (("versions", checks.check_versions), ("device_op", crashes),
                                           ("numpy", lambda node: checks.fail("numpy 1.26.4: LeRobot needs"))))
    assert doctor.main(cfg) == 1
    out = capsys.readouterr().out
    assert "FAIL  device_op" in out and "RuntimeError: AclSetCompileopt error code 500001" in out
    assert "FAILED: device_op, numpy" in out
    monkeypatch.setattr(doctor, "CHECKS", (("versions", checks.check_versions),))
    assert doctor.main(cfg, as_json=True) == 0


def test_attention_reference_input_is_pi05_shaped_and_the_check_can_fail():
    q, k, v, mask, real = checks.pi05_attention_inputs(prefix=20, padded=4, actions=6)
    assert q.shape == (1, 8, 26, 256) and k.shape == v.shape == (1, 1, 26, 256)
    allowed = mask[0, 0] == 0
    assert allowed[:16, :16].all() and not allowed[:16, 20:].any()  # the prefix never sees actions
    assert allowed[20:, :16].all() and allowed[20:, 20:].all() and not allowed[:, 16:20].any()
    assert real.sum() == 22
    ref = checks.reference_attention(q, k, v, mask, 256 ** -0.5)
    wrong = checks.reference_attention(q, k, v, torch.zeros_like(mask), 256 ** -0.5)  # no mask
    assert (ref - wrong)[..., real, :].abs().max() > checks.ATTENTION_ATOL


# ------------------------------------------------------------------ the Ascend rules
def test_version_pairs_follow_torch_npus_compatibility_table():
    assert versions.release("2.11.0.post3") == "2.11.0" and versions.release("26.0.rc1") == "26.0.RC1"
    assert versions.release("8.3.RC1") == "8.3.RC1" and versions.release("unknown") is None
    assert versions.supported_pair("2.11.0.post3", "9.1.0")
    assert versions.pair_problems("2.11.0+cpu", "2.11.0.post3", "9.1.0") == []
    (problem,) = versions.pair_problems("2.11.0+cpu", "2.11.0.post3", "8.5.0")
    assert "paired with CANN 9.1.0" in problem and "install CANN 9.1.0" in problem
    assert any("not built for torch" in p for p in versions.pair_problems("2.10.0", "2.11.0", "9.1.0"))
    assert any("not in pisft's supported pairs" in p for p in versions.pair_problems("2.9.0", "2.9.0", "8.5.0"))
    assert any("not installed" in p for p in versions.pair_problems("2.11.0", None, "9.1.0"))


def test_driver_table_of_cann_910():
    for ok in ("26.0.rc1", "25.5.1", "26.1.0", "25.2.0"):
        assert versions.driver_problem("9.1.0", ok) is None, ok
    assert "upgrade the NPU driver" in versions.driver_problem("9.1.0", "25.0.3")
    assert "no driver table" in versions.driver_problem("8.5.0", "25.5.1")


def test_numpy_rule_of_cann_850_refuses_lerobots_numpy_and_910_admits_it():
    assert not versions.numpy_rule("8.5.0", (3, 12)).contains("2.2.6")
    assert versions.numpy_rule("8.5.0", (3, 12)).contains("1.26.4")
    assert versions.numpy_rule("8.5.0", (3, 13)) == SpecifierSet(">2.1")
    assert versions.numpy_rule("9.1.0", (3, 12)).contains("2.2.6")
    assert versions.numpy_rule("7.0.0", (3, 12)) is None
    assert versions.lerobot_numpy_spec() == SpecifierSet(">=2.0.0,<2.3.0")  # LeRobot 0.6.1


def test_python_dependency_problems_name_what_is_missing_or_too_old():
    problems = versions.python_dependency_problems({"packaging": SpecifierSet(">=1"),
                                                    "no-such-package-pisft": SpecifierSet(),
                                                    "torch": SpecifierSet("<1")})
    assert problems == ["no-such-package-pisft missing",
                        f"torch {versions.installed_version('torch')} (needs <1)"]


# ------------------------------------------------------------------ the NPU branch, stand-in torch_npu
def _npu_checks(code: str, **env: str) -> dict:
    """Run `code` after the NPU node is inspected (8 stand-in 910B cards; `node`, `checks`,
    `torch_npu`, `versions` in scope); it sets `out`, printed as JSON."""
    prelude = """
        import json
        import torch, torch_npu
        from pisft import config as config_mod
        from pisft.doctor import checks, versions
        cfg = config_mod.load(config_mod.DEFAULT_CONFIG, ["device=npu", "train.nproc_per_node=8",
                                                          "train.global_batch_size=32"])
        node = checks.inspect_node(cfg)
        def run(name):
            c = dict(checks.CHECKS)[name](node)
            return [c.status, c.detail]
    """
    script = textwrap.dedent(prelude) + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    pythonpath = os.pathsep.join([str(STAND_INS), str(ROOT / "src")])
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                            env=_env(PYTHONPATH=pythonpath, **env), timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_npu_versions_numpy_devices_and_environment_on_a_good_node():
    out = _npu_checks("""
        versions.python_dependency_problems = lambda req: []  # CANN's packages: the Ascend lock's
        out = {"kind": node.kind, "cards": node.cards,
               **{n: run(n) for n in ("versions", "numpy", "devices", "environment")}}
    """, ASCEND_HOME_PATH="/usr/local/Ascend/cann", HCCL_EXEC_TIMEOUT="3600")
    assert out["kind"] == "npu" and out["cards"] == 8
    assert out["versions"][0] == "pass", out["versions"]
    assert "torch-npu 2.11.0.post3, CANN 9.1.0, driver 26.0.rc1" in out["versions"][1]
    assert out["numpy"][0] == "pass" and "CANN 9.1.0's >=1.19.2" in out["numpy"][1]
    assert out["devices"][0] == "pass" and "npu:7 60.0/64.0 GiB free" in out["devices"][1]
    assert out["environment"][0] == "pass", out["environment"]
    assert "TASK_QUEUE_ENABLE=2 (pisft)" in out["environment"][1]
    assert "HCCL_EXEC_TIMEOUT=3600" in out["environment"][1]


def test_npu_on_cann_850_fails_versions_and_numpy_with_what_to_do():
    out = _npu_checks("""
        torch_npu.cann_versions.update(CANN="8.5.0", DRIVER="25.0.3")
        out = {n: run(n) for n in ("versions", "numpy")}
    """)
    status, detail = out["versions"]
    assert status == "fail"
    assert "paired with CANN 9.1.0" in detail and "no driver table for CANN 8.5.0" in detail
    status, detail = out["numpy"]
    assert status == "fail" and "numpy <2.0,>=1.19.2" in detail and "500001" in detail


def test_npu_cards_short_of_memory_or_number_fail_devices():
    out = _npu_checks("""
        torch_npu.memory[5] = (20 * 2**30, 64 * 2**30)  # another process holds card 5
        busy = run("devices")
        torch.npu.device_count = lambda: 4
        node = checks.inspect_node(cfg)
        out = {"busy": busy, "few": run("devices")}
    """)
    status, detail = out["busy"]
    assert status == "fail" and "npu:5 has only 20.0 of 64.0 GiB free" in detail
    status, detail = out["few"]
    assert status == "fail" and "4 npu card(s) visible, train.nproc_per_node is 8" in detail


def test_npu_environment_without_cann_or_with_a_bad_value_fails():
    out = _npu_checks("""out = run("environment")""", HCCL_CONNECT_TIMEOUT="twenty")
    status, detail = out
    assert status == "fail" and "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in detail
    assert "HCCL_CONNECT_TIMEOUT='twenty' is not a whole number" in detail


def test_a_configured_npu_that_is_not_here_fails_every_device_check():
    cfg = config_mod.load(config_mod.DEFAULT_CONFIG, ["device=npu"])
    report = doctor.run(cfg)
    status = {c["name"]: (c["status"], c["detail"]) for c in report["checks"]}
    assert report["device"] == "npu"
    for name in ("devices", "device_op", "collectives", "attention", "fused_adamw",
                 "checkpoint_round_trip", "environment", "versions"):
        assert status[name][0] == "fail", name
        assert "torch_npu cannot be imported" in status[name][1]


@pytest.mark.parametrize("name", doctor.CHECK_NAMES)
def test_every_check_has_a_stable_name_and_a_function(name):
    assert callable(dict(checks.CHECKS)[name])
