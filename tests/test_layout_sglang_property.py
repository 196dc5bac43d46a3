"""Property test: the sglang layout's coverage contracts hold for random small specs and configs.

Random GQA or MLA attention, dense or MoE MLPs (with or without shared experts, first dense
layers, router bias), random vocab, tied or untied embeddings, and a random valid engine config
(tp, DP-attention, EP, moe_dense_tp, dp-lm-head). The contracts are those of
``test_layout_sglang``: uniform global coverage and exact local coverage except vocab padding.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_layout_sglang import check_global_coverage, check_local_cover
from weightsync.layout.sglang import engine_layout
from weightsync.models.parallel import RolloutParallel
from weightsync.models.spec import Family, ModelSpec


@st.composite
def spec_and_config(draw: st.DrawFn) -> tuple[ModelSpec, RolloutParallel]:
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    dp = draw(st.sampled_from([d for d in (1, 2, 4, 8) if tp % d == 0]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4, 8) if tp % e == 0]))
    attn_tp, moe_tp = tp // dp, tp // ep
    mla = draw(st.booleans())
    moe = draw(st.booleans())
    heads = attn_tp * draw(st.integers(1, 2))
    common = {
        "name": "random", "hf_architecture": "x", "hf_model_type": "x",
        "vocab_size": draw(st.integers(1, 200)), "hidden_size": draw(st.sampled_from([8, 16])),
        "num_layers": draw(st.integers(1, 3)), "num_attention_heads": heads,
        "intermediate_size": tp * draw(st.integers(1, 3)), "tie_word_embeddings": draw(st.booleans()),
    }
    if mla:
        family = Family.DEEPSEEK_V3
        attn = {"num_kv_heads": heads, "q_lora_rank": draw(st.sampled_from([None, 8])), "kv_lora_rank": 8,
                    "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": draw(st.sampled_from([4, 6]))}
        if draw(st.booleans()):
            attn.update(index_n_heads=2, index_head_dim=4, index_topk=4)
    else:
        family = draw(st.sampled_from([Family.QWEN3, Family.QWEN3_MOE, Family.GLM4_MOE]))
        kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0 and (k % attn_tp == 0
                                                                                  or attn_tp % k == 0)]))
        attn = {"num_kv_heads": kv, "head_dim": 4, "qk_norm": draw(st.booleans()),
                "attention_bias": draw(st.booleans())}
    mlp: dict[str, object] = {}
    if moe:
        mlp = {"num_experts": max(tp, ep) * draw(st.integers(1, 2)), "num_experts_per_tok": 1,
                   "moe_intermediate_size": moe_tp * tp * draw(st.integers(1, 2)),
                   "num_shared_experts": draw(st.integers(0, 1)), "first_k_dense_replace": draw(st.integers(0, 1)),
                   "router_expert_bias": draw(st.booleans())}
    spec = ModelSpec(family=family, **common, **attn, **mlp)
    par = RolloutParallel(tp=tp, dp=dp, ep=ep, moe_dense_tp=draw(st.sampled_from([None, 1])),
                          dp_lm_head=draw(st.booleans()))
    return spec, par


@settings(max_examples=60)
@given(spec_and_config())
def test_random_specs_and_configs_keep_the_coverage_contracts(case: tuple[ModelSpec, RolloutParallel]):
    spec, par = case
    layouts = [engine_layout(spec, par, r) for r in range(par.tp)]
    check_global_coverage(spec, layouts, par.tp)
    check_local_cover(layouts)
