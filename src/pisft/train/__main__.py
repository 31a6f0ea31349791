"""`python -m pisft.train --stage STAGE --config FILE [--set KEY=VALUE ...]`: one training process.

Started by torchrun (through `python -m pisft launch STAGE`), never by hand: torchrun sets
RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous. The stage's function comes from the stage
table (pisft.stages): it gets the process's Context inside the process group and the
fused attention kernels. Exit status: 0 done, 2 a user-caused error (message printed), 3 the
smoke report failed a check.
"""

from __future__ import annotations

import argparse
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from pisft import config as config_mod
from pisft.errors import PisftError, stop_on_termination
from pisft.stages import STAGES, TRAINING_STAGES, resolve


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pisft.train", description=__doc__)
    parser.add_argument("--stage", required=True, choices=TRAINING_STAGES)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--iteration", type=int, default=0, help="the RECAP iteration (0: the SFT run)")
    return parser.parse_args(argv)


def run_stage(stage: str, cfg: config_mod.PisftConfig) -> int:
    """Set up this process, run the stage's function in it, leave the process group."""
    import torch.distributed as dist

    from pisft.model.registry import spec_for_preset
    from pisft.train.launch import world_size_for
    from pisft.train.job import setup_process

    row = STAGES[stage]
    before_group = resolve(row.before_group) if row.before_group else None
    ctx = setup_process(cfg, stage, world_size_for(stage, cfg), before_group)
    try:
        stage_fn = resolve(row.run)
        with spec_for_preset(cfg.model.preset).fused_attention():  # fused kernels for the model's attention
            return stage_fn(ctx)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@record
def main(argv: list[str] | None = None) -> int:
    from pisft.train.guard import worker_dies_with_agent

    worker_dies_with_agent()  # an orphan of a killed launcher must not train (see guard.py)
    stop_on_termination()  # torchrun stops workers with SIGTERM: unwind, so temporary outputs go
    args = _parse(argv)
    rank = os.environ.get("RANK", "0")
    try:
        return run_stage(args.stage, config_mod.load(args.config, args.overrides).at_iteration(args.iteration))
    except PisftError as exc:
        print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:
        from pisft import disk_space

        if not disk_space.is_full_disk(exc):
            raise
        # a write not wrapped by name (a log, a small file): the full disk still in one line
        where = disk_space._filename(exc) or "results_dir"  # noqa: SLF001
        print(f"error (rank {rank}): " + disk_space.full_disk_line(where, what=args.stage, needed=None,
              kept="complete checkpoints and finished outputs"), file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    from pisft.device import exit_process

    # not through the interpreter's teardown, which a gloo thread still releasing a collective can
    # abort (issue 47; pisft.device.exit_process)
    exit_process(main())
