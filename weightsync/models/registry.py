"""The registry of models of the reference system, and the scales a model can be built at.

Each entry is a :class:`ModelSpec` filled from the model's published ``config.json``; the
``sources`` dict of each spec says where each number was read. Two kinds of source are used:

* ``miles:<file>``: the Megatron argument files ``scripts/models/*.py`` of radixark/miles
  (commit 31f1ca9), which restate config.json in Megatron flags (``--kv-channels`` = head_dim,
  ``--qk-head-dim`` = qk_nope_head_dim, ``--qk-pos-emb-head-dim`` = qk_rope_head_dim,
  ``--moe-layer-freq [0]*k+[1]*n`` = first_k_dense_replace k);
* ``config.json``: the HF config of the checkpoint, as quoted in public repositories (named in
  the entry).

Scales (:func:`scale_spec`): ``full``; ``layers=N`` (real per-layer shapes, the first N layers,
at least one dense and one MoE layer kept where the family has both); ``tiny`` (same family
and flags, small dims, a few layers; milliseconds on CPU).

MTP / next-n layers are not in any spec: weight updates do not move them.
"""

from __future__ import annotations

from collections.abc import Callable

from weightsync.models.spec import Family, ModelSpec, RopeScaling

MILES = "radixark/miles@31f1ca9 scripts/models/"
"""Prefix of the Megatron argument files the numbers are checked against."""
P2P_DOC = "radixark/miles@31f1ca9 docs/advanced/p2p-weight-transfer.md"
QWEN3_CONFIGS = "citsjtu2020/LLM-Prof sglang/Model_Config.md"


def _qwen3_4b() -> ModelSpec:
    src = MILES + "qwen3-4B.py"
    cfg = "Qwen/Qwen3-4B config.json (as quoted in " + QWEN3_CONFIGS + ")"
    return ModelSpec(
        name="Qwen3-4B",
        family=Family.QWEN3,
        hf_architecture="Qwen3ForCausalLM",
        hf_model_type="qwen3",
        vocab_size=151936,
        hidden_size=2560,
        num_layers=36,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=9728,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        sources={
            "vocab_size": src + " --vocab-size 151936",
            "hidden_size": src + " --hidden-size 2560",
            "num_layers": src + " --num-layers 36",
            "num_attention_heads": src + " --num-attention-heads 32",
            "num_kv_heads": src + " --num-query-groups 8",
            "head_dim": src + " --kv-channels 128",
            "intermediate_size": src + " --ffn-hidden-size 9728",
            "rms_norm_eps": src + " --norm-epsilon 1e-6",
            "rope_theta": src + " --rotary-base 1000000",
            "qk_norm": src + " --qk-layernorm",
            "tie_word_embeddings": src + " (no --untie-embeddings-and-output-weights); " + cfg + " tie true",
            "max_position_embeddings": cfg + " (40960)",
            "checkpoint": "Qwen/Qwen3-4B (miles run.py PREPARE_CONFIGS)",
        },
    )


def _qwen3_moe(name: str, *, file: str, checkpoint: str, hidden: int, layers: int, heads: int, ffn: int,
               moe_ffn: int, rope_theta: float, max_pos: int, cfg: str) -> ModelSpec:
    src = MILES + file
    return ModelSpec(
        name=name,
        family=Family.QWEN3_MOE,
        hf_architecture="Qwen3MoeForCausalLM",
        hf_model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=ffn,
        rms_norm_eps=1e-6,
        rope_theta=rope_theta,
        qk_norm=True,
        tie_word_embeddings=False,
        max_position_embeddings=max_pos,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=moe_ffn,
        router_score_function="softmax",
        norm_topk_prob=True,
        sources={
            "vocab_size": src + " --vocab-size 151936",
            "hidden_size": f"{src} --hidden-size {hidden}",
            "num_layers": f"{src} --num-layers {layers}",
            "num_attention_heads": f"{src} --num-attention-heads {heads}",
            "num_kv_heads": src + " --num-query-groups 4",
            "head_dim": src + " --kv-channels 128",
            "intermediate_size": f"{src} --ffn-hidden-size {ffn} (config.json intermediate_size; no dense layer)",
            "rms_norm_eps": src + " --norm-epsilon 1e-6",
            "rope_theta": f"miles p2p_weight_transfer/run.py rotary_base={int(rope_theta)} for this profile",
            "qk_norm": src + " --qk-layernorm",
            "tie_word_embeddings": src + " --untie-embeddings-and-output-weights",
            "num_experts": src + " --num-experts 128",
            "num_experts_per_tok": src + " --moe-router-topk 8",
            "moe_intermediate_size": f"{src} --moe-ffn-hidden-size {moe_ffn}",
            "router_score_function": src + " --moe-router-score-function softmax",
            "first_k_dense_replace": src + " FIRST_K_DENSE_REPLACE = 0",
            "norm_topk_prob": cfg + " norm_topk_prob true",
            "max_position_embeddings": f"{cfg} ({max_pos})",
            "checkpoint": checkpoint + " (miles run.py PREPARE_CONFIGS)",
        },
    )


def _glm45_air() -> ModelSpec:
    src = MILES + "glm4.5-106B-A12B.py"
    cfg = "zai-org/GLM-4.5-Air config.json"
    return ModelSpec(
        name="GLM-4.5-Air",
        family=Family.GLM4_MOE,
        hf_architecture="Glm4MoeForCausalLM",
        hf_model_type="glm4_moe",
        vocab_size=151552,
        hidden_size=4096,
        num_layers=46,
        num_attention_heads=96,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=10944,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        partial_rotary_factor=0.5,
        qk_norm=False,
        attention_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1408,
        num_shared_experts=1,
        first_k_dense_replace=1,
        router_score_function="sigmoid",
        router_expert_bias=True,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        sources={
            "vocab_size": src + " --vocab-size 151552",
            "hidden_size": src + " --hidden-size 4096",
            "num_layers": src + " N_DENSE_LAYERS 1 + N_MOE_LAYERS 45",
            "num_attention_heads": src + " --num-attention-heads 96",
            "num_kv_heads": src + " --num-query-groups 8",
            "head_dim": src + " --kv-channels 128",
            "intermediate_size": src + " --ffn-hidden-size 10944",
            "rms_norm_eps": cfg + " rms_norm_eps 1e-05",
            "rope_theta": (
                src + " --rotary-base 1000000 (also THUDM/slime glm4.5-106B-A12B.sh and miles run.py "
                "rotary_base); one third-party conversion script writes 10000: not confirmed from config.json"
            ),
            "partial_rotary_factor": src + " --rotary-percent 0.5",
            "qk_norm": cfg + " use_qk_norm false (no --qk-layernorm in " + src + ")",
            "attention_bias": src + " --add-qkv-bias",
            "tie_word_embeddings": src + " --untie-embeddings-and-output-weights",
            "max_position_embeddings": cfg + " (131072)",
            "num_experts": src + " --num-experts 128",
            "num_experts_per_tok": src + " --moe-router-topk 8",
            "moe_intermediate_size": src + " --moe-ffn-hidden-size 1408",
            "num_shared_experts": src + " --moe-shared-expert-intermediate-size 1408 (= 1 x 1408)",
            "first_k_dense_replace": src + " --moe-layer-freq [0]*1+[1]*45",
            "router_score_function": src + " --moe-router-score-function sigmoid",
            "router_expert_bias": src + " --moe-router-enable-expert-bias",
            "routed_scaling_factor": cfg + " routed_scaling_factor 1.0 (no topk-scaling flag in " + src + ")",
            "n_group": cfg + " n_group 1, topk_group 1",
            "checkpoint": "zai-org/GLM-4.5-Air (miles run.py PREPARE_CONFIGS)",
        },
    )


def _kimi_k2() -> ModelSpec:
    src = MILES + "kimi-k2.py"
    cfg = "moonshotai/Kimi-K2-Instruct config.json"
    return ModelSpec(
        name="Kimi-K2",
        family=Family.DEEPSEEK_V3,
        hf_architecture="DeepseekV3ForCausalLM",
        hf_model_type="kimi_k2",
        vocab_size=163840,
        hidden_size=7168,
        num_layers=61,
        num_attention_heads=64,
        num_kv_heads=64,
        intermediate_size=18432,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        num_experts=384,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        num_shared_experts=1,
        first_k_dense_replace=1,
        router_score_function="sigmoid",
        router_expert_bias=True,
        norm_topk_prob=True,
        routed_scaling_factor=2.827,
        n_group=1,
        topk_group=1,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_scaling=RopeScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
        fp8_block=(64, 64),
        sources={
            "vocab_size": src + " --vocab-size 163840",
            "hidden_size": src + " --hidden-size 7168",
            "num_layers": src + " --num-layers 61",
            "num_attention_heads": src + " --num-attention-heads 64",
            "num_kv_heads": cfg + " num_key_value_heads 64 (MLA)",
            "intermediate_size": src + " --ffn-hidden-size 18432",
            "rms_norm_eps": src + " --norm-epsilon 1e-6",
            "rope_theta": src + " --rotary-base 50000 (yarn, --rotary-scaling-factor 32.0)",
            "rope_scaling": (
                src + " --rope-type yarn --rotary-scaling-factor 32.0 --original-max-position-embeddings 4096 "
                "--beta-fast 1 --beta-slow 1 --mscale 1.0 --mscale-all-dim 1.0"
            ),
            "rope_interleave": cfg + " (DeepseekV3 default: rope rows interleaved in pairs)",
            "tie_word_embeddings": src + " --untie-embeddings-and-output-weights",
            "max_position_embeddings": (
                "131072 = 4096 x yarn factor 32 (" + src + " --original-max-position-embeddings 4096 "
                "--rotary-scaling-factor 32.0); sglang serves Kimi-K2-Instruct with max_model_len 131072 "
                "(pbelevich/awsome-ai-research kimi-k2/README.md)"
            ),
            "num_experts": src + " --num-experts 384",
            "num_experts_per_tok": src + " --moe-router-topk 8",
            "moe_intermediate_size": src + " --moe-ffn-hidden-size 2048",
            "num_shared_experts": src + " --moe-shared-expert-intermediate-size 2048 (= 1 x 2048)",
            "first_k_dense_replace": src + " FIRST_K_DENSE_REPLACE = 1",
            "router_score_function": src + " --moe-router-score-function sigmoid",
            "router_expert_bias": src + " --moe-router-enable-expert-bias",
            "routed_scaling_factor": src + " --moe-router-topk-scaling-factor 2.827",
            "n_group": src + " --moe-router-num-groups 1 --moe-router-group-topk 1",
            "q_lora_rank": src + " --q-lora-rank 1536",
            "kv_lora_rank": src + " --kv-lora-rank 512",
            "qk_nope_head_dim": src + " --qk-head-dim 128",
            "qk_rope_head_dim": src + " --qk-pos-emb-head-dim 64",
            "v_head_dim": src + " --v-head-dim 128",
            "fp8_block": (
                P2P_DOC + ": the original checkpoint's [128, 128] blocks break sglang tp 32, so the "
                "reference system serves [64, 64] (dense FFN 18432 / 32 = 576 = 9 x 64); weightsync serves "
                "the checkpoint's own blocks where no shard cuts them and re-blocks them losslessly into "
                "these otherwise"
            ),
            "checkpoint": "moonshotai/Kimi-K2-Instruct (miles run.py PREPARE_CONFIGS)",
        },
    )


def _glm47_flash() -> ModelSpec:
    src = MILES + "glm4.7-flash.py"
    cfg = "zai-org/GLM-4.7-Flash config.json (as quoted in vLLM's glm4_moe_lite config test)"
    return ModelSpec(
        name="GLM-4.7-Flash",
        family=Family.DEEPSEEK_V3,
        hf_architecture="Glm4MoeLiteForCausalLM",
        hf_model_type="glm4_moe_lite",
        vocab_size=154880,
        hidden_size=2048,
        num_layers=47,
        num_attention_heads=20,
        num_kv_heads=20,
        intermediate_size=10240,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        max_position_embeddings=202752,
        num_experts=64,
        num_experts_per_tok=4,
        moe_intermediate_size=1536,
        num_shared_experts=1,
        first_k_dense_replace=1,
        router_score_function="sigmoid",
        router_expert_bias=True,
        norm_topk_prob=True,
        routed_scaling_factor=1.8,
        n_group=1,
        topk_group=1,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        sources={
            "vocab_size": src + " --vocab-size 154880",
            "hidden_size": src + " NHIDDEN = 2048",
            "num_layers": src + " N_DENSE_LAYERS 1 + N_MOE_LAYERS 46",
            "num_attention_heads": src + " NHEADS = 20",
            "num_kv_heads": cfg + " num_key_value_heads 20 (MLA)",
            "intermediate_size": src + " FFN_HIDDEN = 10240",
            "rms_norm_eps": src + " --norm-epsilon 1e-5",
            "rope_theta": src + " --rotary-base 1000000",
            "attention_bias": cfg + " attention_bias false (miles passes --add-qkv-bias, which MLA ignores)",
            "tie_word_embeddings": src + " --untie-embeddings-and-output-weights",
            "max_position_embeddings": cfg + " (202752)",
            "num_experts": src + " MOE_ROUTED_EXPERTS = 64",
            "num_experts_per_tok": src + " MOE_ACTIVE_ROUTED_EXPERTS = 4",
            "moe_intermediate_size": src + " MOE_FFN_HIDDEN = 1536",
            "num_shared_experts": src + " MOE_SHARED_EXPERTS = 1",
            "first_k_dense_replace": src + " --moe-layer-freq [0]*1+[1]*46",
            "router_score_function": src + " --moe-router-score-function sigmoid",
            "router_expert_bias": src + " --moe-router-enable-expert-bias",
            "routed_scaling_factor": src + " --moe-router-topk-scaling-factor 1.8",
            "n_group": cfg + " n_group 1, topk_group 1",
            "q_lora_rank": src + " --q-lora-rank 768",
            "kv_lora_rank": src + " --kv-lora-rank 512",
            "qk_nope_head_dim": src + " --qk-head-dim 192",
            "qk_rope_head_dim": src + " --qk-pos-emb-head-dim 64",
            "v_head_dim": src + " --v-head-dim 256",
            "checkpoint": "zai-org/GLM-4.7-Flash (miles run.py PREPARE_CONFIGS)",
        },
    )


def _glm5(name: str = "GLM-5", num_layers: int = 78, checkpoint: str = "zai-org/GLM-5",
          file: str = "glm5-744B-A40B.py") -> ModelSpec:
    src = MILES + "glm5-744B-A40B.py"
    cfg = "zai-org/GLM-5 config.json (as quoted in vllm-project/vllm#36220)"
    n_moe = num_layers - 3
    sources = {
        "vocab_size": src + " --vocab-size 154880",
        "hidden_size": src + " NHIDDEN = 6144",
        "num_layers": f"{MILES}{file} N_DENSE_LAYERS 3 + n_moe_layers {n_moe}",
        "num_attention_heads": src + " NHEADS = 64",
        "num_kv_heads": cfg + " num_key_value_heads 64 (MLA)",
        "intermediate_size": src + " FFN_HIDDEN = 12288",
        "rms_norm_eps": cfg + " rms_norm_eps 1e-05",
        "rope_theta": src + " --rotary-base 1000000; " + cfg + " rope_parameters.rope_theta 1000000",
        "tie_word_embeddings": src + " --untie-embeddings-and-output-weights",
        "max_position_embeddings": cfg + " (202752)",
        "num_experts": src + " MOE_ROUTED_EXPERTS = 256",
        "num_experts_per_tok": src + " MOE_ACTIVE_ROUTED_EXPERTS = 8",
        "moe_intermediate_size": src + " MOE_FFN_HIDDEN = 2048",
        "num_shared_experts": src + " MOE_SHARED_EXPERTS = 1",
        "first_k_dense_replace": src + " N_DENSE_LAYERS = 3",
        "router_score_function": src + " --moe-router-score-function sigmoid",
        "router_expert_bias": src + " --moe-router-enable-expert-bias",
        "routed_scaling_factor": src + " --moe-router-topk-scaling-factor 2.5",
        "n_group": cfg + " n_group 1, topk_group 1",
        "q_lora_rank": src + " --q-lora-rank 2048",
        "kv_lora_rank": src + " --kv-lora-rank 512",
        "qk_nope_head_dim": src + " --qk-head-dim 192",
        "qk_rope_head_dim": src + " --qk-pos-emb-head-dim 64",
        "v_head_dim": src + " --v-head-dim 256",
        "index_n_heads": cfg + " index_n_heads 32",
        "index_head_dim": cfg + " index_head_dim 128",
        "index_topk": cfg + " index_topk 2048",
        "indexer_rope_interleave": "zai-org/GLM-5 config.json indexer_rope_interleave true (transformers' "
                                   "GlmMoeDsaIndexer rotates pairs)",
        "checkpoint": checkpoint + " (miles run.py PREPARE_CONFIGS)",
    }
    if name != "GLM-5":
        sources["num_layers"] += f" ('first {num_layers} layers: 3 dense + {n_moe} MoE' in {file})"
    return ModelSpec(
        name=name,
        family=Family.DEEPSEEK_V3,
        # The reference system patches the checkpoint's config to DeepseekV32ForCausalLM /
        # deepseek_v32 (run.py patch_glm5_config); the published config says GlmMoeDsaForCausalLM.
        hf_architecture="GlmMoeDsaForCausalLM",
        hf_model_type="glm_moe_dsa",
        vocab_size=154880,
        hidden_size=6144,
        num_layers=num_layers,
        num_attention_heads=64,
        num_kv_heads=64,
        intermediate_size=12288,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        max_position_embeddings=202752,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        num_shared_experts=1,
        first_k_dense_replace=3,
        router_score_function="sigmoid",
        router_expert_bias=True,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        n_group=1,
        topk_group=1,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        indexer_rope_interleave=True,
        sources=sources,
    )


MODELS: dict[str, Callable[[], ModelSpec]] = {
    "Qwen3-4B": _qwen3_4b,
    "Qwen3-30B-A3B": lambda: _qwen3_moe(
        "Qwen3-30B-A3B", file="qwen3-30B-A3B.py", checkpoint="Qwen/Qwen3-30B-A3B", hidden=2048, layers=48,
        heads=32, ffn=6144, moe_ffn=768, rope_theta=1_000_000.0, max_pos=40960,
        cfg="Qwen/Qwen3-30B-A3B config.json (as quoted in " + QWEN3_CONFIGS + ")",
    ),
    "Qwen3-235B-A22B": lambda: _qwen3_moe(
        "Qwen3-235B-A22B", file="qwen3-235B-A22B.py", checkpoint="Qwen/Qwen3-235B-A22B-Instruct-2507",
        hidden=4096, layers=94, heads=64, ffn=12288, moe_ffn=1536, rope_theta=5_000_000.0, max_pos=262144,
        # Not found quoted for this exact checkpoint: 262144 and norm_topk_prob are the values of
        # the Qwen3 2507 series (rope 5e6 is confirmed by run.py).
        cfg="Qwen3 2507-series config.json (unconfirmed for this checkpoint)",
    ),
    "GLM-4.5-Air": _glm45_air,
    "Kimi-K2": _kimi_k2,
    "GLM-4.7-Flash": _glm47_flash,
    "GLM-5": _glm5,
    "GLM-5_4layer": lambda: _glm5("GLM-5_4layer", 4, "Pinaster/GLM-5_4layer", "glm5-744B-A40B_4layer.py"),
    "GLM-5_20layer": lambda: _glm5("GLM-5_20layer", 20, "Pinaster/GLM-5_20layer", "glm5-744B-A40B_20layer.py"),
}
"""Registry name -> builder of the full-size spec (the reference system's names, minus the
``-Instruct`` suffixes of its Kimi-K2 / Qwen3-235B checkpoint names)."""


def list_models() -> list[str]:
    """Registry names, in registry order (smallest reference run first within each family)."""
    return list(MODELS)


def get_model(name: str, scale: str = "full") -> ModelSpec:
    """The spec of a registry model at a scale.

    Args:
        name: exact registry name (see :func:`list_models`).
        scale: ``"full"``, ``"layers=N"`` or ``"tiny"``.

    Returns:
        The :class:`ModelSpec`, with ``spec.scale`` set to the normalised scale.

    Raises:
        ValueError: unknown name (the message lists the known ones) or bad scale.
    """
    builder = MODELS.get(name)
    if builder is None:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return scale_spec(builder(), scale)


def parse_scale(scale: str) -> tuple[str, int | None]:
    """Parse a scale string.

    Args:
        scale: ``"full"``, ``"tiny"`` or ``"layers=N"`` (N >= 1).

    Returns:
        ``("full", None)``, ``("tiny", None)`` or ``("layers", N)``.

    Raises:
        ValueError: anything else.
    """
    s = scale.strip()
    if s in ("full", "tiny"):
        return s, None
    if s.startswith("layers="):
        value = s.removeprefix("layers=")
        if value.isdigit() and int(value) >= 1:
            return "layers", int(value)
    raise ValueError(f"bad scale {scale!r}: expected 'full', 'tiny' or 'layers=N' with N >= 1")


def scale_spec(spec: ModelSpec, scale: str) -> ModelSpec:
    """``spec`` (a full-size spec) at ``scale``.

    Args:
        spec: a full-scale spec.
        scale: ``"full"``, ``"layers=N"`` or ``"tiny"``.

    Returns:
        The scaled spec; ``spec.scale`` records the scale.

    Raises:
        ValueError: bad scale, ``spec`` already scaled, N above the model's layer count, or N too
            small to keep both a dense and an MoE layer where the model has both.
    """
    kind, n = parse_scale(scale)
    if kind == "full":
        return spec
    if spec.scale != "full":
        raise ValueError(f"{spec.name}: scale {scale!r} applies to a full-scale spec, got scale {spec.scale!r}")
    if kind == "tiny":
        return _tiny(spec)
    assert n is not None
    return _truncate(spec, n)


def _truncate(spec: ModelSpec, n: int) -> ModelSpec:
    if n > spec.num_layers:
        raise ValueError(f"{spec.name}: layers={n} exceeds the model's {spec.num_layers} layers")
    dense_first = spec.first_k_dense_replace
    if spec.is_moe and dense_first >= 1:
        if n < 2:
            raise ValueError(
                f"{spec.name}: layers={n} cannot keep both a dense and an MoE layer; use layers=2 or more"
            )
        dense_first = min(dense_first, n - 1)
    types = spec.mlp_layer_types[:n] if spec.mlp_layer_types is not None else None
    return spec.replace(num_layers=n, first_k_dense_replace=dense_first, mlp_layer_types=types, scale=f"layers={n}")


TINY_SOURCE = "tiny scale: small synthetic dims with the family's structure (weightsync.models.registry)"


def _tiny(spec: ModelSpec) -> ModelSpec:
    """Small dims, same family, same flags (see module docstring)."""
    c: dict[str, object] = {
        "vocab_size": 300,  # not a multiple of 64 or 128: both sides' padding paths run
        "hidden_size": 64,
        "num_layers": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 1024,
        "scale": "tiny",
        "sources": {"*": TINY_SOURCE},
    }
    if spec.is_mla:
        c.update(num_attention_heads=4, num_kv_heads=4, head_dim=0, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16 if spec.v_head_dim == spec.qk_nope_head_dim else 32)
        if spec.q_lora_rank is not None:
            c["q_lora_rank"] = 48
    else:
        # kv heads 2 < attention TP 4 exercises kv-head replication.
        c.update(num_attention_heads=4, num_kv_heads=2, head_dim=16)
    if spec.has_indexer:
        c.update(index_n_heads=4, index_head_dim=16, index_topk=8)
    if spec.is_moe:
        # 8 experts split over EP 1, 2, 4, 8; moe intermediate 32 split over moe-TP up to 4 in
        # whole fp8 blocks of 8.
        c.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 first_k_dense_replace=1 if spec.first_k_dense_replace else 0)
    if spec.fp8_block is not None:
        c["fp8_block"] = (8, 8)
    return spec.replace(**c)
