"""Pure tensor functions of the engine's forward: norms, rotary embeddings, masks, MoE routing.

No parameters live here; the model passes its (local) weights in. Norm and softmax math runs
in float32 and returns the input dtype.

Rotary conventions (one per family, documented here once):

* Qwen3, Qwen3-MoE, GLM-4.5: neox style (rotate halves), on the first
  ``head_dim * partial_rotary_factor`` dims of each head (GLM-4.5: half the head).
* MLA (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash, GLM-5): interleaved style (rotate pairs
  ``(2i, 2i+1)``) on the ``qk_rope_head_dim`` part, as sglang's DeepseekV2 (``is_neox_style=False``).
  HF's DeepseekV3 de-interleaves before a neox rotation, which gives the same dot products.
* DSA indexer (GLM-5): neox style on its first ``qk_rope_head_dim`` dims.

Not modelled: YaRN / rope scaling (the spec carries no ``rope_scaling``; it changes frequencies
and the MLA softmax scale of the full-size Kimi-K2 / DeepSeek-V3 only).

Legend: ``B`` batch, ``S`` query positions, ``T`` key positions, ``N`` tokens, ``E`` experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (float32 math)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim (float32 math)."""
    y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return y.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, rot_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``positions.shape + (rot_dim // 2,)`` in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, device=positions.device, dtype=torch.float32) / rot_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    return freqs.cos(), freqs.sin()


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of the first ``2 * cos.shape[-1]`` dims of ``x [B, S, h, d]``; the rest passes."""
    rot = 2 * cos.shape[-1]
    xr, rest = x[..., :rot].float(), x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(2i, 2i+1)`` of ``x [B, S, h, r]`` (``r = 2 * cos.shape[-1]``)."""
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)


def causal_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[B, S, T]`` bool: query at position ``p`` sees keys ``0..p`` (keys are stored by position)."""
    keys = torch.arange(num_keys, device=positions.device)
    return keys[None, None, :] <= positions[:, :, None]


def route_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing (Qwen3-MoE): ``(weights [N, k] float32, expert ids [N, k])``."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_sigmoid(
    logits: torch.Tensor,
    *,
    top_k: int,
    bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid routing with correction bias and group-limited top-k (DeepSeek-V3 ``noaux_tc``).

    The bias only steers the choice; the weights are the unbiased sigmoid scores of the chosen
    experts (renormalized, then multiplied by ``scaling``). With ``n_group > 1`` only experts of
    the ``topk_group`` groups with the largest sum of their two best biased scores compete.

    Returns:
        ``(weights [N, k] float32, expert ids [N, k])``.
    """
    scores = torch.sigmoid(logits.float())
    choice = scores + bias.float() if bias is not None else scores
    if n_group > 1:
        n, e = choice.shape
        grouped = choice.view(n, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(n, e)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[..., 2 * I]`` tensor laid out as ``[gate; up]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
