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
from dataclasses import dataclass, field


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
    router_score_function: str = "softmax"
    """``"softmax"`` or ``"sigmoid"``."""
    router_expert_bias: bool = False
    """``e_score_correction_bias`` (DeepSeek-V3 style aux-loss-free balancing)."""
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1

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
    """Block size of the engine's fp8 block-quantized linear weights (None: not quantized)."""

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
        if not self.is_moe or layer < self.first_k_dense_replace:
            return False
        return (layer - self.first_k_dense_replace) % self.moe_layer_freq == 0

    def replace(self, **changes: object) -> ModelSpec:
        return dataclasses.replace(self, **changes)
