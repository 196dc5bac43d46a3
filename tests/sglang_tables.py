"""sglang 0.5.23's parameter table of one engine rank, re-derived from its model classes for the tests.

Independent of weightsync's layout code (``weightsync/layout/``): every rule below is read off the
sglang 0.5.23 class that creates the parameter (paths relative to ``python/sglang/srt/``), for a CUDA
GPU of compute capability 8.0 or more and default flags but those given. The result is
``{name: (shape, dtype)}`` of ``model.named_parameters()`` on that rank: what the engine registers
and what ``/get_remote_instance_transfer_engine_info`` publishes (``register_memory_region``
iterates ``named_parameters``).

The model's config comes in as a :class:`~weightsync.models.spec.ModelSpec` (the normalised
config.json: sizes, ``architectures[0]``, ``router_fp32``, ``indexer_rope_interleave``, the MLP
layer pattern, ``quantization_config.weight_block_size`` as ``fp8_block``).
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.models.spec import ModelSpec

Table = dict[str, tuple[tuple[int, ...], str]]
F32, FP8 = "float32", "float8_e4m3fn"


@dataclass(frozen=True, kw_only=True)
class ServerArgs:
    """The ``ServerArgs`` fields the table depends on (sglang's flag names)."""

    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    moe_dense_tp_size: int | None = None
    enable_dp_lm_head: bool = False
    disable_shared_experts_fusion: bool = False


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Rank:
    """``distributed/parallel_state.py`` / ``layers/dp_attention.py`` sizes of one rank."""

    def __init__(self, args: ServerArgs, rank: int) -> None:
        self.tp, self.rank = args.tp_size, rank
        self.attn_tp = args.tp_size // args.dp_size  # compute_dp_attention_world_info
        self.moe_tp = args.tp_size // args.ep_size
        self.ep = args.ep_size


def _vocab_rows(vocab: int, split: int) -> int:
    """``VocabParallelEmbedding.__init__`` (layers/vocab_parallel_embedding.py): pad to 64, or to
    ``64 * tp_size`` when ``pad_vocab_size(V, 64) % tp_size != 0``; rows per rank = padded / tp_size."""
    padding = 64
    if _cdiv(vocab, padding) * padding % split:
        padding *= split
    return _cdiv(vocab, padding) * padding // split


class _Builder:
    def __init__(self, spec: ModelSpec, fp8: bool) -> None:
        self.spec, self.fp8, self.table = spec, fp8, {}

    def param(self, name: str, shape: tuple[int, ...], dtype: str | None = None) -> None:
        self.table[name] = (shape, dtype or self.spec.dtype)

    def linear(self, name: str, out: int, inp: int, *, quantized: bool = True) -> None:
        """A ``LinearBase`` weight; with ``Fp8Config`` (block quant) ``Fp8LinearMethod.create_weights``
        (layers/quantization/fp8.py): float8_e4m3fn ``weight`` + float32 ``weight_scale_inv``
        ``[ceil(out / block_n), ceil(in / block_k)]``."""
        if self.fp8 and quantized:
            bn, bk = self.spec.fp8_block  # type: ignore[misc]
            self.param(name + ".weight", (out, inp), FP8)
            self.param(name + ".weight_scale_inv", (_cdiv(out, bn), _cdiv(inp, bk)), F32)
        else:
            self.param(name + ".weight", (out, inp))


def sglang_table(spec: ModelSpec, args: ServerArgs, rank: int) -> Table:
    """``{name: (shape, dtype)}`` of ``model.named_parameters()`` on ``rank`` (module docstring)."""
    r = _Rank(args, rank)
    b = _Builder(spec, fp8=spec.fp8_block is not None)
    h = spec.hidden_size
    # embed_tokens: use_attn_tp_group=is_dp_attention_enabled() (qwen2.py Qwen2Model, qwen2_moe.py,
    # glm4_moe.py, glm4_moe_lite.py; deepseek_v2.py DeepseekV2Model via get_embedding_tp_kwargs)
    b.param("model.embed_tokens.weight", (_vocab_rows(spec.vocab_size, r.attn_tp), h))
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        b.param(p + "input_layernorm.weight", (h,))
        if spec.family.value == "deepseek_v3":
            _mla(b, r, p + "self_attn.")
        else:
            _gqa(b, r, p + "self_attn.")
        b.param(p + "post_attention_layernorm.weight", (h,))
        _mlp(b, r, args, layer, p + "mlp.")
    b.param("model.norm.weight", (h,))
    if not spec.tie_word_embeddings:  # Qwen3ForCausalLM ties lm_head = model.embed_tokens: one parameter
        # ParallelLMHead(use_attn_tp_group=enable_dp_lm_head); a VocabParallelEmbedding, not a LinearBase:
        # Fp8Config leaves it unquantized
        split = r.attn_tp if args.enable_dp_lm_head else r.tp
        b.param("lm_head.weight", (_vocab_rows(spec.vocab_size, split), h))
    return b.table


def _gqa(b: _Builder, r: _Rank, a: str) -> None:
    """qwen3.py Qwen3Attention, qwen3_moe.py Qwen3MoeAttention, glm4_moe.py Glm4MoeAttention: a
    ``QKVParallelLinear`` over attention-TP (``num_kv_heads = max(1, total_kv // tp)``, layers/linear.py),
    ``RowParallelLinear`` o_proj, RMSNorm q_norm / k_norm (Qwen3; GLM-4.5 with use_qk_norm), the qkv
    bias with attention_bias (GLM-4.5). Their RadixAttention gets no quant_config: no k/v scales."""
    s = b.spec
    d = s.head_dim
    heads = s.num_attention_heads // r.attn_tp
    kv = max(1, s.num_kv_heads // r.attn_tp)
    b.param(a + "qkv_proj.weight", ((heads + 2 * kv) * d, s.hidden_size))
    if s.attention_bias:
        b.param(a + "qkv_proj.bias", ((heads + 2 * kv) * d,))
    b.param(a + "o_proj.weight", (s.hidden_size, heads * d))
    if s.qk_norm:
        b.param(a + "q_norm.weight", (d,))
        b.param(a + "k_norm.weight", (d,))


def _mla(b: _Builder, r: _Rank, a: str) -> None:
    """deepseek_v2.py DeepseekV2AttentionMLA (Kimi-K2, GLM-4.7-Flash, GLM-5): with q_lora_rank a
    ``ReplicatedLinear`` fused_qkv_a_proj_with_mqa [q_lora + kv_lora + rope, H], q_a_layernorm, a
    ``ColumnParallelLinear`` q_b_proj over attention-TP, kv_a_layernorm, kv_b_proj (column-parallel),
    o_proj (row-parallel); ``w_kc`` / ``w_vc`` are plain attributes (post_load_weights), not
    parameters. With Fp8Config, ``attn_mqa`` and ``attn_mha`` (RadixAttention(quant_config=...)) get
    ``Fp8KVCacheMethod``'s float32 scalars k_scale / v_scale (layers/quantization/kv_cache.py).
    The DSA indexer (layers/attention/dsa/dsa_indexer.py Indexer) after them (GLM-5)."""
    s = b.spec
    h, heads = s.hidden_size, s.num_attention_heads // r.attn_tp
    qk, nope, rope, v = s.qk_nope_head_dim + s.qk_rope_head_dim, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
    if s.q_lora_rank is not None:
        b.linear(a + "fused_qkv_a_proj_with_mqa", s.q_lora_rank + s.kv_lora_rank + rope, h)
        b.param(a + "q_a_layernorm.weight", (s.q_lora_rank,))
        b.linear(a + "q_b_proj", heads * qk, s.q_lora_rank)
    else:
        b.linear(a + "q_proj", heads * qk, h)
        b.linear(a + "kv_a_proj_with_mqa", s.kv_lora_rank + rope, h)
    b.param(a + "kv_a_layernorm.weight", (s.kv_lora_rank,))
    b.linear(a + "kv_b_proj", heads * (nope + v), s.kv_lora_rank)
    b.linear(a + "o_proj", h, heads * v)
    if s.has_indexer:
        _indexer(b, a + "indexer.")
    if b.fp8:
        for attn in ("attn_mqa", "attn_mha"):
            b.param(f"{a}{attn}.k_scale", (), F32)
            b.param(f"{a}{attn}.v_scale", (), F32)


def _indexer(b: _Builder, ix: str) -> None:
    """Indexer.__init__: wq_b (quant_config); on CUDA with the interleaved indexer rope
    (``use_dsa_indexer_fusion = _is_cuda and ... and not is_neox_style``, ``is_neox_style = not
    config.indexer_rope_interleave``) one ``wk_weights_proj`` [dim + n, H] with
    ``params_dtype=torch.bfloat16``, else wk (quant_config) and weights_proj (bfloat16); k_norm a
    float32 LayerNorm (weight and bias)."""
    s = b.spec
    n, dim = s.index_n_heads, s.index_head_dim
    b.param(ix + "wq_b.weight", (n * dim, s.q_lora_rank))  # type: ignore[arg-type]
    if s.indexer_rope_interleave:
        b.param(ix + "wk_weights_proj.weight", (dim + n, s.hidden_size), "bfloat16")
    else:
        b.param(ix + "wk.weight", (dim, s.hidden_size))
        b.param(ix + "weights_proj.weight", (n, s.hidden_size), "bfloat16")
    b.param(ix + "k_norm.weight", (dim,), F32)
    b.param(ix + "k_norm.bias", (dim,), F32)


def _fused_shared(spec: ModelSpec, args: ServerArgs) -> bool:
    """layers/moe/utils.py resolve_shared_experts_config with each class's
    shared_experts_fusion_disable_reason (CUDA, capability >= 8.0, no DeepEP/SBO/TBO)."""
    if args.disable_shared_experts_fusion or not spec.num_shared_experts or args.ep_size > 1:
        return False  # every class: "... cannot use shared experts fusion ... under expert parallelism"
    arch = spec.hf_architecture
    if arch == "Glm4MoeForCausalLM":  # glm4_moe.py: no config condition
        return True
    if arch == "Glm4MoeLiteForCausalLM":  # glm4_moe_lite.py: n_shared_experts == 1
        return spec.num_shared_experts == 1
    # deepseek_v2.py: architectures[0] == fused_shared_experts_architecture (DeepseekV3ForCausalLM;
    # GlmMoeDsaForCausalLM overrides it), n_routed_experts 256 (384 only with Quark), one shared expert
    return arch in ("DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM") and spec.num_experts == 256 \
        and spec.num_shared_experts == 1


def _mlp(b: _Builder, r: _Rank, args: ServerArgs, layer: int, m: str) -> None:
    s = b.spec
    h = s.hidden_size
    if not s.is_moe_layer(layer):
        # Qwen2MLP (Qwen3), Qwen2MoeMLP (Qwen3-MoE's dense layers): MergedColumnParallelLinear /
        # RowParallelLinear over TP; DeepseekV2MLP, Glm4MoeMLP, Glm4MoeLiteMLP: tp_size 1 (replicated)
        # with --moe-dense-tp-size 1 (enable_moe_dense_fully_dp)
        dense_tp = 1 if args.moe_dense_tp_size == 1 and s.family.value in ("deepseek_v3", "glm4_moe") else r.tp
        i = s.intermediate_size // dense_tp
        b.linear(m + "gate_up_proj", 2 * i, h)
        b.linear(m + "down_proj", h, i)
        return
    e = s.num_experts
    glm_gate = s.hf_architecture in ("Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM")
    if s.family.value == "qwen3_moe":  # qwen3_moe.py: ReplicatedLinear gate, model dtype
        b.param(m + "gate.weight", (e, h))
    else:  # Glm4MoeGate / Glm4MoeLiteGate: float32; deepseek_v2.py MoEGate: float32 iff config.router_fp32
        b.param(m + "gate.weight", (e, h), F32 if glm_gate or s.router_fp32 else None)
        b.param(m + "gate.e_score_correction_bias", (e,), F32)  # noaux_tc: float32
    fused = _fused_shared(s, args)
    # FusedMoE (layers/moe/fused_moe_triton/layer.py): num_experts / ep routed slots + the fused shared ones
    local = e // r.ep + (1 if fused else 0)
    i = s.moe_intermediate_size // r.moe_tp
    if b.fp8:  # Fp8MoEMethod.create_weights
        bn, bk = s.fp8_block  # type: ignore[misc]
        b.param(m + "experts.w13_weight", (local, 2 * i, h), FP8)
        b.param(m + "experts.w2_weight", (local, h, i), FP8)
        b.param(m + "experts.w13_weight_scale_inv", (local, 2 * _cdiv(i, bn), _cdiv(h, bk)), F32)
        b.param(m + "experts.w2_weight_scale_inv", (local, _cdiv(h, bn), _cdiv(i, bk)), F32)
    else:
        b.param(m + "experts.w13_weight", (local, 2 * i, h))
        b.param(m + "experts.w2_weight", (local, h, i))
    if s.num_shared_experts and not fused:  # the shared expert MLP over TP (non-a2a MoE)
        si = s.num_shared_experts * s.moe_intermediate_size // r.tp
        b.linear(m + "shared_experts.gate_up_proj", 2 * si, h)
        b.linear(m + "shared_experts.down_proj", h, si)
