"""Pure tensor functions of the engine's forward: norms, rotary embeddings, masks, MoE routing.

No parameters live here; the model passes its (local) weights in. Norm and softmax math runs
in float32 and returns the input dtype.

Rotary conventions (one per family, documented here once):

* Qwen3, Qwen3-MoE, GLM-4.5: neox style (rotate halves), on the first
  ``head_dim * partial_rotary_factor`` dims of each head (GLM-4.5: half the head).
* MLA (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash, GLM-5): interleaved style (rotate pairs
  ``(2i, 2i+1)``) on the ``qk_rope_head_dim`` part, as sglang's DeepseekV2 (``is_neox_style=False``).
  HF's DeepseekV3 de-interleaves before a neox rotation, which gives the same dot products.
  ``rope_interleave: false`` in config.json rotates halves instead (transformers' DeepseekV3).
* DSA indexer: on its first ``qk_rope_head_dim`` dims, in pairs (GLM-5, ``indexer_rope_interleave``)
  or halves (DeepSeek-V3.2).

YaRN (``spec.rope_scaling``): the inverse frequencies and the cos/sin factor of transformers'
``_compute_yarn_parameters`` (:func:`rope_inv_freq`); MLA's softmax-scale correction is applied
by the attention.

Legend: ``B`` batch, ``S`` query positions, ``T`` key positions, ``N`` tokens, ``E`` experts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from weightsync.models.spec import RopeScaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (float32 math)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim (float32 math)."""
    y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return y.to(x.dtype)


def rope_inv_freq(rot_dim: int, theta: float, scaling: RopeScaling | None = None,
                  device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rot_dim // 2]`` (float32) and the factor cos and sin are scaled by.

    Plain rope: ``1 / theta^(2i / d)`` and 1. YaRN: interpolated frequencies ``1 / (factor *
    theta^(2i/d))`` for the dims below the correction range of ``beta_slow``, extrapolated ones above
    that of ``beta_fast``, a linear ramp between, and :attr:`RopeScaling.cos_sin_factor`.
    """
    exponents = torch.arange(0, rot_dim, 2, device=device, dtype=torch.int64).to(torch.float32) / rot_dim
    pos_freqs = theta**exponents
    if scaling is None:
        return 1.0 / pos_freqs, 1.0

    def correction_dim(rotations: float) -> float:
        return rot_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(rot_dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, scaling.cos_sin_factor


def rope_cos_sin(
    positions: torch.Tensor, rot_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``positions.shape + (rot_dim // 2,)`` in float32 (YaRN-scaled with ``scaling``)."""
    inv_freq, factor = rope_inv_freq(rot_dim, theta, scaling, positions.device)
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    if factor == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * factor, freqs.sin() * factor


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of the first ``2 * cos.shape[-1]`` dims of ``x [B, S, h, d]``; the rest passes."""
    rot = 2 * cos.shape[-1]
    xr, rest = x[..., :rot].float(), x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(2i, 2i+1)`` of the first ``r = 2 * cos.shape[-1]`` dims of ``x [B, S, h, d]``;
    the rest passes."""
    rot = 2 * cos.shape[-1]
    xf, rest = x[..., :rot].float(), x[..., rot:]
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """:func:`apply_rope_interleaved` or :func:`apply_rope_neox`."""
    return apply_rope_interleaved(x, cos, sin) if interleaved else apply_rope_neox(x, cos, sin)


def causal_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[B, S, T]`` bool: query at position ``p`` sees keys ``0..p`` (keys are stored by position)."""
    keys = torch.arange(num_keys, device=positions.device)
    return keys[None, None, :] <= positions[:, :, None]


def route(
    logits: torch.Tensor,
    *,
    score: str,
    top_k: int,
    bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert routing of every MoE family: ``(weights [N, k] float32, expert ids [N, k])``.

    Scores are ``softmax`` (Qwen3-MoE; DeepSeek ``greedy`` / ``group_limited_greedy``) or
    ``sigmoid`` (DeepSeek-V3 ``noaux_tc``, GLM) of the router logits. The correction ``bias``, when
    given, only steers the choice: the weights are the unbiased scores of the chosen experts. With
    ``n_group > 1`` only the experts of the ``topk_group`` best groups compete; a group scores the
    sum of its two best biased scores (with a bias, as ``noaux_tc``) or its best score (without).
    The weights are renormalized to sum to 1 (``norm_topk_prob``), then multiplied by ``scaling``.
    """
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)
    choice = scores + bias.float() if bias is not None else scores
    if n_group > 1:
        n, e = choice.shape
        grouped = choice.view(n, n_group, e // n_group)
        if bias is not None:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(n, e)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if score == "sigmoid" else 0.0))
    return (weights * scaling if scaling != 1.0 else weights), ids


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[..., 2 * I]`` tensor laid out as ``[gate; up]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
