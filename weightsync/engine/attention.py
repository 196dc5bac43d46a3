"""Attention blocks of the engine over sglang-layout weights: GQA (fused ``qkv_proj``) and MLA
(absorbed ``w_kc``/``w_vc``, latent KV cache), with the GLM-5 DSA indexer.

Each function computes one layer's attention for this rank's heads and returns the rank's
*partial* ``o_proj`` output; the caller all-reduces it over the attention-TP group.

The KV cache of a batch stores every key at the index of its position (``cache[b, p]``), so
one causal mask on positions serves prefill (right-padded prompts) and decode alike: padding
queries write garbage at positions a real token of that row overwrites before any query reads
it.

DSA (GLM-5): the indexer scores every cached key with ``sum_h w_h * relu(q_h . k)`` and each
query attends only to its ``index_topk`` best keys (all keys while a row is shorter than
``index_topk``). Computed in the compute dtype, without the fp8 activation quantization of
sglang's kernel; the Hadamard rotation sglang applies to both sides is orthogonal and leaves
``q . k`` unchanged, so it is skipped. Exact ties (keys whose every head score is clipped to 0
by the ReLU) go to the earlier key, on every device.

Legend: ``B`` batch, ``S`` query positions, ``T`` cached positions, ``h`` local heads,
``d`` head dim, ``c`` kv_lora_rank, ``r`` rope dims.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from weightsync.engine.layers import (
    apply_rope,
    apply_rope_neox,
    causal_mask,
    layer_norm,
    rms_norm,
    rope_cos_sin,
)
from weightsync.models.spec import ModelSpec

WeightFn = Callable[[str], torch.Tensor]
"""Returns a parameter by name in the compute dtype (fp8 dequantized)."""

INDEXER_NORM_EPS = 1e-6


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def _write(cache: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)
    cache[rows, positions] = values.to(cache.dtype)


def gqa_attention(
    spec: ModelSpec,
    w: WeightFn,
    a: str,
    x: torch.Tensor,
    positions: torch.Tensor,
    cache: dict[str, torch.Tensor],
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """One GQA layer (Qwen3 / Qwen3-MoE / GLM-4.5) for this rank's heads.

    Args:
        spec: the model.
        w: weight accessor.
        a: parameter prefix ``model.layers.{i}.self_attn.``.
        x: normalized hidden states ``[B, S, H]``.
        positions: ``[B, S]``.
        cache: this layer's ``{"k": [B, T, kv, d], "v": ...}``, written at ``positions``.
        num_heads: local query heads.
        num_kv_heads: local kv heads.

    Returns:
        Partial ``o_proj`` output ``[B, S, H]``.
    """
    bsz, s, _ = x.shape
    d = spec.head_dim
    bias = w(a + "qkv_proj.bias") if spec.attention_bias else None
    qkv = _linear(x, w(a + "qkv_proj.weight"), bias)
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k, v = q.view(bsz, s, num_heads, d), k.view(bsz, s, num_kv_heads, d), v.view(bsz, s, num_kv_heads, d)
    if spec.qk_norm:
        q = rms_norm(q, w(a + "q_norm.weight"), spec.rms_norm_eps)
        k = rms_norm(k, w(a + "k_norm.weight"), spec.rms_norm_eps)
    cos, sin = rope_cos_sin(positions, int(d * spec.partial_rotary_factor), spec.rope_theta, spec.rope_scaling)
    q, k = apply_rope_neox(q, cos, sin), apply_rope_neox(k, cos, sin)
    _write(cache["k"], positions, k)
    _write(cache["v"], positions, v)
    t = int(positions.max()) + 1
    keys, values = cache["k"][:, :t].transpose(1, 2), cache["v"][:, :t].transpose(1, 2)
    mask = causal_mask(positions, t)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, scale=d**-0.5, enable_gqa=num_heads != num_kv_heads
    )
    out = out.transpose(1, 2).reshape(bsz, s, num_heads * d)
    return _linear(out, w(a + "o_proj.weight"))


def mla_softmax_scale(spec: ModelSpec) -> float:
    """MLA's softmax scale: ``qk_head_dim^-0.5``, times YaRN's ``mscale(factor, mscale_all_dim)^2``."""
    scale = spec.qk_head_dim**-0.5
    return scale * spec.rope_scaling.softmax_mscale if spec.rope_scaling is not None else scale


def mla_attention(
    spec: ModelSpec,
    w: WeightFn,
    a: str,
    x: torch.Tensor,
    positions: torch.Tensor,
    cache: dict[str, torch.Tensor],
    num_heads: int,
    *,
    fused_indexer: bool = False,
) -> torch.Tensor:
    """One MLA layer (absorbed form, latent cache) for this rank's heads.

    Args:
        spec: the model.
        w: weight accessor.
        a: parameter prefix ``model.layers.{i}.self_attn.``.
        x: normalized hidden states ``[B, S, H]``.
        positions: ``[B, S]``.
        cache: this layer's ``{"latent": [B, T, c], "k_pe": [B, T, r]}`` (+ ``"index_k"`` for DSA).
        num_heads: local heads.
        fused_indexer: the DSA indexer's ``wk`` and ``weights_proj`` are one ``wk_weights_proj``.

    Returns:
        Partial ``o_proj`` output ``[B, S, H]``.
    """
    bsz, s, _ = x.shape
    nope, rope, c = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
    if spec.q_lora_rank is not None:
        fused = _linear(x, w(a + "fused_qkv_a_proj_with_mqa.weight"))
        q_lat, kv_a = fused.split([spec.q_lora_rank, c + rope], dim=-1)
        q_lat = rms_norm(q_lat, w(a + "q_a_layernorm.weight"), spec.rms_norm_eps)
        q = _linear(q_lat, w(a + "q_b_proj.weight"))
    else:
        q_lat = x
        q = _linear(x, w(a + "q_proj.weight"))
        kv_a = _linear(x, w(a + "kv_a_proj_with_mqa.weight"))
    q_nope, q_pe = q.view(bsz, s, num_heads, nope + rope).split([nope, rope], dim=-1)
    latent, k_pe = kv_a.split([c, rope], dim=-1)
    latent = rms_norm(latent, w(a + "kv_a_layernorm.weight"), spec.rms_norm_eps)
    cos, sin = rope_cos_sin(positions, rope, spec.rope_theta, spec.rope_scaling)
    q_pe = apply_rope(q_pe, cos, sin, spec.rope_interleave)
    k_pe = apply_rope(k_pe[:, :, None, :], cos, sin, spec.rope_interleave)[:, :, 0, :]
    _write(cache["latent"], positions, latent)
    _write(cache["k_pe"], positions, k_pe)
    t = int(positions.max()) + 1
    lat_all, pe_all = cache["latent"][:, :t], cache["k_pe"][:, :t]
    q_abs = torch.einsum("bshn,hnc->bshc", q_nope, w(a + "w_kc"))
    scores = torch.einsum("bshc,btc->bhst", q_abs, lat_all) + torch.einsum("bshr,btr->bhst", q_pe, pe_all)
    scores = scores.float() * mla_softmax_scale(spec)
    allowed = causal_mask(positions, t)
    if spec.has_indexer:
        allowed = allowed & dsa_select(spec, w, a + "indexer.", x, q_lat, positions, cache, allowed,
                                       fused=fused_indexer)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(x.dtype)
    out_lat = torch.einsum("bhst,btc->bshc", probs, lat_all)
    out = torch.einsum("bshc,hcv->bshv", out_lat, w(a + "w_vc")).reshape(bsz, s, -1)
    return _linear(out, w(a + "o_proj.weight"))


def dsa_select(
    spec: ModelSpec,
    w: WeightFn,
    ix: str,
    x: torch.Tensor,
    q_lat: torch.Tensor,
    positions: torch.Tensor,
    cache: dict[str, torch.Tensor],
    allowed: torch.Tensor,
    *,
    fused: bool = False,
) -> torch.Tensor:
    """The DSA indexer's key selection ``[B, S, T]`` (True = among the query's top-k keys).

    Args:
        spec: the model (``index_n_heads``, ``index_head_dim``, ``index_topk``).
        w: weight accessor.
        ix: parameter prefix ``model.layers.{i}.self_attn.indexer.``.
        x: normalized hidden states ``[B, S, H]``.
        q_lat: the normalized q latent ``[B, S, q_lora_rank]`` (``x`` without q-LoRA).
        positions: ``[B, S]``.
        cache: holds ``"index_k" [B, T, index_head_dim]``, written at ``positions``.
        allowed: the causal mask ``[B, S, T]``.
        fused: ``wk`` and ``weights_proj`` are the rows of one ``wk_weights_proj`` (sglang's fusion).

    Returns:
        Bool selection mask.
    """
    bsz, s, _ = x.shape
    n, dim, rope = spec.index_n_heads, spec.index_head_dim, spec.qk_rope_head_dim
    cos, sin = rope_cos_sin(positions, rope, spec.rope_theta, spec.rope_scaling)
    pairs = spec.indexer_rope_interleave
    q = apply_rope(_linear(q_lat, w(ix + "wq_b.weight")).view(bsz, s, n, dim), cos, sin, pairs)
    if fused:
        k, head_w = _linear(x, w(ix + "wk_weights_proj.weight")).split([dim, n], dim=-1)
    else:
        k, head_w = _linear(x, w(ix + "wk.weight")), _linear(x, w(ix + "weights_proj.weight"))
    k = layer_norm(k, w(ix + "k_norm.weight"), w(ix + "k_norm.bias"), INDEXER_NORM_EPS)
    k = apply_rope(k[:, :, None, :], cos, sin, pairs)[:, :, 0, :]
    _write(cache["index_k"], positions, k)
    t = allowed.shape[-1]
    head_w = head_w.float() * n**-0.5
    logits = torch.einsum("bshd,btd->bsht", q.float(), cache["index_k"][:, :t].float()).relu()
    score = (logits * head_w[..., None]).sum(dim=2) * dim**-0.5
    score = score.masked_fill(~allowed, float("-inf"))
    # Stable sort, not topk: keys whose head scores are all clipped to 0 tie exactly, and the
    # selection must not depend on the device's topk kernel (ties go to earlier keys).
    top = score.sort(dim=-1, descending=True, stable=True).indices[..., : spec.index_topk]
    return torch.zeros_like(allowed).scatter_(-1, top, True)


def new_layer_cache(
    spec: ModelSpec, batch: int, max_len: int, num_kv_heads: int, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Empty KV storage of one layer for ``batch`` rows of up to ``max_len`` positions."""

    def z(*shape: int) -> torch.Tensor:
        return torch.zeros(batch, max_len, *shape, device=device, dtype=dtype)

    if not spec.is_mla:
        return {"k": z(num_kv_heads, spec.head_dim), "v": z(num_kv_heads, spec.head_dim)}
    cache = {"latent": z(spec.kv_lora_rank), "k_pe": z(spec.qk_rope_head_dim)}
    if spec.has_indexer:
        cache["index_k"] = z(spec.index_head_dim)
    return cache
