"""pi0.5's training loss and embeddings without host synchronisation (5.): `PI05Policy.forward`
without the `.item()` of its log dict, `embed_prefix` / `embed_suffix` with their mask rows made on
the device and the time embedding in float32 (`sinusoidal_time_embedding`), the cameras through
SigLIP in one batch (11.). `pisft.model.pi05.checks` holds the steps of LeRobot's they must match.

Numbers (5., 9., ...) are the items of the package's docstring (`pisft.model.pi05`).
"""

from __future__ import annotations

import math

import torch


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
