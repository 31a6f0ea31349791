"""`python -m pisft <command>`: one command per non-training stage, plus tools.

Stages (each reads the config, writes under results/):
  {stages}
Training stages run through the launcher, which starts torchrun:
  {training}   (python -m pisft launch <stage> --config FILE)
Tools:
  validate [FILE], estimate, dvc-yaml, profile FILE, bench, summary, doctor
  serve --model DIR    serve a model over openpi's websocket policy protocol

The stages are the table in pisft.stages.
"""

from __future__ import annotations

import argparse
import errno
import signal
import sys

from pisft import layout
from pisft import config as config_mod
from pisft.errors import PisftError, Terminated, restore_handlers, stop_on_termination
from pisft.logs import tee_output
from pisft.workflow.drivers import pin_threads
from pisft.workflow.invalidate import invalidate_downstream
from pisft.stages import STAGES, TRAINING_STAGES, resolve

# The stages this process runs itself (the training stages run under torchrun).
IN_PROCESS = {name: stage for name, stage in STAGES.items() if not stage.training}


def _description() -> str:
    return (__doc__ or "").format(stages=", ".join(IN_PROCESS), training=", ".join(TRAINING_STAGES))


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(config_mod.DEFAULT_CONFIG), help="run config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set train.steps=10 (repeatable)")
    p.add_argument("--log", default=None, metavar="FILE",
                   help="also write everything printed (child processes too) to FILE")
    p.add_argument("--iteration", type=int, default=0, metavar="K",
                   help="the RECAP iteration the stage runs for (0: the SFT run; README, 'The RECAP loop')")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pisft", description=_description(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check a config; exit non-zero with the problem")
    p.add_argument("file", nargs="?", default=str(config_mod.DEFAULT_CONFIG))

    for name, stage in IN_PROCESS.items():
        p = sub.add_parser(name, help=f"stage: {stage.help}")
        _add_config(p)
        if stage.shards_key:  # scattered over jobs (pisft.rollout.plan, "Scattered rollouts")
            how = p.add_mutually_exclusive_group()
            how.add_argument("--shard", default=None, metavar="I/N",
                             help=f"only shard I of N of its episodes, into its shard folder ({stage.shards_key}: N)")
            how.add_argument("--merge-shards", type=int, default=None, metavar="N",
                             help="write its outputs from its N shards (each run with --shard I/N)")

    p = sub.add_parser("launch", help="run a training stage under torchrun")
    p.add_argument("stage", choices=TRAINING_STAGES)
    _add_config(p)

    p = sub.add_parser("estimate", help="parameter count and per-device memory estimate")
    _add_config(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--fits", action=argparse.BooleanOptionalAction, default=None,
                   help="the largest micro batch of each train.trainable mode for pi0.5 on a 910B and an "
                        "80 GB GPU (default: when model.preset is pi05; minutes)")
    p.add_argument("--world-size", type=int, default=None, help="devices to shard over (default: the config's)")

    p = sub.add_parser("doctor", help="preflight: can this node run the configured training? "
                                      "(versions, devices, collectives, kernels, checkpoint; ~1 min)")
    _add_config(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("dvc-yaml", help="write dvc.yaml from the workflow rules")
    p.add_argument("--check", action="store_true", help="exit 1 if the committed dvc.yaml is stale")
    p.add_argument("--output", default="dvc.yaml")

    p = sub.add_parser("profile", help="make config/config.yaml (and dvc.yaml) run a profile, for "
                                       "snakemake and dvc repro alike")
    p.add_argument("file", help="a profile, e.g. config/profiles/ascend-8card.yaml")

    sub.add_parser("serve", help="serve a model over openpi's websocket protocol (see serve -h)",
                   add_help=False)

    p = sub.add_parser("summary", help="print the evaluation figures of the last run")
    _add_config(p)

    p = sub.add_parser("bench", help="benchmarks, written to results/bench/bench.json")
    _add_config(p)
    p.add_argument("--only", action="append", metavar="NAME",
                   help="run only this part (pipeline, convert_recap, train_loop, train_structure, "
                        "data_loader, closed_loop, real_size, inference, host_overhead, device: the "
                        "accelerator figures, at most 6 minutes; repeatable) and update its section of bench.json")
    return parser


def _summary(cfg: config_mod.PisftConfig) -> int:
    import json

    from pisft.bench.run import stage_times_lines

    print("\n".join(stage_times_lines(layout.benchmarks(cfg))))
    path = layout.iteration(cfg).eval_metrics
    if not path.is_file():
        print(f"no evaluation yet ({path} missing): run `snakemake --cores all` first")
        return 1
    metrics = json.loads(path.read_text())
    if metrics.get("evaluated") is False:  # data.eval_fraction 0: no episode held out
        print(f"held-out action MSE: not measured ({metrics.get('note')})")
    else:
        base = metrics.get("base", {}).get("action_mse")
        tuned = metrics.get("finetuned", {}).get("action_mse")
        print(f"held-out action MSE: base {base:.4g} -> fine-tuned {tuned:.4g}"
              + (f" ({base / tuned:.1f}x lower)" if base and tuned else ""))
    recap = layout.recap_metrics(cfg)
    if cfg.recap.iterations and recap.is_file():
        from pisft.recap.summary import CLOSED

        rates = [(it["k"], it[CLOSED]) for it in json.loads(recap.read_text())["iterations"]]
        print("closed-loop success per RECAP iteration: " + ", ".join(
            f"k={k} {c['successes']}/{c['episodes']}" for k, c in rates))
    return 0


def _running_trainer(args: argparse.Namespace) -> str | None:
    """Why `launch` must stop at once: its run folder is held by a running trainer; else None."""
    from pisft.train import guard, run_folders

    if not STAGES[args.stage].resumable:
        return None
    try:
        cfg = config_mod.load(args.config, args.overrides).at_iteration(args.iteration)
        folder = run_folders.stage_checkpoint_root(args.stage, cfg)
    except Exception:  # noqa: BLE001 - the stage itself reports a bad config or missing inputs
        return None
    holder = guard.lock_holder(folder, args.stage)
    return None if holder is None else guard.held_message(args.stage, folder, holder)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":  # the server has its own options (python -m pisft serve -h)
        from pisft.serve import server

        return server.main(argv[1:])
    args = build_parser().parse_args(argv)
    # SIGTERM/SIGHUP (a driver stopping the job, a scheduler's time limit) unwind the stage as
    # Ctrl-C does, so its temporary output folder is removed (`pisft.io.atomic_dir`).
    previous = stop_on_termination()
    try:
        return _main(args)
    except (KeyboardInterrupt, Terminated) as exc:
        name = "SIGINT" if isinstance(exc, KeyboardInterrupt) else signal.Signals(exc.signum).name
        print(f"error: {getattr(args, 'command', 'pisft')} stopped by {name}; its temporary output was "
              "removed and finished outputs were left as they were. Rerun the same command to redo it",
              file=sys.stderr, flush=True)
        return 128 + (signal.SIGINT if isinstance(exc, KeyboardInterrupt) else exc.signum)
    finally:
        restore_handlers(previous)


def _main(args: argparse.Namespace) -> int:
    log = getattr(args, "log", None)
    if log and getattr(args, "config", None) is not None:
        # A bad config is refused before the stage log is opened: the previous run's log stays.
        try:
            config_mod.load(args.config, args.overrides)
        except PisftError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.command == "launch":
        # A second trainer on a running run folder is refused before it opens any output (the
        # running trainer's stage log, the downstream invalidation): the trainer's own lock
        # (pisft.train.guard) would refuse it too, but only after those.
        refused = _running_trainer(args)
        if refused:
            print(f"error: {refused}", file=sys.stderr)
            return 1
    try:
        with tee_output(log):
            try:
                return _run(args)
            except OSError as exc:
                if not _is_storage_error(exc):
                    raise
                print(_storage_error_line(exc), file=sys.stderr)
                return 1
            except Exception as exc:  # noqa: BLE001 - a bug, not a user error: the traceback goes to the log too
                import traceback

                from pisft import disk_space

                if disk_space.is_full_disk(exc):  # a library's own error around a full disk (pyarrow, av, torch)
                    print(_full_disk_line(exc), file=sys.stderr)
                    return 1

                traceback.print_exc()
                return 1
    except OSError as exc:  # the log itself could not be opened or written
        if not _is_storage_error(exc):
            raise
        print(_storage_error_line(exc), file=sys.stderr)
        return 1


_STORAGE_ERRNOS = {errno.ENOSPC: "no space left on the device",
                   errno.EDQUOT: "disk quota exceeded",
                   errno.EROFS: "read-only filesystem",
                   errno.EACCES: "permission denied",
                   errno.EPERM: "operation not permitted"}


def _is_storage_error(exc: OSError) -> bool:
    return exc.errno in _STORAGE_ERRNOS


# The running stage's results_dir (where a nameless write went) and its command (to resume).
_RESULTS_DIR: list[str | None] = [None, None]


def _full_disk_line(exc: BaseException) -> str:
    """A stage's write ran out of space: where, how much is free, what was kept, how to resume."""
    from pisft import disk_space

    where = disk_space._filename(exc) or _RESULTS_DIR[0] or "results_dir"  # noqa: SLF001
    return "error: " + disk_space.full_disk_line(
        where, what="the stage's write", needed=None,
        kept="the previous complete output, if any (the temporary one was removed), and every finished stage",
        resume=f"{_RESULTS_DIR[1]} --config FILE (or the same snakemake / dvc repro command)" if _RESULTS_DIR[1]
        else None)


def _storage_error_line(exc: OSError) -> str:
    """One line for disk full / read-only / not permitted: the path and what to do."""
    where = exc.filename or "a file under results_dir"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and (exc.filename or _RESULTS_DIR[0]):
        return _full_disk_line(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        todo = ("free space there (or set results_dir to a larger disk) and rerun the same command; "
                "finished stages and complete checkpoints are kept")
    else:
        todo = "make that folder writable (or set results_dir to a writable folder) and rerun"
    return f"error: {where}: {_STORAGE_ERRNOS[exc.errno]}; {todo}"


def _writing_as(stage: str, k: int):
    """The manifests this stage writes name its rule and command (`pisft.integrity`), from its row."""
    from pisft.integrity import writing_as

    row = STAGES[stage]
    _RESULTS_DIR[1] = row.invocation(k)
    return writing_as(row.rule(k), row.invocation(k))


def _check_shards(stage: str, cfg: config_mod.PisftConfig, n: int, flag: str) -> None:
    """A shard or a merge for the number of shards the config gives (the workflow's rules follow it)."""
    key = STAGES[stage].shards_key
    want = STAGES[stage].shards(config_mod.to_dict(cfg))
    if n != want:
        raise PisftError(f"{stage} {flag}: the config gives {key} = {want}, not {n}; set {key}: {n} "
                         f"(or run {want} shard(s) with --shard I/{want})")


def _run_shard(args: argparse.Namespace, cfg: config_mod.PisftConfig) -> int:
    """`python -m pisft <stage> --shard I/N`: one shard of a scattered rollout stage; its manifest names
    the shard's rule and command."""
    from pisft.integrity import writing_as
    from pisft.rollout.plan import parse_shard

    row = STAGES[args.command]
    i, n = parse_shard(args.shard)
    _check_shards(row.name, cfg, n, f"--shard {args.shard}")
    rule = row.shard_rule(cfg.iteration, i, n)
    invalidate_downstream(rule, cfg.results_dir)  # the merge's outputs and what follows them
    pin_threads()
    _RESULTS_DIR[1] = f"{row.invocation(cfg.iteration)} --shard {i}/{n}"
    with writing_as(rule, _RESULTS_DIR[1]):
        resolve(row.run)(cfg, shard=(i, n))
    return 0


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command == "validate":
            cfg = config_mod.load(args.file)
            accum = cfg.grad_accum_steps
            split = (f"{accum}" if accum is not None else "from the micro batch smoke_1card chooses "
                     "(train.micro_batch_size: auto: a divisor of each process's share of the global batch, "
                     "which is kept)")
            print(f"{args.file}: OK (world size {cfg.world_size}, gradient accumulation {split})")
            return 0
        if args.command == "dvc-yaml":
            from pisft.workflow import dvc_yaml
            return dvc_yaml.main(check=args.check, output=args.output)
        if args.command == "profile":
            from pisft.workflow import profile
            return profile.switch(args.file)
        cfg = config_mod.load(args.config, args.overrides).at_iteration(args.iteration)
        _RESULTS_DIR[0] = str(cfg.results_dir)
        if args.command in IN_PROCESS and getattr(args, "shard", None) is not None:
            return _run_shard(args, cfg)
        if args.command in IN_PROCESS:
            invalidate_downstream(STAGES[args.command].rule(cfg.iteration), cfg.results_dir)
            pin_threads()  # the same CPU threads under Snakemake and DVC
            with _writing_as(args.command, cfg.iteration):
                if getattr(args, "merge_shards", None) is not None:
                    _check_shards(args.command, cfg, args.merge_shards, f"--merge-shards {args.merge_shards}")
                    resolve(IN_PROCESS[args.command].merge)(cfg, args.merge_shards)
                else:
                    resolve(IN_PROCESS[args.command].run)(cfg)
            return 0
        if args.command == "launch":
            from pisft.train import launch

            launch.preflight(args.stage, cfg)  # a refused launch removes nothing downstream
            invalidate_downstream(STAGES[args.stage].rule(cfg.iteration), cfg.results_dir)
            with _writing_as(args.stage, cfg.iteration):
                return launch.main(args.stage, cfg, args.config, args.overrides)
        if args.command == "estimate":
            from pisft.introspect import estimate
            return estimate.main(cfg, as_json=args.json, fits=args.fits, world_size=args.world_size)
        if args.command == "doctor":
            from pisft import doctor
            return doctor.main(cfg, as_json=args.json)
        if args.command == "summary":
            return _summary(cfg)
        if args.command == "bench":
            from pisft.bench import run as bench
            return bench.main(cfg, args.config, only=args.only)
    except PisftError as exc:
        line, code = user_error(exc)
        print(line, file=sys.stderr)
        return code
    return 1


def user_error(exc: PisftError) -> tuple[str, int]:
    """The line a stage stopped by `exc` ends with, and its exit status: 2, or 1 for a full disk.
    A full disk reported as something else (episodes whose video or recording could not be
    written, retried to the end) is named as what it is, without the other error's advice."""
    from pisft import disk_space

    if not isinstance(exc, disk_space.DiskFull) and disk_space.is_full_disk(exc):
        return _full_disk_line(exc), 1
    return f"error: {exc}", 2


if __name__ == "__main__":
    raise SystemExit(main())
