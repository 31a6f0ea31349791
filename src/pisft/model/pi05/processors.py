"""LeRobot's pi0.5 processor pipelines on a local tokenizer (3.), openpi's prompt without the state,
and non-blocking host->device copies in LeRobot's device step.

Numbers (5., 9., ...) are the items of the package's docstring (`pisft.model.pi05`).
"""

from __future__ import annotations

from typing import Any

from pisft import device as devices
from pisft.model.pi05.modeling import PATCH_LOCK, patched


def set_non_blocking_transfers(preprocessor) -> None:
    """Host->device copies of LeRobot's device step without blocking, on every accelerator.

    `DeviceProcessorStep.__post_init__` sets `non_blocking = "cuda" in device`, so on `npu:<i>`
    every copy blocks the host until the device queue drains.
    """
    for step in getattr(preprocessor, "steps", ()):
        if hasattr(step, "non_blocking") and hasattr(step, "device"):
            step.non_blocking = not devices.on_host(step.device)


def prompt_without_state(task: str) -> str:
    """openpi's prompt when the state is not in it (`discrete_state_input=False`;
    Physical-Intelligence/openpi @ 15a9616, src/openpi/models/tokenizer.py `PaligemmaTokenizer.tokenize`
    with `state=None`): the cleaned task, then "\n" as the start of the answer. (openpi encodes the
    two parts separately, `encode(text, add_bos=True) + encode("\n")`; here the tokenizer step
    takes the joined text, which gives the same tokens when the vocabulary has no piece merging a
    word with the newline: PaliGemma's keeps "\n" a piece of its own. A test checks it on the
    model's tokenizer.) LeRobot's `Pi05PrepareStateTokenizerProcessorStep` cleans the task alike
    and always adds `, State: <256-bin state>;\nAction: `."""
    return task.strip().replace("_", " ").replace("\n", " ") + "\n"


def _no_state_prompt_step(processor_pi05):
    """LeRobot's prompt step, writing openpi's prompt without the state (`prompt_without_state`)."""
    TransitionKey = processor_pi05.TransitionKey  # noqa: N806 - LeRobot's enum, as its step uses it

    class NoStatePromptStep(processor_pi05.Pi05PrepareStateTokenizerProcessorStep):
        def __call__(self, transition):
            transition = transition.copy()
            data = dict(transition.get(TransitionKey.COMPLEMENTARY_DATA) or {})
            tasks = data.get(self.task_key)
            if tasks is None:
                raise ValueError("No task found in complementary data")
            data[self.task_key] = [prompt_without_state(t) for t in tasks]
            transition[TransitionKey.COMPLEMENTARY_DATA] = data
            return transition

    return NoStatePromptStep


def pi05_processors(config, dataset_stats, tokenizer, *, state_in_prompt: bool = True):
    """LeRobot's own pi0.5 processor pipelines, with a local tokenizer object instead of the hub's.
    `state_in_prompt` False: the prompt has no state tokens (`prompt_without_state`, openpi's
    `discrete_state_input=False`)."""
    from lerobot.policies.pi05 import processor_pi05

    real_step = processor_pi05.TokenizerProcessorStep

    def tokenizer_step(**kwargs):
        kwargs.pop("tokenizer_name", None)
        return real_step(tokenizer=tokenizer, **kwargs)

    replacements: dict[str, Any] = {"TokenizerProcessorStep": tokenizer_step}
    if not state_in_prompt:
        replacements["Pi05PrepareStateTokenizerProcessorStep"] = _no_state_prompt_step(processor_pi05)
    with PATCH_LOCK, patched(processor_pi05, replacements):
        return processor_pi05.make_pi05_pre_post_processors(config, dataset_stats=dataset_stats)


def resize_with_pad_torch(images, height: int, width: int):
    """LeRobot's pi0.5 image resize with padding (`lerobot.policies.common.vla_utils`), what its
    `_preprocess_images` runs on the device (pisft.bench.data_loader_bench times it on the host)."""
    from lerobot.policies.common import vla_utils

    return vla_utils.resize_with_pad_torch(images, height, width)
