"""Modules that fill slots of megatron-core's local layer spec where its own do not serve.

**Core attention.**
megatron-core 0.16.1's local ``DotProductAttention`` takes no ``k_channels`` / ``v_channels``
(MLA's q/k head dim differs from its v head dim), so ``MLASelfAttention`` can be built only with
Transformer Engine's attention. :class:`SdpaCoreAttention` is a drop-in for the
``core_attention`` slot: the same constructor arguments, the same tensors in and out
(``[s, b, heads, dim]`` -> ``[s, b, heads * v_dim]``), computed with
``torch.nn.functional.scaled_dot_product_attention`` in float32. It holds no weights, so it
changes nothing in the parameter layout.

GLM-5's DSA indexer: megatron-core 0.16.1 builds it only with TE. When the model has one,
:class:`SdpaCoreAttention` carries an ``indexer`` submodule with the parameters of
megatron-core's ``DSAIndexer`` (``linear_wq_b``, ``linear_wk``, ``k_norm`` with bias,
``linear_weights_proj``), so that names, shapes and checkpoint keys match and the weights can be
loaded, trained and transferred. The attention itself stays dense: the indexer's top-k token
selection is not applied (a limitation stated in docs/trainer.md).

**Norms.** The local spec's ``WrappedTorchNorm`` refuses sequence parallelism, which megatron-core
requires for training MoE layers at TP > 1 (and which the reference runs use everywhere).
:class:`RMSNormSP` is ``torch.nn.RMSNorm`` (same parameter, same checkpoint key) that marks its
weight ``sequence_parallel`` as TE's and Apex's norms do, so that its gradient is summed over
the TP group like theirs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNormSP(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built from a megatron-core config, sequence-parallel aware (module docstring)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused: object) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"RMSNormSP needs normalization='RMSNorm', got {config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


class DsaIndexerWeights(torch.nn.Module):
    """The parameters of megatron-core's DSA indexer (unused by the forward; see module docstring)."""

    def __init__(self, *, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.linear_wq_b = torch.nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.linear_wk = torch.nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = torch.nn.LayerNorm(head_dim)
        self.linear_weights_proj = torch.nn.Linear(hidden_size, num_heads, bias=False)


class SdpaCoreAttention(MegatronModule):
    """Causal softmax attention over ``[s, b, heads, dim]`` tensors (see module docstring).

    Query groups (GQA) are expanded to the heads; ``attention_mask`` (True = masked, Megatron's
    convention) is honoured; packed sequences and attention bias are not supported.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection: object | None = None, indexer: dict[str, int] | None = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SdpaCoreAttention does not support context parallelism")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        if indexer is not None:
            self.indexer = DsaIndexerWeights(hidden_size=config.hidden_size, **indexer)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: object | None = None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SdpaCoreAttention supports neither packed sequences nor attention bias")
        heads, groups = query.shape[2], key.shape[2]
        if heads != groups:
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, value))  # [b, h, s, d]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if attention_mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=mask_type == AttnMaskType.causal,
                                                 scale=self.softmax_scale)
        s, b = query.shape[0], query.shape[1]
        return out.to(query.dtype).permute(2, 0, 1, 3).reshape(s, b, heads * value.shape[-1])
