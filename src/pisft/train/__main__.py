"""`python -m pisft.train --stage STAGE --config FILE [--set KEY=VALUE ...]`: one training process.

Started by torchrun (through `python -m pisft launch STAGE`), never by hand: torchrun sets
RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous. Exit status: 0 done, 2 a user-caused error
(message printed), 3 the smoke report failed a check.
"""

from __future__ import annotations

import argparse
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from pisft import config as config_mod
from pisft.errors import PisftError


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pisft.train", description=__doc__)
    parser.add_argument("--stage", required=True, choices=("smoke_1card", "train_8card"))
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return parser.parse_args(argv)


@record
def main(argv: list[str] | None = None) -> int:
    from pisft.train.guard import worker_dies_with_agent

    worker_dies_with_agent()  # an orphan of a killed launcher must not train (see guard.py)
    args = _parse(argv)
    rank = os.environ.get("RANK", "0")
    try:
        cfg = config_mod.load(args.config, args.overrides)
        from pisft.train.stage import main as stage_main

        return stage_main(args.stage, cfg)
    except PisftError as exc:
        print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
