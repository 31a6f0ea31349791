"""Pass 1 of a conversion over one source (`open_source`): every episode's non-image columns
read and checked, the filters (`data.success_only`, `data.tasks`) deciding what is kept and why
the rest is dropped, the advantage labels matched to the frames; and the refusals of a pool that
leaves nothing to learn (a data.tasks entry no source holds, labels without a positive frame)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pisft.config import DataSource
from pisft.data.convert_options import Options
from pisft.data.convert_side_files import advantages_path, check_returns_files, load_advantages
from pisft.data.libero import SUCCESS_COLUMNS
from pisft.data.recap_reader import EpisodeRef, RecapSource
from pisft.data.validate import check_episode
from pisft.errors import DataError
from pisft.stages import CONVERT_RECAP


@dataclass
class Kept:
    ref: EpisodeRef
    cols: dict[str, np.ndarray]
    task_index: int
    prompts: list[str]
    src: RecapSource | None = None  # the source it comes from (set by convert_recap)
    source: int = 0  # its position in the pool
    labels: np.ndarray | None = None  # the advantage label per frame (data.advantage_tag), else None


def _resolve_tasks(src: RecapSource, wanted: list[str]) -> tuple[set[int] | None, list[str]]:
    """data.tasks entries (task index or instruction text) -> this source's task indices, and
    the entries it does not hold. The filter is the pool's: an entry need only name a task of
    one source (a RECAP iteration's rollouts hold recap.task_ids alone), see `refuse_unknown_tasks`."""
    if not wanted:
        return None, []
    by_text = {t.strip().lower(): i for i, t in src.tasks.items()}
    chosen: set[int] = set()
    unknown: list[str] = []
    for entry in wanted:
        text = str(entry).strip()
        if text.lstrip("-").isdigit() and int(text) in src.tasks:
            chosen.add(int(text))
        elif text.lower() in by_text:
            chosen.add(by_text[text.lower()])
        else:
            unknown.append(entry)
    return chosen, unknown


def refuse_unknown_tasks(srcs: list[RecapSource], unknown: list[list[str]], wanted: list[str]) -> None:
    """A data.tasks entry that names a task of no source of the pool is a typo, not a filter."""
    nowhere = [e for e in wanted if all(e in u for u in unknown)]
    if not nowhere:
        return
    def known(src: RecapSource) -> str:
        return "; ".join(f"{i}: {t}" for i, t in sorted(src.tasks.items()))
    if len(srcs) == 1:
        raise DataError(f"data.tasks: '{nowhere[0]}' is neither a task_index nor an instruction in "
                        f"{srcs[0].where(srcs[0].tasks_path)}; known tasks: {known(srcs[0])}")
    per_source = " | ".join(f"{src.where(src.tasks_path)}: {known(src)}" for src in srcs)
    raise DataError(f"data.tasks: '{nowhere[0]}' is neither a task_index nor an instruction in any of the "
                    f"{len(srcs)} sources of the pool; known tasks per source: {per_source}")


def episode_task(cols: dict[str, np.ndarray]) -> int:
    return int(cols["task_index"][0])


def _select(src: RecapSource, lowdim: dict[int, dict[str, np.ndarray]], opts: Options
            ) -> tuple[list[Kept], list[dict]]:
    wanted_tasks, unknown = _resolve_tasks(src, opts.data.tasks)
    if opts.data.success_only and "is_success" not in src.names:
        names = " nor ".join(f"'{c}'" for c in SUCCESS_COLUMNS)
        raise DataError(f"{src.where(src.info_path)}: data.success_only is set but the dataset records no "
                        f"per-frame success: neither {names} is among its features "
                        f"(RECAP/RLinf write 'is_success', LeRobot's lerobot-eval 'next.success'). Unset "
                        "data.success_only to keep every episode, or add a success column to the dataset")
    advantages = load_advantages(src, opts.data.advantage_tag, lowdim) if opts.data.advantage_tag else None
    kept: list[Kept] = []
    dropped: list[dict] = []
    for ref in src.episodes:
        cols = lowdim[ref.episode_index]
        task = episode_task(cols)
        reason = None
        if wanted_tasks is not None and task not in wanted_tasks:
            reason = "task_not_selected"
        elif opts.data.success_only and not bool(cols["is_success"].any()):
            reason = "not_successful"
        if reason:
            dropped.append({"source_episode_index": ref.episode_index, "task_index": task,
                            "task": src.tasks[task], "frames": len(cols["frame_index"]), "reason": reason,
                            "detail": reason_text(src, reason)})
            continue
        frame_tasks = [src.tasks[int(t)] for t in cols["task_index"]]
        if advantages is not None:
            cond = opts.conditioning
            prompts = [cond.frame_prompt(t, a) for t, a in zip(frame_tasks, advantages[ref.episode_index],
                                                                  strict=True)]
        else:
            prompts = frame_tasks
        kept.append(Kept(ref, cols, task, prompts,
                         labels=None if advantages is None else advantages[ref.episode_index]))
    return kept, dropped, unknown


_REASONS = {
    "task_not_selected": "the task (column 'task_index') is not in data.tasks",
    "not_successful": "data.success_only is set and column '{success}' is never true",
}


def reason_text(src: RecapSource, reason: str) -> str:
    return _REASONS[reason].format(success=src.names.get("is_success", "is_success"))


def short(items: list[int], limit: int = 12) -> str:
    if len(items) <= limit:
        return str(items)
    return str(items[:limit])[:-1] + f", ...] ({len(items)} episodes)"


def open_source(source: DataSource, opts: Options
                ) -> tuple[RecapSource, dict[int, dict[str, np.ndarray]], list[Kept], list[dict]]:
    """Pass 1 over one source: layout, every episode checked, the filters applied."""
    from pisft.integrity import verify_read

    # A source pisft wrote (demo_recap, collect_rollouts) is checked against its MANIFEST.json;
    # the user's own data (no pisft_config.json) as it is.
    verify_read(source.path, what=f"{CONVERT_RECAP.name}'s source {source.path}")
    src = RecapSource.open(source.path, opts.data.columns)
    lowdim: dict[int, dict[str, np.ndarray]] = {}
    for ref in src.episodes:
        cols = src.read_lowdim(ref)
        check_episode(src, ref, cols)
        lowdim[ref.episode_index] = cols
    if not src.episodes:
        raise DataError(f"{src.where(src.episodes_path)}: lists no episodes; nothing to convert")
    if source.type == "rollout" and "is_success" not in src.names:
        names = " nor ".join(f"'{c}'" for c in SUCCESS_COLUMNS)
        raise DataError(f"{src.where(src.info_path)}: a source of type rollout needs each episode's outcome, but "
                        f"neither {names} is among its features; give it type sft if it holds demonstrations")
    check_returns_files(src, lowdim)
    kept, dropped, unknown = _select(src, lowdim, opts)
    for k in kept:
        k.src = src
    failed = [k.ref.episode_index for k in kept if "is_success" in src.names and not k.cols["is_success"].any()]
    if source.type == "sft" and failed:
        print(f"convert_recap: note: {src.root} is a source of type sft (demonstrations): its {len(failed)} "
              f"episode(s) whose '{src.names['is_success']}' is never true ({short(failed)})\n"
              "convert_recap: note: they count as successes for their returns and are positive frames, as "
              "RLinf's type sft; give the source type rollout to use their outcome", flush=True)
    return src, lowdim, kept, dropped, unknown


def label_counts(kept: list[Kept]) -> dict:
    """Positive and negative frames of the converted episodes, overall and per task."""
    per_task: dict[str, dict[str, int]] = {}
    for k in kept:
        if k.labels is None:
            continue
        entry = per_task.setdefault(k.src.tasks[k.task_index], {"positive": 0, "negative": 0})  # type: ignore[union-attr]
        p = int(np.sum(k.labels))
        entry["positive"] += p
        entry["negative"] += len(k.labels) - p
    return {"positive": sum(e["positive"] for e in per_task.values()),
            "negative": sum(e["negative"] for e in per_task.values()),
            "per_task": dict(sorted(per_task.items()))}


def refuse_untrainable_labels(opened, kept: list[Kept], opts: Options) -> None:
    """An advantage-conditioned policy learns from positive frames (and, when every frame
    carries its label, `data.positive_only_conditional: false`, from negative ones too)."""
    counts = label_counts(kept)
    files = ", ".join(str(advantages_path(src, opts.data.advantage_tag)) for _, src, *_ in opened)
    frames = counts["positive"] + counts["negative"]
    need_negative = not opts.data.positive_only_conditional
    if counts["positive"] == 0 or (need_negative and counts["negative"] == 0):
        missing = "positive" if counts["positive"] == 0 else "negative"
        raise DataError(
            f"{files}: the {frames} converted frames have {counts['positive']} positive and {counts['negative']} "
            f"negative advantage labels: no {missing} frame, so the advantage-conditioned prompt "
            + ("(positive_only_conditional: false labels every frame) " if need_negative else "")
            + "cannot be learned. Relabel (recap.positive_quantile, the advantages stage), check "
              "data.advantage_tag and the data.tasks / data.success_only filters, or unset data.advantage_tag")
