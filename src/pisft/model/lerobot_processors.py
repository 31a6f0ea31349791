"""LeRobot's own processor files in an exported model, so LeRobot's tools take it as it is.

LeRobot 0.6.1 keeps a policy's input and output processing beside its weights:
`policy_preprocessor.json` and `policy_postprocessor.json` (the pipelines' steps and their
settings) with one `<pipeline>_step_<i>_<step>.safetensors` per stateful step (the normalisation
statistics), written by `DataProcessorPipeline.save_pretrained` and read by
`make_pre_post_processors(policy_cfg, pretrained_path=...)` (lerobot/policies/factory.py), which
`lerobot-eval` and LeRobot's inference use. Without them LeRobot refuses the model
(`ProcessorMigrationError`). `write_processors` saves the pipelines pisft itself prompts and
normalises with (`pisft.model.policy.make_processors`: LeRobot's pi0.5 steps,
lerobot/policies/pi05/processor_pi05.py `make_pi05_pre_post_processors`, on the model's own
tokenizer and statistics), so LeRobot's processors built from the files compute what `serve` does.

Two places differ from a checkpoint LeRobot writes itself:
- the tokenizer step names the model's own tokenizer folder (`tokenizer_name`) by its path as the
  run's config gives it (`results/train/model/tokenizer` for the default `results_dir`), where
  LeRobot names PaliGemma's hub repository; a tiny model's tokenizer exists nowhere else. From
  another working directory, or after moving the model, pass
  `preprocessor_overrides={"tokenizer_processor": {"tokenizer_name": "<model>/tokenizer"}}`.
- a model trained without the state in its prompt (`model.state_in_prompt: false`, openpi's
  `discrete_state_input=False`) gets `PromptWithoutStateStep` below in place of LeRobot's
  `Pi05PrepareStateTokenizerProcessorStep`, which always writes the state. The files name it by
  its import path (LeRobot's loader imports it, `_resolve_step_class`), so LeRobot reads it where
  pisft is installed and refuses it elsewhere, naming the class, rather than prompting with the
  state the model never saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lerobot.processor import ProcessorStep
from lerobot.processor.tokenizer_processor import TokenizerProcessorStep

from pisft.io import follow_umask
from pisft.model.lerobot_internals import prompt_without_state

# LeRobot's file names (lerobot.utils.constants POLICY_PREPROCESSOR_DEFAULT_NAME / ..._POSTPROCESSOR_...).
PREPROCESSOR_FILE = "policy_preprocessor.json"
POSTPROCESSOR_FILE = "policy_postprocessor.json"


@dataclass
class PromptWithoutStateStep(ProcessorStep):
    """openpi's pi0.5 prompt without the discretised state (`prompt_without_state`): the cleaned
    task and "\\n", where LeRobot's step writes `Task: ..., State: ...;\\nAction: `."""

    task_key: str = "task"

    def __call__(self, transition: Any) -> Any:
        from lerobot.lerobot_types import TransitionKey

        transition = transition.copy()
        data = dict(transition.get(TransitionKey.COMPLEMENTARY_DATA) or {})
        tasks = data.get(self.task_key)
        if tasks is None:
            raise ValueError("No task found in complementary data")
        data[self.task_key] = [prompt_without_state(t) for t in ([tasks] if isinstance(tasks, str) else tasks)]
        transition[TransitionKey.COMPLEMENTARY_DATA] = data
        return transition

    def get_config(self) -> dict[str, Any]:
        return {"task_key": self.task_key}

    def transform_features(self, features: Any) -> Any:
        return features


def write_processors(model_dir: str | Path, *, tokenizer_name: str) -> list[Path]:
    """Save the pre- and post-processor of the model written in `model_dir` (its config.json,
    pisft_model.json, tokenizer and statistics) in LeRobot's layout beside it; `tokenizer_name`:
    how the files name the tokenizer folder. Returns the files written (with the user's file mode)."""
    from lerobot.policies.pi05.processor_pi05 import Pi05PrepareStateTokenizerProcessorStep

    from pisft.model import policy as policy_mod
    from pisft.model.lerobot_internals import pi05_processors
    from pisft.model.norm_stats import STATS_FILE, load_stats
    from pisft.model.tokenizer import load_tokenizer

    model_dir = Path(model_dir)
    config, _ = policy_mod.read_config(model_dir / policy_mod.CONFIG_FILE)
    state = policy_mod.read_model_info(model_dir).get(policy_mod.STATE_IN_PROMPT_KEY, True)
    pre, post = pi05_processors(config, load_stats(model_dir / STATS_FILE),
                                load_tokenizer(model_dir / policy_mod.TOKENIZER_DIR), state_in_prompt=True)
    for i, step in enumerate(pre.steps):
        if isinstance(step, TokenizerProcessorStep):
            step.tokenizer_name, step.tokenizer = tokenizer_name, None  # named in the file, still loaded
        elif isinstance(step, Pi05PrepareStateTokenizerProcessorStep) and not state:
            pre.steps[i] = PromptWithoutStateStep(task_key=step.task_key)
    before = set(model_dir.iterdir())
    pre.save_pretrained(model_dir, config_filename=PREPROCESSOR_FILE)
    post.save_pretrained(model_dir, config_filename=POSTPROCESSOR_FILE)
    written = sorted(set(model_dir.iterdir()) - before)
    for path in written:
        follow_umask(path)  # safetensors writes 0600
    return written
