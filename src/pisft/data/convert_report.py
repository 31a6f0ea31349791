"""A conversion's report (`conversion_report.json`): the sources, the episodes kept and dropped
and why, the split's outcomes, each source's share of the samples, the advantage labels."""

from __future__ import annotations

from collections import Counter

from pisft.data.convert_select import Kept, episode_task, label_counts
from pisft.data.prompts import PromptConditioning
from pisft.data.recap_reader import RecapSource
from pisft.data.source_weights import SourceSampling


def _source_info(src: RecapSource) -> dict:
    return {"path": str(src.root), "codebase_version": src.version, "naming": src.naming,
            "columns": {k: src.names[k] for k in ("image", "wrist_image", "state", "actions")},
            "success_column": src.names.get("is_success"),
            "side_features": {k: p.name for k, p in sorted(src.side_features.items())},
            "image_storage": "video" if src.has_video else "png_in_parquet", "fps": src.fps,
            "image_shape": list(src.image_shape("image"))}


def _sampling_report(opened, kept: list[Kept], split: dict, sampling: SourceSampling) -> dict:
    """Each source's frames and expected share of the samples, in the train split (the SFT run,
    the value model) and in every episode (the policy at a RECAP iteration)."""
    from pisft.data import source_weights

    n = len(opened)
    frames = {name: [0] * n for name in ("train", "all")}
    train = set(split["train"])
    for i, k in enumerate(kept):
        frames["all"][k.source] += len(k.cols["frame_index"])
        if i in train:
            frames["train"][k.source] += len(k.cols["frame_index"])
    return source_weights.report(sampling, frames)


def conversion_report(opened, opts, kept, dropped, split, frames_in, tasks_out, out_shape, sampling) -> dict:
    in_split = {i: name for name, ids in split.items() for i in ids}
    types = [source.type for source, *_ in opened]
    episodes = []
    for i, k in enumerate(kept):
        src = k.src
        success = "is_success" in src.names
        episodes.append({
            "episode_index": i, "source_episode_index": k.ref.episode_index, "task_index": k.task_index,
            "task": src.tasks[k.task_index], "frames": len(k.cols["frame_index"]),
            "success": bool(k.cols["is_success"].any()) if success else None, "split": in_split[i],
            "source": k.source, "source_type": types[k.source],
        })
    source_tasks = sorted({(n, episode_task(c)) for n, (_, _, lowdim, _, _) in enumerate(opened)
                           for c in lowdim.values()})

    def outcomes(eps: list[dict]) -> dict:
        return {"episodes": len(eps), "successes": sum(e["success"] is True for e in eps),
                "failures": sum(e["success"] is False for e in eps),
                "unknown": sum(e["success"] is None for e in eps)}

    sampled = _sampling_report(opened, kept, split, sampling)
    sources = []
    for n, (source, src, lowdim, _, _) in enumerate(opened):
        mine = [e for e in episodes if e["source"] == n]
        sources.append({**_source_info(src), "type": source.type, "episodes_in": len(lowdim),
                        "frames_in": int(sum(len(c["frame_index"]) for c in lowdim.values())),
                        "frames": int(sum(e["frames"] for e in mine)), **outcomes(mine),
                        "dropped": sum(d["source"] == n for d in dropped),
                        # its weight, training frames and expected share of the samples (`sampling`)
                        "weight": source.weight, "frames_train": sampled["frames"]["train"][n],
                        "share_train": _share(sampled, "train", n), "share_all": _share(sampled, "all", n)})
    cond = opts.conditioning if opts.data.advantage_tag else PromptConditioning()
    return {
        "source": _source_info(opened[0][1]),  # the first source (the only one unless a pool)
        "sources": sources,
        "sampling": sampled,
        "options": opts.recorded(),
        "prompts": cond.to_dict(),
        "stats_from": "train",
        # held-out successes and failures: with data.success_only false, failed rollouts are held
        # out too and evaluated like demonstrations
        "outcomes": {name: outcomes([e for e in episodes if e["split"] == name]) for name in ("train", "eval")},
        "in": {"episodes": sum(len(lowdim) for _, _, lowdim, _, _ in opened), "frames": int(frames_in),
               "tasks": len(source_tasks)},
        "out": {"episodes": len(kept), "frames": int(sum(e["frames"] for e in episodes)),
                "tasks": len({e["task"] for e in episodes}), "prompts": len(tasks_out),
                "image_shape": list(out_shape), "train_episodes": len(split["train"]),
                "eval_episodes": len(split["eval"])},
        "dropped": dropped,
        "dropped_by_reason": dict(sorted(Counter(d["reason"] for d in dropped).items())),
        # positive and negative frames, overall and per task (data.advantage_tag; None without labels)
        "advantage_labels": label_counts(kept) if opts.data.advantage_tag else None,
        "episodes": episodes,
    }


def _share(sampled: dict, split: str, n: int) -> float | None:
    share = sampled["share"][split]
    return None if share is None else share[n]
