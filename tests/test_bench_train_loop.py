"""The train_loop bench's measuring tools: CPU seconds of a process tree, the 2-process launches."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from pisft.bench import train_bench


def test_cpu_seconds_include_the_child_processes():
    """A busy child (like a data-loader worker) counts towards the variant's cores_used."""
    before = train_bench.process_tree_cpu_s()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 1.0: pass\ntime.sleep(30)"])
    try:
        deadline = time.time() + 60
        while train_bench.process_tree_cpu_s() - before < 0.9:
            assert time.time() < deadline, "the child's CPU time was not counted"
            time.sleep(0.2)
    finally:
        child.kill()
        child.wait()


def test_lerobot_runs_under_its_own_accelerate_launch_ours_under_torchrun(tmp_path):
    cmds = train_bench.launch_commands(tmp_path / "root", tmp_path, micro=4, warmup=10, steps=20,
                                       lr=1e-3, log_every=10, seed=0)
    ours, lerobot = cmds["ours"](tmp_path / "o.json", 40001), cmds["lerobot"](tmp_path / "l.json", 40002)
    assert ours[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node" in ours and ours[ours.index("--nproc-per-node") + 1] == "2"
    assert Path(lerobot[0]).name == "accelerate" and lerobot[1] == "launch"
    assert lerobot[lerobot.index("--num_processes") + 1] == "2"
    assert lerobot[lerobot.index("--main_process_port") + 1] == "40002"  # the port held while it runs
    layers = cmds["ours_layer_units"](tmp_path / "u.json", 40003)
    for cmd, variant in ((ours, "ours"), (lerobot, "lerobot"), (layers, "ours")):
        assert cmd[cmd.index("--variant") + 1] == variant
        assert cmd[cmd.index("--warmup") + 1] == "10" and cmd[cmd.index("--steps") + 1] == "20"
    assert "--min-unit-params" not in ours  # the training default for the CPU
    assert layers[layers.index("--min-unit-params") + 1] == "0" and layers[:4] == ours[:4]


def test_each_side_steps_with_the_optimizer_its_trainer_builds():
    """Ours: the fused AdamW train.job builds on the CPU; LeRobot: its pi0.5 preset, as
    lerobot-train builds it (torch's default AdamW implementation)."""
    import torch

    from pisft.model.policy import build_policy

    policy = build_policy("tiny", seed=0, device="cpu")
    ours, _ = train_bench.ours_optimizer(policy, 1e-3)
    theirs, _ = train_bench.lerobot_optimizer(policy, 1e-3)
    assert isinstance(ours, torch.optim.AdamW) and ours.defaults["fused"] is True
    assert isinstance(theirs, torch.optim.AdamW) and not theirs.defaults["fused"]
    preset = policy.config.get_optimizer_preset()
    assert theirs.defaults["betas"] == tuple(preset.betas) and theirs.defaults["eps"] == preset.eps
    assert theirs.defaults["weight_decay"] == preset.weight_decay and theirs.defaults["lr"] == 1e-3
