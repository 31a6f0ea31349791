"""pi0.5 (LeRobot 0.6.1's `PI05Policy`): THE ONE PLACE where pisft reaches into LeRobot's pi0.5
internals, one module per concern, and the model's entry in pisft's registry (`pisft.model.registry`).

Everything here depends on how `lerobot.policies.pi05` is written, not on a public API, so
`tests/test_model_internals.py` checks every assumption below (`checks.structure_problems`) and
fails loudly when LeRobot changes underneath. Nothing outside this package patches or inspects
LeRobot's private structure. The modules:
- `modeling`: LeRobot's pi0.5 module and the lock every patch of it holds;
- `construction`: sizes (1.), tied embeddings (2.), the meta device (4.), the training structure
  (5.) and the value model's backbone (7.);
- `processors`: LeRobot's processor pipelines on a local tokenizer (3.);
- `embedding`, `forward`: the sync-free loss (5.), the frozen prefix (8.), the forward block by
  block (11.) and the value model's prefix pass (7.);
- `chunk`: the velocity of a denoising step (6.) and the compiled chunk's entry points (9.);
- `precision`: bf16 where openpi runs bf16 (10.);
- `fused`: fused projections (12.);
- `parts`: pi0.5's parts by name (13.);
- `units`: its FSDP2 units (14.);
- `trainable`: its side of the trainable modes and its LoRA target presets (15.);
- `attention`: the fused-kernel swap of LeRobot's `modeling_gemma` for training;
- `flops`: the analytic FLOP counts;
- `presets`: the architecture presets (`model.preset`);
- `rtc`: LeRobot's real-time chunking on a policy;
- `checks`: every source assumption above, checked against the installed LeRobot;
- `spec`: the `ModelSpec` pisft's other packages ask for (`pisft.model.registry.model_spec("pi05")`).

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
12. Fused projections (`fuse_decoder_projections`, `split_name`): see `fused`.
13. pi0.5's parts by name (`VISION_TOWER`, `VLM_LAYERS`, `EXPERT_LAYERS`, ..., `part`): LeRobot's
    module paths inside a `PI05Policy`, written here once; training, the value model, the
    estimate and the benches ask for a part instead of spelling its path.
14. FSDP2 units (`policy_units`, `prefix_units`, `value_units`): which modules of a `PI05Policy` (or
    of the RECAP value model's prefix) form one unit, in forward order; pisft.train.fsdp shards them
    (`pisft.model.units.Unit`). A decoder layer pair is one unit (its block runs through `run_block`,
    11.), the vision layers three to a unit and gathered once; with a frozen VLM (8.) one unit per layer.
15. The trainable modes' parts (`PARTS`: SigLIP's vision tower, the whole PaliGemma VLM, by their paths,
    13.), LeRobot's freezing flags' module (`freeze_flags`: `PaliGemmaWithExpertModel`), what LeRobot
    keeps in float32 (`KEEP_FP32`, 10.) and the LoRA target presets `lerobot`, `openpi`, `rlinf`
    (`lora_preset`); pisft.train.trainable applies the modes (`pisft.config.TRAINABLE_MODE_TABLE`).
"""
