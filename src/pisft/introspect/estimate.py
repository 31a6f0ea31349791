"""Parameter count and per-device peak memory of a training step, before any compute is spent.

`python -m pisft estimate [--config FILE] [--json]`, and `estimate_memory(cfg)` for the smoke
stage. Nothing is allocated and nothing is computed: the step runs on fake tensors.

How: the estimate runs pisft's own training step for one device of the configured world size W,
with every tensor a `FakeTensor` (shapes, dtypes and aliasing, no data) and a fake process group
of W ranks (collectives return at once), and follows the bytes of every tensor storage that the
step creates, resizes and frees. The step is the training's, not a model of it:

- the policy with the training structure (`pi05.construction.prepare_for_training`): activation
  checkpointing per joint decoder layer only, the unused action-expert `lm_head` removed;
- FSDP2 sharding through `pisft.train.fsdp.shard` (its units, its mixed-precision policy, its
  reshard-after-forward choices and prefetch), on the W-rank fake group: sharded fp32 master
  parameters, bf16 all-gathered compute copies, fp32 gradient reduce-scatter;
- the loss through `pisft.train.policy_task.PolicyTask` (`torch.autocast` in bf16, so autocast's
  bf16 casts and its fp32 intermediates are there), inside `fused_joint_attention`;
- backward (with the recompute of each checkpointed layer), gradient clipping, fused AdamW,
  `zero_grad(set_to_none=True)`; counted in steady state (AdamW's moments, which the first step
  creates, are held from the start).

Per device, at the moment of the step's peak (bytes; their sum is the peak):
  params       the parameter shards (1/W of every parameter; exact): fp32, the frozen ones
               bf16 under train.precision=bf16
  optimizer    AdamW's exp_avg + exp_avg_sq shards of the trained parameters (exact)
  grads        the fp32 gradient shards already reduce-scattered at the peak
  gathered     FSDP's unsharded compute copies (each unit between its all-gather and its reshard:
               the root and the vision units for the whole forward+backward, a decoder pair and
               the one prefetched), its all-gather and reduce-scatter buffers
  activations  everything else the step holds: saved activations (each checkpointed layer's
               inputs, the vision tower's activations), one layer's recompute, autocast's casts
               and fp32 intermediates, backward temporaries and the unsharded bf16 gradients
               waiting for their reduce-scatter, the input batch
  ema          with train.ema_decay set: the fp32 moving average of the trained parameters' shards

The trainable mode (`train.trainable`, pisft.train.trainable) is applied to the simulated policy
as the training applies it (`apply_mode`, then `hold_frozen_in`: frozen parameters in bf16 under
train.precision=bf16): frozen parameters have no gradient, no optimizer state and no EMA copy,
and with the whole VLM frozen (`expert`) the prefix runs without grad, its activations freed
layer by layer (pisft.model.pi05 8.). `largest_micro_batches` (printed by `pisft estimate` for
pi0.5) finds, per mode and checkpointing on/off, the largest micro batch whose estimate fits a
device's memory less the smoke gate's headroom.
`state_bytes` gives the whole model state (params, all gradient shards, optimizer).

What the estimate is not: a device's reserved memory (the caching allocator holds more than the
tensors), collective-library buffers, kernel workspaces and the runtime context. docs/memory.md
says what each adds and how npu-smi's figure relates to this one. The simulated tensors are CPU
tensors, so ops run CPU's kernel choices (attention: the CPU flash kernel; on CUDA/NPU the fused
kernels save the same output + log-sum-exp) and CPU autocast's op lists; the differences are
listed in docs/memory.md. Checked against a measured CPU step within 15% at two sizes
(tests/test_train_estimate.py, `python -m pisft.introspect.measure`).

Its modules: `step_memory` (the storage tracker), `simulated_step` (the step on fake tensors, by
category), `micro_batch_fits` (the largest micro batch per mode); this one reads the
configuration (which model, which mode, a subprocess where a process group exists), reports,
and is `pisft estimate`'s entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

from pisft import layout
from pisft.config import PisftConfig
from pisft.introspect import estimate_cache
from pisft.introspect.micro_batch_fits import FIT_PRESET, format_fits, largest_micro_batches
from pisft.introspect.simulated_step import GIB, ema_enabled, simulate_step, with_mode
from pisft.model import policy as policy_mod

# ------------------------------------------------------------------------------------------------
# The configured run


def _estimate_policy(cfg: PisftConfig) -> tuple[Callable[[], Any], str]:
    """A builder of the policy to estimate, on the meta device, through the spec of the config's
    preset (pisft.model.registry): the fetched base model's structure if present and of the config's
    preset, else the preset (a base fetched for another preset, e.g. the embedded default's tiny one
    before `--set model.preset=pi05`, is not the model asked about: it is named on stderr and left
    aside)."""
    from pisft.model.registry import spec_for_preset

    model = spec_for_preset(cfg.model.preset)
    base = _base_of_preset(cfg)
    if base is not None:
        return lambda: model.load.structure(base, device="meta", dtype="float32"), str(base)
    return (lambda: model.build(cfg.model.preset, seed=0, device="meta", dtype="float32"),
            f"preset {cfg.model.preset}")


def _base_of_preset(cfg: PisftConfig, *, quiet: bool = False) -> Any:
    """The fetched base model's folder when it holds a model of the config's preset, else None
    (named on stderr unless `quiet` when it holds another preset's)."""
    base = layout.base_model(cfg)
    if not (base / policy_mod.CONFIG_FILE).is_file():
        return None
    info = policy_mod.read_model_info(base)
    if info.get("preset") == cfg.model.preset:
        return base
    if not quiet:
        print(f"estimate: {base} holds a {info.get('preset')} model, the config asks for model.preset "
              f"{cfg.model.preset}: estimating the preset's model (fetch_base makes the config's base)",
              file=sys.stderr)
    return None



# The estimates this process made or read, by (the config as JSON, world size): the smoke stage's,
# made before its process group (`estimate_before_process_group`) or from inside it by a fresh process.
_KEPT: dict[tuple[str, int], dict[str, Any]] = {}


def _kept_for(cfg: PisftConfig, world: int) -> tuple[str, dict[int, str]]:
    """The config as JSON and the cache key (pisft.introspect.estimate_cache) of each world size one
    computation answers for `world`: it, 1 and the configured one (what the smoke stage asks for).
    Those kept by an earlier smoke run of the same step are read into `_KEPT` (with this run's model
    folder as `model`)."""
    from pisft import config as config_mod

    raw = json.dumps(config_mod.to_dict(cfg), sort_keys=True)
    base = _base_of_preset(cfg, quiet=True)
    model_files = [] if base is None else [base / policy_mod.CONFIG_FILE, base / policy_mod.MODEL_INFO_FILE]
    label = f"preset {cfg.model.preset}" if base is None else str(base)
    keys = {w: estimate_cache.key(json.loads(raw), w, model_files, label) for w in sorted({world, 1, cfg.world_size})}
    for w, cache_key in keys.items():
        if (raw, w) not in _KEPT and (kept := estimate_cache.read(cache_key)) is not None:
            _KEPT[(raw, w)] = {**kept, "model": label}
    return raw, keys


def _keep(raw: str, keys: dict[int, str], estimates: dict[int, dict[str, Any]]) -> None:
    for w, est in estimates.items():
        _KEPT[(raw, w)] = est
        estimate_cache.write(keys[w], est)


def estimate_before_process_group(cfg: PisftConfig) -> None:
    """The estimates a stage asks for once it holds a process group (world size 1 and the configured
    one: smoke_1card's, pisft.gates.smoke), made now, in this process, which holds none yet: inside
    the group `estimate_memory` answers from them instead of starting a fresh process, which spends
    most of its time importing the model's libraries (docs/memory.md). Kept for later smoke runs as
    the fresh process's are. torch's generator is left as it was (the simulation builds its policy
    from a seed)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("estimate_before_process_group: this process already holds a process group")
    raw, keys = _kept_for(cfg, cfg.world_size)
    with torch.random.fork_rng(devices=[]):
        _keep(raw, keys, {w: estimate_memory(cfg, world_size=w) for w in keys if (raw, w) not in _KEPT})


def _simulate_elsewhere(cfg: PisftConfig, world: int) -> dict[str, Any]:
    """The estimate from a fresh process (this one has a process group; the simulation needs its
    own), unless this process made it before its group or an earlier smoke run kept it."""
    raw, keys = _kept_for(cfg, world)
    if (raw, world) not in _KEPT:
        worlds = list(keys)
        cmd = [sys.executable, "-m", "pisft.introspect.estimate", "--config-json", "-",
               "--world-sizes", ",".join(map(str, worlds))]
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
        out = subprocess.run(cmd, input=raw, capture_output=True, text=True, env=env, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"memory estimate in a subprocess failed: {out.stderr[-2000:]}")
        _keep(raw, keys, dict(zip(worlds, json.loads(out.stdout.strip().splitlines()[-1]), strict=True)))
    return _KEPT[(raw, world)]


def estimate_memory(cfg: PisftConfig, *, world_size: int | None = None) -> dict[str, Any]:
    """Parameter counts and per-device peak memory (bytes and GiB) of one training step.

    `world_size`: override the configured one (the 1-device smoke run passes 1).
    """
    import torch.distributed as dist

    world = world_size or cfg.world_size
    if dist.is_initialized():
        return _simulate_elsewhere(cfg, world)
    from pisft import device as devices
    from pisft.train.fsdp import min_unit_params

    from pisft.train import trainable

    t = cfg.train
    if "auto" in (t.micro_batch_size, t.activation_checkpointing):
        from pisft.errors import PisftError

        raise PisftError("train.micro_batch_size / train.activation_checkpointing: auto is decided by smoke_1card "
                         "on the device from measured peaks; estimate a given setting (--set "
                         "train.micro_batch_size=N --set train.activation_checkpointing=true|false)")
    make, model_from = _estimate_policy(cfg)
    make = with_mode(make, t.trainable, trainable.spec_for(cfg), t.precision, seed=t.seed)
    kind = devices.resolve_kind("auto") if cfg.device == "auto" else cfg.device
    smallest = min_unit_params(kind, t.fsdp_min_unit_params)
    sim = simulate_step(make, world_size=world, micro_batch=t.micro_batch_size, precision=t.precision,
                        checkpointing=t.activation_checkpointing, min_unit_params=smallest,
                        ema=ema_enabled(cfg))
    return {
        "model": model_from,
        "preset": cfg.model.preset,
        "trainable": t.trainable,
        "ema": ema_enabled(cfg),
        "params_total": sim["params_total"],
        "params_trained": sim["params_trained"],
        "params_untrained": sim["params_total"] - sim["params_trained"],
        "params_bf16": sim["params_bf16"],
        "params_root_unit": sim["fsdp"]["params_root_unit"],
        "params_largest_unit": sim["fsdp"]["params_largest_unit"],
        "fsdp_units": sim["fsdp"]["units"],
        "fsdp_min_unit_params": smallest,
        "world_size": world,
        "micro_batch_size": t.micro_batch_size,
        "precision": t.precision,
        "activation_checkpointing": t.activation_checkpointing,
        "sequence": sim["sequence"],
        "peak_phase": sim["peak_phase"],
        "bytes": {k: int(v) for k, v in sim["bytes"].items()},
        "gib": {k: round(v / GIB, 3) for k, v in sim["bytes"].items()},
        "state_bytes": {k: int(v) for k, v in sim["state_bytes"].items()},
        "step_peak_bytes": int(sim["step_peak_bytes"]),
        "total_bytes": int(sim["bytes"]["total"]),
    }


def _dummy_inputs(config, micro_batch: int, device: str):
    """Inputs of `PI05Pytorch.forward` (images, masks, tokens, actions, noise, time), zeros."""
    res = config.image_resolution[0]
    n_cams = len([k for k in config.input_features if k.startswith("observation.images.")])
    with torch.device(device):
        images = [torch.zeros(micro_batch, 3, res, res) for _ in range(n_cams)]
        img_masks = [torch.ones(micro_batch, dtype=torch.bool) for _ in range(n_cams)]
        tokens = torch.zeros(micro_batch, config.tokenizer_max_length, dtype=torch.long)
        token_mask = torch.ones(micro_batch, config.tokenizer_max_length, dtype=torch.bool)
        actions = torch.zeros(micro_batch, config.chunk_size, config.max_action_dim)
        noise = torch.zeros_like(actions)
        time = torch.full((micro_batch,), 0.5)
    return images, img_masks, tokens, token_mask, actions, noise, time


def format_report(est: dict[str, Any]) -> str:
    lines = [
        f"model            {est['model']}",
        f"parameters       {est['params_total'] / 1e6:,.1f} M in the training model, "
        f"{est['params_trained'] / 1e6:,.1f} M receive gradients (train.trainable: {est.get('trainable', 'all')}; "
        f"{est['params_untrained'] / 1e6:,.1f} M are frozen or never reached by pi0.5's loss)",
        f"step             world size {est['world_size']} (FSDP2 full sharding, {est['fsdp_units']} units), "
        f"micro batch {est['micro_batch_size']}, {est['precision']}, activation checkpointing "
        f"{'per decoder layer' if est['activation_checkpointing'] else 'off'}; sequence "
        f"{est['sequence']['prefix_tokens']} prefix + {est['sequence']['suffix_tokens']} action tokens",
        f"per-device peak allocated memory (GiB), at its peak ({est['peak_phase']})",
    ]
    labels = {"params": "param shards (fp32, frozen bf16)" if est.get("params_bf16") else "parameter shards (fp32)",
              "optimizer": "AdamW moment shards (fp32)",
              "grads": "gradient shards (fp32)", "gathered": "FSDP unsharded copies + buffers",
              "activations": "activations + temporaries", "ema": "EMA of trained params (fp32)",
              "total": "total (peak allocated)"}
    for key, label in labels.items():
        if key not in est["gib"] or (key == "ema" and not est.get("ema")):  # ema: only with train.ema_decay
            continue
        lines.append(f"  {label:<32} {est['gib'][key]:>10.3f}")
    lines.append("A device shows more: caching-allocator reserve, HCCL/NCCL buffers, workspaces, "
                 "runtime context (docs/memory.md).")
    return "\n".join(lines)


def main(cfg: PisftConfig, as_json: bool = False, fits: bool | None = None,
         world_size: int | None = None) -> int:
    """`pisft estimate`: the configured step; and for pi0.5 (by default when model.preset is pi05,
    or with --fits) the largest micro batch of each mode on a 910B and an 80 GB GPU."""
    est = estimate_memory(cfg, world_size=world_size)
    show_fits = cfg.model.preset == FIT_PRESET if fits is None else fits
    table = largest_micro_batches(cfg, world_size=world_size) if show_fits else None
    if as_json:
        print(json.dumps(est | ({"largest_micro_batches": table} if table else {}), indent=2, sort_keys=True))
    else:
        print(format_report(est))
        if table:
            print(format_fits(table))
    return 0


def _subprocess_main(argv: list[str]) -> int:
    import argparse

    from pisft import config as config_mod

    parser = argparse.ArgumentParser(prog="python -m pisft.introspect.estimate",
                                     description="estimate_memory for a config given as JSON (internal)")
    parser.add_argument("--config-json", required=True, help="'-': the config as JSON on stdin")
    parser.add_argument("--world-sizes", required=True, help="comma-separated")
    args = parser.parse_args(argv)
    cfg = config_mod.from_dict(json.loads(sys.stdin.read()))
    worlds = [int(w) for w in args.world_sizes.split(",")]
    print(json.dumps([estimate_memory(cfg, world_size=w) for w in worlds]))
    return 0


if __name__ == "__main__":
    raise SystemExit(_subprocess_main(sys.argv[1:]))
