"""Advantage-conditioned prompts as RLinf trains and evaluates them (RECAP's CFG stage).

RLinf (`rlinf/models/embodiment/openpi_cfg/openpi_cfg_action_model.py`,
`compute_cfg_routing_masks`; recipe `examples/offline_rl/config/cfg_rl_openpi.yaml`:
`positive_only_conditional: true`, `unconditional_prob: 0.1`, `guidance_type: positive`,
`cfgrl_guidance_scale: 1.0`) trains a frame

- with `positive_only_conditional`: with `"<task>\\nAdvantage: positive"` when its advantage is
  positive and a uniform draw exceeds `unconditional_prob`, else with the plain `"<task>"`
  (negative frames are always unconditioned);
- without it: with its own label (`positive`/`negative`) when the draw exceeds
  `unconditional_prob`, else with the plain task;

and evaluates with the positive prompt (guidance scale 1: the conditioned velocity alone).

pisft splits this in two: `convert_recap` writes each frame's conditioned prompt
(`frame_prompt`: the label, or the plain task for a negative frame under
`positive_only_conditional`), and the training data pipeline drops the label of a sample with
probability `unconditional_prob` (`training_prompt`), drawing from the sample's generator
`sample_rng(seed, (step, position))` so the choice does not depend on the world size. How a
dataset was conditioned is recorded in `meta/prompt_conditioning.json` (`CONDITIONING_FILE`),
which the export copies next to the model; evaluation, closed-loop and serving prompt a model
with `inference_prompt`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from pisft.data.libero import advantage_prompt, has_advantage, strip_advantage
from pisft.stages import ADVANTAGES

CONDITIONING_FILE = "prompt_conditioning.json"
# How RLinf evaluates a model trained with advantage prompts (guidance_type: positive, scale 1).
POSITIVE = "positive"
PLAIN = "task"


@dataclass(frozen=True)
class PromptConditioning:
    advantage_tag: str = ""  # "" : the model was trained on the plain task prompts
    positive_only_conditional: bool = True
    unconditional_prob: float = 0.1

    @property
    def conditioned(self) -> bool:
        return bool(self.advantage_tag)

    @property
    def eval_prompt(self) -> str:
        """`positive` (RLinf's evaluation prompt) for a conditioned model, else `task`."""
        return POSITIVE if self.conditioned else PLAIN

    @property
    def drops(self) -> bool:
        """Whether training draws a random unconditioned prompt at all."""
        return self.conditioned and self.unconditional_prob > 0

    # ---------------------------------------------------------------- the three places
    def frame_prompt(self, task: str, positive: bool) -> str:
        """The prompt `convert_recap` stores for a frame with this advantage label."""
        if not self.conditioned:
            return task
        if self.positive_only_conditional and not positive:
            return task
        return advantage_prompt(task, positive)

    def training_prompt(self, prompt: str, rng: np.random.Generator) -> str:
        """The prompt a training sample sees: the stored one, or with probability
        `unconditional_prob` its plain task (RLinf's dropout to the unconditioned prompt).
        Draws one uniform from `rng` whenever `drops` (whatever the prompt), so the draws that
        follow do not depend on the data."""
        if not self.drops:
            return prompt
        u = float(rng.random())
        if u < self.unconditional_prob:
            return strip_advantage(prompt)
        return prompt

    def inference_prompt(self, task: str) -> str:
        """The prompt for evaluation, closed loop and serving: RLinf's positive prompt for a
        conditioned model (a prompt that already carries a label is left as sent), else the task."""
        if not self.conditioned or has_advantage(task):
            return task
        return advantage_prompt(task, True)

    # ---------------------------------------------------------------- records
    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["eval_prompt"] = self.eval_prompt
        out["eval_prompt_example"] = self.inference_prompt("<task>")
        out["source"] = ("RLinf CFG recipe (rlinf/models/embodiment/openpi_cfg): evaluated with the "
                         "positive prompt" if self.conditioned else "plain task prompts")
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PromptConditioning:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        return cls(advantage_tag=kwargs.get("advantage_tag", ""),
                   positive_only_conditional=kwargs.get("positive_only_conditional", True),
                   unconditional_prob=float(kwargs.get("unconditional_prob", 0.1)))

    def describe(self) -> str:
        """One line for reports."""
        if not self.conditioned:
            return "the task instruction (not advantage-conditioned)"
        return (f"`<task>\\nAdvantage: positive` (RLinf's positive prompt; trained with advantage_tag "
                f"`{self.advantage_tag}`, positive_only_conditional {str(self.positive_only_conditional).lower()}, "
                f"unconditional_prob {self.unconditional_prob:g})")

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


PLAIN_PROMPTS = PromptConditioning()


def read(path: Path) -> PromptConditioning | None:
    """The conditioning recorded in a `prompt_conditioning.json`; None when the file is absent."""
    path = Path(path)
    if not path.is_file():
        return None
    from pisft import records

    data = records.read(path, records.fields_of(PromptConditioning),
                        writer="convert_recap (the exported model carries the dataset's copy)")
    return PromptConditioning.from_dict(data)


def for_dataset(dataset_dir: str | Path) -> PromptConditioning:
    """How a converted dataset's prompts were conditioned (plain when it records nothing)."""
    return read(Path(dataset_dir) / "meta" / CONDITIONING_FILE) or PLAIN_PROMPTS


def for_model(model_dir: str | Path, *, trained_on: str | Path | None = None) -> PromptConditioning:
    """How to prompt a model: what its directory records (`prompt_conditioning.json`, copied by
    the export); else, for a model known to be trained on `trained_on` (a converted dataset),
    what that dataset records; else the plain task."""
    found = read(Path(model_dir) / CONDITIONING_FILE)
    if found is not None:
        return found
    if trained_on is not None:
        return for_dataset(trained_on)
    return PLAIN_PROMPTS


def training_prompt_fn(dataset_dir: str | Path):
    """The per-sample prompt function for the training data pipeline (`StepDataset`), or None
    when the dataset's prompts are used as stored (no random unconditioned prompt)."""
    cond = for_dataset(dataset_dir)
    return cond.training_prompt if cond.drops else None


def recap_conditioning(iteration: int, positive_only_conditional: bool, unconditional_prob: float
                       ) -> PromptConditioning:
    """How the policy of RECAP iteration k >= 1 is conditioned: on the labels of that iteration's
    `advantages` stage (its tag names the iteration), with RLinf's CFG recipe settings."""
    return PromptConditioning(advantage_tag=f"recap_iter{iteration}",
                              positive_only_conditional=positive_only_conditional,
                              unconditional_prob=unconditional_prob)


class LabelledPrompts:
    """The training prompt of a frame whose advantage label comes from a labels file (RECAP's
    `advantages` stage: `labels.parquet`, one row per frame, RLinf's columns `episode_index`,
    `frame_index`, `advantage`), not from the converted dataset's prompts.

    A frame's prompt is `conditioning.frame_prompt(task, label)`, then RLinf's random drop to the
    plain task (`training_prompt`) from the sample's generator, as for a dataset converted with
    labels. Called with the whole sample (`for_frame`), since the label is looked up by its
    episode and frame.
    """

    def __init__(self, labels_path: str | Path, conditioning: PromptConditioning) -> None:
        import pyarrow.parquet as pq

        from pisft.errors import DataError

        path = Path(labels_path)
        if not path.is_file():
            raise DataError(f"{path}: missing; the advantages stage writes it (run it first)")
        from pisft.integrity import verify_read

        verify_read(path.parent, what=f"reading the advantage labels {path}", stage=ADVANTAGES.name)
        table = pq.read_table(path, columns=["episode_index", "frame_index", "advantage"])
        ep = table.column("episode_index").to_numpy().astype(np.int64)
        fr = table.column("frame_index").to_numpy().astype(np.int64)
        adv = table.column("advantage").to_numpy(zero_copy_only=False).astype(bool)
        self.labels: dict[tuple[int, int], bool] = dict(zip(zip(ep.tolist(), fr.tolist(), strict=True),
                                                            adv.tolist(), strict=True))
        self.path = path
        self.conditioning = conditioning

    def for_frame(self, item: dict[str, Any], rng: np.random.Generator) -> str:
        key = (int(item["episode_index"]), int(item["frame_index"]))
        if key not in self.labels:
            from pisft.errors import DataError

            raise DataError(f"{self.path}: no label for episode {key[0]}, frame {key[1]}; the labels "
                            "belong to another dataset: rerun the advantages stage")
        task = strip_advantage(item["task"])
        return self.conditioning.training_prompt(self.conditioning.frame_prompt(task, self.labels[key]), rng)
