"""The engine's decoder, one class for every family, computing on a rank's sglang-layout weights.

The model owns no memory: it reads the :class:`~weightsync.sync.params.ParamStore` views by
their sglang names on every call (so a weight update is visible to the next forward with no
reload step) and casts them to the compute dtype on the fly (fp8 weights are dequantized
blockwise; fine for CPU tests and small models, not a fast path).

Where the layout splits a reduction dim, the rank computes a partial sum and the model
all-reduces it (see :mod:`weightsync.engine.tp`): attention output over attention-TP, dense
MLP over TP unless replicated (``--moe-dense-tp-size 1``), routed + shared experts over TP
(EP x moe-TP; a fused shared expert is the last slot of the routed experts' weights), the
embedding over its vocab split; the lm_head logits are all-gathered over the lm_head's vocab split
(attention-TP with ``--enable-dp-lm-head``, else TP): with DP-attention every attention group
computes the same batch here, so each group's gather is the full vocab.

Typical usage::

    model = Model(spec, store, groups, compute_dtype=torch.float32)
    cache = model.new_cache(batch=2, max_len=64)
    h = model.hidden(ids, positions, cache)          # [B, S, H]
    logits = model.logits(h[:, -1])                   # [B, vocab] float32, on every rank
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weightsync.engine.attention import gqa_attention, mla_attention, new_layer_cache
from weightsync.engine.layers import rms_norm, route, swiglu
from weightsync.engine.tp import EngineGroups, Group
from weightsync.layout.sglang import dense_mlp_split, vocab_shard
from weightsync.layout.sglang_options import layout_options
from weightsync.models.spec import ModelSpec
from weightsync.quant.fp8 import dequantize_block_fp8
from weightsync.sync.params import ParamStore

FP8 = torch.float8_e4m3fn


class Model:
    """Forward of one engine rank (see the module docstring)."""

    def __init__(self, spec: ModelSpec, store: ParamStore, groups: EngineGroups, compute_dtype: torch.dtype) -> None:
        self.spec = spec
        self.store = store
        self.groups = groups
        self.dtype = compute_dtype
        self.device = store.device
        self.options = layout_options(spec, groups.par)
        self._embed = vocab_shard(spec, groups.par, groups.rank, lm_head=False)
        self._head = (
            self._embed if spec.tie_word_embeddings else vocab_shard(spec, groups.par, groups.rank, lm_head=True)
        )
        # --moe-dense-tp-size 1 (MLA / GLM-4.5 families): dense MLPs whole on every rank, no reduction.
        self._dense_replicated = dense_mlp_split(spec, groups.par, groups.coords)[1] == 1
        a0 = "model.layers.0.self_attn."
        if spec.is_mla:
            q_name = a0 + ("q_b_proj.weight" if spec.q_lora_rank is not None else "q_proj.weight")
            self.num_heads = store[q_name].shape[0] // spec.qk_head_dim
            self.num_kv_heads = 0
        else:
            d = spec.head_dim
            self.num_heads = store[a0 + "o_proj.weight"].shape[1] // d
            self.num_kv_heads = (store[a0 + "qkv_proj.weight"].shape[0] // d - self.num_heads) // 2

    # ------------------------------------------------------------------ weights

    def w(self, name: str) -> torch.Tensor:
        """Parameter ``name`` in the compute dtype (fp8: dequantized with its scale)."""
        t = self.store[name]
        if t.dtype == FP8:
            assert self.spec.fp8_block is not None
            return dequantize_block_fp8(t, self.store[name + "_scale_inv"], self.spec.fp8_block, dtype=self.dtype)
        return t.to(self.dtype)

    def _expert_w(self, name: str, j: int) -> torch.Tensor:
        t = self.store[name][j]
        if t.dtype == FP8:
            assert self.spec.fp8_block is not None
            scale = self.store[name + "_scale_inv"][j]
            return dequantize_block_fp8(t, scale, self.spec.fp8_block, dtype=self.dtype)
        return t.to(self.dtype)

    def _vocab_group(self, split: int) -> Group | None:
        if split == 1:
            return None
        if split == self.groups.tp.size:
            return self.groups.tp
        assert split == self.groups.attn_tp.size, f"vocab split {split} matches no group"
        return self.groups.attn_tp

    # ------------------------------------------------------------------ forward

    def new_cache(self, batch: int, max_len: int) -> list[dict[str, torch.Tensor]]:
        """Empty KV cache for ``batch`` rows of up to ``max_len`` positions (one dict per layer)."""
        return [
            new_layer_cache(self.spec, batch, max_len, self.num_kv_heads, self.device, self.dtype)
            for _ in range(self.spec.num_layers)
        ]

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, cache: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Final-norm hidden states ``[B, S, H]`` of tokens ``ids`` at ``positions`` (both ``[B, S]``).

        Writes the tokens' keys/values into ``cache`` at their positions. Collective: every rank
        of the engine calls it with the same arguments.
        """
        spec = self.spec
        x = self._embed_tokens(ids)
        for layer in range(spec.num_layers):
            p = f"model.layers.{layer}."
            h = rms_norm(x, self.w(p + "input_layernorm.weight"), spec.rms_norm_eps)
            if spec.is_mla:
                attn = mla_attention(spec, self.w, p + "self_attn.", h, positions, cache[layer], self.num_heads,
                                     fused_indexer=self.options.dsa_indexer_fusion)
            else:
                attn = gqa_attention(
                    spec, self.w, p + "self_attn.", h, positions, cache[layer], self.num_heads, self.num_kv_heads
                )
            x = x + self.groups.attn_tp.all_reduce(attn)
            h = rms_norm(x, self.w(p + "post_attention_layernorm.weight"), spec.rms_norm_eps)
            x = x + self._mlp(layer, p + "mlp.", h)
        return rms_norm(x, self.w("model.norm.weight"), spec.rms_norm_eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full-vocab float32 logits ``[..., vocab]`` of hidden states ``h [..., H]`` (on every rank)."""
        name = "model.embed_tokens.weight" if self.spec.tie_word_embeddings else "lm_head.weight"
        local = F.linear(h, self.w(name)).float()
        group = self._vocab_group(self._head.split)
        full = group.all_gather_last(local) if group is not None else local
        return full[..., : self.spec.vocab_size]

    def _embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        shard = self._embed
        table = self.w("model.embed_tokens.weight")
        inside = (ids >= shard.start) & (ids < shard.stop)
        local = torch.where(inside, ids - shard.start, torch.zeros_like(ids))
        x = F.embedding(local, table) * inside[..., None].to(self.dtype)
        group = self._vocab_group(shard.split)
        return group.all_reduce(x) if group is not None else x

    def _mlp(self, layer: int, m: str, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if not spec.is_moe_layer(layer):
            out = F.linear(swiglu(F.linear(x, self.w(m + "gate_up_proj.weight"))), self.w(m + "down_proj.weight"))
            return out if self._dense_replicated else self.groups.tp.all_reduce(out)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        out = self._experts(m, flat)
        if spec.num_shared_experts and not self.options.shared_experts_fusion:
            out = out + F.linear(
                swiglu(F.linear(flat, self.w(m + "shared_experts.gate_up_proj.weight"))),
                self.w(m + "shared_experts.down_proj.weight"),
            )
        return self.groups.tp.all_reduce(out).view(shape)

    def _route(self, m: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        logits = F.linear(x.float(), self.store[m + "gate.weight"].float())
        bias = self.store.get(m + "gate.e_score_correction_bias") if spec.router_expert_bias else None
        return route(
            logits,
            score=spec.router_score_function,
            top_k=spec.num_experts_per_tok,
            bias=bias,
            n_group=spec.n_group,
            topk_group=spec.topk_group,
            renormalize=spec.norm_topk_prob,
            scaling=spec.routed_scaling_factor,
        )

    def _experts(self, m: str, x: torch.Tensor) -> torch.Tensor:
        """This rank's experts' partial output ``[N, H]`` (its experts, its moe-TP slice): the routed
        ones, weighted by the router, and a fused shared expert (the last slot), weight 1."""
        weights, ids = self._route(m, x)
        w13, w2 = m + "experts.w13_weight", m + "experts.w2_weight"
        num_routed = self.store[w13].shape[0] - (1 if self.options.shared_experts_fusion else 0)
        first = self.groups.coords.moe_ep_rank * num_routed
        out = torch.zeros_like(x)
        for j in range(num_routed):
            rows, slot = (ids == first + j).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = F.linear(swiglu(F.linear(x[rows], self._expert_w(w13, j))), self._expert_w(w2, j))
            out.index_add_(0, rows, y * weights[rows, slot, None].to(self.dtype))
        if self.options.shared_experts_fusion:
            out = out + F.linear(swiglu(F.linear(x, self._expert_w(w13, num_routed))), self._expert_w(w2, num_routed))
        return out
