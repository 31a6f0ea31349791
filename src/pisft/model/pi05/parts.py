"""pi0.5's parts by name (13.): LeRobot's module paths inside a PI05Policy, written here once;
training, the value model, the estimate and the benches ask for a part instead of spelling its path.
And LeRobot's default LoRA targets of pi0.5 (`lerobot_targets`, train.lora_targets: lerobot).
"""

from __future__ import annotations

import functools
from typing import Any


# 13. pi0.5's parts by name: LeRobot's module paths inside a PI05Policy (`modeling_pi05`:
# `PI05Policy.model` is the `PI05Pytorch` core, its `paligemma_with_expert` the
# `PaliGemmaWithExpertModel` holding PaliGemma and the action expert `gemma_expert`).

CORE = "model"
PALIGEMMA_WITH_EXPERT = f"{CORE}.paligemma_with_expert"
PALIGEMMA = f"{PALIGEMMA_WITH_EXPERT}.paligemma"  # the VLM (LeRobot's train_expert_only freezes it)
VLM_MODEL = f"{PALIGEMMA}.model"  # transformers' PaliGemmaModel
VISION_TOWER = f"{VLM_MODEL}.vision_tower"  # SigLIP (LeRobot's freeze_vision_encoder freezes it)
VISION_MODEL = f"{VISION_TOWER}.vision_model"  # embeddings, encoder.layers, post_layernorm
PROJECTOR = f"{VLM_MODEL}.multi_modal_projector"
LANGUAGE_MODEL = f"{VLM_MODEL}.language_model"
VLM_LAYERS = f"{LANGUAGE_MODEL}.layers"
EXPERT = f"{PALIGEMMA_WITH_EXPERT}.gemma_expert"
EXPERT_LAYERS = f"{EXPERT}.model.layers"
EXPERT_HEAD = f"{EXPERT}.lm_head.weight"  # the expert's unused LM head (5.)
EXPERT_NAME = EXPERT.rsplit(".", 1)[1]  # the expert's own name, as patterns match it at any depth


def in_core(path: str) -> str:
    """A path above, relative to the `PI05Pytorch` core (`policy.model`)."""
    return path.removeprefix(CORE + ".")


def below(path: str, parent: str) -> str:
    """`path` relative to `parent`, a path above it: below(VISION_TOWER, PALIGEMMA_WITH_EXPERT) is
    `paligemma.model.vision_tower`."""
    if not path.startswith(parent + "."):
        raise ValueError(f"{path} is not below {parent}")
    return path[len(parent) + 1:]


def part(root: Any, path: str, *, core: bool = False) -> Any:
    """The module at `path` (above) in a PI05Policy `root`, or in a PI05Pytorch core with `core`."""
    return functools.reduce(getattr, (in_core(path) if core else path).split("."), root)


def lerobot_targets() -> str:
    """LeRobot 0.6.1's pi0.5 default targets (`PI05Policy._get_default_peft_targets`), read from it.

    the action expert's attention q and v projections and `model\\.(state_proj|action_in_proj|
    action_out_proj|action_time_mlp_in|action_time_mlp_out)`: of the projections only
    action_in_proj and action_out_proj exist in pi0.5 (state_proj and action_time_mlp_* are pi0's
    names; pi0.5's time_mlp_in/out are not matched). `modules_to_save` is empty: nothing else trains.
    """
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    return PI05Policy._get_default_peft_targets(None)["target_modules"]  # noqa: SLF001 - LeRobot's own defaults
