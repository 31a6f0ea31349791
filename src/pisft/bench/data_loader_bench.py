"""The training data loader's capacity on one core, at LIBERO's real image size (issue 23).

`python -m pisft bench --only data_loader`. What a data-loader worker does for training, in one
process on one thread, timed by the process's CPU clock: the loader training builds
(`train.batches.make_loader` over `data.dataset.load_split`, with the policy task's per-sample
draws, the training prompt and `PolicyTask.collate` as collate_fn; `num_workers=0`, so the
work runs here rather than in a worker process), i.e. per micro-batch:

- read: LeRobot's `LeRobotDataset` row (parquet through Hugging Face datasets) and its PNG
  decode of both cameras to float CHW in [0, 1] (`pil_to_chw_tensor`), the action chunk
  (`ActionChunks`), the flow-matching draws;
- preprocess: `default_collate`, then LeRobot's pi0.5 preprocessor up to its device step
  (quantile normalisation of state and action, the prompt with the discretised state,
  tokenization padded to `tokenizer_max_length`).
- augment (`augment`): with `data.augment: openpi` the same micro-batches cost this much more,
  timed side by side with the plain loader (`augment_cost`).

The resize to the model's input (256 -> 224, with padding) is not the loader's: LeRobot's
`PI05Policy._preprocess_images` does it inside the forward, on the device. Its host cost is
measured on its own (`host_resize`) for a loader that would do it.

Input: demo episodes at 256x256 with two cameras (`data.demo.build`), converted by
`data.convert.convert_recap` into a LeRobot v3.0 dataset (not timed). The model side is pi0.5's
real configuration (`pi05` preset: chunk 50, 224 px, 200 prompt tokens) built on the meta
device (no weights): the loader needs its config and the processors, not its weights. The
tokenizer is the tiny preset's WordPiece (the PaliGemma tokenizer is not on this host); both
are Rust fast tokenizers and a prompt's encoding is a small part of a sample's cost (`split`).

Beside it: the training step's consumption at real size, samples/s per card, from the
analytic FLOPs per sample (`model.pi05.flops`, what the loop's MFU uses) at the tokens the loader
produces, the card's peak from `train.metrics.PEAK_FLOPS_TABLE` and a stated MFU.
"""

from __future__ import annotations

import io
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pisft import config as config_mod
from pisft.device import intra_op_threads
from pisft.errors import PisftError
from pisft.train.policy_task import TOKENS_KEY

GOAL_SAMPLES_PER_CORE_S = 20.0  # issue 23: a few cores per card must feed the card
GOAL_SAMPLES_PER_CARD_S = 13.0  # issue 23: the training goal per 910B card
MFU_ASSUMED = 0.40  # for the consumption estimate; the figure at the goal rate is reported too
CARD = "910B"  # the peak table's row for a 910B of unknown variant (the 910B3 figure)
OTHER_CARDS = {"910B4": "npu", "910B2": "npu", "H100 SXM": "cuda"}  # name in the peak table: kind


def build_dataset(work: Path, *, episodes_per_task: int, length: int, image_size: int) -> tuple[Path, dict]:
    """Demo RECAP episodes at `image_size` (two cameras) converted into a LeRobot v3.0 dataset."""
    from pisft.data import demo
    from pisft.data.convert import Options, convert_recap

    src, out = work / "recap_in", work / "dataset"
    src.mkdir(parents=True)
    t0 = time.perf_counter()
    demo.build(src, episodes_per_task=episodes_per_task, length=length, image_size=image_size,
               failure_fraction=0.2, seed=0, dataset_name=src.name)
    report = convert_recap(src, out, Options(workers=0))
    return out, {"layout": "LeRobot v3.0, PNG images in parquet (data.convert.convert_recap of "
                           "data.demo episodes)",
                 "episodes": report["out"]["episodes"], "frames": report["out"]["frames"],
                 "image_size": image_size, "cameras": 2,
                 "build_and_convert_s": round(time.perf_counter() - t0, 1)}


class _Loader:
    """The loader training builds (train.run), over the model config of `preset`."""

    def __init__(self, dataset: Path, preset: str, micro: int, seed: int) -> None:
        from pisft.data.dataset import load_split, load_stats
        from pisft.data.prompts import training_prompt_fn
        # pi0.5's folder by design: this bench measures pi0.5's processors on pi0.5's loader
        from pisft.model.pi05.processors import pi05_processors
        from pisft.model.policy import build_policy
        from pisft.model.tokenizer import build_tiny_tokenizer
        from pisft.train.policy_task import PolicyTask
        from pisft.train.sampler import StepLayout, StepSampler

        self.policy = build_policy(preset, seed=0, device="meta")  # config and sizes, no weights
        config = self.policy.config
        config.device = "cpu"  # the processors' device step; the loader never runs it
        pre, _ = pi05_processors(config, load_stats(dataset), build_tiny_tokenizer())
        self.task = PolicyTask(self.policy, pre, torch.device("cpu"))
        self.train_set = load_split(dataset, "train", chunk_size=config.chunk_size)
        self.prompt = training_prompt_fn(dataset)
        self.micro, self.seed = micro, seed
        self.sampler = StepSampler(len(self.train_set), seed, StepLayout(micro, micro, 1))
        self.config = config

    def loader(self, start: int, end: int, augment: str = "none"):
        from pisft.data.augment import make_augment
        from pisft.train.batches import make_loader

        return make_loader(self.train_set, self.sampler, rank=0, start_step=start, end_step=end,
                           seed=self.seed, draw=self.task.draw, num_workers=0, prompt=self.prompt,
                           collate=self.task.collate, pin_memory=False,
                           augment=make_augment(augment, self.config.image_features))

    def dataset(self):
        from pisft.train.batches import StepDataset

        return StepDataset(self.train_set, self.seed, self.task.draw, self.prompt)


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def time_loader(ld: _Loader, warmup: int, batches: int, rounds: int) -> dict[str, Any]:
    """`rounds` passes of `batches` micro-batches through the DataLoader after `warmup`."""
    for _ in ld.loader(0, warmup):
        pass
    per_round = []
    start = warmup
    for _ in range(rounds):
        w0, c0 = _clocks()
        n = 0
        for batch in ld.loader(start, start + batches):
            n += int(batch[TOKENS_KEY].shape[0])
        w1, c1 = _clocks()
        per_round.append({"samples": n, "wall_s": w1 - w0, "cpu_s": c1 - c0})
        start += batches
    return {"rounds": per_round, "last_batch": batch}


def augment_cost(ld: _Loader, start: int, batches: int, rounds: int, kind: str = "openpi") -> dict[str, Any]:
    """CPU ms per sample of the loader without and with `data.augment: kind`, side by side: each
    round times the same micro-batches (the same samples and draws) plain, then augmented."""
    cpu = {"none": 0.0, kind: 0.0}
    n = 0
    for r in range(rounds):
        lo = start + r * batches
        for k in cpu:
            c0 = time.process_time()
            m = sum(int(b[TOKENS_KEY].shape[0]) for b in ld.loader(lo, lo + batches, augment=k))
            cpu[k] += time.process_time() - c0
        n += m
    without, with_ = 1e3 * cpu["none"] / n, 1e3 * cpu[kind] / n
    return {"kind": kind, "samples": n, "rounds": rounds,
            "ms_per_sample_without": round(without, 3), "ms_per_sample_with": round(with_, 3),
            "cost_ms_per_sample": round(with_ - without, 3),
            "cameras_cropped_and_rotated": sum("wrist" not in k for k in ld.config.image_features),
            "how": "the same micro-batches through the training loader, plain then augmented, "
                   "alternating per round; CPU time of this process (one torch thread)"}


def split_parts(ld: _Loader, start: int, batches: int) -> dict[str, float]:
    """CPU ms per sample of reading (row + decode + chunk + draws) and of preparing (collate +
    LeRobot's preprocessing), the same work as the DataLoader's, timed apart."""
    ds = ld.dataset()
    read = prep = 0.0
    n = 0
    for step in range(start, start + batches):
        refs = ld.sampler.micro_batch(step, 0, 0)
        c0 = time.process_time()
        items = [ds[r] for r in refs]
        c1 = time.process_time()
        ld.task.collate(items)
        c2 = time.process_time()
        read += c1 - c0
        prep += c2 - c1
        n += len(refs)
    return {"read_ms_per_sample": 1e3 * read / n, "preprocess_ms_per_sample": 1e3 * prep / n,
            "samples": n}


def decode_cost(dataset: Path, images: int) -> dict[str, float]:
    """CPU ms per image of the decode LeRobot's reader does (PIL PNG decode, then its
    `pil_to_chw_tensor`), on PNGs of the dataset."""
    import pyarrow.parquet as pq
    from lerobot.datasets.io_utils import pil_to_chw_tensor
    from PIL import Image

    from pisft.model.policy import IMAGE_KEYS

    files = sorted((dataset / "data").rglob("*.parquet"))
    if not files:
        raise PisftError(f"{dataset}/data: no parquet files; the conversion wrote no frames")
    table = pq.read_table(files[0], columns=list(IMAGE_KEYS))
    blobs = [cell["bytes"] for key in IMAGE_KEYS for cell in table.column(key).to_pylist()]
    blobs = (blobs * (images // len(blobs) + 1))[:images]
    for b in blobs[:4]:
        pil_to_chw_tensor(Image.open(io.BytesIO(b)))
    c0 = time.process_time()
    for b in blobs:
        pil_to_chw_tensor(Image.open(io.BytesIO(b)))
    cpu = time.process_time() - c0
    return {"decode_ms_per_image": 1e3 * cpu / len(blobs), "images": len(blobs),
            "png_bytes_per_image": round(sum(map(len, blobs)) / len(blobs))}


def host_resize_cost(batch: dict[str, Any], resolution: tuple[int, int], repeats: int) -> dict[str, Any]:
    """CPU ms per sample of LeRobot's pi0.5 image resize (`resize_with_pad_torch`, what its
    forward runs on the device) done on the host instead, both cameras."""
    # pi0.5's folder by design: the cost of LeRobot's pi0.5 resize, measured on the host
    from pisft.model.pi05.processors import resize_with_pad_torch
    from pisft.model.policy import IMAGE_KEYS

    imgs = [batch[k].permute(0, 2, 3, 1).contiguous() for k in IMAGE_KEYS]  # as _preprocess_images
    if tuple(imgs[0].shape[1:3]) == tuple(resolution):
        return {"needed": False, "ms_per_sample": 0.0}
    resize_with_pad_torch(imgs[0], *resolution)
    c0 = time.process_time()
    for _ in range(repeats):
        for img in imgs:
            resize_with_pad_torch(img, *resolution)
    cpu = time.process_time() - c0
    return {"needed": True, "ms_per_sample": 1e3 * cpu / (repeats * imgs[0].shape[0])}


def consumption(ld: _Loader, batch: dict[str, Any], cfg: config_mod.PisftConfig) -> dict[str, Any]:
    """Samples/s one card consumes at the stated MFU, from the training FLOPs per sample."""
    from pisft.train import metrics

    flops = ld.task.flops_per_sample(batch)
    if not flops:
        raise PisftError("the prepared batch has no prompt tokens: LeRobot's pi0.5 preprocessor "
                         "changed underneath?")
    override = cfg.train.peak_flops
    peak, source = metrics.peak_flops_for(CARD, "npu", override)
    assert peak is not None
    rate = peak * MFU_ASSUMED / flops
    others = {}
    for name, kind in OTHER_CARDS.items():
        p, _ = metrics.peak_flops_for(name, kind)
        if p:
            others[name] = round(p * MFU_ASSUMED / flops, 2)
    return {
        "samples_per_card_s": round(rate, 2),
        "card": CARD, "peak_flops": peak, "peak_flops_source": source, "mfu_assumed": MFU_ASSUMED,
        "training_flops_per_sample": flops,
        "mfu_at_goal_rate": float(f"{GOAL_SAMPLES_PER_CARD_S * flops / peak:.3g}"),
        "samples_per_card_s_other_cards": others,
        "assumptions": [
            f"consumption = peak FLOP/s x MFU / training FLOPs per sample; MFU {MFU_ASSUMED} assumed "
            "(not measured on a 910B)",
            f"peak: {source} ({peak / 1e12:.0f} TFLOP/s dense bf16)",
            "training FLOPs per sample: pisft.model.pi05.flops (model FLOPs, each part's backward as its "
            "requires_grad leaves it to do, recompute not counted) of the "
            f"{ld.policy.pisft_model_info['preset']} preset at "
            f"{int(batch[TOKENS_KEY].shape[1])} prompt tokens (the loader's "
            f"padding), chunk {ld.config.chunk_size}, "
            f"{len(ld.config.image_features)} images at {ld.config.image_resolution[0]} px",
        ],
    }


def run(cfg: config_mod.PisftConfig, work: Path, *, episodes_per_task: int = 1, length: int = 40,
        image_size: int = 256, preset: str = "pi05", micro_batch: int | None = None,
        warmup_batches: int = 8, timed_batches: int = 100, rounds: int = 3,
        split_batches: int = 60, decode_images: int = 200, augment_batches: int = 30) -> dict[str, Any]:
    if min(warmup_batches, timed_batches, rounds, split_batches, decode_images, augment_batches) < 1:
        raise ValueError("warmup_batches, timed_batches, rounds, split_batches, decode_images and "
                         "augment_batches must be at least 1")
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the tokenizer on this thread only
    micro = micro_batch or cfg.train.micro_batch_size
    dataset, data_info = build_dataset(work, episodes_per_task=episodes_per_task, length=length,
                                       image_size=image_size)
    with intra_op_threads(1):
        ld = _Loader(dataset, preset, micro, cfg.train.seed)
        timed = time_loader(ld, warmup_batches, timed_batches, rounds)
        split = split_parts(ld, warmup_batches + rounds * timed_batches, split_batches)
        augment = augment_cost(ld, warmup_batches, augment_batches, rounds)  # already-read steps
        decode = decode_cost(dataset, decode_images)
        resize = host_resize_cost(timed["last_batch"], tuple(ld.config.image_resolution), repeats=5)
        est = consumption(ld, timed["last_batch"], cfg)  # at the tokens the loader produced
    rs = timed["rounds"]
    samples = sum(r["samples"] for r in rs)
    cpu_s = sum(r["cpu_s"] for r in rs)
    wall_s = sum(r["wall_s"] for r in rs)
    rate = samples / cpu_s
    ms = 1e3 / rate
    decode_ms = 2 * decode["decode_ms_per_image"]
    read_ms, prep_ms = split["read_ms_per_sample"], split["preprocess_ms_per_sample"]
    return {
        "what": "samples per CPU second of the training data loader on one core (one process, "
                "torch threads 1, num_workers 0): LeRobot's row read + PNG decode of both cameras, "
                "action chunk, draws, collate, LeRobot's pi0.5 preprocessing up to its device step",
        "samples_per_core_s": round(rate, 1),
        "ms_per_sample": round(ms, 2),
        "samples_timed": samples,
        "cpu_s": round(cpu_s, 6),
        "wall_s": round(wall_s, 6),
        "samples_per_wall_s": round(samples / wall_s, 1),
        "cores_used": round(cpu_s / wall_s, 2),
        "samples_per_core_s_by_round": [round(r["samples"] / r["cpu_s"], 1) for r in rs],
        "samples_per_core_s_median_round": round(statistics.median(r["samples"] / r["cpu_s"] for r in rs), 1),
        "rounds": rounds, "warmup_batches": warmup_batches, "micro_batch_size": micro,
        "image_size": image_size,
        "cameras": 2,
        "model_input_resolution": list(ld.config.image_resolution),
        "resize": "in the policy's forward on the device (LeRobot PI05Policy._preprocess_images, "
                  "resize_with_pad_torch), not in the loader; host_resize: its cost if a loader did it",
        "preset": preset, "chunk_size": ld.config.chunk_size,
        "prompt_tokens": int(timed["last_batch"][TOKENS_KEY].shape[1]),
        "tokenizer": "tiny preset's WordPiece (fast tokenizer); the PaliGemma tokenizer is not on this host",
        "dataset": data_info,
        "split_ms_per_sample": {
            "read_and_decode": round(read_ms, 3),
            "of_which_png_decode": round(decode_ms, 3),
            "of_which_row_read_chunk_draws": round(max(read_ms - decode_ms, 0.0), 3),
            "collate_and_preprocess": round(prep_ms, 3),
            "samples": split["samples"],
            "how": "the same work as the DataLoader's, timed apart; PNG decode measured on its own "
                   "(2 images per sample) and subtracted from the read",
        },
        "decode": {k: round(v, 3) if isinstance(v, float) else v for k, v in decode.items()},
        "augment": augment,
        "host_resize": {"to": list(ld.config.image_resolution), "needed": resize["needed"],
                        "ms_per_sample": round(resize["ms_per_sample"], 3),
                        "samples_per_core_s_if_loader_resized": round(1e3 / (ms + resize["ms_per_sample"]), 1)},
        "goal_samples_per_core_s": GOAL_SAMPLES_PER_CORE_S,
        "goal_samples_per_card_s": GOAL_SAMPLES_PER_CARD_S,
        "meets_goal": rate >= GOAL_SAMPLES_PER_CORE_S,
        "training_consumption_estimate": est,
        "cores_per_card_at_estimate": round(est["samples_per_card_s"] / rate, 2),
        "cores_per_card_at_goal": round(GOAL_SAMPLES_PER_CARD_S / rate, 2),
        "cpu": _cpu_name(),
        "load_avg": _load_avg(),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
