"""THE ONE PLACE where pisft reaches into LeRobot 0.6.1's pi0.5 internals.

Everything here depends on how `lerobot.policies.pi05` is written, not on a public API, so
`tests/test_model_internals.py` checks every assumption below and fails loudly when LeRobot
changes underneath. Nothing else in pisft patches or inspects LeRobot's private structure.

1. Model sizes (`sized_construction`). LeRobot hard-codes pi0.5's sizes:
   - `modeling_pi05.get_gemma_config(variant)` knows only `gemma_300m` and `gemma_2b`;
   - `PaliGemmaWithExpertModel.__init__` sets vocabulary 257152, SigLIP `intermediate_size`
     4304, `projection_dim` 2048 and the default SigLIP depth/width, then builds
     `PaliGemmaForConditionalGenerationWithPiGemma(config=...)` and
     `PiGemmaForCausalLM(config=...)`.
   While a tiny policy is constructed we replace, in `modeling_pi05`'s namespace only,
   `get_gemma_config` (tiny Gemma sizes) and the two model classes (by factories that rewrite the
   hard-coded sizes in the config LeRobot just built, then build the real class). LeRobot's
   own constructor runs unchanged, so everything else it configures is kept.
   `compute_layer_complete` reshapes the attention output with a hard-coded `8 * head_dim`, so
   every preset keeps 8 attention heads (checked in `Arch.validate`).
2. Tied embeddings (`tie_vlm_embeddings`). PaliGemma ties `lm_head` to `embed_tokens`
   (`tie_word_embeddings=True`), but LeRobot's `PaliGemmaForConditionalGenerationWithPiGemma`
   replaces the inner model after the tie, leaving two independent vocab x width matrices (0.53B
   parameters for pi0.5, of which `lm_head` never takes part in the flow-matching loss). We tie
   them again: the forward pass is unchanged, memory drops by 2 GB (fp32) plus its optimizer
   state, and checkpoints in either layout (openpi/`lerobot/pi05_base` keep `lm_head`) load.
3. Processors (`pi05_processors`). `make_pi05_pre_post_processors` creates its tokenizer step
   with `tokenizer_name="google/paligemma-3b-pt-224"` (a hub download). We call it with
   `processor_pi05.TokenizerProcessorStep` replaced by one that receives a local tokenizer
   object, so the pipeline (order of steps, prompt format, quantile normalisation) stays
   LeRobot's.
4. Construction on the meta device: `PI05Policy.__init__` ends with `self.model.to(config.device)`
   and the config validates `device` against real devices, so `build_on_meta` sets
   `config.device = "meta"` after validation.
5. Training structure (`enable_layer_checkpointing`, `detach_expert_head`, `sync_free_forward`):
   - `PI05Pytorch.gradient_checkpointing_enable()` sets `gradient_checkpointing_enabled`, which
     makes `_apply_checkpoint` wrap the WHOLE `paligemma_with_expert.forward` (and the vision
     tower, embeddings and projections) in a checkpoint, on top of the per-layer checkpoints
     `PaliGemmaWithExpertModel.forward` takes when `gemma_expert.model.gradient_checkpointing`
     is set: every decoder layer would run three times per micro-step. We set only the
     per-layer flag: forward + one recompute.
   - The action expert's `lm_head` (`gemma_expert.lm_head`, vocab x expert width; 263M
     parameters for pi0.5) is never called by the flow-matching forward. It is detached from
     the training model so it is neither sharded, gathered nor optimised.
   - `PI05Policy.forward` calls `.item()` and `.cpu()` on the loss for its log dict: two
     device->host synchronisations per micro-step. `sync_free_forward` runs the same steps
     (`_preprocess_images`, `prepare_action`, `sample_noise`/`sample_time`, `model.forward`,
     truncation to the action dimension, mean) without them, through the policy's `__call__`
     (FSDP hooks run): `PI05Policy.forward`'s body is checked by `structure_problems`.
   - Within `sync_free_forward`, `PI05Pytorch.embed_prefix` / `embed_suffix` are replaced by
     `_embed_prefix` / `_embed_suffix` (same steps, same values): LeRobot builds each attention
     mask row from a Python list with `torch.tensor(..., device=<the NPU>)`, a host->device copy
     from pageable memory that blocks the host on NPU (torch_npu's
     `copy_between_host_and_device_opapi` synchronises the stream unless the copy is
     non-blocking): two stream syncs per micro-step. Here the rows are made on the device
     (`arange == 0`, `zeros`). And LeRobot's `create_sinusoidal_pos_embedding` computes the time
     embedding in float64 on the device (`get_safe_dtype` keeps float64 except on mps/xpu): the
     only float64 arithmetic of the step. `sinusoidal_time_embedding` computes the same formula
     in float32. Huawei's pi0.5 training recipe patches these same two places (issue 21, citing
     hicann/cann-recipes-embodied-intelligence, manipulation/pi05/train/src/modeling_pi05.py).
     The losses equal LeRobot's (tests/test_model_internals.py); `python -m pisft bench --only
     train_structure` counts both (`tensors_from_python_per_micro_step`,
     `float64_ops_per_micro_step`).
6. The velocity of a denoising step (`velocity_hook`, used by `pisft.model.guidance` for
   classifier-free guidance). `PI05Pytorch.sample_actions` embeds the prefix (images, prompt)
   once, keeps its KV cache, and hands `euler_integrate` a closure that calls
   `self.denoise_step(prefix_pad_masks=..., past_key_values=..., x_t=..., timestep=...)`, which
   returns the velocity v(x_t, t) for every row of the batch; the integrator then steps
   `x_t + dt * v`. Because the method is looked up on the instance at every step, an instance
   attribute `denoise_step` set for the duration of one `predict_action_chunk` sees (and may
   replace) every step's velocity while LeRobot's prefix pass, KV cache, noise and time schedule
   run unchanged.
7. The value model's backbone (`strip_to_vlm_prefix`, `vlm_prefix_readout`; pisft.recap.value_model):
   the policy's own vision-language prefix without the action expert. `PI05Pytorch.embed_prefix`
   embeds the images (SigLIP + projector) and the language tokens; `PaliGemmaWithExpertModel.forward`
   with `inputs_embeds=[prefix, None]` runs the VLM alone (its `if inputs_embeds[1] is None`
   branch: `paligemma.model.language_model.forward`, never the expert), which is how
   `PI05Pytorch.sample_actions` runs the prefix, with the VLM's attention set to "eager" as it does.
   The action expert (`gemma_expert`) and the action/time projections are removed: the value model
   never calls them, so they are neither sharded, trained nor saved. With the VLM frozen (or under
   no_grad) the prefix runs once into the VLM's KV cache and the read-out token after it, as
   `sample_actions` runs its prefix before `denoise_step` (`vlm_prefix_readout`'s `frozen_prefix`).
8. The frozen prefix (`frozen_prefix_forward`, `prefix_frozen`). When every parameter of the
   PaliGemma VLM (vision tower, projector, token embedding, decoder layers) is frozen
   (`requires_grad` False: `train.trainable: expert`, LeRobot's `train_expert_only`), the prefix
   (images + prompt) is a constant of the micro-step. pi0.5's attention mask lets the prefix
   attend only to itself: `embed_prefix` gives every prefix token the autoregressive mask 0 and
   `embed_suffix` opens the action block with a 1, so `make_att_2d_masks` (token i attends to j
   iff cumsum(att)[j] <= cumsum(att)[i]) never lets a prefix row see a suffix column. Each VLM
   layer's prefix output, and hence its keys/values, is therefore the same whether the suffix
   runs beside it (`compute_layer_complete`'s joint layer) or after it, which is how LeRobot's
   inference runs (`sample_actions`: the prefix with a KV cache, then `denoise_step` for the
   suffix). `frozen_prefix_forward` is `PI05Pytorch.forward` split that way: the prefix once
   under `torch.no_grad()` (each VLM layer's post-rotary K/V kept, a few MB per sample), then the
   action expert's layers over the suffix, each attending to [prefix K/V, its own K/V], with
   per-layer checkpointing of the expert layers only. Nothing of the prefix is saved for
   backward or recomputed in it. The layer steps are `compute_layer_complete`'s, stream by
   stream (`_LAYER_STEPS` checks its source); tests/test_frozen_prefix.py checks the same loss
   and the same gradients of every trainable parameter as the joint forward (tiny preset, fp32).
   A prefix with any trainable parameter (`all`, `no_vision`, `lora`) keeps the joint path.
9. The chunk's entry points for a compiled program (`install_sample_actions`, `rtc_pieces`;
   pisft.policy.compiled). `PI05Policy.predict_action_chunk` calls
   `self.model.sample_actions(images, img_masks, tokens, masks, **kwargs)`, an attribute looked up
   on the instance: an instance attribute `sample_actions` (a compiled program of LeRobot's own
   method, with the same signature) takes every chunk, plain, guided (6.) or with RTC. LeRobot's
   own `PI05Config.compile_model` sets the same attribute (`self.sample_actions =
   torch.compile(self.sample_actions, ...)` in `PI05Pytorch.__init__`). A chunk with RTC guidance
   (`prev_chunk_left_over`) cannot be one graph: LeRobot's `RTCProcessor.denoise_step` calls
   `Tensor.requires_grad_` and `torch.autograd.grad`, which torch.compile does not trace. Such a
   chunk runs LeRobot's `sample_actions` eagerly with its three model calls compiled, each an
   attribute it looks up on the instance: `self.embed_prefix(...)`, the VLM's prefix pass
   (`PaliGemmaWithExpertModel.forward`'s prefix-only branch calls
   `self.paligemma.model.language_model.forward(...)`) and `self.denoise_step(...)` (6.).
   `RTCProcessor.denoise_step` takes the model's velocity `v_t` before it sets
   `x_t.requires_grad_(True)`, so no gradient flows through the model: the step may run under
   `torch.no_grad()` with the same values (`structure_problems` checks the order).
10. bf16 where openpi runs bf16 (`openpi_bf16`). With `config.dtype = "bfloat16"` LeRobot's
   `PaliGemmaWithExpertModel.to_bfloat16_for_selected_params` keeps in float32 every parameter
   whose name holds `vision_tower`, `multi_modal_projector`, `input_layernorm`,
   `post_attention_layernorm` or `model.norm` ("Keep full vision path in float32 so we never
   toggle (toggle causes optimizer 'same dtype' error)": a training concern), and the action and
   time projections (`action_in_proj`, `action_out_proj`, `time_mlp_in`, `time_mlp_out`) are
   created after that call, in float32. openpi's own method of the same name
   (Physical-Intelligence/openpi @ 15a9616, src/openpi/models_pytorch/gemma_pytorch.py), which its
   inference calls on every PyTorch model it serves (src/openpi/policies/policy_config.py), keeps
   only SigLIP's patch and position embeddings and the norms (`OPENPI_FP32`) in float32; its
   `PI0Pytorch` creates the same four projections after the call, in float32
   (src/openpi/models_pytorch/pi0_pytorch.py), and its JAX model computes them in float32 too
   (src/openpi/models/pi0.py: float32 inputs). `openpi_bf16` casts the rest of the vision path
   (SigLIP's encoder layers, its post-layernorm, the projector) to bf16. Its encoder then gets
   float32 embeddings: openpi's SigLIP casts them to bf16 before its first layer
   (transformers_replace/models/siglip/modeling_siglip.py, "Convert to bfloat16 if the encoder
   uses bfloat16"); transformers' `SiglipVisionTransformer.forward` calls
   `self.encoder(inputs_embeds=hidden_states, ...)`, so a forward pre-hook on the encoder does the
   same cast. LeRobot's `embed_image` returns the features in the image's dtype (float32), as
   before.
11. The training forward, block by block (`joint_forward`, `frozen_prefix_forward`, `run_block`).
    `PI05Pytorch.forward` (`_CORE_FORWARD_STEPS`) runs as pisft's own loop over the decoder: each
    layer pair (`pair_layer`: `compute_layer_complete`'s steps, `_LAYER_STEPS`), or with a frozen
    VLM each VLM layer (`prefix_layer`) and each expert layer (`suffix_layer`), is one call of
    `run_block` on the block's first layer, where pisft.train.blocks installs the block's runner:
    FSDP2's unit (a registered forward method), activation checkpointing and torch.compile work on
    whole blocks. LeRobot's own loop (`PaliGemmaWithExpertModel.forward`) hands the layers' parts
    to `compute_layer_complete`, so no module holds a block there. The last VLM layer's output
    projection and MLP are not run (its output reaches only the VLM's final norm, which no loss
    reads); the cameras go through SigLIP in one batch (`_embed_images`).
12. Fused projections (`fuse_decoder_projections`, `split_name`): see its section below.
13. pi0.5's parts by name (`VISION_TOWER`, `VLM_LAYERS`, `EXPERT_LAYERS`, ..., `part`): LeRobot's
    module paths inside a `PI05Policy`, written here once; training, the value model, the
    estimate and the benches ask for a part instead of spelling its path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import threading
from collections.abc import Iterator
from typing import Any

import torch

# LeRobot's hard-coded sizes that the tiny preset must never inherit (see the structure test).
LEROBOT_HARDCODED = {"vocab": 257152, "siglip_intermediate": 4304, "projection_dim": 2048}
# The attention output reshape in compute_layer_complete assumes exactly this many heads.
REQUIRED_NUM_HEADS = 8

_PATCH_LOCK = threading.RLock()


@dataclasses.dataclass(frozen=True)
class GemmaSize:
    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class VisionSize:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    patch_size: int


@dataclasses.dataclass(frozen=True)
class Arch:
    """Sizes of a pi0.5-architecture model that LeRobot does not know (the tiny preset)."""

    vlm: GemmaSize
    expert: GemmaSize
    vision: VisionSize
    vocab_size: int

    def validate(self) -> None:
        problems = []
        for name, size in (("vlm", self.vlm), ("expert", self.expert)):
            if size.num_heads != REQUIRED_NUM_HEADS:
                problems.append(f"{name}.num_heads must be {REQUIRED_NUM_HEADS} (LeRobot reshapes "
                                f"attention output with a hard-coded 8 * head_dim)")
        if self.vlm.depth != self.expert.depth:
            problems.append("vlm.depth and expert.depth must be equal (layers run in pairs)")
        if (self.vlm.head_dim, self.vlm.num_kv_heads) != (self.expert.head_dim, self.expert.num_kv_heads):
            problems.append("vlm and expert must share head_dim and num_kv_heads (joint attention)")
        if problems:
            raise ValueError("invalid model sizes: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Arch:
        return cls(
            vlm=GemmaSize(**raw["vlm"]),
            expert=GemmaSize(**raw["expert"]),
            vision=VisionSize(**raw["vision"]),
            vocab_size=int(raw["vocab_size"]),
        )


def _modeling():
    from lerobot.policies.pi05 import modeling_pi05

    return modeling_pi05


@contextlib.contextmanager
def _patched(module: Any, replacements: dict[str, Any]) -> Iterator[None]:
    originals = {}
    try:
        for name, value in replacements.items():
            originals[name] = getattr(module, name)  # AttributeError: LeRobot changed (tested)
            setattr(module, name, value)
        yield
    finally:
        for name, value in originals.items():
            setattr(module, name, value)


@contextlib.contextmanager
def sized_construction(arch: Arch | None) -> Iterator[None]:
    """Within this block, `PI05Policy(config)` builds a model of `arch`'s sizes (None: LeRobot's)."""
    if arch is None:
        yield
        return
    arch.validate()
    m = _modeling()
    real_vlm_cls = m.PaliGemmaForConditionalGenerationWithPiGemma
    real_expert_cls = m.PiGemmaForCausalLM
    real_gemma_config_cls = m.GemmaConfig

    def get_gemma_config(variant: str):
        size = {"gemma_2b": arch.vlm, "gemma_300m": arch.expert}.get(variant)
        if size is None:
            raise ValueError(f"unknown gemma variant {variant!r}")
        return real_gemma_config_cls(**dataclasses.asdict(size))

    def build_vlm(config):
        v = arch.vision
        config.vocab_size = arch.vocab_size
        config._vocab_size = arch.vocab_size  # noqa: SLF001 (LeRobot sets it too)
        config.image_token_index = arch.vocab_size
        config.text_config.vocab_size = arch.vocab_size
        config.projection_dim = arch.vlm.width
        config.hidden_size = arch.vlm.width
        vc = config.vision_config
        vc.hidden_size = v.hidden_size
        vc.intermediate_size = v.intermediate_size
        vc.num_hidden_layers = v.num_hidden_layers
        vc.num_attention_heads = v.num_attention_heads
        vc.patch_size = v.patch_size
        vc.projection_dim = arch.vlm.width
        config.text_config.num_image_tokens = (vc.image_size // vc.patch_size) ** 2
        return real_vlm_cls(config=config)

    def build_expert(config):
        config.vocab_size = arch.vocab_size
        return real_expert_cls(config=config)

    with _PATCH_LOCK, _patched(m, {
        "get_gemma_config": get_gemma_config,
        "PaliGemmaForConditionalGenerationWithPiGemma": build_vlm,
        "PiGemmaForCausalLM": build_expert,
    }):
        yield


def vlm_embedding_pair(policy) -> tuple[torch.nn.Linear, torch.nn.Embedding]:
    paligemma = policy.model.paligemma_with_expert.paligemma
    return paligemma.lm_head, paligemma.model.language_model.embed_tokens


def tie_vlm_embeddings(policy) -> None:
    """Make PaliGemma's lm_head share embed_tokens' weight (as its config declares)."""
    lm_head, embed = vlm_embedding_pair(policy)
    lm_head.weight = embed.weight


def vlm_embeddings_tied(policy) -> bool:
    lm_head, embed = vlm_embedding_pair(policy)
    return lm_head.weight is embed.weight


def enable_layer_checkpointing(policy) -> None:
    """Activation checkpointing per joint decoder layer only (see 5. above)."""
    core = policy.model
    core.gradient_checkpointing_enabled = False
    core.paligemma_with_expert.gemma_expert.model.gradient_checkpointing = True


def set_layer_checkpointing(policy, on: bool) -> None:
    """Per-layer checkpointing on or off on a policy prepared for training (the flag `run_block`
    reads at every forward: the smoke gate measures both settings on one built model)."""
    policy.model.gradient_checkpointing_enabled = False
    policy.model.paligemma_with_expert.gemma_expert.model.gradient_checkpointing = bool(on)


def prepare_for_training(policy, *, checkpointing: bool) -> None:
    """The training structure of 5. above: per-layer checkpointing, no expert lm_head."""
    if checkpointing:
        enable_layer_checkpointing(policy)
    detach_expert_head(policy)


def detach_expert_head(policy) -> torch.nn.Module | None:
    """Remove the unused action-expert lm_head from `policy`; return it (None if absent)."""
    expert = policy.model.paligemma_with_expert.gemma_expert
    head = getattr(expert, "lm_head", None)
    if head is not None:
        expert.lm_head = None
    return head


def attach_expert_head(policy, weight: torch.Tensor) -> None:
    """Put an (unchanged, untrained) expert lm_head back, e.g. to export LeRobot's full layout."""
    out_features, in_features = weight.shape
    head = torch.nn.Linear(in_features, out_features, bias=False, device="meta")
    head.weight = torch.nn.Parameter(weight, requires_grad=False)
    policy.model.paligemma_with_expert.gemma_expert.lm_head = head


# The modules of PI05Pytorch that only the action expert's suffix uses (see 6. above).
ACTION_ONLY_MODULES = ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")


def strip_to_vlm_prefix(policy) -> None:
    """Remove the action expert and the action/time projections from `policy` (6. above)."""
    core = policy.model
    core.paligemma_with_expert.gemma_expert = None
    for name in ACTION_ONLY_MODULES:
        setattr(core, name, None)


def vlm_width(policy) -> int:
    return int(policy.model.paligemma_with_expert.paligemma.model.language_model.config.hidden_size)


def vlm_prefix_readout(policy, images: list[torch.Tensor], img_masks: list[torch.Tensor],
                       tokens: torch.Tensor, masks: torch.Tensor, readout: torch.Tensor, *,
                       frozen_prefix: bool = False) -> torch.Tensor:
    """The final VLM hidden states (B, n, width) of `readout` tokens (B, n, width) appended to
    pi0.5's prefix (images, then language tokens): LeRobot's `embed_prefix` (as `_embed_prefix`,
    without the host->device copy of its mask row) and its prefix-only
    VLM pass (7. above). The prefix attends within itself as in pi0.5 (bidirectionally, padding
    masked); each read-out token attends to the whole prefix and the read-out tokens before it,
    and no prefix token attends to a read-out token (its autoregressive mask is 1).

    `frozen_prefix` (no VLM parameter trains, or no gradient is wanted): since no prefix row
    sees a read-out column, the prefix's keys/values do not depend on the read-out tokens, so the
    prefix runs once under `torch.no_grad()` with the VLM's KV cache, and the read-out tokens run
    after it through the same layers attending to [prefix K/V, their own] -- how LeRobot's
    `sample_actions` runs its prefix and then `denoise_step`, and how `frozen_prefix_forward`
    (8.) trains the policy. The backward then runs through n tokens per layer instead of the whole
    prefix, and nothing of the prefix is kept for it (recap.value_trainable: head at real size:
    tests/test_recap_value.py checks the same logits and gradients as the joint pass)."""
    from lerobot.policies.common.vla_utils import make_att_2d_masks, prepare_attention_masks_4d

    core = policy.model
    pwe = core.paligemma_with_expert
    pwe.paligemma.model.language_model.config._attn_implementation = "eager"  # noqa: SLF001 - as sample_actions
    bsize, n = readout.shape[:2]
    # the sync-free embedding of the training step (5. above): same values, no host->device copy
    with torch.no_grad() if frozen_prefix else contextlib.nullcontext():
        embs, pad, att = _embed_prefix(core, images, img_masks, tokens, masks)
    ones = torch.ones(bsize, n, dtype=torch.bool, device=pad.device)
    readout = readout.to(embs.dtype)
    if not frozen_prefix:
        pad_all = torch.cat([pad, ones], dim=1)
        mask_4d = prepare_attention_masks_4d(make_att_2d_masks(pad_all, torch.cat([att, ones], dim=1)))
        (hidden, _), _ = pwe.forward(attention_mask=mask_4d, position_ids=torch.cumsum(pad_all, dim=1) - 1,
                                     past_key_values=None, inputs_embeds=[torch.cat([embs, readout], dim=1), None],
                                     use_cache=False)
        return hidden[:, -n:]
    with torch.no_grad():
        _, cache = pwe.forward(attention_mask=prepare_attention_masks_4d(make_att_2d_masks(pad, att)),
                               position_ids=torch.cumsum(pad, dim=1) - 1, past_key_values=None,
                               inputs_embeds=[embs, None], use_cache=True)
    # denoise_step's mask and positions: the prefix's padding, then the read-out block
    mask_2d = torch.cat([pad[:, None, :].expand(bsize, n, pad.shape[1]), make_att_2d_masks(ones, ones)], dim=2)
    position_ids = pad.sum(dim=-1, keepdim=True) + torch.cumsum(ones, dim=1) - 1
    (hidden, _), _ = pwe.forward(attention_mask=prepare_attention_masks_4d(mask_2d), position_ids=position_ids,
                                 past_key_values=cache, inputs_embeds=[readout, None], use_cache=False)
    return hidden


# What PI05Policy.forward must still do for `sync_free_forward` to be the same computation.
_FORWARD_STEPS = ("self._preprocess_images(batch)", "self.prepare_action(batch)",
                  "self.model.sample_noise(actions.shape, actions.device)",
                  "self.model.sample_time(actions.shape[0], actions.device)",
                  "self.model.forward(images, img_masks, tokens, masks, actions, noise, time)",
                  "losses[:, :, :original_action_dim]", "loss = losses.mean()")


def _loss_forward(self, batch):
    """PI05Policy.forward (reduction "mean") without the host synchronisations of its log dict."""
    from lerobot.utils.constants import ACTION, OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

    images, img_masks = self._preprocess_images(batch)
    tokens, masks = batch[OBS_LANGUAGE_TOKENS], batch[OBS_LANGUAGE_ATTENTION_MASK]
    actions = self.prepare_action(batch)
    noise = self.model.sample_noise(actions.shape, actions.device)
    time = self.model.sample_time(actions.shape[0], actions.device)
    losses = self.model.forward(images, img_masks, tokens, masks, actions, noise, time)
    action_dim = self.config.output_features[ACTION].shape[0]
    return losses[:, :, :action_dim].mean()


def sinusoidal_time_embedding(time: torch.Tensor, dimension: int, min_period: float,
                              max_period: float) -> torch.Tensor:
    """LeRobot's `create_sinusoidal_pos_embedding` (the same formula, operation by operation) in
    float32 on `time`'s device instead of float64.

    The largest argument of sin/cos is 2*pi/min_period * time (about 1571 for pi0.5's 4e-3 and
    time <= 1): float32 rounds it to about 1e-4, so the embedding moves by up to ~2e-4 against the
    float64 one. The time MLP that reads it runs in bf16 in training (resolution 2**-8 = 3.9e-3).
    """
    if dimension % 2 != 0:
        raise ValueError(f"dimension ({dimension}) must be divisible by 2")
    if time.ndim != 1:
        raise ValueError("The time tensor is expected to be of shape `(batch_size, )`.")
    fraction = torch.linspace(0.0, 1.0, dimension // 2, dtype=torch.float32, device=time.device)
    period = min_period * (max_period / min_period) ** fraction
    scaling_factor = 1.0 / period * 2 * math.pi
    sin_input = scaling_factor[None, :] * time[:, None].to(torch.float32)
    return torch.cat([torch.sin(sin_input), torch.cos(sin_input)], dim=1)


def _embed_images(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
    """`embed_image` of every camera, the cameras in one batch through SigLIP and the projector
    (each image's embedding is its own: nothing in the vision tower mixes the images of a
    batch). One pass instead of one per camera: half the launches, and FSDP2 gathers and
    reduces each vision unit once per step instead of once per camera."""
    if len(images) < 2 or len({img.shape for img in images}) > 1:
        return [self._apply_checkpoint(self.paligemma_with_expert.embed_image, img) for img in images]
    embs = self._apply_checkpoint(self.paligemma_with_expert.embed_image, torch.cat(images, dim=0))
    return list(embs.chunk(len(images), dim=0))


def _embed_prefix(self, images, img_masks, tokens, masks):
    """PI05Pytorch.embed_prefix; the cameras in one batch (`_embed_images`); the attention mask
    row (all 0: every prefix token attends to the whole prefix) is made on the device instead of
    copied from a Python list."""
    embs, pad_masks = [], []
    for img_emb, img_mask in zip(_embed_images(self, images), img_masks, strict=True):
        bsize, num_img_embs = img_emb.shape[:2]
        embs.append(img_emb)
        pad_masks.append(img_mask[:, None].expand(bsize, num_img_embs))
    lang_emb = self._apply_checkpoint(self.paligemma_with_expert.embed_language_tokens, tokens)
    embs.append(lang_emb)
    pad_masks.append(masks)
    embs = torch.cat(embs, dim=1)
    pad_masks = torch.cat(pad_masks, dim=1)
    bsize, length = pad_masks.shape
    att_masks = torch.zeros(length, dtype=torch.bool, device=pad_masks.device)
    return embs, pad_masks, att_masks[None, :].expand(bsize, length)


def _embed_suffix(self, noisy_actions, timestep):
    """PI05Pytorch.embed_suffix; the time embedding in float32 (`sinusoidal_time_embedding`) and
    the attention mask row ([1, 0, ..., 0]: the action block starts a new causal block) made on
    the device."""
    import torch.nn.functional as F

    time_emb = sinusoidal_time_embedding(timestep, self.action_in_proj.out_features,
                                         self.config.min_period, self.config.max_period)
    time_emb = time_emb.type(dtype=timestep.dtype)
    action_emb = self._apply_checkpoint(self.action_in_proj, noisy_actions)

    def time_mlp_func(time_emb):
        x = self.time_mlp_in(time_emb)
        x = F.silu(x)
        x = self.time_mlp_out(x)
        return F.silu(x)

    adarms_cond = self._apply_checkpoint(time_mlp_func, time_emb)
    bsize, action_time_dim = action_emb.shape[:2]
    pad_masks = torch.ones(bsize, action_time_dim, dtype=torch.bool, device=timestep.device)
    chunk = self.config.chunk_size
    first = torch.arange(chunk, device=action_emb.device) == 0
    att_masks = first.to(dtype=action_emb.dtype)[None, :].expand(bsize, chunk)
    return action_emb, pad_masks, att_masks, adarms_cond


@contextlib.contextmanager
def sync_free_forward(policy, *, frozen_prefix: bool | None = None) -> Iterator[None]:
    """Within the block, `policy(batch)` returns the training loss tensor: no host sync, no
    tensor copied from a Python list, no float64 (see 5. above).

    `frozen_prefix`: run the prefix once without grad (`frozen_prefix_forward`, 8. above); None:
    exactly when every VLM parameter is frozen (`prefix_frozen`). True with a trainable VLM
    parameter is refused (its gradient would silently be zero)."""
    core = policy.model
    frozen = prefix_frozen(policy)
    if frozen_prefix and not frozen:
        raise ValueError("frozen_prefix=True but the PaliGemma VLM has trainable parameters: the frozen-prefix "
                         "forward would give them no gradient; freeze the VLM (train.trainable: expert) or "
                         "leave frozen_prefix to None")
    use_frozen = frozen if frozen_prefix is None else frozen_prefix
    policy.forward = _loss_forward.__get__(policy)
    core.embed_prefix = _embed_prefix.__get__(core)
    core.embed_suffix = _embed_suffix.__get__(core)
    core.forward = (frozen_prefix_forward if use_frozen else joint_forward).__get__(core)
    try:
        yield
    finally:
        del policy.forward
        del core.embed_prefix
        del core.embed_suffix
        del core.forward


@contextlib.contextmanager
def velocity_hook(policy, hook) -> Iterator[None]:
    """Within the block, every denoising step of `policy.predict_action_chunk` returns
    `hook(velocity)` where `velocity(x_t, timestep)` is LeRobot's own step (see 6. above).

    One inference at a time per policy (as `serve` and `closed_loop` run them): the hook is an
    attribute of the policy's model while the block lasts.
    """
    model = policy.model
    if "denoise_step" in vars(model):
        raise RuntimeError("velocity_hook: the policy's denoise_step is already hooked "
                           "(one inference at a time per policy)")
    original = model.denoise_step  # LeRobot's bound method

    def step(**kwargs):
        def velocity(x_t, timestep):
            return original(**{**kwargs, "x_t": x_t, "timestep": timestep})
        return hook(velocity)(kwargs["x_t"], kwargs["timestep"])

    setattr(step, _VELOCITY_HOOK, True)  # 9.: a compiled RTC chunk leaves a hooked step as it is
    model.denoise_step = step
    try:
        yield
    finally:
        del model.denoise_step


def set_non_blocking_transfers(preprocessor) -> None:
    """Host->device copies of LeRobot's device step without blocking, on every accelerator.

    `DeviceProcessorStep.__post_init__` sets `non_blocking = "cuda" in device`, so on `npu:<i>`
    every copy blocks the host until the device queue drains.
    """
    for step in getattr(preprocessor, "steps", ()):
        if hasattr(step, "non_blocking") and hasattr(step, "device"):
            step.non_blocking = str(step.device) != "cpu"


def build_on_meta(make: Any, config) -> Any:
    """Run `make(config)` (PI05Policy) on the meta device: no memory is allocated."""
    saved = config.device
    config.device = "meta"
    try:
        with torch.device("meta"):
            return make(config)
    finally:
        config.device = saved


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
    with _PATCH_LOCK, _patched(processor_pi05, replacements):
        return processor_pi05.make_pi05_pre_post_processors(config, dataset_stats=dataset_stats)


# What LeRobot's embed_prefix / embed_suffix / create_sinusoidal_pos_embedding must still do for
# `_embed_prefix`, `_embed_suffix` and `sinusoidal_time_embedding` to compute the same values.
_PREFIX_STEPS = ("self.paligemma_with_expert.embed_image(img)", "img_mask[:, None].expand(bsize, num_img_embs)",
                 "att_masks += [0] * num_img_embs", "self.paligemma_with_expert.embed_language_tokens(tokens)",
                 "att_masks += [0] * num_lang_embs", "torch.cat(embs, dim=1)", "torch.cat(pad_masks, dim=1)",
                 "att_masks[None, :].expand(bsize, len(att_masks))")
_SUFFIX_STEPS = ("create_sinusoidal_pos_embedding(", "self.action_in_proj.out_features",
                 "min_period=self.config.min_period", "max_period=self.config.max_period",
                 "time_emb.type(dtype=timestep.dtype)", "self.action_in_proj(noisy_actions)",
                 "x = self.time_mlp_in(time_emb)", "x = self.time_mlp_out(x)", "adarms_cond = time_emb",
                 "torch.ones(bsize, action_time_dim, dtype=torch.bool, device=timestep.device)",
                 "att_masks += [1] + ([0] * (self.config.chunk_size - 1))",
                 "dtype=action_emb.dtype", "att_masks[None, :].expand(bsize, len(att_masks))")
_SINUSOID_STEPS = ("torch.linspace(0.0, 1.0, dimension // 2", "min_period * (max_period / min_period) ** fraction",
                   "1.0 / period * 2 * math.pi", "scaling_factor[None, :] * time[:, None]",
                   "torch.cat([torch.sin(sin_input), torch.cos(sin_input)], dim=1)")


def _embedding_problems(m) -> list[str]:
    problems = []
    for name, steps in (("embed_prefix", _PREFIX_STEPS), ("embed_suffix", _SUFFIX_STEPS)):
        src = inspect.getsource(getattr(m.PI05Pytorch, name))
        problems += [f"PI05Pytorch.{name} no longer contains {s!r}: revisit _{name}"
                     for s in steps if s not in src]
    src = inspect.getsource(m.create_sinusoidal_pos_embedding)
    problems += [f"create_sinusoidal_pos_embedding no longer contains {s!r}: revisit "
                 "sinusoidal_time_embedding" for s in _SINUSOID_STEPS if s not in src]
    return problems


def structure_problems() -> list[str]:
    """Every assumption above checked against the installed LeRobot; empty list: all hold."""
    problems: list[str] = []
    try:
        m = _modeling()
        from lerobot.policies.pi05 import processor_pi05
    except Exception as exc:  # noqa: BLE001  # pragma: no cover - import failure is itself the report
        return [f"cannot import lerobot.policies.pi05: {exc}"]
    for name in ("get_gemma_config", "GemmaConfig", "PaliGemmaWithExpertModel", "PI05Pytorch",
                 "PaliGemmaForConditionalGenerationWithPiGemma", "PiGemmaForCausalLM",
                 "compute_layer_complete", "PI05Policy"):
        if not hasattr(m, name):
            problems.append(f"modeling_pi05.{name} no longer exists")
    if problems:
        return problems
    src_expert = inspect.getsource(m.PaliGemmaWithExpertModel.__init__)
    for needle in ("PaliGemmaForConditionalGenerationWithPiGemma(config=", "PiGemmaForCausalLM(config=",
                   "CONFIG_MAPPING[\"paligemma\"]()", "257152", "4304", "2048"):
        if needle not in src_expert:
            problems.append(f"PaliGemmaWithExpertModel.__init__ no longer contains {needle!r}")
    src_core = inspect.getsource(m.PI05Pytorch.__init__)
    for needle in ("get_gemma_config(config.paligemma_variant)",
                   "get_gemma_config(config.action_expert_variant)", "PaliGemmaWithExpertModel("):
        if needle not in src_core:
            problems.append(f"PI05Pytorch.__init__ no longer contains {needle!r}")
    params = inspect.signature(m.GemmaConfig.__init__).parameters
    for field in ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"):
        if field not in params:
            problems.append(f"modeling_pi05.GemmaConfig no longer takes {field!r}")
    if "8 * head_dim" not in inspect.getsource(m.compute_layer_complete):
        problems.append("compute_layer_complete no longer hard-codes 8 heads: revisit REQUIRED_NUM_HEADS")
    if "self.model.to(config.device)" not in inspect.getsource(m.PI05Policy.__init__):
        problems.append("PI05Policy.__init__ no longer ends with self.model.to(config.device)")
    src_forward = inspect.getsource(m.PI05Policy.forward)
    for needle in _FORWARD_STEPS:
        if needle not in src_forward:
            problems.append(f"PI05Policy.forward no longer contains {needle!r}: revisit sync_free_forward")
    problems += _embedding_problems(m)
    if "gemma_expert.model.gradient_checkpointing" not in inspect.getsource(
            m.PaliGemmaWithExpertModel.forward):
        problems.append("PaliGemmaWithExpertModel.forward no longer reads "
                        "gemma_expert.model.gradient_checkpointing: revisit enable_layer_checkpointing")
    src_sample = inspect.getsource(m.PI05Pytorch.sample_actions)
    for needle in ("euler_integrate(", "self.denoise_step(", "x_t=input_x_t", "timestep=current_timestep"):
        if needle not in src_sample:
            problems.append(f"PI05Pytorch.sample_actions no longer contains {needle!r}: revisit velocity_hook")
    step_params = list(inspect.signature(m.PI05Pytorch.denoise_step).parameters)
    if step_params != ["self", "prefix_pad_masks", "past_key_values", "x_t", "timestep"]:
        problems.append(f"PI05Pytorch.denoise_step takes {step_params[1:]}, not (prefix_pad_masks, "
                        "past_key_values, x_t, timestep): revisit velocity_hook")
    problems += _prefix_problems(m)
    problems += _frozen_prefix_problems(m)
    problems += _chunk_problems(m) + _bf16_problems(m)
    if not hasattr(processor_pi05, "TokenizerProcessorStep"):
        problems.append("processor_pi05.TokenizerProcessorStep no longer exists")
    elif "TokenizerProcessorStep(" not in inspect.getsource(processor_pi05.make_pi05_pre_post_processors):
        problems.append("make_pi05_pre_post_processors no longer builds a TokenizerProcessorStep")
    return problems


def _prefix_problems(m) -> list[str]:
    """The assumptions of 6. above (the value model's prefix-only pass)."""
    problems = []
    params = list(inspect.signature(m.PI05Pytorch.embed_prefix).parameters)
    if params[1:5] != ["images", "img_masks", "tokens", "masks"]:
        problems.append(f"PI05Pytorch.embed_prefix now takes {params[1:]}: revisit vlm_prefix_readout")
    forward = inspect.getsource(m.PaliGemmaWithExpertModel.forward)
    branch = forward.split("if inputs_embeds[1] is None:", 1)[-1].split("elif", 1)[0]
    if "if inputs_embeds[1] is None:" not in forward or "gemma_expert" in branch:
        problems.append("PaliGemmaWithExpertModel.forward's prefix-only branch changed (it must run the VLM "
                        "alone): revisit vlm_prefix_readout")
    if "past_key_values=past_key_values" not in branch or "prefix_output.past_key_values" not in branch:
        problems.append("PaliGemmaWithExpertModel.forward's prefix-only branch no longer takes and returns the "
                        "VLM's KV cache: revisit vlm_prefix_readout's frozen prefix")
    sample = inspect.getsource(m.PI05Pytorch.sample_actions)
    for needle in ("inputs_embeds=[prefix_embs, None]", '_attn_implementation = "eager"'):
        if needle not in sample:
            problems.append(f"PI05Pytorch.sample_actions no longer contains {needle!r}: revisit vlm_prefix_readout")
    return problems


# ------------------------------------------------------------------------------------------------
# 8. The frozen prefix: prefix once without grad, then the expert's layers over the suffix.

# What compute_layer_complete must still do for `_prefix_layer` / `_suffix_layer` to be its steps.
_LAYER_STEPS = ("layernorm_forward(layer.input_layernorm, hidden_states, adarms_cond[i])",
                "layer.self_attn.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
                "torch.cat(key_states, dim=2)", "cos, sin = rotary_emb(dummy_tensor, position_ids)",
                "modeling_gemma.apply_rotary_pos_emb(", "modeling_gemma.eager_attention_forward(",
                "att_output.reshape(batch_size, -1, 1 * 8 * head_dim)",
                "_gated_residual(hidden_states, out_emb, gates[i])", "after_first_residual = out_emb.clone()",
                "layernorm_forward(layer.post_attention_layernorm, out_emb, adarms_cond[i])",
                "if layer.mlp.up_proj.weight.dtype == torch.bfloat16:",
                "_gated_residual(after_first_residual, out_emb, gate)")
# What PI05Pytorch.forward must still do for `frozen_prefix_forward` to be the same computation.
_CORE_FORWARD_STEPS = ("x_t = time_expanded * noise + (1 - time_expanded) * actions", "u_t = noise - actions",
                       "self.embed_prefix(images, img_masks, tokens, masks)", "self.embed_suffix(x_t, time)",
                       "suffix_embs = suffix_embs.to(dtype=torch.bfloat16)",
                       "torch.cat([prefix_pad_masks, suffix_pad_masks], dim=1)",
                       "make_att_2d_masks(pad_masks, att_masks)", "torch.cumsum(pad_masks, dim=1) - 1",
                       "prepare_attention_masks_4d(att_2d_masks)", "adarms_cond=[None, adarms_cond]",
                       "suffix_out[:, -self.config.chunk_size :]", "suffix_out.to(dtype=torch.float32)",
                       "self.action_out_proj(suffix_out)", 'F.mse_loss(u_t, v_t, reduction="none")')


def prefix_frozen(policy) -> bool:
    """Whether no parameter of the PaliGemma VLM (the whole prefix) is trainable (8. above)."""
    paligemma = policy.model.paligemma_with_expert.paligemma
    return not any(p.requires_grad for p in paligemma.parameters())


def _rotary(rotary_emb, like: torch.Tensor, position_ids: torch.Tensor):
    dummy = torch.zeros(like.shape[0], like.shape[2], like.shape[-1], device=like.device, dtype=like.dtype)
    return rotary_emb(dummy, position_ids)


def _qkv(layer, hidden, cond):
    m = _modeling()
    hidden, gate = m.layernorm_forward(layer.input_layernorm, hidden, cond)
    shape = (*hidden.shape[:-1], -1, layer.self_attn.head_dim)
    attn = layer.self_attn
    fused = getattr(attn, FUSED_QKV, None)  # 12. below
    if fused is not None:
        q, k, v = fused(hidden).split(fused.pisft_split, dim=-1)
    else:
        q, k, v = attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)
    return q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2), gate


def _layer_out(layer, hidden, att_output, gate, cond):
    """compute_layer_complete's second half for one stream: o_proj, residuals, MLP."""
    m = _modeling()
    if att_output.dtype != layer.self_attn.o_proj.weight.dtype:
        att_output = att_output.to(layer.self_attn.o_proj.weight.dtype)
    out = m._gated_residual(hidden, layer.self_attn.o_proj(att_output), gate)  # noqa: SLF001
    after_first_residual = out.clone()
    out, gate = m.layernorm_forward(layer.post_attention_layernorm, out, cond)
    up = getattr(layer.mlp, FUSED_GATE_UP, None) or layer.mlp.up_proj  # 12. below
    if up.weight.dtype == torch.bfloat16:
        out = out.to(dtype=torch.bfloat16)
    return m._gated_residual(after_first_residual, layer.mlp(out), gate)  # noqa: SLF001


def _attend(layer, q, k, v, mask):
    m = _modeling()
    out, _ = m.modeling_gemma.eager_attention_forward(layer.self_attn, q, k, v, mask, layer.self_attn.scaling)
    return out.reshape(q.shape[0], -1, 1 * 8 * layer.self_attn.head_dim)


def prefix_layer(layer, hidden, mask, position_ids, rotary_emb, *, last: bool = False):
    """One VLM layer over the prefix alone: (its output, its post-rotary keys, its values). The
    last layer's output is None: no loss reads it, only its keys and values (11. below)."""
    m = _modeling()
    q, k, v, gate = _qkv(layer, hidden, None)
    cos, sin = _rotary(rotary_emb, q, position_ids)
    q, k = m.modeling_gemma.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    if last:
        return None, k, v
    return _layer_out(layer, hidden, _attend(layer, q, k, v, mask), gate, None), k, v


def suffix_layer(layer, hidden, prefix_k, prefix_v, mask, position_ids, cond, rotary_emb):
    """One action-expert layer over the suffix, attending to [prefix K/V, its own K/V]."""
    m = _modeling()
    q, k, v, gate = _qkv(layer, hidden, cond)
    cos, sin = _rotary(rotary_emb, q, position_ids)
    q, k = m.modeling_gemma.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    k = torch.cat([prefix_k, k], dim=2)
    v = torch.cat([prefix_v, v], dim=2)
    return _layer_out(layer, hidden, _attend(layer, q, k, v, mask), gate, cond)


def pair_layer(vlm_layer, expert_layer, prefix, suffix, mask, position_ids, cond, rotary_emb, *,
               last: bool = False):
    """`compute_layer_complete` for one (VLM layer, expert layer) pair, stream by stream (the same
    steps, `_LAYER_STEPS`): both streams' queries, keys and values, one joint attention, each
    stream's output projection, residuals and MLP. Returns (prefix out, suffix out). The last
    pair's VLM stream stops after the attention (its output is None): its output projection and
    MLP feed only the VLM's final norm, which no loss reads (11. below)."""
    m = _modeling()
    qp, kp, vp, gate_p = _qkv(vlm_layer, prefix, None)
    qs, ks, vs, gate_s = _qkv(expert_layer, suffix, cond)
    q, k, v = torch.cat([qp, qs], dim=2), torch.cat([kp, ks], dim=2), torch.cat([vp, vs], dim=2)
    cos, sin = _rotary(rotary_emb, q, position_ids)
    q, k = m.modeling_gemma.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    att = _attend(vlm_layer, q, k, v, mask)
    n = prefix.shape[1]
    suffix = _layer_out(expert_layer, suffix, att[:, n:], gate_s, cond)
    if last:
        return None, suffix
    return _layer_out(vlm_layer, prefix, att[:, :n], gate_p, None), suffix


# ------------------------------------------------------------------------------------------------
# 11. The training forward, block by block. `PI05Pytorch.forward` is run as pisft's own loop over
# the repeated blocks (`joint_forward`; `frozen_prefix_forward` for a frozen VLM): the same steps
# (`_CORE_FORWARD_STEPS`), each decoder layer pair (or VLM layer, or expert layer) one call of
# `run_block`. A block is then the unit of FSDP2 (its gather and reduce-scatter), of activation
# checkpointing and of torch.compile (pisft.train.blocks installs a runner on the block's first
# layer; torchtitan compiles and shards each TransformerBlock the same way). LeRobot's own loop
# (`PaliGemmaWithExpertModel.forward`) calls `compute_layer_complete` on the layers' parts, never a
# module holding the block, so neither FSDP2's hooks nor a compiled region could hold a whole block.
# The last VLM layer's output projection and MLP are not run: their output reaches only the VLM's
# final norm, which no loss reads (LeRobot computes them and autograd gives them no gradient).

BLOCK_RUNNER = "pisft_block_runner"  # attribute of a block's first layer (pisft.train.blocks)


def layers_checkpointed(core) -> bool:
    """Whether the decoder layers recompute their forward in backward (`enable_layer_checkpointing`)."""
    return bool(getattr(core.paligemma_with_expert.gemma_expert.model, "gradient_checkpointing", False))


def run_block(anchor, fn, *args, checkpoint: bool = False, partner=None, **kwargs):
    """`fn(*args, **kwargs)`, one block of the training forward whose first layer is `anchor`,
    recomputed in backward when `checkpoint`: through the runner pisft.train.blocks installed on
    `anchor` (FSDP2's forward method, torch.compile), or plainly without one. `partner`: a layer the
    block also runs (a pair's expert layer); when it is a block of its own (a frozen VLM's layout,
    pisft.train.fsdp, run through the joint forward) its runner wraps this one without compiling or
    checkpointing anything, so that its FSDP2 unit is gathered too."""
    outer = getattr(partner, BLOCK_RUNNER, None) if partner is not None else None
    if outer is not None:
        return outer(functools.partial(run_block, anchor, fn, checkpoint=checkpoint), *args, plain=True, **kwargs)
    runner = getattr(anchor, BLOCK_RUNNER, None)
    if runner is not None:
        return runner(fn, *args, checkpoint=checkpoint, **kwargs)
    return checkpointed(fn, *args, **kwargs) if checkpoint else fn(*args, **kwargs)


def checkpointed(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` with its activations recomputed in backward: LeRobot's per-layer
    checkpoint (`torch.utils.checkpoint`, non-reentrant, no RNG state: the layers draw none)."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def _inputs(self, images, img_masks, tokens, masks, actions, noise, time, *, frozen: bool):
    """PI05Pytorch.forward up to its decoder: the flow-matching target, both streams' embeddings
    (the prefix without grad when `frozen`), the joint mask and positions."""
    from lerobot.policies.common.vla_utils import make_att_2d_masks, prepare_attention_masks_4d

    time_expanded = time[:, None, None]
    x_t = time_expanded * noise + (1 - time_expanded) * actions
    u_t = noise - actions
    with torch.no_grad() if frozen else contextlib.nullcontext():
        prefix_embs, prefix_pad_masks, prefix_att_masks = self.embed_prefix(images, img_masks, tokens, masks)
    suffix_embs, suffix_pad_masks, suffix_att_masks, adarms_cond = self.embed_suffix(x_t, time)
    vlm = self.paligemma_with_expert.paligemma.model.language_model
    if query_projection(vlm.layers[0].self_attn).weight.dtype == torch.bfloat16:  # LeRobot reads q_proj's
        suffix_embs = suffix_embs.to(dtype=torch.bfloat16)
        prefix_embs = prefix_embs.to(dtype=torch.bfloat16)
    pad_masks = torch.cat([prefix_pad_masks, suffix_pad_masks], dim=1)
    att_masks = torch.cat([prefix_att_masks, suffix_att_masks], dim=1)
    position_ids = torch.cumsum(pad_masks, dim=1) - 1
    mask_4d = prepare_attention_masks_4d(make_att_2d_masks(pad_masks, att_masks))
    return u_t, prefix_embs, suffix_embs, adarms_cond, mask_4d, position_ids


def _loss(self, expert, hidden, adarms_cond, u_t):
    """PI05Pytorch.forward after its decoder: the expert's final norm, the action projection, the loss."""
    import torch.nn.functional as F

    suffix_out, _ = _modeling().layernorm_forward(expert.norm, hidden, adarms_cond)
    suffix_out = suffix_out[:, -self.config.chunk_size:].to(dtype=torch.float32)
    v_t = self.action_out_proj(suffix_out)
    return F.mse_loss(u_t, v_t, reduction="none")


def joint_forward(self, images, img_masks, tokens, masks, actions, noise, time):
    """PI05Pytorch.forward (a trainable VLM): same inputs, same per-element losses, each layer pair
    one block (11. above)."""
    pwe = self.paligemma_with_expert
    vlm = pwe.paligemma.model.language_model
    expert = pwe.gemma_expert.model
    u_t, prefix, suffix, cond, mask_4d, position_ids = _inputs(self, images, img_masks, tokens, masks, actions,
                                                               noise, time, frozen=False)
    checkpointing = layers_checkpointed(self) and self.training
    last = len(vlm.layers) - 1
    for i, (vlm_layer, expert_layer) in enumerate(zip(vlm.layers, expert.layers, strict=True)):
        prefix, suffix = run_block(vlm_layer, pair_layer, vlm_layer, expert_layer, prefix, suffix, mask_4d,
                                   position_ids, cond, vlm.rotary_emb, last=i == last, checkpoint=checkpointing,
                                   partner=expert_layer)
    return _loss(self, expert, suffix, cond, u_t)


def frozen_prefix_forward(self, images, img_masks, tokens, masks, actions, noise, time):
    """PI05Pytorch.forward for a frozen VLM (8. above): same inputs, same per-element losses; each VLM
    layer and each expert layer one block (11. above)."""
    pwe = self.paligemma_with_expert
    vlm = pwe.paligemma.model.language_model
    expert = pwe.gemma_expert.model
    u_t, hidden, suffix, cond, mask_4d, position_ids = _inputs(self, images, img_masks, tokens, masks, actions,
                                                               noise, time, frozen=True)
    n = hidden.shape[1]
    kv = []
    last = len(vlm.layers) - 1
    with torch.no_grad():
        for i, layer in enumerate(vlm.layers):
            hidden, k, v = run_block(layer, prefix_layer, layer, hidden, mask_4d[:, :, :n, :n],
                                     position_ids[:, :n], vlm.rotary_emb, last=i == last)
            kv.append((k, v))
    checkpointing = layers_checkpointed(self) and self.training
    suffix_mask, suffix_pos = mask_4d[:, :, n:, :], position_ids[:, n:]
    for layer, (k, v) in zip(expert.layers, kv, strict=True):
        suffix = run_block(layer, suffix_layer, layer, suffix, k, v, suffix_mask, suffix_pos, cond, vlm.rotary_emb,
                           checkpoint=checkpointing)
    return _loss(self, expert, suffix, cond, u_t)


def _frozen_prefix_problems(m) -> list[str]:
    problems = [f"compute_layer_complete no longer contains {s!r}: revisit _prefix_layer/_suffix_layer"
                for s in _LAYER_STEPS if s not in inspect.getsource(m.compute_layer_complete)]
    src = inspect.getsource(m.PI05Pytorch.forward)
    problems += [f"PI05Pytorch.forward no longer contains {s!r}: revisit frozen_prefix_forward"
                 for s in _CORE_FORWARD_STEPS if s not in src]
    fwd = inspect.getsource(m.PaliGemmaWithExpertModel.forward)
    for needle in ("self.paligemma.model.language_model.rotary_emb", "self.gemma_expert.model.norm"):
        if needle not in fwd:
            problems.append(f"PaliGemmaWithExpertModel.forward no longer uses {needle}: revisit "
                            "frozen_prefix_forward")
    return problems


# ------------------------------------------------------------------------------------------------
# 9. The chunk's entry points for a compiled program (pisft.policy.compiled).

# What LeRobot's pi0.5 must still do for an instance attribute to take its chunks (9. above).
_CHUNK_CALL = "self.model.sample_actions(images, img_masks, tokens, masks, **kwargs)"
_SAMPLE_CALLS = ("self.embed_prefix(images, img_masks, tokens, masks)", "inputs_embeds=[prefix_embs, None]",
                 "self.denoise_step(", "rtc_processor=self.rtc_processor",
                 'prev_chunk_left_over=kwargs.get("prev_chunk_left_over")')
_PREFIX_CALL = "self.paligemma.model.language_model.forward("
_RTC_ORDER = ("v_t = original_denoise_step_partial(x_t)", "x_t.requires_grad_(True)")
_VELOCITY_HOOK = "_pisft_velocity_hook"  # marks the step velocity_hook installs (6.)


def install_sample_actions(policy, fn) -> None:
    """Every `policy.predict_action_chunk` runs `fn(images, img_masks, tokens, masks, noise=,
    num_steps=, **rtc)` in place of LeRobot's `PI05Pytorch.sample_actions` (9. above)."""
    policy.model.sample_actions = fn


def remove_sample_actions(policy) -> None:
    vars(policy.model).pop("sample_actions", None)


def lerobot_sample_actions(policy):
    """LeRobot's own `sample_actions`, bound to the policy's model (whatever is installed)."""
    core = policy.model
    return type(core).sample_actions.__get__(core)


def _prefix_vlm(policy):
    return policy.model.paligemma_with_expert.paligemma.model.language_model


def rtc_pieces(policy) -> dict[str, Any]:
    """LeRobot's three model calls of a chunk, bound (9. above): `embed_prefix`, the VLM's
    `forward` (the prefix pass) and `denoise_step`."""
    core, vlm = policy.model, _prefix_vlm(policy)
    return {"embed_prefix": type(core).embed_prefix.__get__(core),
            "prefix_forward": type(vlm).forward.__get__(vlm),
            "denoise_step": type(core).denoise_step.__get__(core)}


def velocity_hooked(policy) -> bool:
    """Whether `velocity_hook` (6.) holds the policy's denoising step now."""
    step = vars(policy.model).get("denoise_step")
    return step is not None and getattr(step, _VELOCITY_HOOK, False)


@contextlib.contextmanager
def pieces_installed(policy, pieces: dict[str, Any]) -> Iterator[bool]:
    """Within the block LeRobot's `sample_actions` calls `pieces` (compiled `rtc_pieces`) for its
    prefix and its denoising steps; yields whether the steps are the given ones (not while
    `velocity_hook` holds them: a guided chunk's steps then run LeRobot's own)."""
    core, vlm = policy.model, _prefix_vlm(policy)
    hooked = velocity_hooked(policy)
    core.embed_prefix = pieces["embed_prefix"]
    vlm.forward = pieces["prefix_forward"]
    if not hooked:
        core.denoise_step = pieces["denoise_step"]
    try:
        yield not hooked
    finally:
        del core.embed_prefix
        del vlm.forward
        if not hooked:
            del core.denoise_step


def _chunk_problems(m) -> list[str]:
    """The assumptions of 9. above."""
    from lerobot.policies.rtc import modeling_rtc

    problems = []
    if _CHUNK_CALL not in inspect.getsource(m.PI05Policy.predict_action_chunk):
        problems.append(f"PI05Policy.predict_action_chunk no longer calls {_CHUNK_CALL!r}: revisit "
                        "install_sample_actions")
    sample = inspect.getsource(m.PI05Pytorch.sample_actions)
    problems += [f"PI05Pytorch.sample_actions no longer contains {s!r}: revisit rtc_pieces"
                 for s in _SAMPLE_CALLS if s not in sample]
    params = list(inspect.signature(m.PI05Pytorch.sample_actions).parameters)
    if params != ["self", "images", "img_masks", "tokens", "masks", "noise", "num_steps", "kwargs"]:
        problems.append(f"PI05Pytorch.sample_actions takes {params[1:]}: revisit pisft.policy.compiled")
    if "self.sample_actions = torch.compile(self.sample_actions" not in inspect.getsource(m.PI05Pytorch.__init__):
        problems.append("PI05Pytorch.__init__ no longer compiles sample_actions as an instance attribute: "
                        "revisit install_sample_actions")
    forward = inspect.getsource(m.PaliGemmaWithExpertModel.forward)
    branch = forward.split("if inputs_embeds[1] is None:", 1)[-1].split("elif", 1)[0]
    if _PREFIX_CALL not in branch:
        problems.append(f"PaliGemmaWithExpertModel.forward's prefix-only branch no longer calls {_PREFIX_CALL!r}: "
                        "revisit pieces_installed")
    rtc = inspect.getsource(modeling_rtc.RTCProcessor.denoise_step)
    if not all(s in rtc for s in _RTC_ORDER) or rtc.index(_RTC_ORDER[0]) > rtc.index(_RTC_ORDER[1]):
        problems.append("RTCProcessor.denoise_step no longer takes the model's velocity before x_t requires "
                        "grad: the compiled RTC chunk's no_grad step would drop a gradient; revisit pieces_installed")
    return problems


# ------------------------------------------------------------------------------------------------
# 10. bf16 where openpi runs bf16.

# openpi's `to_bfloat16_for_selected_params` keeps these (name substrings, relative to
# PaliGemmaWithExpertModel) in float32: Physical-Intelligence/openpi @ 15a9616,
# src/openpi/models_pytorch/gemma_pytorch.py.
OPENPI_FP32 = ("vision_tower.vision_model.embeddings.patch_embedding.weight",
               "vision_tower.vision_model.embeddings.patch_embedding.bias",
               "vision_tower.vision_model.embeddings.position_embedding.weight",
               "input_layernorm", "post_attention_layernorm", "model.norm")
# What LeRobot 0.6.1 keeps besides (its params_to_keep_float32), checked by structure_problems.
LEROBOT_FP32 = ("vision_tower", "multi_modal_projector", "input_layernorm", "post_attention_layernorm",
                "model.norm")
_BF16_HOOK = "_pisft_bf16_encoder_hook"


def _vision(policy):
    return policy.model.paligemma_with_expert.paligemma.model.vision_tower.vision_model


def _cast_embeddings(encoder, args, kwargs):
    """SigLIP's encoder gets its embeddings in its layers' dtype (openpi's cast, 10. above)."""
    dtype = encoder.layers[0].self_attn.q_proj.weight.dtype
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None and embeds.dtype != dtype:
        kwargs = {**kwargs, "inputs_embeds": embeds.to(dtype)}
    return args, kwargs


def openpi_bf16(policy) -> int:
    """Cast a bf16 policy's float32 parameters to bf16 except openpi's (`OPENPI_FP32`) and the
    action/time projections (10. above); returns how many parameters were cast. A policy built in
    float32 is refused: its float32 layout is LeRobot's `precision="float32"`, not a bf16 one."""
    pwe = policy.model.paligemma_with_expert
    q = pwe.paligemma.model.language_model.layers[0].self_attn.q_proj.weight
    if q.dtype != torch.bfloat16:
        raise ValueError("openpi_bf16: the policy was not built in bf16 (config.dtype = 'bfloat16')")
    cast = 0
    for name, p in pwe.named_parameters():
        if p.dtype == torch.float32 and not any(sel in name for sel in OPENPI_FP32):
            p.data = p.data.to(torch.bfloat16)
            cast += p.numel()
    encoder = _vision(policy).encoder
    if not getattr(encoder, _BF16_HOOK, False):
        encoder.register_forward_pre_hook(_cast_embeddings, with_kwargs=True)
        setattr(encoder, _BF16_HOOK, True)
    return cast


def float32_parts(policy) -> dict[str, int]:
    """Float32 parameters per part of the policy (`model.<part>`, the VLM's vision tower, projector,
    language model and the expert apart), for the records of what runs in float32."""
    out: dict[str, int] = {}
    for name, p in policy.named_parameters():
        if p.dtype != torch.float32:
            continue
        parts = name.split(".")
        key = ".".join(parts[1:5] if parts[1] == "paligemma_with_expert" and parts[2] == "paligemma"
                       else parts[1:3] if parts[1] == "paligemma_with_expert" else parts[1:2])
        out[key] = out.get(key, 0) + p.numel()
    return out


def _bf16_problems(m) -> list[str]:
    """The assumptions of 10. above."""
    from transformers.models.siglip import modeling_siglip

    problems = []
    src = inspect.getsource(m.PaliGemmaWithExpertModel.to_bfloat16_for_selected_params)
    problems += [f"to_bfloat16_for_selected_params no longer keeps {s!r} in float32: revisit openpi_bf16"
                 for s in LEROBOT_FP32 if f'"{s}"' not in src]
    vit = inspect.getsource(modeling_siglip.SiglipVisionTransformer.forward)
    if "self.encoder(" not in vit or "inputs_embeds=hidden_states" not in vit:
        problems.append("SiglipVisionTransformer.forward no longer calls self.encoder(inputs_embeds=...): "
                        "revisit openpi_bf16's cast")
    if "features.to(out_dtype)" not in inspect.getsource(m.PaliGemmaWithExpertModel.embed_image):
        problems.append("PaliGemmaWithExpertModel.embed_image no longer returns the image's dtype: revisit openpi_bf16")
    return problems


# ------------------------------------------------------------------------------------------------
# 12. Fused projections for training (`fuse_decoder_projections`). Each Gemma decoder layer's
# q/k/v projections become one Linear (`qkv_proj`, rows q then k then v) and its MLP's gate/up one
# Linear (`gate_up_proj`, rows gate then up), as Huawei's pi0.5 recipe for Ascend fuses them
# (hicann/cann-recipes-embodied-intelligence, manipulation/pi05/train: the QKV and the gate/up
# projections): one matrix product instead of three (two), and one FSDP2 parameter instead of
# three (two) to gather, cast and reduce each step. The values are the same: a fused product's
# rows are the separate products' rows. Fused after loading (the file keeps LeRobot's names and
# strict loading holds) and split on export (`split_name`, pisft.train.export_weights); only the
# training model is fused (pisft's layer functions above read either), never a LoRA-adapted
# projection (peft wraps the separate ones) nor a model LeRobot's own forward runs.

FUSED_QKV = "qkv_proj"  # on a decoder layer's self_attn
FUSED_GATE_UP = "gate_up_proj"  # on a decoder layer's mlp
_QKV_PARTS = ("q_proj", "k_proj", "v_proj")
_GATE_UP_PARTS = ("gate_proj", "up_proj")


class FusedGemmaMLP(torch.nn.Module):
    """LeRobot's `pi_gemma.GemmaMLP` (down_proj(act(gate_proj(x)) * up_proj(x))) with gate and up
    in one product (`gate_up_proj`)."""

    def __init__(self, gate_up_proj: torch.nn.Linear, down_proj: torch.nn.Linear, act_fn: Any) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _fused_linear(parts: list[torch.nn.Linear]) -> torch.nn.Linear | None:
    """One Linear holding `parts`' rows, or None when they cannot be one parameter (a LoRA-wrapped
    part, a bias on some only, parts that train and parts that do not, mixed dtypes)."""
    if any(type(p) is not torch.nn.Linear for p in parts):  # exactly nn.Linear: peft's LoRA layers wrap it
        return None
    weights = [p.weight for p in parts]
    biases = [p.bias for p in parts]
    if (len({w.requires_grad for w in weights}) > 1 or len({w.dtype for w in weights}) > 1
            or len({b is None for b in biases}) > 1):
        return None
    fused = torch.nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=biases[0] is not None,
                            device=weights[0].device, dtype=weights[0].dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat(weights, dim=0))
        if biases[0] is not None:
            fused.bias.copy_(torch.cat(biases, dim=0))
    fused.requires_grad_(weights[0].requires_grad)
    fused.pisft_split = [p.out_features for p in parts]
    return fused


def query_projection(attn):
    """A decoder layer's Linear that makes its queries: `q_proj`, or fused, `qkv_proj`."""
    return getattr(attn, FUSED_QKV, None) or attn.q_proj


def attention_projections(attn) -> list:
    """A decoder layer's Linear layers that make its queries, keys and values (one when fused)."""
    fused = getattr(attn, FUSED_QKV, None)
    return [fused] if fused is not None else [getattr(attn, n) for n in _QKV_PARTS]


def query_width(attn) -> int:
    """Query heads x head dim of a decoder layer's attention (fused or not)."""
    return int(attn.config.num_attention_heads * attn.head_dim)


def decoder_layers(policy) -> list:
    """Every Gemma decoder layer of the policy: the VLM's, then the action expert's."""
    pwe = policy.model.paligemma_with_expert
    return [*pwe.paligemma.model.language_model.layers, *pwe.gemma_expert.model.layers]


def fuse_decoder_projections(policy) -> int:
    """Fuse each decoder layer's q/k/v and gate/up projections in place (12. above); returns the
    number of fused products. Call after the trainable mode is applied (a LoRA-wrapped or
    partly trained group stays as it is), before sharding."""
    fused_count = 0
    for layer in decoder_layers(policy):
        attn = layer.self_attn
        if getattr(attn, FUSED_QKV, None) is None:
            fused = _fused_linear([getattr(attn, n) for n in _QKV_PARTS])
            if fused is not None:
                for n in _QKV_PARTS:
                    delattr(attn, n)
                setattr(attn, FUSED_QKV, fused)
                fused_count += 1
        mlp = layer.mlp
        if not isinstance(mlp, FusedGemmaMLP):
            fused = _fused_linear([getattr(mlp, n) for n in _GATE_UP_PARTS])
            if fused is not None:
                layer.mlp = FusedGemmaMLP(fused, mlp.down_proj, mlp.act_fn)
                fused_count += 1
    return fused_count


def split_name(name: str) -> list[tuple[str, int, int]] | None:
    """A fused parameter's name -> (LeRobot's name, first row, end row) of each part; None: not fused."""
    for fused, parts in ((f"self_attn.{FUSED_QKV}.", _QKV_PARTS), (f"mlp.{FUSED_GATE_UP}.", _GATE_UP_PARTS)):
        if fused in name:
            return [(name.replace(fused, fused.rsplit(".", 2)[0] + f".{part}."), -1, -1) for part in parts]
    return None


def split_rows(module_of, name: str) -> list[tuple[str, int, int]] | None:
    """`split_name` with each part's rows, read off the fused Linear (`module_of(name)`)."""
    parts = split_name(name)
    if parts is None:
        return None
    sizes = module_of(name).pisft_split
    out, start = [], 0
    for (plain, _, _), size in zip(parts, sizes, strict=True):
        out.append((plain, start, start + size))
        start += size
    return out


# ------------------------------------------------------------------------------------------------
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
EXPERT_HEAD = f"{EXPERT}.lm_head.weight"  # the expert's unused LM head (5. above)
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
