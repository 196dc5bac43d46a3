"""Small random checkpoints written by Hugging Face ``transformers`` itself, one per architecture
weightsync serves, and transformers' own forward of them: the reference of the checkpoint tests.

Every checkpoint has shapes unlike the registry's tiny ones (vocab, hidden, heads, head dims,
expert counts, LoRA ranks) and non-default rope and routing fields (YaRN on Qwen3 and
DeepSeek-V3, partial rotary, attention bias and q/k norm on GLM-4.5, grouped top-k, scaling
factors, ``norm_topk_prob`` off, a Qwen3-MoE layer pattern that is not dense-then-MoE,
``rope_interleave`` off on GLM-4.7-Flash, the DSA indexer's two rope styles). Their dims divide
TP 2 and EP 2, and every linear weight of the fp8 one (DeepSeek-V3, served as Kimi-K2) is cut into
whole [8, 8] blocks on both sides' shards.

The weights are seeded normals (linear ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2), router bias and
attention biases ~ N(0, 0.1^2)) so that logits are far from uniform and routing far from ties. The
DSA indexer's ``wk`` and ``weights_proj`` hold bfloat16 values (in the float32 file): sglang, and so
the engine, store them in bfloat16 whatever ``--dtype`` says (``Indexer``'s ``params_dtype``).

One difference of transformers from sglang, the engine and Megatron is undone in its reference
model: transformers builds the MLA latent norms (``q_a_layernorm``, ``kv_a_layernorm``) with eps
1e-6 whatever ``rms_norm_eps`` says; sglang (``DeepseekV2AttentionMLA``) and Megatron use
``rms_norm_eps``.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FP8_BLOCK = (8, 8)
"""The Kimi-K2 profile's engine block at tiny scale (the fp8 checkpoint's block too)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HFFamily:
    """One architecture's small transformers checkpoint and the registry model serving it."""

    model: str
    """Registry model (the run profile)."""
    config_class: str
    model_class: str
    config: dict[str, Any] = field(default_factory=dict)
    fp8: bool = False
    """Written in DeepSeek's block-fp8 format (float8 weights, weight_scale_inv, quantization_config)."""


_MLA_COMMON: dict[str, Any] = {"hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 3,
                               "num_attention_heads": 4, "num_key_value_heads": 4, "moe_intermediate_size": 16,
                               "n_shared_experts": 1}

FAMILIES: dict[str, HFFamily] = {
    "qwen3": HFFamily(
        model="Qwen3-4B", config_class="Qwen3Config", model_class="Qwen3ForCausalLM",
        config={"vocab_size": 120, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3,
                "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": True, "max_position_embeddings": 256,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                 "rope_theta": 5e5}}),
    "qwen3_moe": HFFamily(
        model="Qwen3-30B-A3B", config_class="Qwen3MoeConfig", model_class="Qwen3MoeForCausalLM",
        config={"vocab_size": 130, "hidden_size": 40, "intermediate_size": 72, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 10, "rms_norm_eps": 3e-6,
                "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": False,
                "decoder_sparse_step": 2, "rope_theta": 2e5}),
    "glm4_moe": HFFamily(
        model="GLM-4.5-Air", config_class="Glm4MoeConfig", model_class="Glm4MoeForCausalLM",
        config={"vocab_size": 140, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 3,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 2e-5,
                "attention_bias": True, "use_qk_norm": True, "n_routed_experts": 8, "num_experts_per_tok": 3,
                "moe_intermediate_size": 16, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
                "topk_group": 1, "routed_scaling_factor": 1.5, "partial_rotary_factor": 0.5, "rope_theta": 3e5}),
    "glm4_moe_lite": HFFamily(
        model="GLM-4.7-Flash", config_class="Glm4MoeLiteConfig", model_class="Glm4MoeLiteForCausalLM",
        config={**_MLA_COMMON, "vocab_size": 110, "q_lora_rank": 24, "kv_lora_rank": 20, "qk_nope_head_dim": 12,
                "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.3, "rope_interleave": False,
                "mlp_layer_types": ["dense", "sparse", "sparse"], "rms_norm_eps": 2e-6, "rope_theta": 1e6}),
    "deepseek_v3": HFFamily(
        model="Kimi-K2", config_class="DeepseekV3Config", model_class="DeepseekV3ForCausalLM", fp8=True,
        config={**_MLA_COMMON, "vocab_size": 150, "q_lora_rank": None, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 2,
                "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
                # Kimi-K2's YaRN (beta_fast = beta_slow = 1) with a softmax mscale unlike the cos/sin one
                "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                                 "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                                 "rope_theta": 5e4}}),
    "glm_moe_dsa": HFFamily(
        model="GLM-5", config_class="GlmMoeDsaConfig", model_class="GlmMoeDsaForCausalLM",
        config={**_MLA_COMMON, "vocab_size": 100, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 12,
                "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "first_k_dense_replace": 1, "index_topk": 5, "index_head_dim": 16, "index_n_heads": 8,
                "routed_scaling_factor": 2.0, "rms_norm_eps": 3e-6, "rope_theta": 1e6}),
    "deepseek_v32": HFFamily(
        model="GLM-5", config_class="DeepseekV32Config", model_class="DeepseekV32ForCausalLM",
        config={**_MLA_COMMON, "vocab_size": 100, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 12,
                "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "index_topk": 5, "index_head_dim": 16,
                "index_n_heads": 8, "routed_scaling_factor": 2.0, "rms_norm_eps": 1e-6, "rope_theta": 1e6}),
}
"""Test key -> family. ``deepseek_v32`` is GLM-5's config as the reference system patches it."""

PROMPTS = ([5, 17, 99, 3, 8, 1, 2, 60], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [42, 7])
"""Token ids below every family's vocab; one longer than the DSA configs' index_topk (5)."""


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name or not t.dtype.is_floating_point:
                continue
            if name.endswith("norm.weight"):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=gen))
            elif name.endswith("bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))
            else:
                t.copy_(torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[-1]))
            if ".indexer.wk." in name or ".indexer.weights_proj." in name:
                t.copy_(t.to(torch.bfloat16))


def _latent_norm_eps(model: torch.nn.Module, eps: float) -> None:
    """Give the MLA latent norms ``rms_norm_eps`` (see the module docstring)."""
    for module in model.modules():
        for attr in ("q_a_layernorm", "kv_a_layernorm"):
            norm = getattr(module, attr, None)
            if norm is not None and hasattr(norm, "variance_epsilon"):
                norm.variance_epsilon = eps


def load_hf_model(family: HFFamily, path: Path) -> torch.nn.Module:
    """transformers' model of a (float32, unquantized) checkpoint directory, eager attention, eval mode."""
    import transformers

    cls = getattr(transformers, family.model_class)
    model = cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    _latent_norm_eps(model, model.config.rms_norm_eps)
    return model


def write_family_checkpoint(key: str, path: Path, *, seed: int = 0, fp8_block: tuple[int, int] = FP8_BLOCK) -> Path:
    """Write ``FAMILIES[key]``'s checkpoint at ``path`` with transformers' ``save_pretrained`` (float32).

    The fp8 family is then rewritten in DeepSeek's format: every linear weight the engine stores
    in fp8 becomes float8_e4m3fn with a float32 ``weight_scale_inv`` per [8, 8] block, and
    config.json gets the ``quantization_config``; the float32 weights it was made from are kept,
    dequantized, in the sibling ``<path>-dequantized`` (what transformers computes with).

    Returns:
        The directory transformers' reference model loads (``path``, or its dequantized sibling).
    """
    import transformers

    family = FAMILIES[key]
    config = getattr(transformers, family.config_class)(**family.config)
    torch.manual_seed(seed)
    model = getattr(transformers, family.model_class)(config).to(torch.float32)
    _randomize(model, seed)
    model.save_pretrained(str(path))
    if not family.fp8:
        return path
    return _to_block_fp8(family, path, fp8_block)


def _to_block_fp8(family: HFFamily, path: Path, block: tuple[int, int]) -> Path:
    from safetensors.torch import load_file, save_file

    from weightsync.models.hf import is_fp8_linear
    from weightsync.models.resolve import model_spec
    from weightsync.quant.fp8 import dequantize_block_fp8, quantize_block_fp8

    spec = model_spec(family.model, "tiny", checkpoint=path)
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1, files
    tensors = load_file(str(files[0]))
    stored, dequantized = {}, {}
    for name, w in tensors.items():
        if is_fp8_linear(spec, name):
            q, scale = quantize_block_fp8(w, block)
            stored[name], stored[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_block_fp8(q, scale, block, dtype=torch.float32)
        else:
            stored[name] = dequantized[name] = w
    ref = path.with_name(path.name + "-dequantized")
    ref.mkdir()
    shutil.copy(path / "config.json", ref / "config.json")
    save_file(dequantized, str(ref / files[0].name), metadata={"format": "pt"})
    save_file(stored, str(files[0]), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return ref


def hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax of the logits of one prompt, ``[len(ids), vocab]``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
