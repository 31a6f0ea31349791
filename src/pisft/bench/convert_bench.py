"""Benchmark of `convert_recap` against LeRobot's own conversion paths, same run, same input.

Input: a demo RECAP dataset at the real LIBERO size (256x256, two cameras, PNG in parquet,
LeRobot v2.1 layout, a few thousand frames), built once (not timed).

Timed, each on that input, each producing a LeRobot v3.0 dataset with quantile stats:
- `pisft`: our `convert_recap` (every frame decoded and checked, renamed pi0.5 keys, exact
  quantiles, split, report), on all cores, and again on one worker to show the scaling;
- `lerobot_v21_to_v30`: LeRobot's converter `lerobot.scripts.convert_dataset_v21_to_v30.convert_dataset`
  (repackages the parquet files and metadata; keeps the input names, stats without quantiles),
  followed by LeRobot's quantile pass (`augment_dataset_quantile_stats.compute_quantile_stats_for_dataset`,
  which decodes LeRobot's frame sample of every episode) — what LeRobot offers to get a v2.1
  RECAP dataset ready for pi0.5's quantile normalisation. It checks nothing and renames nothing;
- `lerobot_recorder`: LeRobot's documented way to port external data with new feature names
  (`LeRobotDataset.create` + `add_frame` + `save_episode` + `finalize`, image writer threads on
  all cores), on the first few episodes (its rate in frames/s is the figure).

Reported: seconds, frames/s, CPU seconds, cores used (CPU time / wall time) and frames per CPU
second (the work per frame, which other jobs on the machine do not change) for each, the ratios
ours/theirs on both, and a profile of our path (decode cost per image, parquet read, how much of
the wall time the decode of every frame accounts for).

`scaling`: our conversion of two inputs of the same kind (RLinf's complete RECAP output: data,
returns and advantages side files), the second with 4x the episodes, each in a fresh process:
frames/s and the process's peak resident memory (`VmHWM`), also measured right after the
imports, so the conversion's own share shows, and the resident memory over the run. Memory that
does not grow with the number of episodes is the claim checked here: frames stream through a bounded window of episodes.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pisft import device

REPO_ID = "pisft/bench_recap"


class _Clock:
    """Wall and CPU time (this process, all threads, plus finished children)."""

    def __enter__(self):
        self.wall0 = time.perf_counter()
        self.cpu0 = self._cpu()
        return self

    @staticmethod
    def _cpu() -> float:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall0
        self.cpu = self._cpu() - self.cpu0

    def figures(self, frames: int) -> dict:
        return {"seconds": round(self.wall, 3), "frames": frames, "frames_per_s": round(frames / self.wall, 1),
                "cpu_seconds": round(self.cpu, 3), "cores_used": round(self.cpu / self.wall, 2),
                # work per frame, independent of what else shares the machine
                "frames_per_cpu_s": round(frames / max(self.cpu, 1e-9), 1)}


def build_input(root: Path, episodes_per_task: int, length: int, image_size: int, labelled: bool = False) -> dict:
    """The demo data as RLinf's LeRobot writer leaves it; `labelled`: with RLinf's returns and
    advantages steps run on it too (its complete RECAP output, used by `scaling`). The comparison
    of converters uses the writer's output, the part every path reads the same way."""
    from pisft.data import demo

    root.mkdir(parents=True)
    with _Clock() as c:
        demo.build(root, episodes_per_task=episodes_per_task, length=length, image_size=image_size,
                   failure_fraction=0.2, seed=0, dataset_name=root.name, labelled=labelled)
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    frames = 10 * episodes_per_task * length
    return {"layout": "LeRobot v2.1, PNG in parquet, RECAP names (RLinf's writer)"
                      + (", RLinf's returns and advantages side files" if labelled else ""),
            "episodes": 10 * episodes_per_task,
            "frames": frames, "image_size": image_size, "cameras": 2, "bytes": size,
            "png_bytes_per_image": round(size / (2 * frames)), "build_seconds": round(c.wall, 1)}


def bench_pisft(src: Path, out: Path, workers: int) -> dict:
    from pisft.data.convert import Options, convert_recap

    with _Clock() as c:
        rep = convert_recap(src, out, Options(workers=workers))
    t = rep["_timing"]
    return {**c.figures(rep["out"]["frames"]), "workers": workers,
            "metadata_pass_seconds": round(t["metadata_s"], 3), "frames_pass_seconds": round(t["frames_s"], 3)}


def bench_lerobot_v21_to_v30(src: Path, scratch: Path) -> dict:
    from lerobot.datasets.io_utils import write_stats
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from lerobot.scripts.augment_dataset_quantile_stats import compute_quantile_stats_for_dataset
    from lerobot.scripts.convert_dataset_v21_to_v30 import convert_dataset

    root = scratch / "bench_recap"
    shutil.copytree(src, root)  # the converter works in place; the copy is not timed
    (root / "pisft_config.json").unlink(missing_ok=True)
    with _Clock() as total:
        with _Clock() as conv:
            convert_dataset(repo_id=REPO_ID, root=root, push_to_hub=False)
        with _Clock() as quant:
            ds = LeRobotDataset(repo_id=REPO_ID, root=root, video_backend="pyav")
            stats = compute_quantile_stats_for_dataset(ds)
            write_stats(stats, root)
    frames = ds.meta.total_frames
    return {**total.figures(frames), "convert_seconds": round(conv.wall, 3),
            "convert_frames_per_s": round(frames / conv.wall, 1), "quantile_stats_seconds": round(quant.wall, 3),
            "has_q01": "q01" in stats.get("actions", {})}


def bench_lerobot_recorder(src: Path, out: Path, episodes: int) -> dict:
    """LeRobotDataset.create/add_frame/save_episode on the first `episodes` episodes (it is slow;
    its rate per frame is steady, so a few episodes give the figure)."""
    import io

    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from PIL import Image

    from pisft.data.convert_frames import output_features
    from pisft.data.libero import OUTPUT_NAMES
    from pisft.data.recap_reader import RecapSource

    source = RecapSource.open(src)
    chosen = source.episodes[:episodes]
    features = output_features(source.image_shape("image"))
    threads = 2 * device.usable_cores()
    frames = 0
    with _Clock() as c:
        ds = LeRobotDataset.create(repo_id=REPO_ID, fps=source.fps, features=features, root=out,
                                   use_videos=False, image_writer_threads=threads)
        for ep in chosen:
            table = pq.read_table(ep.data_file)
            cols = table.to_pydict()
            for i in range(table.num_rows):
                frame = {
                    OUTPUT_NAMES["image"]: np.asarray(Image.open(io.BytesIO(cols["image"][i]["bytes"])).convert("RGB")),
                    OUTPUT_NAMES["wrist_image"]: np.asarray(
                        Image.open(io.BytesIO(cols["wrist_image"][i]["bytes"])).convert("RGB")),
                    OUTPUT_NAMES["state"]: np.asarray(cols["state"][i], dtype=np.float32),
                    OUTPUT_NAMES["actions"]: np.asarray(cols["actions"][i], dtype=np.float32),
                    "task": source.tasks[cols["task_index"][i]],
                }
                ds.add_frame(frame)
            ds.save_episode()
            frames += table.num_rows
        ds.finalize()
    return {**c.figures(frames), "episodes": len(chosen), "image_writer_threads": threads}


_CHILD = """
import json, resource, sys, threading, time
from pisft.data.convert import Options, convert_recap
def status_mb(key):
    # VmHWM: this process image's peak resident set (ru_maxrss would carry the parent's peak
    # across fork and exec); VmRSS: the resident set now
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
def peak_mb():
    return status_mb("VmHWM")
def rss_mb():
    return status_mb("VmRSS")
samples, done = [], threading.Event()
def sample():
    while not done.is_set():
        samples.append((time.perf_counter(), rss_mb()))
        done.wait(0.05)
base = peak_mb()
t0 = time.perf_counter()
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
rep = convert_recap(sys.argv[1], sys.argv[2], Options(workers=int(sys.argv[3]), advantage_tag=sys.argv[4]))
wall = time.perf_counter() - t0
done.set()
sampler.join()
quarters = [max((r for t, r in samples if q * wall / 4 <= t - t0 < (q + 1) * wall / 4), default=None)
            for q in range(4)]
print(json.dumps({"frames": rep["out"]["frames"], "episodes": rep["out"]["episodes"], "seconds": round(wall, 3),
                  "frames_per_s": round(rep["out"]["frames"] / wall, 1), "rss_after_imports_mb": round(base, 1),
                  "peak_rss_mb": round(peak_mb(), 1),
                  "rss_max_by_quarter_of_run_mb": [None if r is None else round(r, 1) for r in quarters]}))
"""


def convert_in_child(src: Path, out: Path, workers: int, advantage_tag: str = "") -> dict:
    """`convert_recap` in a fresh Python process: its figures and peak resident memory."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(out), str(workers), advantage_tag],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_recap in a child process failed:\n{proc.stderr[-3000:]}")
    out_figures = json.loads(proc.stdout.strip().splitlines()[-1])
    out_figures["conversion_rss_mb"] = round(out_figures["peak_rss_mb"] - out_figures["rss_after_imports_mb"], 1)
    return out_figures


def scaling(work: Path, *, episodes_per_task: tuple[int, int] = (1, 4), length: int = 100,
            image_size: int = 256, workers: int = 0) -> dict:
    """Frames/s and peak memory of the conversion at two dataset sizes (the second 4x the first)."""
    small, large = episodes_per_task
    if large < 4 * small:
        raise ValueError("the larger input must have at least 4x the episodes of the smaller")
    workers = workers or device.usable_cores()
    out: dict = {"workers": workers, "advantage_tag": "demo"}
    for name, per_task in (("small", small), ("large", large)):
        src = work / f"scale_{name}"
        out[name] = {"input": build_input(src, per_task, length, image_size, labelled=True),
                     **convert_in_child(src, work / f"scale_{name}_out", workers, "demo")}
        shutil.rmtree(work / f"scale_{name}_out", ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)
    s, big = out["small"], out["large"]
    out["episodes_ratio"] = round(big["episodes"] / s["episodes"], 2)
    out["peak_rss_ratio"] = round(big["peak_rss_mb"] / s["peak_rss_mb"], 3)
    extra_frames = big["frames"] - s["frames"]
    out["peak_rss_growth_mb_per_1000_frames"] = round(
        1000 * (big["peak_rss_mb"] - s["peak_rss_mb"]) / max(extra_frames, 1), 2)
    out["frames_per_s_ratio"] = round(big["frames_per_s"] / s["frames_per_s"], 2)
    # within the larger run: resident memory in its last quarter vs its second (a leak per
    # episode would show as a climb; a bounded window of episodes in flight as a plateau)
    quarters = big["rss_max_by_quarter_of_run_mb"]
    if quarters[1] is not None and quarters[3] is not None:
        out["large_rss_last_vs_second_quarter_mb"] = round(quarters[3] - quarters[1], 1)
    return out


def profile_decode(src: Path, samples: int = 200) -> dict:
    """Single-thread cost of the parts of our per-frame work."""
    from pisft.data import images as imgs

    files = sorted((src / "data").glob("*/*.parquet"))
    with _Clock() as read:
        tables = [pq.read_table(f, columns=["image", "wrist_image"]) for f in files]
    n_images = sum(2 * t.num_rows for t in tables)
    blobs = [x["bytes"] for x in tables[0].column("image").to_pylist()]
    blobs = (blobs * (samples // max(len(blobs), 1) + 1))[:samples]
    with _Clock() as dec:
        decoded = [imgs.decode_png(b) for b in blobs]
    with _Clock() as enc:
        for img in decoded[:50]:
            imgs.encode_png(img)
    return {"read_image_columns_seconds": round(read.wall, 3), "images": n_images,
            "decode_ms_per_image": round(1000 * dec.wall / len(blobs), 3),
            "png_encode_ms_per_image": round(1000 * enc.wall / 50, 3),
            "decode_all_images_one_core_seconds": round(n_images * dec.wall / len(blobs), 2)}


def run(workdir: str | Path, *, episodes_per_task: int = 2, length: int = 100, image_size: int = 256,
        recorder_episodes: int = 3, scale_episodes_per_task: tuple[int, int] = (1, 4)) -> dict:
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = work / "recap_v21"
    out: dict = {"input": build_input(src, episodes_per_task, length, image_size), "cpus": device.usable_cores()}
    out["pisft"] = bench_pisft(src, work / "pisft_out", workers=0)
    out["pisft"]["workers"] = device.usable_cores()
    out["pisft_1_worker"] = bench_pisft(src, work / "pisft_out_1", workers=1)
    out["lerobot_v21_to_v30"] = bench_lerobot_v21_to_v30(src, work / "lerobot")
    out["lerobot_recorder"] = bench_lerobot_recorder(src, work / "lerobot_recorder", recorder_episodes)
    out["profile"] = profile_decode(src)
    ours = out["pisft"]["frames_per_s"]
    out["ratio_pisft_vs_lerobot_v21_to_v30"] = round(ours / out["lerobot_v21_to_v30"]["frames_per_s"], 2)
    out["ratio_pisft_vs_lerobot_recorder"] = round(ours / out["lerobot_recorder"]["frames_per_s"], 2)
    per_cpu = out["pisft"]["frames_per_cpu_s"]
    out["cpu_ratio_pisft_vs_lerobot_v21_to_v30"] = round(per_cpu / out["lerobot_v21_to_v30"]["frames_per_cpu_s"], 2)
    out["cpu_ratio_pisft_vs_lerobot_recorder"] = round(per_cpu / out["lerobot_recorder"]["frames_per_cpu_s"], 2)
    # LeRobot's bare repackaging step alone (no frame decoded, no check, no rename, no quantiles)
    out["ratio_pisft_vs_lerobot_v21_to_v30_repackaging_only"] = round(
        ours / out["lerobot_v21_to_v30"]["convert_frames_per_s"], 2)
    out["pisft_scaling_all_vs_1_worker"] = round(ours / out["pisft_1_worker"]["frames_per_s"], 2)
    prof = out["profile"]
    out["pisft_decode_share_of_one_worker_wall"] = round(
        prof["decode_all_images_one_core_seconds"] / out["pisft_1_worker"]["seconds"], 2)
    out["scaling"] = scaling(work, episodes_per_task=scale_episodes_per_task, length=length,
                             image_size=image_size)
    return out


if __name__ == "__main__":  # pragma: no cover - manual use: python -m pisft.bench.convert_bench DIR
    import json
    import sys

    print(json.dumps(run(sys.argv[1] if len(sys.argv) > 1 else "/tmp/pisft-convert-bench"), indent=2))
