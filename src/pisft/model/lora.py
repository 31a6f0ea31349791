"""A LoRA target preset resolved (`LoraSpec`): what peft adapts, with which rank, and what trains in
full. Model-neutral: a model's folder makes the specs of its presets (`train.lora_targets`; pi0.5's:
`pisft.model.pi05.trainable`) and pisft.train.trainable applies them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA target preset resolved: what peft adapts, with which rank, and what trains in full."""

    preset: str
    target_modules: str  # a regex peft full-matches against module names
    rank: int
    alpha: float
    rank_pattern: dict[str, int] = field(default_factory=dict)  # peft: regex -> rank
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    init: str = "peft"  # peft (A kaiming-uniform, B zero) | gaussian (peft's) | openpi (A, B ~ N(0, 0.01))
    # Modules trained in full beside the adapters: dotted suffixes of module names (PEFT's
    # `modules_to_save` matching, `key.endswith(name)`; the adapter export lists them so).
    full_modules: tuple[str, ...] = ()

    def trains_in_full(self, name: str) -> bool:
        dotted = "." + name
        return any(f".{m}." in dotted for m in self.full_modules)

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=self.target_modules,
                          rank_pattern=dict(self.rank_pattern), alpha_pattern=dict(self.alpha_pattern),
                          lora_dropout=0.0, bias="none",
                          init_lora_weights="gaussian" if self.init == "gaussian" else True)

    def scaling(self, module_name: str) -> float:
        """alpha / rank of the adapter on `module_name` (peft's `scaling`, not rank-stabilised)."""
        from peft.utils.other import get_pattern_key

        rank = self.rank_pattern.get(get_pattern_key(self.rank_pattern, module_name), self.rank)
        alpha = self.alpha_pattern.get(get_pattern_key(self.alpha_pattern, module_name), self.alpha)
        return alpha / rank
