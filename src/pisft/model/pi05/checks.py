"""Every assumption pisft makes about LeRobot's pi0.5 source (`structure_problems`), checked against
the installed LeRobot: the steps of LeRobot's that pisft's own forward, embeddings, chunk entry
points and bf16 layout must still match. `tests/test_model_internals.py` runs it.

Numbers (5., 9., ...) are the items of the package's docstring (`pisft.model.pi05`).
"""

from __future__ import annotations

import inspect

from pisft.model.pi05.precision import LEROBOT_FP32
from pisft.model.pi05.modeling import lerobot_pi05

# What PI05Policy.forward must still do for `sync_free_forward` to be the same computation.
_FORWARD_STEPS = ("self._preprocess_images(batch)", "self.prepare_action(batch)",
                  "self.model.sample_noise(actions.shape, actions.device)",
                  "self.model.sample_time(actions.shape[0], actions.device)",
                  "self.model.forward(images, img_masks, tokens, masks, actions, noise, time)",
                  "losses[:, :, :original_action_dim]", "loss = losses.mean()")


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
    """Every assumption of this package checked against the installed LeRobot; empty list: all hold."""
    problems: list[str] = []
    try:
        m = lerobot_pi05()
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
    """The assumptions of 6. (the value model's prefix-only pass)."""
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


# What LeRobot's pi0.5 must still do for an instance attribute to take its chunks (9.).
_CHUNK_CALL = "self.model.sample_actions(images, img_masks, tokens, masks, **kwargs)"
_SAMPLE_CALLS = ("self.embed_prefix(images, img_masks, tokens, masks)", "inputs_embeds=[prefix_embs, None]",
                 "self.denoise_step(", "rtc_processor=self.rtc_processor",
                 'prev_chunk_left_over=kwargs.get("prev_chunk_left_over")')
_PREFIX_CALL = "self.paligemma.model.language_model.forward("
_RTC_ORDER = ("v_t = original_denoise_step_partial(x_t)", "x_t.requires_grad_(True)")


def _chunk_problems(m) -> list[str]:
    """The assumptions of 9.."""
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


def _bf16_problems(m) -> list[str]:
    """The assumptions of 10.."""
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
