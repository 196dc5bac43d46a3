"""A plain single-process reference forward over the global HF tensors: the yardstick of the
engine's tests and of the logprob-parity gate of a run (``reference_prompt_logprobs``).

Deliberately written the long way, sharing no code with the engine's forward: unfused HF weights
(``q_proj``/``k_proj``/``v_proj``, per-expert ``gate_proj``/``up_proj``/``down_proj``,
``kv_b_proj`` applied as in HF DeepseekV3 instead of the absorbed ``w_kc``/``w_vc``), one
prompt at a time, no KV cache, float32 math. fp8 models read the bf16 checkpoint weights
(the synthetic checkpoints make them fp8-exact, see ``weightsync.models.checkpoint``).

The conventions that are choices (rotary styles, DSA indexer details) are those the engine
documents in ``weightsync/engine/layers.py`` and ``weightsync/engine/attention.py``; YaRN follows
the YaRN formulas (correction range, ramp, magnitude factors) element by element in Python.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from weightsync.models.hf import global_tensors
from weightsync.models.spec import ModelSpec


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _inv_freq(dim: int, spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of a ``dim``-dim rotary embedding and the cos/sin magnitude factor."""
    theta, y = spec.rope_theta, spec.rope_scaling
    freqs = [1.0 / float(torch.tensor(theta, dtype=torch.float32) ** (i / dim)) for i in range(0, dim, 2)]
    if y is None:
        return torch.tensor(freqs, dtype=torch.float32), 1.0

    def dim_of(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(y.beta_fast), dim_of(y.beta_slow)
    if y.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi + 0.001 if hi == lo else hi
    out = []
    for j, f in enumerate(freqs):
        ramp = min(max((j - lo) / (hi - lo), 0.0), 1.0)  # 0: extrapolate (keep f), 1: interpolate (f / factor)
        out.append(f / y.factor * ramp + f * (1 - ramp))

    def mscale(m: float) -> float:
        return 1.0 if y.factor <= 1 else 0.1 * m * math.log(y.factor) + 1.0

    if y.attention_factor is not None:
        magnitude = y.attention_factor
    elif y.mscale and y.mscale_all_dim:
        magnitude = mscale(y.mscale) / mscale(y.mscale_all_dim)
    else:
        magnitude = mscale(1.0)
    return torch.tensor(out, dtype=torch.float32), magnitude


def _angles(t: int, dim: int, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    inv, magnitude = _inv_freq(dim, spec)
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos()[:, None, :] * magnitude, ang.sin()[:, None, :] * magnitude


def _rope_halves(x: torch.Tensor, rot: int, spec: ModelSpec) -> torch.Tensor:
    """x [T, heads, d]: neox rotation of the first ``rot`` dims."""
    cos, sin = _angles(x.shape[0], rot, spec)
    half = rot // 2
    a, b, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def _rope_pairs(x: torch.Tensor, rot: int, spec: ModelSpec) -> torch.Tensor:
    """x [T, heads, d]: rotation of pairs (2i, 2i+1) of the first ``rot`` dims."""
    cos, sin = _angles(x.shape[0], rot, spec)
    out = x.clone()
    out[..., 0:rot:2] = x[..., 0:rot:2] * cos - x[..., 1:rot:2] * sin
    out[..., 1:rot:2] = x[..., 1:rot:2] * cos + x[..., 0:rot:2] * sin
    return out


def _rope(x: torch.Tensor, rot: int, spec: ModelSpec, pairs: bool) -> torch.Tensor:
    return _rope_pairs(x, rot, spec) if pairs else _rope_halves(x, rot, spec)


def _softmax_attention(scores: torch.Tensor, extra_mask: torch.Tensor | None = None) -> torch.Tensor:
    """scores [heads, T, T] -> causal probabilities."""
    t = scores.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    allowed = causal if extra_mask is None else causal & extra_mask
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


class Reference:
    """HF-style forward of ``spec`` over ``tensors`` (global HF names -> tensors)."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, torch.Tensor]) -> None:
        self.spec = spec
        self.t = {k: v.float() for k, v in tensors.items() if not k.endswith("_scale_inv")}

    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits ``[len(ids), vocab]`` of one prompt."""
        s, t = self.spec, self.t
        x = t["model.embed_tokens.weight"][torch.tensor(ids)]
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            h = _rms(x, t[p + "input_layernorm.weight"], s.rms_norm_eps)
            x = x + (self._mla(p, h) if s.is_mla else self._gqa(p, h))
            h = _rms(x, t[p + "post_attention_layernorm.weight"], s.rms_norm_eps)
            x = x + (self._moe(p, h) if s.is_moe_layer(i) else self._ffn(p + "mlp.", h))
        x = _rms(x, t["model.norm.weight"], s.rms_norm_eps)
        head = t["model.embed_tokens.weight"] if s.tie_word_embeddings else t["lm_head.weight"]
        return x @ head.T

    def _gqa(self, p: str, h: torch.Tensor) -> torch.Tensor:
        s, t = self.spec, self.t
        a = p + "self_attn."
        n, kv, d = s.num_attention_heads, s.num_kv_heads, s.head_dim

        def proj(name: str) -> torch.Tensor:
            y = h @ t[a + name + ".weight"].T
            return y + t[a + name + ".bias"] if s.attention_bias else y

        q = proj("q_proj").view(-1, n, d)
        k = proj("k_proj").view(-1, kv, d)
        v = proj("v_proj").view(-1, kv, d)
        if s.qk_norm:
            q = _rms(q, t[a + "q_norm.weight"], s.rms_norm_eps)
            k = _rms(k, t[a + "k_norm.weight"], s.rms_norm_eps)
        rot = int(d * s.partial_rotary_factor)
        q, k = _rope_halves(q, rot, s), _rope_halves(k, rot, s)
        group = n // kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        probs = _softmax_attention(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d))
        out = torch.einsum("hqk,khd->qhd", probs, v).reshape(h.shape[0], n * d)
        return out @ t[a + "o_proj.weight"].T

    def _mla(self, p: str, h: torch.Tensor) -> torch.Tensor:
        s, t = self.spec, self.t
        a = p + "self_attn."
        n, nope, rope, vd, c = (
            s.num_attention_heads,
            s.qk_nope_head_dim,
            s.qk_rope_head_dim,
            s.v_head_dim,
            s.kv_lora_rank,
        )
        if s.q_lora_rank is not None:
            q_lat = _rms(h @ t[a + "q_a_proj.weight"].T, t[a + "q_a_layernorm.weight"], s.rms_norm_eps)
            q = q_lat @ t[a + "q_b_proj.weight"].T
        else:
            q_lat = h
            q = h @ t[a + "q_proj.weight"].T
        q = q.view(-1, n, nope + rope)
        q_nope, q_pe = q[..., :nope], _rope(q[..., nope:], rope, s, s.rope_interleave)
        kv_a = h @ t[a + "kv_a_proj_with_mqa.weight"].T
        compressed = _rms(kv_a[:, :c], t[a + "kv_a_layernorm.weight"], s.rms_norm_eps)
        k_pe = _rope(kv_a[:, None, c:], rope, s, s.rope_interleave)
        kv = (compressed @ t[a + "kv_b_proj.weight"].T).view(-1, n, nope + vd)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        k = torch.cat([k_nope, k_pe.expand(-1, n, -1)], dim=-1)
        qf = torch.cat([q_nope, q_pe], dim=-1)
        scores = torch.einsum("qhd,khd->hqk", qf, k) / math.sqrt(nope + rope)
        if s.rope_scaling is not None and s.rope_scaling.mscale_all_dim:
            y = s.rope_scaling
            scores = scores * (0.1 * y.mscale_all_dim * math.log(y.factor) + 1.0 if y.factor > 1 else 1.0) ** 2
        select = self._dsa(a + "indexer.", h, q_lat) if s.has_indexer else None
        probs = _softmax_attention(scores, select)
        out = torch.einsum("hqk,khd->qhd", probs, v).reshape(h.shape[0], n * vd)
        return out @ t[a + "o_proj.weight"].T

    def _dsa(self, ix: str, h: torch.Tensor, q_lat: torch.Tensor) -> torch.Tensor:
        """[T, T] bool: each query's index_topk best earlier keys."""
        s, t = self.spec, self.t
        n, dim = s.index_n_heads, s.index_head_dim
        pairs, r = s.indexer_rope_interleave, s.qk_rope_head_dim
        q = _rope((q_lat @ t[ix + "wq_b.weight"].T).view(-1, n, dim), r, s, pairs)
        k = F.layer_norm(h @ t[ix + "wk.weight"].T, (dim,), t[ix + "k_norm.weight"], t[ix + "k_norm.bias"], 1e-6)
        k = _rope(k[:, None, :], r, s, pairs)[:, 0, :]
        head_w = (h @ t[ix + "weights_proj.weight"].T) / math.sqrt(n)
        score = (torch.einsum("qhd,kd->qhk", q, k).relu() * head_w[..., None]).sum(1) / math.sqrt(dim)
        steps = score.shape[0]
        score = score.masked_fill(~torch.ones(steps, steps, dtype=torch.bool).tril(), float("-inf"))
        top = score.sort(dim=-1, descending=True, stable=True).indices[:, : s.index_topk]  # ties: earlier key
        return torch.zeros(steps, steps, dtype=torch.bool).scatter_(-1, top, True)

    def _ffn(self, m: str, h: torch.Tensor) -> torch.Tensor:
        t = self.t
        return (F.silu(h @ t[m + "gate_proj.weight"].T) * (h @ t[m + "up_proj.weight"].T)) @ t[m + "down_proj.weight"].T

    def _moe(self, p: str, h: torch.Tensor) -> torch.Tensor:
        s, t = self.spec, self.t
        m = p + "mlp."
        logits = h @ t[m + "gate.weight"].T
        k = s.num_experts_per_tok
        scores = torch.softmax(logits, dim=-1) if s.router_score_function == "softmax" else torch.sigmoid(logits)
        biased = scores + t[m + "gate.e_score_correction_bias"] if s.router_expert_bias else scores.clone()
        if s.n_group > 1:
            per = s.num_experts // s.n_group
            grouped = biased.view(-1, s.n_group, per)
            if s.router_expert_bias:
                group_score = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_score = grouped.max(dim=-1).values
            best = group_score.topk(s.topk_group, dim=-1).indices
            keep = torch.zeros(biased.shape[0], s.n_group, dtype=torch.bool).scatter_(1, best, True)
            biased = grouped.masked_fill(~keep[..., None], float("-inf")).view(-1, s.num_experts)
        ids = biased.topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if s.router_score_function == "sigmoid" else 0))
        weights = weights * s.routed_scaling_factor
        out = torch.zeros_like(h)
        for tok in range(h.shape[0]):
            for slot in range(k):
                e = int(ids[tok, slot])
                out[tok] += weights[tok, slot] * self._ffn(f"{m}experts.{e}.", h[tok : tok + 1])[0]
        if s.num_shared_experts:
            out = out + self._ffn(m + "shared_experts.", h)
        return out


def reference_prompt_logprobs(
    spec: ModelSpec, read: Callable[[str], torch.Tensor], hf_dir: str | Path | None, prompt: str
) -> list[float | None]:
    """Logprob of each token of ``prompt`` given the ones before it, by the reference forward.

    The prompt is tokenized as the engine tokenizes it when started with ``--checkpoint hf_dir``
    (:func:`weightsync.engine.tokenizer.load_tokenizer`), so the values line up with the
    engine's ``input_token_logprobs`` for ``logprob_start_len=0``.

    Args:
        spec: the model.
        read: global tensor name -> the full tensor (e.g. the trainer's weights at a step).
        hf_dir: the checkpoint directory the engine tokenizes with (None: byte tokenizer).
        prompt: text.

    Returns:
        ``[None, logprob of token 1, ...]``.
    """
    from weightsync.engine.tokenizer import load_tokenizer

    ids = load_tokenizer(spec.vocab_size, str(hf_dir) if hf_dir is not None else None).encode(prompt)
    tensors = {name: read(name) for name, gt in global_tensors(spec).items() if gt.quant_of is None}
    logp = torch.log_softmax(Reference(spec, tensors).logits(ids), dim=-1)
    return [None, *(float(logp[k, ids[k + 1]]) for k in range(len(ids) - 1))]
