"""pi0.5's FSDP2 units (14.): which modules of a PI05Policy `fully_shard` takes as one unit, in forward
order (`policy_units`, the spec's `fsdp_units`; `prefix_units`, the VLM prefix's, which the RECAP value
model shares). pisft.train.fsdp shards them (and merges small ones on the CPU); `pisft.model.units.Unit`
is the model-neutral unit.

Numbers (5., 9., ...) are the items of the package's docstring (`pisft.model.pi05`).

FSDP2 gathers a unit's parameters in a forward pre-hook and frees them in a forward post-hook;
both run on `module(...)` or on a registered forward method. LeRobot's pi0.5 calls the parts of
each decoder layer directly (`compute_layer_complete`), never `layer(...)`; pisft's training
forward runs each block (a decoder layer pair) as one call of `run_block` on the block's first
layer (11.), whose runner is the unit's registered FSDP2 forward method (`pisft.train.blocks`).
The units:

- decoder layer pair i: VLM layer i AND action-expert layer i in ONE unit (`fully_shard`'s list
  form, torch >= 2.6). The two layers always run together (joint attention), so one all-gather
  and one reduce-scatter serve both (a k/v projection of pi0.5 is 0.26-0.5M parameters:
  latency-bound collectives on HCCL);
- the SigLIP embeddings, the encoder layers (`VISION_LAYERS_PER_UNIT` to a unit) and the
  post-layernorm + projector: these units are NOT resharded after forward (kept until their
  backward, which then needs no second gather), and every camera's image goes through them in
  one batch (`embedding._embed_images`: one forward, one backward, one reduce-scatter);
  HF's encoder calls each layer as a module, so its hooks are the module's;
- the action/time projections (one unit) and the token embedding when it is not tied.
With the whole VLM frozen (`train.trainable: expert`) the forward runs the prefix first and
without grad, then the expert (8.): the units are then one per VLM layer and one per expert layer
in that order (a pair unit would stay gathered from its VLM half to its expert half, every pair at
once), and the vision units are freed after their forward (they have no backward).
Everything else (small final norms, the tied VLM `lm_head`/`embed_tokens` pair) lives in the root
unit. The action expert's `lm_head` is detached before sharding (`construction.detach_expert_head`):
it never takes part in the loss and would otherwise travel in the root unit every micro-step.
"""

from __future__ import annotations

from torch import nn

from pisft.model.pi05.forward import prefix_frozen
from pisft.model.pi05.parts import (EXPERT_LAYERS, LANGUAGE_MODEL, PALIGEMMA_WITH_EXPERT, PROJECTOR, VISION_MODEL,
                                    VLM_LAYERS, in_core, part)
from pisft.model.units import Unit

# SigLIP encoder layers per FSDP unit. The vision units are kept gathered from their forward to their
# backward (every camera's image goes through them), so grouping layers costs no memory while a
# training step holds them; it cuts the per-unit collectives and host work (pi0.5: 27 units -> 9).
VISION_LAYERS_PER_UNIT = 3


def _core(model: nn.Module) -> nn.Module | None:
    core = getattr(model, "model", None)
    if core is not None and hasattr(core, in_core(PALIGEMMA_WITH_EXPERT)):
        return core
    return None


def _is_tied(model: nn.Module, module: nn.Module) -> bool:
    inside = {id(p) for p in module.parameters()}
    inside_modules = {id(m) for m in module.modules()}
    for mod in model.modules():
        if id(mod) in inside_modules:
            continue
        if any(id(p) in inside for p in mod.parameters(recurse=False)):
            return True
    return False


def policy_units(policy: nn.Module) -> list[Unit]:
    """The FSDP units of a LeRobot PI05Policy, in forward order."""
    core = _core(policy)
    if core is None:
        raise TypeError(f"{type(policy).__name__} is not a LeRobot PI05Policy")
    frozen = prefix_frozen(policy)
    units = prefix_units(policy, frozen=frozen)
    vlm_layers = part(policy, VLM_LAYERS)
    # Called before the decoder (embed_suffix) and after it (action_out_proj): one small unit.
    action = Unit("model.action_time_projections", "action",
                  tuple(getattr(core, n) for n in ("action_in_proj", "time_mlp_in", "time_mlp_out",
                                                   "action_out_proj")))
    expert_layers = part(policy, EXPERT_LAYERS)
    if frozen:
        # The frozen-prefix forward (8.) runs every VLM layer over the prefix
        # first, without grad, then the expert's layers over the suffix: one unit per layer, in
        # that order, each gathered once and freed after its forward (the VLM's have no backward).
        units += [Unit(f"{VLM_LAYERS}.{i}", "vlm_decoder", (layer,), anchors=(layer,))
                  for i, layer in enumerate(vlm_layers)]
        units.append(action)
        units += [Unit(f"{EXPERT_LAYERS}.{i}", "decoder", (layer,),
                       anchors=(layer,)) for i, layer in enumerate(expert_layers)]
        return units
    units.append(action)
    for i, (vlm_layer, expert_layer) in enumerate(zip(vlm_layers, expert_layers, strict=True)):
        units.append(Unit(f"decoder_pair.{i}", "decoder", (vlm_layer, expert_layer), anchors=(vlm_layer,)))
    return units


def prefix_units(model: nn.Module, lead: str = "", *, frozen: bool = False) -> list[Unit]:
    """The units of PaliGemma's vision-language prefix of the PI05Policy at `lead` in `model` (""
    for the policy itself, "policy." in the RECAP value model): the SigLIP embeddings, the encoder
    layers (`VISION_LAYERS_PER_UNIT` to a unit) and the post-layernorm + projector (gathered once
    per forward, see the module docstring), and the token embedding when it is not tied (pisft ties
    it to the unused lm_head: then it stays in the root). `frozen`: the prefix
    runs without grad (8.), so the vision units have no backward and are freed
    after their forward."""
    vp = lead + VISION_MODEL
    vision = part(model, vp)
    free = frozen  # reshard after forward: only when there is no backward to keep it for
    units = [Unit(f"{vp}.embeddings", "vision", (vision.embeddings,), reshard_after_forward=free)]
    layers = list(vision.encoder.layers)
    for i in range(0, len(layers), VISION_LAYERS_PER_UNIT):
        group = tuple(layers[i:i + VISION_LAYERS_PER_UNIT])
        name = f"{vp}.encoder.layers.{i}" + (f"..{i + len(group) - 1}" if len(group) > 1 else "")
        units.append(Unit(name, "vision", group, reshard_after_forward=free, compiled_modules=group))
    head = tuple(m for m in (getattr(vision, "post_layernorm", None), part(model, lead + PROJECTOR))
                 if m is not None)
    units.append(Unit(lead + PROJECTOR, "vision", head, reshard_after_forward=free))
    embed = part(model, lead + LANGUAGE_MODEL).embed_tokens
    if not _is_tied(model, embed):
        units.append(Unit(f"{lead}{LANGUAGE_MODEL}.embed_tokens", "embed", (embed,)))
    return units


def value_units(model: nn.Module, lead: str) -> list[Unit]:
    """The RECAP value model's units (the policy at `lead` in `model`, stripped to its VLM prefix,
    `construction.strip_to_vlm_prefix`): the prefix's vision units and one unit per VLM decoder layer
    (the layers are called as modules by the VLM's forward); the read-out token, the head and the
    tied embedding stay in the root."""
    units = prefix_units(model, lead)
    units += [Unit(f"{lead}{VLM_LAYERS}.{i}", "decoder", (layer,))
              for i, layer in enumerate(model.get_submodule(lead + VLM_LAYERS))]
    return units
