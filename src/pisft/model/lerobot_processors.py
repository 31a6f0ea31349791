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
- the tokenizer step is `ModelTokenizerStep` below, LeRobot's `TokenizerProcessorStep` on the model's
  own tokenizer carried in the step's state file inside the model folder, where LeRobot names
  PaliGemma's hub repository (a tiny model's tokenizer exists nowhere else). A step's state file is
  the one thing LeRobot 0.6.1's loader reads from the model folder itself, whatever the working
  directory (`DataProcessorPipeline._load_step_state`: `base_path / state_file`, the hub for a hub
  model); a step's config is handed to its constructor as written, and `TokenizerProcessorStep`
  gives `tokenizer_name` to `AutoTokenizer.from_pretrained`, so a path there is read from the working
  directory: `results/train/model/tokenizer`, as written before, was another project's tokenizer when
  run from that project's root, without a word. The files name the step by its import path, so
  LeRobot reads it where pisft is installed and refuses it elsewhere, naming the class.
- a model trained without the state in its prompt (`model.state_in_prompt: false`, openpi's
  `discrete_state_input=False`) gets `PromptWithoutStateStep` below in place of LeRobot's
  `Pi05PrepareStateTokenizerProcessorStep`, which always writes the state. The files name it by
  its import path (LeRobot's loader imports it, `_resolve_step_class`), so LeRobot reads it where
  pisft is installed and refuses it elsewhere, naming the class, rather than prompting with the
  state the model never saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lerobot.processor import ProcessorStep
from lerobot.processor.tokenizer_processor import TokenizerProcessorStep

from pisft.io import follow_umask
from pisft.model.pi05.processors import prompt_without_state

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


@dataclass
class ModelTokenizerStep(TokenizerProcessorStep):
    """LeRobot's tokenizer step (lerobot/processor/tokenizer_processor.py, LeRobot 0.6.1) on the model's
    own tokenizer, whose files are the step's state (`state_dict`: one uint8 tensor per file of the
    model's `tokenizer/`), saved beside the pipeline's JSON in the model folder and read back from there
    by LeRobot's loader (`load_state_dict`), wherever the process runs. Its config names no tokenizer."""

    # TokenizerProcessorStep's registry name is inherited otherwise, and the files would name LeRobot's step
    _registry_name = None
    files: dict[str, bytes] = field(default_factory=dict, repr=False)  # the tokenizer's files, by name

    def __post_init__(self) -> None:
        if self.tokenizer is None and self.tokenizer_name is None:
            self.input_tokenizer = None  # made from the state file (load_state_dict)
            return
        super().__post_init__()

    @classmethod
    def from_folder(cls, tokenizer_dir: Path, step: TokenizerProcessorStep) -> ModelTokenizerStep:
        """The step `step` (LeRobot's, as pi0.5's processors make it) on the tokenizer in `tokenizer_dir`."""
        from pisft.model.tokenizer import load_tokenizer

        files = {p.relative_to(tokenizer_dir).as_posix(): p.read_bytes()
                 for p in sorted(tokenizer_dir.rglob("*")) if p.is_file()}
        return cls(tokenizer=load_tokenizer(tokenizer_dir), max_length=step.max_length, task_key=step.task_key,
                   padding_side=step.padding_side, padding=step.padding, truncation=step.truncation, files=files)

    def get_config(self) -> dict[str, Any]:
        return {k: v for k, v in super().get_config().items() if k != "tokenizer_name"}

    def state_dict(self) -> dict[str, Any]:
        import torch

        return {name: torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
                else torch.zeros(0, dtype=torch.uint8) for name, data in self.files.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import tempfile

        from pisft.model.tokenizer import load_tokenizer

        files = {name: bytes(tensor.numpy().tobytes()) for name, tensor in state.items()}
        if not files:
            raise ValueError(f"{type(self).__name__}: its state file holds no tokenizer files; the model folder's "
                             "processor files are damaged: export the model again")
        with tempfile.TemporaryDirectory(prefix="pisft-tokenizer-") as tmp:
            for name, data in files.items():
                path = Path(tmp, name)
                if not path.resolve().is_relative_to(Path(tmp).resolve()):
                    raise ValueError(f"{type(self).__name__}: a tokenizer file named {name!r} lies outside its folder")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            self.input_tokenizer = load_tokenizer(tmp)  # read whole: nothing refers to the folder after this
        self.files = files

    def observation(self, observation: Any) -> Any:
        if self.input_tokenizer is None:
            raise ValueError(f"{type(self).__name__} has no tokenizer: it is the step's state, read from its state "
                             "file in the model folder by DataProcessorPipeline.from_pretrained (LeRobot's "
                             "make_pre_post_processors(pretrained_path=<model folder>))")
        return super().observation(observation)


def write_processors(model_dir: str | Path) -> list[Path]:
    """Save the pre- and post-processor of the model written in `model_dir` (its config.json,
    pisft_model.json, tokenizer and statistics) in LeRobot's layout beside it, the tokenizer inside
    the step's state file (`ModelTokenizerStep`). Returns the files written (with the user's file mode)."""
    from lerobot.policies.pi05.processor_pi05 import Pi05PrepareStateTokenizerProcessorStep

    from pisft.model import policy as policy_mod
    from pisft.model.pi05.processors import pi05_processors
    from pisft.model.norm_stats import STATS_FILE, load_stats
    from pisft.model.tokenizer import load_tokenizer

    model_dir = Path(model_dir)
    config, _ = policy_mod.read_config(model_dir / policy_mod.CONFIG_FILE)
    state = policy_mod.read_model_info(model_dir).get(policy_mod.STATE_IN_PROMPT_KEY, True)
    pre, post = pi05_processors(config, load_stats(model_dir / STATS_FILE),
                                load_tokenizer(model_dir / policy_mod.TOKENIZER_DIR), state_in_prompt=True)
    for i, step in enumerate(pre.steps):
        if isinstance(step, TokenizerProcessorStep):
            pre.steps[i] = ModelTokenizerStep.from_folder(model_dir / policy_mod.TOKENIZER_DIR, step)
        elif isinstance(step, Pi05PrepareStateTokenizerProcessorStep) and not state:
            pre.steps[i] = PromptWithoutStateStep(task_key=step.task_key)
    before = set(model_dir.iterdir())
    pre.save_pretrained(model_dir, config_filename=PREPROCESSOR_FILE)
    post.save_pretrained(model_dir, config_filename=POSTPROCESSOR_FILE)
    written = sorted(set(model_dir.iterdir()) - before)
    for path in written:
        follow_umask(path)  # safetensors writes 0600
    return written
