"""Model specifications: the architecture numbers of one model, independent of sharding.

A :class:`ModelSpec` holds what a model's HF ``config.json`` says (hidden size, heads, experts,
MLA ranks, ...), normalised across families, so that the layout code can derive the global
(HF-named) tensors and each side's shards from it alone.

Typical usage::

    from weightsync.models import get_model
    spec = get_model("Qwen3-4B", "tiny")
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling:
    """YaRN rope scaling (config.json ``rope_type``/``type`` ``"yarn"``), as transformers'
    ``_compute_yarn_parameters`` and sglang's YaRN rotary embeddings read it.

    The rotary inverse frequencies blend interpolation (``1 / (factor * theta^(2i/d))``) and
    extrapolation (``1 / theta^(2i/d)``) with a linear ramp between the correction dims of
    ``beta_fast`` and ``beta_slow``; cos and sin are multiplied by :attr:`cos_sin_factor`; MLA
    models multiply their softmax scale by ``yarn_mscale(factor, mscale_all_dim) ** 2``.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    """An explicit cos/sin factor (None: derived from ``factor``, ``mscale``, ``mscale_all_dim``)."""
    truncate: bool = True
    """Round the correction range to whole dims (transformers' default)."""

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        if self.original_max_position_embeddings < 1:
            raise ValueError("rope scaling original_max_position_embeddings must be positive, got "
                             f"{self.original_max_position_embeddings}")

    @property
    def cos_sin_factor(self) -> float:
        """The factor cos and sin are multiplied by (transformers' ``attention_factor``)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """MLA's softmax-scale multiplier ``yarn_mscale(factor, mscale_all_dim) ** 2`` (1 without
        ``mscale_all_dim``), as DeepSeek-V3's attention applies it."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


class Family(enum.StrEnum):
    """Architecture families; each has its own layout rules on both sides."""

    QWEN3 = "qwen3"  # dense GQA, q/k RMSNorm (Qwen3ForCausalLM)
    QWEN3_MOE = "qwen3_moe"  # GQA + q/k norm + softmax-routed MoE, no shared expert
    GLM4_MOE = "glm4_moe"  # GQA + attention bias + partial rotary + sigmoid router + shared expert
    DEEPSEEK_V3 = "deepseek_v3"  # MLA + MoE (Kimi-K2, GLM-4.7-Flash, GLM-5 with DSA indexer)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Architecture of one model, as its HF config.json states it."""

    name: str
    """Registry name, e.g. ``"Qwen3-4B"``."""
    family: Family
    hf_architecture: str
    """``architectures[0]`` of config.json, e.g. ``"Qwen3ForCausalLM"``."""
    hf_model_type: str
    """``model_type`` of config.json, e.g. ``"qwen3"``."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    """``num_hidden_layers`` (MTP / next-n layers are not counted and not transferred)."""
    num_attention_heads: int
    num_kv_heads: int
    """``num_key_value_heads``; for MLA equal to ``num_attention_heads``."""
    head_dim: int = 0
    """Per-head dim of GQA attention (0 for MLA)."""
    intermediate_size: int = 0
    """FFN size of dense layers."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    rope_scaling: RopeScaling | None = None
    """YaRN scaling of the rotary embedding (None: plain rope)."""
    rope_interleave: bool = True
    """MLA only: the rope dims of q and k are rotated in pairs ``(2i, 2i+1)`` (DeepSeek's
    checkpoint layout, config.json ``rope_interleave``); False rotates halves (neox style)."""
    indexer_rope_interleave: bool = False
    """DSA indexer only: pairs (GLM-5, ``indexer_rope_interleave``) or halves (DeepSeek-V3.2)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k (Qwen3)."""
    attention_bias: bool = False
    """Bias on q/k/v projections (GLM-4.5)."""
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    # MoE
    num_experts: int = 0
    """Routed experts per MoE layer (0 = dense model)."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    """Shared experts (their FFN width is ``num_shared_experts * moe_intermediate_size``)."""
    first_k_dense_replace: int = 0
    """The first this-many layers use a dense MLP instead of MoE."""
    moe_layer_freq: int = 1
    mlp_layer_types: tuple[str, ...] | None = None
    """``"dense"`` / ``"sparse"`` per layer when the layer pattern is not ``first_k_dense_replace``
    dense layers then MoE (Qwen3-MoE ``mlp_only_layers`` / ``decoder_sparse_step``, transformers'
    ``mlp_layer_types``); None: the pattern of ``first_k_dense_replace`` and ``moe_layer_freq``."""
    router_score_function: str = "softmax"
    """``"softmax"`` or ``"sigmoid"``."""
    router_expert_bias: bool = False
    """``e_score_correction_bias`` (DeepSeek-V3 style aux-loss-free balancing)."""
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    router_fp32: bool = False
    """config.json ``router_fp32`` (DeepSeek-V2/V3 architectures, GLM-5): sglang 0.5.23's ``MoEGate``
    holds the router weight in float32 (GLM-4.5 and GLM-4.7-Flash routers always are)."""

    # MLA (DeepSeek-V3 family)
    q_lora_rank: int | None = None
    """None means q is a plain ``q_proj`` (no low-rank q)."""
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    # DSA indexer (GLM-5)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    dtype: str = "bfloat16"
    """Dtype of the trainer's weights and of the engine's unquantized weights."""
    fp8_block: tuple[int, int] | None = None
    """Block size of the engine's fp8 block-quantized linear weights (None: not quantized): a block-fp8
    checkpoint's own, or the run profile's where a shard would cut that
    (:func:`weightsync.layout.sglang_fp8.serving_fp8_block`)."""

    scale: str = "full"
    """``"full"``, ``"layers=N"`` or ``"tiny"``."""
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    """Where each number comes from (field name -> source)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.hidden_size < 1 or self.vocab_size < 1:
            raise ValueError(f"{self.name}: num_layers, hidden_size and vocab_size must be positive")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_attention_heads={self.num_attention_heads} is not a multiple "
                f"of num_kv_heads={self.num_kv_heads}"
            )
        if self.is_mla and not (self.kv_lora_rank and self.qk_rope_head_dim and self.v_head_dim):
            raise ValueError(f"{self.name}: an MLA model needs kv_lora_rank, qk_rope_head_dim, v_head_dim")
        if not self.is_mla and self.head_dim < 1:
            raise ValueError(f"{self.name}: head_dim must be positive for GQA attention")
        if self.num_experts and not (self.num_experts_per_tok and self.moe_intermediate_size):
            raise ValueError(f"{self.name}: an MoE model needs num_experts_per_tok and moe_intermediate_size")
        if self.router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"{self.name}: router_score_function must be softmax or sigmoid")
        if self.num_experts and self.num_experts % self.n_group:
            raise ValueError(f"{self.name}: num_experts={self.num_experts} is not a multiple of n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"{self.name}: topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
        if self.mlp_layer_types is not None and (
            len(self.mlp_layer_types) != self.num_layers or set(self.mlp_layer_types) - {"dense", "sparse"}
        ):
            raise ValueError(f"{self.name}: mlp_layer_types must name 'dense' or 'sparse' for each of the "
                             f"{self.num_layers} layers, got {self.mlp_layer_types}")

    @property
    def is_mla(self) -> bool:
        return self.family is Family.DEEPSEEK_V3

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def has_indexer(self) -> bool:
        return self.index_n_heads > 0

    @property
    def qk_head_dim(self) -> int:
        """MLA q/k head dim (nope + rope)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` has a routed-expert MLP."""
        if not self.is_moe:
            return False
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer] == "sparse"
        if layer < self.first_k_dense_replace:
            return False
        return (layer - self.first_k_dense_replace) % self.moe_layer_freq == 0

    def replace(self, **changes: object) -> ModelSpec:
        return dataclasses.replace(self, **changes)
