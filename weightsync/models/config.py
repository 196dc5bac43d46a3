"""A model spec from a checkpoint's ``config.json``: every field that changes the forward pass is
read, or the checkpoint is refused naming the field.

Architectures (``architectures[0]``, else ``model_type``): ``Qwen3ForCausalLM``,
``Qwen3MoeForCausalLM``, ``Glm4MoeForCausalLM``, ``Glm4MoeLiteForCausalLM`` (GLM-4.7-Flash),
``DeepseekV3ForCausalLM`` (DeepSeek-V3, Kimi-K2 with ``model_type`` ``kimi_k2``), and the DSA
models ``GlmMoeDsaForCausalLM`` (GLM-5) and ``DeepseekV32ForCausalLM``. Both spellings found in
the wild are read: transformers 4.x (top-level ``rope_theta``, ``rope_scaling``,
``num_experts``) and 5.x (``rope_parameters``, ``num_local_experts``, ``mlp_layer_types``); a key
absent from the file takes the default of the architecture's transformers config class
(:data:`HF_DEFAULTS`, checked against transformers by the tests), as ``from_pretrained`` would.

Every key of the file is accounted for: read (and honoured), refused when its value is one the
engine cannot compute (:class:`ConfigError` names the key and the value), or listed in
:data:`IRRELEVANT_KEYS` (metadata, training-only, generation defaults). An unknown key is
refused too: weightsync cannot tell whether it changes the forward pass.

Where transformers and sglang (the engine this project mirrors) read a field differently, the
engine follows sglang and the choice is recorded here:

* the MLA latent norms (``q_a_layernorm``, ``kv_a_layernorm``) use ``rms_norm_eps`` (sglang,
  Megatron); transformers builds them with its default eps 1e-6;
* DeepSeek ``topk_method``/``scoring_func``: ``noaux_tc`` is sigmoid scoring with
  ``e_score_correction_bias`` and group scores summed over each group's two best experts;
  ``greedy`` and ``group_limited_greedy`` are softmax scoring without bias, groups scored by
  their best expert (transformers always routes as ``noaux_tc``);
* ``indexer_rope_interleave`` is read for both DSA architectures (default: pairs for
  ``GlmMoeDsaForCausalLM``, halves for ``DeepseekV32ForCausalLM``, as transformers hard-codes).

Typical usage::

    spec = spec_from_hf_config(json.loads(Path(d, "config.json").read_text()), name="Kimi-K2")
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from weightsync.models.spec import Family, ModelSpec, RopeScaling


class ConfigError(ValueError):
    """A ``config.json`` the engine cannot honour; the message names the field and its value."""


ARCHITECTURES: dict[str, Family] = {
    "Qwen3ForCausalLM": Family.QWEN3,
    "Qwen3MoeForCausalLM": Family.QWEN3_MOE,
    "Glm4MoeForCausalLM": Family.GLM4_MOE,
    "Glm4MoeLiteForCausalLM": Family.DEEPSEEK_V3,
    "DeepseekV3ForCausalLM": Family.DEEPSEEK_V3,
    "DeepseekV32ForCausalLM": Family.DEEPSEEK_V3,
    "GlmMoeDsaForCausalLM": Family.DEEPSEEK_V3,
}
"""Supported ``architectures[0]`` -> layout family."""

MODEL_TYPES: dict[str, str] = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}
"""``model_type`` -> architecture, for configs without ``architectures``."""

DSA_ARCHITECTURES = ("GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM")

_COMMON = {"hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "rope_theta": 10000.0}
_MLA = {**_COMMON, "num_key_value_heads": None, "q_lora_rank": None, "norm_topk_prob": True, "n_group": 1,
        "topk_group": 1}

_DEEPSEEK_V3 = {**_MLA, "rope_interleave": True, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
                "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                "first_k_dense_replace": 3, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6}

HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen3ForCausalLM": {**_COMMON, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                         "head_dim": 128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    "Qwen3MoeForCausalLM": {**_COMMON, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                            "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
                            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "decoder_sparse_step": 1,
                            "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
                            "norm_topk_prob": False},
    "Glm4MoeForCausalLM": {**_COMMON, "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
                           "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
                           "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "moe_intermediate_size": 1408,
                           "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128,
                           "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                           "norm_topk_prob": True, "use_qk_norm": False, "partial_rotary_factor": 0.5},
    "Glm4MoeLiteForCausalLM": {**_MLA, "rope_interleave": True, "vocab_size": 154880, "hidden_size": 2048,
                               "intermediate_size": 10240,
                               "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20,
                               "num_key_value_heads": 20, "n_shared_experts": 1, "n_routed_experts": 64,
                               "routed_scaling_factor": 1.8, "kv_lora_rank": 512, "q_lora_rank": 768,
                               "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192,
                               "num_experts_per_tok": 4, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5},
    "DeepseekV3ForCausalLM": _DEEPSEEK_V3,
    "DeepseekV32ForCausalLM": {**_DEEPSEEK_V3, "rope_interleave": None, "max_position_embeddings": 163840,
                               "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64},
    "GlmMoeDsaForCausalLM": {**_MLA, "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
                             "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
                             "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256,
                             "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048,
                             "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1,
                             "topk_group": 1, "num_experts_per_tok": 8, "max_position_embeddings": 202752,
                             "rms_norm_eps": 1e-5, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
                             "first_k_dense_replace": 3},
}
"""The transformers config-class defaults (transformers 5.18) of the keys read here, per architecture:
the value a key absent from config.json takes."""

IRRELEVANT_KEYS = frozenset({
    # identity, provenance, file format
    "architectures", "model_type", "transformers_version", "_name_or_path", "auto_map", "torch_dtype", "dtype",
    "name_or_path", "_commit_hash", "_attn_implementation_autoset", "use_return_dict", "return_dict",
    # token ids and generation defaults (the engine reads eos_token_id itself, for stopping)
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    # inference-time switches and training-only settings
    "use_cache", "initializer_range", "attention_dropout", "hidden_dropout", "output_attentions",
    "output_hidden_states", "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads",
    "chunk_size_feed_forward", "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux",
    "ep_size", "pretraining_tp", "moe_router_dtype", "finetuning_task", "id2label", "label2id", "problem_type",
    "tokenizer_class", "prefix", "task_specific_params", "is_encoder_decoder", "is_decoder",
    "cross_attention_hidden_size", "add_cross_attention", "tie_encoder_decoder",
    # multi-token-prediction layers: not part of the model's forward, never transferred
    "num_nextn_predict_layers", "num_mtp_layers", "index_share_for_mtp_iteration",
})
"""config.json keys that do not change the forward pass of the layers weightsync serves."""

_YARN_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor",
                        "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                        "attention_factor", "truncate"})
_ROPE_LAYER_TYPES = ("full_attention", "sliding_attention", "indexed_attention")


def _fmt(value: Any) -> str:
    return repr(value) if not isinstance(value, str) else f"'{value}'"


class _Fields:
    """config.json values with the architecture's defaults, remembering which keys were read."""

    def __init__(self, config: Mapping[str, Any], arch: str, where: str) -> None:
        self.config = dict(config)
        self.defaults = HF_DEFAULTS[arch]
        self.arch = arch
        self.where = where
        self.read: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.config

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        if key in self.config:
            return self.config[key]
        return self.defaults.get(key, default)

    def refuse(self, key: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{self.where}: {key}={_fmt(value)} is not supported: {why}")

    def expect(self, key: str, allowed: tuple[Any, ...], why: str) -> Any:
        """The value of ``key``, refused unless it is one of ``allowed`` (absent keys read their default)."""
        value = self.get(key)
        if value not in allowed:
            raise self.refuse(key, value, why)
        return value

    def positive_int(self, key: str) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{self.where}: {key}={_fmt(value)} must be a positive integer")
        return value

    def number(self, key: str) -> float:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{self.where}: {key}={_fmt(value)} must be a finite number")
        return float(value)

    def unread(self) -> list[str]:
        return [k for k in self.config if k not in self.read and k not in IRRELEVANT_KEYS]


def architecture_of(config: Mapping[str, Any], where: str = "config.json") -> str:
    """The supported architecture a config.json describes.

    Raises:
        ConfigError: no ``architectures`` / ``model_type``, or an unsupported one.
    """
    archs = config.get("architectures")
    if archs:
        if not isinstance(archs, list) or len(archs) != 1:
            raise ConfigError(f"{where}: architectures={_fmt(archs)}: expected one architecture")
        arch = archs[0]
    else:
        arch = MODEL_TYPES.get(str(config.get("model_type")))
        if arch is None:
            raise ConfigError(f"{where}: no architectures and model_type={_fmt(config.get('model_type'))} is not one "
                              f"of {', '.join(MODEL_TYPES)}")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{where}: architectures={_fmt([arch])} is not supported; supported: "
                          f"{', '.join(ARCHITECTURES)}")
    return arch


def spec_from_hf_config(config: Mapping[str, Any], *, name: str, where: str = "config.json",
                        dtype: str = "bfloat16", fp8_block: tuple[int, int] | None = None,
                        scale: str = "full", sources: dict[str, str] | None = None) -> ModelSpec:
    """The :class:`ModelSpec` a checkpoint's config.json describes (see the module docstring).

    Args:
        config: the parsed config.json.
        name: the spec's name (the registry model the checkpoint is served as).
        where: how messages name the file (e.g. its path).
        dtype: the weights' dtype in the trainer and the engine (``--dtype``).
        fp8_block: the block size the engine stores linear weights in (the run profile's), or None.
        scale: the scale label of the spec.
        sources: the spec's ``sources`` (default: every field from ``where``).

    Returns:
        The spec.

    Raises:
        ConfigError: an unsupported architecture, a field whose value the engine cannot honour,
            or an unknown key (the message names the key and its value).
    """
    arch = architecture_of(config, where)
    f = _Fields(config, arch, where)
    family = ARCHITECTURES[arch]
    f.expect("hidden_act", ("silu",), "the engine computes SwiGLU MLPs (silu)")
    kw: dict[str, Any] = {
        "name": name, "family": family, "hf_architecture": arch, "hf_model_type": str(config.get("model_type", "")),
        "vocab_size": f.positive_int("vocab_size"), "hidden_size": f.positive_int("hidden_size"),
        "num_layers": f.positive_int("num_hidden_layers"), "num_attention_heads": f.positive_int("num_attention_heads"),
        "rms_norm_eps": f.number("rms_norm_eps"), "max_position_embeddings": f.positive_int("max_position_embeddings"),
        "tie_word_embeddings": bool(f.get("tie_word_embeddings")), "dtype": dtype, "scale": scale,
        "fp8_block": fp8_block, "sources": sources if sources is not None else {"*": where},
    }
    kw["intermediate_size"] = f.positive_int("intermediate_size")
    if family is Family.DEEPSEEK_V3:
        kw.update(_mla_fields(f, kw["num_attention_heads"]))
    else:
        kw.update(_gqa_fields(f, family, kw["num_attention_heads"], kw["hidden_size"]))
    kw.update(_rope_fields(f, family, kw))
    if family is not Family.QWEN3:
        kw.update(_moe_fields(f, family, kw["num_layers"]))
    _check_quantization(f)
    _check_layer_types(f, kw["num_layers"])
    unknown = f.unread()
    if unknown:
        key = unknown[0]
        raise ConfigError(f"{where}: unknown key {key}={_fmt(config[key])}"
                          + (f" (and {len(unknown) - 1} more: {', '.join(unknown[1:6])})" if len(unknown) > 1 else "")
                          + ": weightsync cannot tell whether it changes the forward pass; remove it from config.json "
                            "if it does not")
    try:
        return ModelSpec(**kw)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _gqa_fields(f: _Fields, family: Family, heads: int, hidden: int) -> dict[str, Any]:
    kv = f.get("num_key_value_heads")
    kv = heads if kv is None else kv
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or heads % kv:
        raise ConfigError(f"{f.where}: num_key_value_heads={_fmt(kv)} must divide num_attention_heads={heads}")
    head_dim = f.get("head_dim")
    if head_dim is None:
        head_dim = hidden // heads
    out: dict[str, Any] = {"num_kv_heads": kv, "head_dim": int(head_dim)}
    if family is Family.GLM4_MOE:
        out["attention_bias"] = bool(f.get("attention_bias"))
        out["qk_norm"] = bool(f.get("use_qk_norm"))
    else:
        f.expect("attention_bias", (False,), "Qwen3 puts the bias on o_proj too, which the engine has no tensor for")
        out["qk_norm"] = True
        if f.get("use_sliding_window"):
            raise f.refuse("use_sliding_window", True, "the engine has no sliding-window attention")
        f.get("sliding_window")  # only read with use_sliding_window
        f.get("max_window_layers")
    return out


def _mla_fields(f: _Fields, heads: int) -> dict[str, Any]:
    f.read.add("num_key_value_heads")
    kv = f.config.get("num_key_value_heads")
    if kv is not None and kv != heads:
        raise f.refuse("num_key_value_heads", kv, f"MLA attention has one kv head per head ({heads})")
    f.expect("attention_bias", (False,), "MLA projections without bias only")
    q_lora = f.get("q_lora_rank")
    if q_lora is None and f.arch in DSA_ARCHITECTURES:
        raise f.refuse("q_lora_rank", None, "the DSA indexer reads the q latent")
    out: dict[str, Any] = {
        "num_kv_heads": heads, "head_dim": 0,
        "q_lora_rank": None if q_lora is None else f.positive_int("q_lora_rank"),
        "kv_lora_rank": f.positive_int("kv_lora_rank"), "qk_nope_head_dim": f.positive_int("qk_nope_head_dim"),
        "qk_rope_head_dim": f.positive_int("qk_rope_head_dim"), "v_head_dim": f.positive_int("v_head_dim"),
    }
    f.get("head_dim")  # transformers sets head_dim = qk_rope_head_dim for MLA; a stored value is not used
    qk = f.get("qk_head_dim")
    if qk is not None and qk != out["qk_nope_head_dim"] + out["qk_rope_head_dim"]:
        raise f.refuse("qk_head_dim", qk, "expected qk_nope_head_dim + qk_rope_head_dim = "
                       f"{out['qk_nope_head_dim'] + out['qk_rope_head_dim']}")
    if f.arch in DSA_ARCHITECTURES:
        interleave = f.get("rope_interleave")
        if interleave is not None and not interleave:
            raise f.refuse("rope_interleave", interleave, f"{f.arch} always rotates the rope dims in pairs")
        f.expect("mlp_bias", (False, None), "MLPs without bias only")
        out.update(index_n_heads=f.positive_int("index_n_heads"), index_head_dim=f.positive_int("index_head_dim"),
                   index_topk=f.positive_int("index_topk"))
        if out["index_head_dim"] < out["qk_rope_head_dim"]:
            raise f.refuse("index_head_dim", out["index_head_dim"],
                           f"the indexer rotates its first qk_rope_head_dim={out['qk_rope_head_dim']} dims")
        out["indexer_rope_interleave"] = bool(f.get("indexer_rope_interleave",
                                                    f.arch == "GlmMoeDsaForCausalLM"))
        _check_indexer_types(f)
    else:
        out["rope_interleave"] = bool(f.get("rope_interleave"))
    return out


def _check_indexer_types(f: _Fields) -> None:
    """GLM-5.1+ IndexShare: layers marked "shared" reuse an earlier layer's selection (refused)."""
    types = f.get("indexer_types")
    pattern = f.get("index_topk_pattern")
    freq, offset = f.get("index_topk_freq", 1), f.get("index_skip_topk_offset", 2)
    if types is not None:
        if any(t != "full" for t in types):
            raise f.refuse("indexer_types", types, "layers that share another layer's DSA selection are not built")
    elif pattern is not None:
        if any(c != "F" for c in pattern):
            raise f.refuse("index_topk_pattern", pattern, "layers that share another layer's DSA selection are "
                           "not built")
    else:
        n = f.positive_int("num_hidden_layers")
        freq = max(int(freq), 1)
        if any(max(i - int(offset) + 1, 0) % freq for i in range(n)):
            raise f.refuse("index_topk_freq", freq, f"with index_skip_topk_offset={offset} some layers share "
                           "another layer's DSA selection, which is not built")


def _rope_fields(f: _Fields, family: Family, kw: dict[str, Any]) -> dict[str, Any]:
    """rope_theta, partial rotary and YaRN from either spelling (transformers' precedence)."""
    params = f.get("rope_scaling") or f.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{f.where}: rope_parameters={_fmt(params)} must be an object")
    nested = [k for k in params if k in _ROPE_LAYER_TYPES]
    if nested:
        if set(params) != {"full_attention"} and set(params) != {"indexed_attention"}:
            raise f.refuse("rope_parameters", params, "per-layer-type rope parameters other than one type")
        params = params[nested[0]]
    unknown = sorted(set(params) - _YARN_KEYS)
    if unknown:
        raise f.refuse(f"rope_parameters.{unknown[0]}", params[unknown[0]], "not a rope parameter weightsync knows")
    theta = params.get("rope_theta", f.get("rope_theta"))
    partial = params.get("partial_rotary_factor", f.get("partial_rotary_factor", 1.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(theta), "partial_rotary_factor": float(partial)}
    if not (isinstance(theta, (int, float)) and theta > 0):
        raise f.refuse("rope_theta", theta, "must be a positive number")
    if family is not Family.GLM4_MOE and partial != 1.0:
        raise f.refuse("partial_rotary_factor", partial, "only GLM-4.5 attention rotates part of each head")
    if not 0 < partial <= 1:
        raise f.refuse("partial_rotary_factor", partial, "must be in (0, 1]")
    if rope_type == "default":
        return out
    if rope_type != "yarn":
        raise f.refuse("rope_type", rope_type, "the engine implements plain and YaRN rotary embeddings")
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise f.refuse("rope_parameters.factor", factor, "YaRN needs a numeric factor")
    original = f.config.get("original_max_position_embeddings",
                            params.get("original_max_position_embeddings", kw["max_position_embeddings"]))
    f.get("original_max_position_embeddings")
    try:
        out["rope_scaling"] = RopeScaling(
            factor=float(factor), original_max_position_embeddings=int(original),
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))
    except ValueError as exc:
        raise ConfigError(f"{f.where}: rope_parameters: {exc}") from None
    return out


def _moe_fields(f: _Fields, family: Family, num_layers: int) -> dict[str, Any]:
    experts_key = next((k for k in ("num_experts", "num_local_experts", "n_routed_experts") if f.has(k)),
                       "num_experts" if family is Family.QWEN3_MOE else "n_routed_experts")
    for k in ("num_experts", "num_local_experts", "n_routed_experts"):
        if f.has(k) and f.config[k] != f.config[experts_key]:
            raise f.refuse(k, f.config[k], f"{experts_key}={f.config[experts_key]} says otherwise")
        f.read.add(k)
    experts = f.get(experts_key)
    if not experts:  # a Qwen3-MoE config with no experts is a dense model in transformers
        raise f.refuse(experts_key, experts, "a MoE architecture needs routed experts")
    out: dict[str, Any] = {
        "num_experts": int(experts), "num_experts_per_tok": f.positive_int("num_experts_per_tok"),
        "moe_intermediate_size": f.positive_int("moe_intermediate_size"),
        "norm_topk_prob": bool(f.get("norm_topk_prob")),
    }
    if out["num_experts_per_tok"] > out["num_experts"]:
        raise f.refuse("num_experts_per_tok", out["num_experts_per_tok"], f"more than the {experts} experts")
    if family is Family.QWEN3_MOE:
        out.update(router_score_function="softmax", router_expert_bias=False)
        for key in ("scoring_func", "topk_method", "n_group", "routed_scaling_factor", "n_shared_experts"):
            if f.has(key):
                raise f.refuse(key, f.config[key], "Qwen3-MoE routes by softmax top-k, without groups, scaling "
                               "or shared experts")
        only = f.get("mlp_only_layers") or []
        step = f.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise f.refuse("decoder_sparse_step", step, "must be a positive integer")
        types = tuple("dense" if (i in only or (i + 1) % step) else "sparse" for i in range(num_layers))
        out.update(_layer_pattern(types))
        return out
    shared = f.get("n_shared_experts") or 0
    out.update(num_shared_experts=int(shared), routed_scaling_factor=f.number("routed_scaling_factor"),
               n_group=f.positive_int("n_group"), topk_group=f.positive_int("topk_group"))
    out.update(_router_method(f, family))
    router_fp32 = f.get("router_fp32", False)
    if not isinstance(router_fp32, bool):
        raise f.refuse("router_fp32", router_fp32, "expected true or false")
    out["router_fp32"] = router_fp32
    out.update(_dense_layers(f, num_layers))
    return out


def _router_method(f: _Fields, family: Family) -> dict[str, Any]:
    method = f.get("topk_method", "noaux_tc")
    scoring = f.get("scoring_func", "sigmoid" if method == "noaux_tc" else "softmax")
    if family is Family.GLM4_MOE or f.arch == "Glm4MoeLiteForCausalLM":
        if (method, scoring) != ("noaux_tc", "sigmoid"):
            key, value = ("topk_method", method) if method != "noaux_tc" else ("scoring_func", scoring)
            raise f.refuse(key, value, f"{f.arch} routes by sigmoid scores with e_score_correction_bias (noaux_tc)")
        return {"router_score_function": "sigmoid", "router_expert_bias": True}
    if method == "noaux_tc":
        if scoring != "sigmoid":
            raise f.refuse("scoring_func", scoring, "topk_method noaux_tc scores experts with a sigmoid")
        return {"router_score_function": "sigmoid", "router_expert_bias": True}
    if method in ("greedy", "group_limited_greedy"):
        if scoring != "softmax":
            raise f.refuse("scoring_func", scoring, f"topk_method {method} scores experts with a softmax")
        if method == "greedy" and f.get("n_group") not in (1, None):
            raise f.refuse("n_group", f.get("n_group"), "topk_method greedy has no expert groups")
        return {"router_score_function": "softmax", "router_expert_bias": False}
    raise f.refuse("topk_method", method, "supported: noaux_tc, greedy, group_limited_greedy")


def _dense_layers(f: _Fields, num_layers: int) -> dict[str, Any]:
    """The MLP layer pattern of the GLM / DeepSeek architectures."""
    freq = f.get("moe_layer_freq", 1)
    if freq != 1:
        raise f.refuse("moe_layer_freq", freq, "transformers makes every layer after first_k_dense_replace MoE, "
                       "sglang every moe_layer_freq-th: only 1 is unambiguous")
    types = f.get("mlp_layer_types")
    first_k = f.get("first_k_dense_replace")
    if types is not None:
        types = tuple(types)
        if len(types) != num_layers or set(types) - {"dense", "sparse"}:
            raise f.refuse("mlp_layer_types", list(types), f"expected 'dense' or 'sparse' for each of the {num_layers} "
                           "layers")
        if f.has("first_k_dense_replace"):
            k = min(int(first_k), num_layers)
            if types != ("dense",) * k + ("sparse",) * (num_layers - k):
                raise f.refuse("mlp_layer_types", list(types), f"first_k_dense_replace={first_k} says otherwise "
                               "(transformers reads one, sglang the other)")
        return _layer_pattern(types)
    if f.arch == "Glm4MoeLiteForCausalLM":
        # transformers ignores first_k_dense_replace here (its default mlp_layer_types: one dense
        # layer, then MoE); sglang reads it: only a value both agree on is unambiguous.
        if first_k not in (None, 1):
            raise f.refuse("first_k_dense_replace", first_k, "Glm4MoeLite in transformers has one dense layer "
                           "unless mlp_layer_types says otherwise; give mlp_layer_types")
        first_k = 1
    first_k = 0 if first_k is None else int(first_k)
    k = min(first_k, num_layers)
    return _layer_pattern(("dense",) * k + ("sparse",) * (num_layers - k))


def _layer_pattern(types: tuple[str, ...]) -> dict[str, Any]:
    """``first_k_dense_replace`` when the pattern is dense-then-MoE, else explicit ``mlp_layer_types``."""
    k = next((i for i, t in enumerate(types) if t == "sparse"), len(types))
    if all(t == "sparse" for t in types[k:]):
        return {"first_k_dense_replace": k, "mlp_layer_types": None}
    return {"first_k_dense_replace": 0, "mlp_layer_types": types}


def _check_layer_types(f: _Fields, num_layers: int) -> None:
    types = f.get("layer_types")
    if types is None:
        return
    allowed = {"full_attention", "indexed_attention"}
    if len(types) != num_layers or set(types) - allowed:
        raise f.refuse("layer_types", types, "every layer must be full (or DSA-indexed) attention")


def _check_quantization(f: _Fields) -> None:
    """Only DeepSeek-style block fp8 (dynamic activations, e4m3, float scales) is read."""
    q = f.get("quantization_config")
    if q is None:
        return
    if not isinstance(q, dict):
        raise ConfigError(f"{f.where}: quantization_config={_fmt(q)} must be an object")
    checkpoint_fp8_block(q, f.where)


_QUANT_KEYS = frozenset({"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
                         "ignored_layers", "dequantize", "scale_fmt"})


def checkpoint_fp8_block(quantization_config: Mapping[str, Any] | None,
                         where: str = "config.json") -> tuple[int, int] | None:
    """The block size a checkpoint stores its fp8 weights in (None: not quantized).

    The checkpoint's own block is what its ``weight_scale_inv`` tensors scale; an engine serves it, or a
    block size that tiles it where a shard would cut it (each scale copied to its sub-blocks).

    Raises:
        ConfigError: a quantization the readers cannot dequantize (the message names the key).
    """
    if quantization_config is None:
        return None
    q = quantization_config

    def refuse(key: str, why: str) -> ConfigError:
        return ConfigError(f"{where}: quantization_config.{key}={_fmt(q.get(key))} is not supported: {why}")

    unknown = sorted(set(q) - _QUANT_KEYS)
    if unknown:
        raise refuse(unknown[0], "not a block-fp8 setting weightsync knows")
    if q.get("quant_method") != "fp8":
        raise refuse("quant_method", "only block fp8 checkpoints (DeepSeek style, weight_scale_inv) are read")
    if q.get("fmt", "e4m3") != "e4m3":
        raise refuse("fmt", "the weights must be float8_e4m3fn")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise refuse("activation_scheme", "the engine computes with dequantized weights; static activation "
                     "scales are not read")
    if q.get("scale_fmt") not in (None, "float"):
        raise refuse("scale_fmt", "weight_scale_inv must hold float scales")
    block = q.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise refuse("weight_block_size", "expected two positive integers (per-tensor fp8 is not read)")
    return int(block[0]), int(block[1])
