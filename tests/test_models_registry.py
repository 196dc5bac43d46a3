"""Contract tests of the model registry, its scales and the reference run profiles.

The contract: every registry model builds at every scale; ``layers=N`` keeps real per-layer
shapes and at least one dense and one MoE layer where the model has both; ``tiny`` keeps the
family's structure and flags with dims small and divisible enough for TP/EP up to 4; the run
profiles are exactly the reference system's (issue 2's table, radixark/miles run.py); parameter
counts at full size match the published totals.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

from weightsync.cli.models import model_sizes
from weightsync.models import (
    Family,
    ModelSpec,
    get_model,
    get_profile,
    list_models,
    list_profiles,
    parse_scale,
    scale_spec,
)
from weightsync.models.hf import global_tensors

ALL = list_models()
MOE = [m for m in ALL if get_model(m).is_moe]
DENSE_AND_MOE = [m for m in MOE if get_model(m).first_k_dense_replace >= 1]

EXPECTED_MODELS = [
    "Qwen3-4B", "Qwen3-30B-A3B", "Qwen3-235B-A22B", "GLM-4.5-Air", "Kimi-K2", "GLM-4.7-Flash", "GLM-5",
    "GLM-5_4layer", "GLM-5_20layer",
]


@functools.cache
def _full_shapes(name: str) -> dict[str, tuple[int, ...]]:
    return {k: t.shape for k, t in global_tensors(get_model(name)).items()}


def _layer_kinds(spec: ModelSpec) -> set[bool]:
    return {spec.is_moe_layer(i) for i in range(spec.num_layers)}


def test_registry_names() -> None:
    assert sorted(ALL) == sorted(EXPECTED_MODELS)
    assert sorted(list_profiles()) == sorted(EXPECTED_MODELS)


@pytest.mark.parametrize("scale", ["full", "tiny", "layers=2"])
@pytest.mark.parametrize("name", ALL)
def test_every_model_builds(name: str, scale: str) -> None:
    spec = get_model(name, scale)
    assert spec.name == name
    assert spec.scale == scale
    tensors = global_tensors(spec)
    assert "model.embed_tokens.weight" in tensors
    assert ("lm_head.weight" in tensors) != spec.tie_word_embeddings


FAMILIES = {
    "Qwen3-4B": Family.QWEN3,
    "Qwen3-30B-A3B": Family.QWEN3_MOE,
    "Qwen3-235B-A22B": Family.QWEN3_MOE,
    "GLM-4.5-Air": Family.GLM4_MOE,
    "Kimi-K2": Family.DEEPSEEK_V3,
    "GLM-4.7-Flash": Family.DEEPSEEK_V3,
    "GLM-5": Family.DEEPSEEK_V3,
    "GLM-5_4layer": Family.DEEPSEEK_V3,
    "GLM-5_20layer": Family.DEEPSEEK_V3,
}


@pytest.mark.parametrize("name", ALL)
def test_family_and_flags(name: str) -> None:
    spec = get_model(name)
    assert spec.family is FAMILIES[name]
    assert spec.has_indexer == name.startswith("GLM-5")
    assert (spec.fp8_block is not None) == (name == "Kimi-K2")
    assert spec.qk_norm == name.startswith("Qwen3")
    assert spec.tie_word_embeddings == (name == "Qwen3-4B")
    if spec.family is Family.GLM4_MOE:
        assert spec.attention_bias
        assert spec.partial_rotary_factor == 0.5
        assert spec.num_shared_experts == 1


def test_kimi_k2_fp8_blocks_are_64() -> None:
    spec = get_model("Kimi-K2")
    assert spec.fp8_block == (64, 64)
    assert "[64, 64]" in spec.sources["fp8_block"]


@pytest.mark.parametrize("name", ALL)
def test_sources_recorded(name: str) -> None:
    """Every architecture number of a full-scale spec says where it comes from."""
    spec = get_model(name)
    keys = {"vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads"}
    if spec.is_moe:
        keys |= {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace"}
    if spec.is_mla:
        keys |= {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank"}
    else:
        keys.add("head_dim")
    if spec.has_indexer:
        keys |= {"index_n_heads", "index_head_dim", "index_topk"}
    assert keys <= spec.sources.keys()


# Published totals (model cards / READMEs), in billions. MTP layers are not in the specs.
PUBLISHED_PARAMS_B = {
    "Qwen3-4B": 4.0,  # Qwen/Qwen3-4B model card: "Number of Parameters: 4.0B"
    "Qwen3-30B-A3B": 30.5,  # Qwen/Qwen3-30B-A3B model card: "30.5B in total and 3.3B activated"
    "Qwen3-235B-A22B": 235.0,  # Qwen/Qwen3-235B-A22B model card: "235B in total and 22B activated"
    "GLM-4.5-Air": 106.0,  # zai-org/GLM-4.5 README / transformers glm4_moe.md: "106 billion total"
    "Kimi-K2": 1000.0,  # moonshotai/Kimi-K2-Instruct model card: "1 trillion total parameters"
    "GLM-4.7-Flash": 30.0,  # zai-org/GLM-4.7-Flash model card: "30B-A3B MoE"; miles p2p doc "30B(3B)"
    "GLM-5": 744.0,  # zai-org/GLM-5 model card / miles p2p doc: "744B(40B)"
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS_B))
def test_param_counts_match_published(name: str) -> None:
    params = model_sizes(get_model(name))["params"]
    published = PUBLISHED_PARAMS_B[name] * 1e9
    assert abs(params - published) / published < 0.03, f"{name}: {params / 1e9:.2f}B vs {published / 1e9}B"


def test_truncated_glm5_variants_equal_glm5_at_layers() -> None:
    """GLM-5_4layer / _20layer are GLM-5's first 4 / 20 layers (3 dense + 1 / 17 MoE)."""
    for name, n, moe in (("GLM-5_4layer", 4, 1), ("GLM-5_20layer", 20, 17)):
        variant = get_model(name)
        cut = get_model("GLM-5", f"layers={n}")
        assert variant.num_layers == n
        assert variant.first_k_dense_replace == 3
        assert sum(variant.is_moe_layer(i) for i in range(n)) == moe
        shapes = {k: (t.shape, t.dtype) for k, t in global_tensors(variant).items()}
        assert shapes == {k: (t.shape, t.dtype) for k, t in global_tensors(cut).items()}


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("name", DENSE_AND_MOE)
def test_layers_n_keeps_dense_and_moe(name: str, n: int) -> None:
    full = get_model(name)
    if n > full.num_layers:
        pytest.skip(f"{name} has only {full.num_layers} layers")
    spec = get_model(name, f"layers={n}")
    assert spec.num_layers == n
    assert _layer_kinds(spec) == {False, True}
    assert 1 <= spec.first_k_dense_replace <= min(full.first_k_dense_replace, n - 1)
    # Real per-layer shapes: layer 0 (dense) and the last layer (MoE) equal the full model's layers.
    first_moe = next(i for i in range(full.num_layers) if full.is_moe_layer(i))
    full_shapes = _full_shapes(name)
    for name_cut, t in global_tensors(spec).items():
        if name_cut.startswith(f"model.layers.{n - 1}."):
            key = name_cut.replace(f"model.layers.{n - 1}.", f"model.layers.{first_moe}.")
            assert full_shapes[key] == t.shape
        elif not name_cut.startswith("model.layers.") or name_cut.startswith("model.layers.0."):
            assert full_shapes[name_cut] == t.shape


@pytest.mark.parametrize("name", ["Qwen3-4B", "Qwen3-30B-A3B"])
def test_layers_n_without_dense_layers(name: str) -> None:
    spec = get_model(name, "layers=1")
    assert spec.num_layers == 1
    assert spec.first_k_dense_replace == 0


@pytest.mark.parametrize("name", DENSE_AND_MOE)
def test_layers_1_refused_where_dense_and_moe(name: str) -> None:
    with pytest.raises(ValueError, match="dense and an MoE layer"):
        get_model(name, "layers=1")


def test_layers_above_model_refused() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        get_model("Qwen3-4B", "layers=37")


@pytest.mark.parametrize("name", ALL)
def test_tiny_keeps_structure(name: str) -> None:
    full, tiny = get_model(name), get_model(name, "tiny")
    for field in ("family", "hf_architecture", "qk_norm", "attention_bias", "partial_rotary_factor",
                  "tie_word_embeddings", "router_score_function", "router_expert_bias", "num_shared_experts",
                  "is_moe", "is_mla", "has_indexer", "norm_topk_prob"):
        assert getattr(tiny, field) == getattr(full, field), field
    assert (tiny.q_lora_rank is None) == (full.q_lora_rank is None)
    assert (tiny.fp8_block is None) == (full.fp8_block is None)
    assert (tiny.v_head_dim == tiny.qk_nope_head_dim) == (full.v_head_dim == full.qk_nope_head_dim)
    assert tiny.num_layers >= 2
    assert _layer_kinds(tiny) == _layer_kinds(full)


@pytest.mark.parametrize("name", ALL)
def test_tiny_is_small_and_divisible(name: str) -> None:
    """TP and EP up to 4 must split a tiny model, attention TP 4 above its kv heads included."""
    tiny = get_model(name, "tiny")
    assert model_sizes(tiny)["params"] < 1_000_000
    assert tiny.vocab_size % 64 != 0
    for size in (1, 2, 4):
        assert tiny.num_attention_heads % size == 0
        assert tiny.intermediate_size % size == 0
        if tiny.is_moe:
            assert tiny.num_experts % size == 0
            assert tiny.moe_intermediate_size % size == 0
        if tiny.fp8_block is not None:
            b0, _b1 = tiny.fp8_block
            assert (tiny.moe_intermediate_size // size) % b0 == 0
            assert (tiny.intermediate_size // size) % b0 == 0
    if not tiny.is_mla:
        assert tiny.num_kv_heads < 4


def test_scale_spec_and_parse_scale() -> None:
    assert parse_scale("full") == ("full", None)
    assert parse_scale("tiny") == ("tiny", None)
    assert parse_scale("layers=12") == ("layers", 12)
    for bad in ("layers=0", "layers=x", "huge", "layers=", "layers=-1"):
        with pytest.raises(ValueError, match="bad scale"):
            parse_scale(bad)
    spec = get_model("Kimi-K2")
    assert scale_spec(spec, "full") is spec
    assert scale_spec(spec, "tiny") == get_model("Kimi-K2", "tiny")
    with pytest.raises(ValueError, match="full-scale"):
        scale_spec(get_model("Kimi-K2", "tiny"), "layers=2")


def test_unknown_model_names_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown model") as err:
        get_model("qwen3-4b")
    for name in ALL:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="Kimi-K2-Instruct") as err:
        get_profile("Kimi-K2-Instruct")
    assert "Kimi-K2" in str(err.value)


# Issue 2's table: nodes, train GPUs, train (tp, pp, cp, ep, last stage layers),
# rollout (GPUs per engine, ep, dp); dp from run.py where the table says only dp-attention.
PROFILE_TABLE = {
    "Qwen3-4B": (1, 4, (2, 1, 2, 1, None), (2, 1, 1)),
    "GLM-4.7-Flash": (2, 8, (4, 1, 1, 8, None), (4, 4, 1)),
    "GLM-5_4layer": (2, 8, (4, 1, 1, 8, None), (8, 8, 8)),
    "GLM-5_20layer": (12, 48, (4, 3, 1, 16, 6), (16, 16, 16)),
    "GLM-5": (32, 128, (4, 8, 2, 16, 8), (64, 64, 64)),
    "Qwen3-30B-A3B": (4, 16, (4, 1, 1, 8, None), (8, 8, 1)),
    "GLM-4.5-Air": (8, 32, (1, 4, 1, 8, 10), (8, 8, 1)),
    "Qwen3-235B-A22B": (16, 64, (4, 4, 2, 16, 22), (32, 32, 1)),
    "Kimi-K2": (64, 256, (8, 8, 4, 32, 5), (32, 32, 8)),
}


@pytest.mark.parametrize("name", ALL)
def test_profile_matches_reference_table(name: str) -> None:
    nodes, gpus, (tp, pp, cp, ep, last), (engine, sgl_ep, sgl_dp) = PROFILE_TABLE[name]
    p = get_profile(name)
    assert p.model == name
    assert (p.num_nodes, p.num_train_gpus, p.num_rollout_gpus) == (nodes, gpus, gpus)
    t = p.train
    assert (t.world_size, t.tp, t.pp, t.cp, t.ep, t.etp, t.pp_last_stage_layers) == (gpus, tp, pp, cp, ep, 1, last)
    assert t.sequence_parallel
    r = p.rollout
    assert (r.tp, r.ep, r.dp, r.num_engines) == (engine, sgl_ep, sgl_dp, gpus // engine)
    assert r.dp_lm_head == (name != "Qwen3-4B")
    assert r.moe_dense_tp == (1 if name == "Kimi-K2" or name.startswith("GLM-5") else None)
    sgl = " ".join(p.sglang_args)
    assert f"--tp-size {engine}" in sgl
    assert ("--enable-dp-attention" in sgl) == (name != "Qwen3-4B")
    assert (f"--dp-size {sgl_dp}" in sgl) == (name in ("Kimi-K2", "Qwen3-235B-A22B") or name.startswith("GLM-5"))
    meg = " ".join(p.megatron_args)
    assert f"--tensor-model-parallel-size {tp} --sequence-parallel" in meg
    assert f"--expert-model-parallel-size {ep} --expert-tensor-parallel-size 1" in meg


@pytest.mark.parametrize("name", ALL)
def test_profile_consistent_with_model(name: str) -> None:
    p, spec = get_profile(name), get_model(name)
    assert p.num_nodes * p.gpus_per_node == p.num_train_gpus + p.num_rollout_gpus
    t, r = p.train, p.rollout
    assert t.world_size == t.tp * t.pp * t.cp * t.dp == t.etp * t.ep * t.edp * t.pp
    assert r.world_size == p.num_rollout_gpus
    if t.pp_last_stage_layers is not None:
        rest = spec.num_layers - t.pp_last_stage_layers
        assert rest > 0
        assert rest % (t.pp - 1) == 0
    else:
        assert spec.num_layers % t.pp == 0
    assert spec.num_attention_heads % t.tp == 0
    assert spec.num_attention_heads % r.attn_tp == 0
    if spec.is_moe:
        assert spec.num_experts % t.ep == 0
        assert spec.num_experts % r.ep == 0


def test_cli_list_json() -> None:
    out = subprocess.run([sys.executable, "-m", "weightsync.cli", "list", "--json"], capture_output=True,
                         text=True, check=True).stdout
    rows = json.loads(out)
    assert [row["model"] for row in rows] == ALL
    kimi = rows[ALL.index("Kimi-K2")]
    assert kimi["family"] == "deepseek_v3"
    assert kimi["fp8_block"] == [64, 64]
    assert kimi["profile"]["rollout"]["num_engines"] == 8
    assert kimi["engine_bytes"] < kimi["bytes"]
    assert rows[ALL.index("Qwen3-4B")]["bytes"] == 2 * rows[ALL.index("Qwen3-4B")]["params"]


def test_cli_list_table_and_no_torch() -> None:
    code = (
        "import sys; from weightsync.cli import main; rc = main(['list']); "
        "assert 'torch' not in sys.modules, 'weightsync list imported torch'; sys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 1 + len(ALL)
    assert lines[1].startswith("Qwen3-4B")


@pytest.mark.parametrize("name", ALL)
def test_mla_profiles_duplicate_the_down_projections(name: str) -> None:
    """The reference trains with Megatron's TE spec, which keeps the MLA down projections whole on
    every TP rank; so do the MLA profiles and the embedded default of their families."""
    from weightsync.models.fit import embedded_layout

    mla = get_model(name).is_mla
    assert get_profile(name).train.mla_down_proj_replicated == mla
    train, _ = embedded_layout(name)
    assert train.mla_down_proj_replicated == mla
    assert train.tp == 2


@pytest.mark.parametrize("name", ALL)
def test_embedded_engine_keeps_the_profile_flags(name: str) -> None:
    """The embedded default's engine keeps the profile's --moe-dense-tp-size and, under
    DP-attention, --enable-dp-lm-head (``weightsync serve`` starts engines with both)."""
    from weightsync.models.fit import embedded_layout

    r = get_profile(name).rollout
    _, emb = embedded_layout(name)
    assert emb.moe_dense_tp == r.moe_dense_tp
    assert emb.dp_lm_head == (r.dp_lm_head and emb.dp > 1)
