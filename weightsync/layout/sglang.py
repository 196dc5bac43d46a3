"""The engine (sglang) layout: each rank's parameters as pieces of the canonical global tensors.

For a model spec, an sglang parallel configuration and a rank inside one engine, this module
lists the rank's parameters exactly as sglang's model classes hold them -- the names of
``model.named_parameters()``, their per-rank shapes, dtypes, and which box of which HF-named
global tensor (:func:`weightsync.models.hf.global_tensors`) fills which box of each parameter.
The built-in rollout engine allocates its parameters from this list, and the planner writes
into them, so the names here are the engine's parameter names.

Model classes followed (sgl-project/sglang, python/sglang/srt/):

* ``models/qwen3.py`` (Qwen3ForCausalLM; MLP from ``models/qwen2.py`` Qwen2MLP),
  ``models/qwen3_moe.py`` (Qwen3MoeForCausalLM),
  ``models/glm4_moe.py`` (Glm4MoeForCausalLM, and GlmMoeDsaForCausalLM = GLM-5, a thin
  subclass of DeepseekV2ForCausalLM), ``models/glm4_moe_lite.py`` (GLM-4.7-Flash, DeepseekV2
  modules), ``models/deepseek_v2.py`` (DeepseekV2/V3ForCausalLM: Kimi-K2);
* layers: ``layers/linear.py``, ``layers/vocab_parallel_embedding.py``,
  ``layers/moe/fused_moe_triton/layer.py``, ``layers/quantization/fp8.py``,
  ``layers/attention/dsa/dsa_indexer.py``, ``layers/dp_attention.py``,
  ``layers/communicator.py``, ``distributed/parallel_state.py``.

Choices where sglang has several paths (documented once here):

* MoE runs the standard (non-a2a) FusedMoE path, as the reference profiles do: shared experts
  are a separate TP-split MLP (``mlp.shared_experts``), or, with the ``shared_experts_fusion``
  option (sglang's default at expert-parallel 1 for GLM-4.5, GLM-4.7-Flash and 256-expert
  DeepSeek-V3 / GLM-5), the last slot of ``w13_weight`` / ``w2_weight``. No redundant experts
  (EPLB off): expert ``e`` lives on EP rank ``e // (E / ep)``.
* The MLA path absorbs ``kv_b_proj`` into ``w_kc``/``w_vc`` after loading; both are listed
  as ``derived`` (recomputed by the engine, never written by a plan) in the model dtype. (Real
  sglang keeps them bf16 for 128x128 fp8 blocks and re-quantizes them per tensor otherwise; they
  are engine-internal either way.)

Dtypes: the model dtype (``spec.dtype``), except block-quantized linear weights
(``float8_e4m3fn``) and their ``weight_scale_inv`` (``float32``), the router's
``e_score_correction_bias`` (``float32``, MoEGate / Glm4MoeGate) and, with the ``router_fp32``
option, its weight (:mod:`weightsync.layout.sglang_options`), and the DSA indexer's ``k_norm``
weight and bias (``float32``, V32LayerNorm). A local dtype other than the global tensor's tells
the sender to cast (or quantize) while packing.

Options: where sglang's layout depends on the GPU, the flags or the version (router dtype, ...),
``par`` carries a named option, resolved by :func:`weightsync.layout.sglang_options.layout_options`.

Typical usage::

    from weightsync.layout.sglang import engine_layout, engine_coords
    tensors = engine_layout(spec, RolloutParallel(tp=4, dp=2, ep=4), rank=3)
    coords = engine_coords(RolloutParallel(tp=4, dp=2, ep=4), 3)
"""

from __future__ import annotations

import functools

from weightsync.layout.box import LocalTensor
from weightsync.layout.sglang_coords import (
    VOCAB_PADDING,
    EngineCoords,
    VocabShard,
    engine_coords,
    vocab_shard,
)
from weightsync.layout.sglang_options import layout_options
from weightsync.layout.sglang_parts import (
    Fp8BlockCut,
    LayerBuilder,
    build_attention,
    build_mlp,
    build_vocab,
    dense_mlp_split,
    kv_head_range,
)
from weightsync.models.parallel import RolloutParallel
from weightsync.models.spec import ModelSpec

__all__ = [
    "VOCAB_PADDING",
    "EngineCoords",
    "Fp8BlockCut",
    "VocabShard",
    "check_engine_parallel",
    "dense_mlp_split",
    "engine_coords",
    "engine_layout",
    "kv_head_range",
    "vocab_shard",
]


def engine_layout(spec: ModelSpec, par: RolloutParallel, rank: int) -> list[LocalTensor]:
    """The parameters of one engine rank, each as pieces of global tensors.

    Names are sglang's parameter names (``model.layers.3.self_attn.qkv_proj.weight``,
    ``model.layers.3.mlp.experts.w13_weight``, ...). fp8 block-quantized weights have dtype
    ``float8_e4m3fn`` and pieces of the bf16 global weight (the sender quantizes); their
    ``..._scale_inv`` tensors are float32 pieces of the global scale tensors. Padding rows (vocab)
    have no piece. Derived tensors (MLA ``w_kc``/``w_vc``) have no pieces and ``derived=True``.

    The result is cached per ``(spec, par, rank)``; a fresh list is returned on each call.

    Args:
        spec: the model.
        par: the engine's parallel sizes (every engine of a fleet has the same layout).
        rank: rank inside the engine, ``0 <= rank < par.tp``.

    Returns:
        The rank's local tensors, in model order (embedding, layers, final norm, lm_head).

    Raises:
        ValueError: a configuration sglang refuses (heads, kv heads, experts or intermediate
            sizes not divisible by their split; fp8 blocks cut by a split), naming the constraint.
    """
    return list(_engine_layout_cached(spec, par, rank))


@functools.lru_cache(maxsize=512)
def _engine_layout_cached(spec: ModelSpec, par: RolloutParallel, rank: int) -> tuple[LocalTensor, ...]:
    coords = engine_coords(par, rank)
    check_engine_parallel(spec, par)
    b = LayerBuilder(spec, layout_options(spec, par))
    build_vocab(b, "model.embed_tokens.weight", "model.embed_tokens.weight",
                vocab_shard(spec, par, rank, lm_head=False))
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        b.replicated(p + "input_layernorm.weight")
        build_attention(b, coords, p)
        b.replicated(p + "post_attention_layernorm.weight")
        build_mlp(b, coords, par, layer, p)
    b.replicated("model.norm.weight")
    if not spec.tie_word_embeddings:
        # Tied models (Qwen3ForCausalLM) alias lm_head to embed_tokens: one parameter, listed once.
        build_vocab(b, "lm_head.weight", "lm_head.weight", vocab_shard(spec, par, rank, lm_head=True))
    return tuple(b.tensors)


def check_engine_parallel(spec: ModelSpec, par: RolloutParallel) -> None:
    """Refuse the configurations sglang refuses, with the constraint in the message.

    Args:
        spec: the model.
        par: the engine's parallel sizes.

    Raises:
        ValueError: the first violated constraint.
    """
    attn_tp = par.attn_tp
    heads = spec.num_attention_heads
    if heads % attn_tp:
        raise ValueError(f"{spec.name}: {heads} attention heads are not divisible by attention-TP {attn_tp} "
                         f"(tp {par.tp} / dp {par.dp})")
    kv = spec.num_kv_heads
    if not spec.is_mla and (kv % attn_tp if kv >= attn_tp else attn_tp % kv):
        raise ValueError(f"{spec.name}: {kv} kv heads and attention-TP {attn_tp}: one must divide the other")
    has_dense = any(not spec.is_moe_layer(layer) for layer in range(spec.num_layers))
    dense_split = dense_mlp_split(spec, par, engine_coords(par, 0))[1]
    if has_dense and spec.intermediate_size % dense_split:
        raise ValueError(f"{spec.name}: dense intermediate size {spec.intermediate_size} is not divisible by tp "
                         f"{dense_split} (moe_dense_tp=1 replicates dense MLPs in MLA and GLM-4.5 models)")
    if not spec.is_moe:
        return
    experts = spec.num_experts
    if par.tp > experts:
        raise ValueError(f"{spec.name}: tp {par.tp} is greater than the number of experts {experts} (sglang refuses)")
    if experts % par.ep:
        raise ValueError(f"{spec.name}: {experts} experts are not divisible by ep {par.ep}")
    if spec.moe_intermediate_size % par.moe_tp:
        raise ValueError(f"{spec.name}: moe intermediate size {spec.moe_intermediate_size} is not divisible by "
                         f"moe-TP {par.moe_tp} (tp {par.tp} / ep {par.ep})")
    shared = spec.num_shared_experts * spec.moe_intermediate_size
    if shared % par.tp:
        raise ValueError(f"{spec.name}: shared-expert intermediate size {shared} is not divisible by tp {par.tp}")
    if spec.fp8_block is not None:
        # Fp8MoEMethod.create_weights: whole blocks per moe-TP shard (block_k checked whenever tp > 1).
        i_l = spec.moe_intermediate_size // par.moe_tp
        bn, bk = spec.fp8_block
        if i_l % bn or (par.tp > 1 and i_l % bk):
            raise Fp8BlockCut(f"{spec.name}: moe intermediate size per moe-TP rank {i_l} is not a multiple of the fp8 "
                             f"block {spec.fp8_block} (sglang Fp8MoEMethod refuses it)")
