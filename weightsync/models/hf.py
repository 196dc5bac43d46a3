"""The canonical global tensors of a model: HF checkpoint names, shapes and dtypes.

Both sides' layouts are expressed as pieces of these tensors, so this table is the contract
between the trainer layout, the engine layout and the planner. Names follow the HF
checkpoints of each family (``model.layers.{i}.self_attn.q_proj.weight`` ...).

fp8 models: the global weight is the bf16 tensor the trainer holds; the engine stores it
block-quantized, and its ``weight_scale_inv`` is a global tensor of its own whose
``quant_of`` names the weight it is computed from.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.models.spec import ModelSpec

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "int32": 4, "int64": 8}


@dataclass(frozen=True, kw_only=True, slots=True)
class GlobalTensor:
    """One HF-named tensor of the whole model."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    quant_of: str | None = None
    """For an fp8 scale tensor: the weight whose blocks it scales."""
    block: tuple[int, int] | None = None
    """For an fp8 scale tensor (and its weight): the quantization block."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def is_fp8_linear(spec: ModelSpec, name: str) -> bool:
    """Whether the engine stores this linear weight block-quantized (DeepSeek-V3 fp8 rule)."""
    if spec.fp8_block is None or not name.startswith("model.layers."):
        return False
    if ".mlp.gate.weight" in name or "layernorm" in name or ".norm" in name:
        return False
    if ".indexer." in name:
        return False
    return name.endswith(("_proj.weight", "proj_with_mqa.weight"))


def attention_tensors(spec: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
    """Attention weights of one layer, keyed by full name, prefix ``p`` = ``model.layers.{i}.``."""
    h = spec.hidden_size
    t: dict[str, tuple[int, ...]] = {}
    a = p + "self_attn."
    if spec.is_mla:
        nh = spec.num_attention_heads
        if spec.q_lora_rank is None:
            t[a + "q_proj.weight"] = (nh * spec.qk_head_dim, h)
        else:
            t[a + "q_a_proj.weight"] = (spec.q_lora_rank, h)
            t[a + "q_a_layernorm.weight"] = (spec.q_lora_rank,)
            t[a + "q_b_proj.weight"] = (nh * spec.qk_head_dim, spec.q_lora_rank)
        t[a + "kv_a_proj_with_mqa.weight"] = (spec.kv_lora_rank + spec.qk_rope_head_dim, h)
        t[a + "kv_a_layernorm.weight"] = (spec.kv_lora_rank,)
        t[a + "kv_b_proj.weight"] = (nh * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank)
        t[a + "o_proj.weight"] = (h, nh * spec.v_head_dim)
        if spec.has_indexer:
            ix = a + "indexer."
            q_in = spec.q_lora_rank if spec.q_lora_rank is not None else h
            t[ix + "wq_b.weight"] = (spec.index_n_heads * spec.index_head_dim, q_in)
            t[ix + "wk.weight"] = (spec.index_head_dim, h)
            t[ix + "k_norm.weight"] = (spec.index_head_dim,)
            t[ix + "k_norm.bias"] = (spec.index_head_dim,)
            t[ix + "weights_proj.weight"] = (spec.index_n_heads, h)
        return t
    d = spec.head_dim
    nq, nkv = spec.num_attention_heads * d, spec.num_kv_heads * d
    t[a + "q_proj.weight"] = (nq, h)
    t[a + "k_proj.weight"] = (nkv, h)
    t[a + "v_proj.weight"] = (nkv, h)
    if spec.attention_bias:
        t[a + "q_proj.bias"] = (nq,)
        t[a + "k_proj.bias"] = (nkv,)
        t[a + "v_proj.bias"] = (nkv,)
    t[a + "o_proj.weight"] = (h, nq)
    if spec.qk_norm:
        t[a + "q_norm.weight"] = (d,)
        t[a + "k_norm.weight"] = (d,)
    return t


def mlp_tensors(spec: ModelSpec, layer: int, p: str) -> dict[str, tuple[int, ...]]:
    """MLP weights (dense, or router + experts + shared experts) of one layer."""
    h = spec.hidden_size
    m = p + "mlp."
    t: dict[str, tuple[int, ...]] = {}
    if not spec.is_moe_layer(layer):
        i = spec.intermediate_size
        t[m + "gate_proj.weight"] = (i, h)
        t[m + "up_proj.weight"] = (i, h)
        t[m + "down_proj.weight"] = (h, i)
        return t
    e, i = spec.num_experts, spec.moe_intermediate_size
    t[m + "gate.weight"] = (e, h)
    if spec.router_expert_bias:
        t[m + "gate.e_score_correction_bias"] = (e,)
    for x in range(e):
        ex = f"{m}experts.{x}."
        t[ex + "gate_proj.weight"] = (i, h)
        t[ex + "up_proj.weight"] = (i, h)
        t[ex + "down_proj.weight"] = (h, i)
    if spec.num_shared_experts:
        s = spec.num_shared_experts * i
        se = m + "shared_experts."
        t[se + "gate_proj.weight"] = (s, h)
        t[se + "up_proj.weight"] = (s, h)
        t[se + "down_proj.weight"] = (h, s)
    return t


def global_tensors(spec: ModelSpec) -> dict[str, GlobalTensor]:
    """Every global tensor of ``spec`` that weight updates move, in checkpoint order.

    Args:
        spec: the model.

    Returns:
        name -> :class:`GlobalTensor`; fp8 scale tensors follow their weights.
    """
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size)}
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (spec.hidden_size,)
        shapes.update(attention_tensors(spec, p))
        shapes[p + "post_attention_layernorm.weight"] = (spec.hidden_size,)
        shapes.update(mlp_tensors(spec, layer, p))
    shapes["model.norm.weight"] = (spec.hidden_size,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    out: dict[str, GlobalTensor] = {}
    for name, shape in shapes.items():
        dtype = "float32" if name.endswith("e_score_correction_bias") else spec.dtype
        if is_fp8_linear(spec, name):
            assert spec.fp8_block is not None
            out[name] = GlobalTensor(name=name, shape=shape, dtype=dtype, block=spec.fp8_block)
            b0, b1 = spec.fp8_block
            sname = name + "_scale_inv"
            sshape = (_ceil_div(shape[0], b0), _ceil_div(shape[1], b1))
            out[sname] = GlobalTensor(name=sname, shape=sshape, dtype="float32", quant_of=name, block=spec.fp8_block)
        else:
            out[name] = GlobalTensor(name=name, shape=shape, dtype=dtype)
    return out
