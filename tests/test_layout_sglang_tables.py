"""Contract: every seed family's engine layout is sglang 0.5.23's parameter table.

For every registry model (Qwen3, Qwen3-MoE, GLM-4.5-Air, GLM-4.7-Flash, GLM-5 and its truncations,
Kimi-K2) at full size, at its reference profile's engine sizes and flags and at expert-parallel 1
(the same engine, ``--ep-size 1``: shared-expert fusion where sglang fuses), the names, shapes per
rank and dtypes of :func:`weightsync.layout.sglang.engine_layout` (options left to sglang's rules)
equal the table ``tests/sglang_tables.py`` derives from sglang's model classes, on the first and
the last rank. And the built-in engine registers exactly that table: its parameters and its
published transfer-engine table (``[ptr, numel, element_size]``) for every family at tiny scale.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tests.engine_helpers import FAMILY_MODELS
from tests.sglang_tables import ServerArgs, sglang_table
from weightsync.engine.engine import Engine
from weightsync.engine.tp import EngineGroups
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model, get_profile, list_models
from weightsync.models.parallel import RolloutParallel

DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}


def _args(par: RolloutParallel) -> ServerArgs:
    return ServerArgs(tp_size=par.tp, dp_size=par.dp, ep_size=par.ep, moe_dense_tp_size=par.moe_dense_tp,
                      enable_dp_lm_head=par.dp_lm_head)


def _ours(spec, par: RolloutParallel, rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
    return {t.name: (t.shape, t.dtype) for t in engine_layout(spec, par, rank) if not t.derived}


def _diff(ours: dict, theirs: dict) -> list[str]:
    return [f"{n}: weightsync {ours.get(n)}, sglang {theirs.get(n)}"
            for n in sorted(set(ours) | set(theirs)) if ours.get(n) != theirs.get(n)]


CASES = [pytest.param(m, ep1, id=f"{m}-{'ep1' if ep1 else 'profile'}") for m in list_models() for ep1 in (False, True)]


@pytest.mark.parametrize(("model", "ep1"), CASES)
def test_full_size_layout_is_sglangs_table(model: str, ep1: bool):
    spec = get_model(model)
    par = get_profile(model).rollout
    if ep1:
        par = replace(par, ep=1)
    for rank in (0, par.tp - 1):
        diff = _diff(_ours(spec, par, rank), sglang_table(spec, _args(par), rank))
        assert not diff, f"{model} tp {par.tp} dp {par.dp} ep {par.ep} rank {rank}: {len(diff)} differ: {diff[:5]}"


def test_the_tables_reach_every_rule():
    """The full-size cases above include each rule that differs between families and engines."""
    def table(model: str, ep1: bool = False) -> dict:
        par = get_profile(model).rollout
        return sglang_table(get_model(model), _args(replace(par, ep=1) if ep1 else par), 0)

    kimi, glm5, glm5_ep1 = table("Kimi-K2"), table("GLM-5"), table("GLM-5", ep1=True)
    assert kimi["model.embed_tokens.weight"][0] == (163840 // 4, 7168)  # DP-attention: attention-TP 4
    assert kimi["model.layers.3.self_attn.attn_mqa.k_scale"] == ((), "float32")
    assert table("GLM-4.5-Air")["model.layers.3.mlp.gate.weight"][1] == "float32"
    assert table("GLM-4.7-Flash")["model.layers.3.mlp.gate.weight"][1] == "float32"
    assert glm5["model.layers.3.self_attn.indexer.wk_weights_proj.weight"][1] == "bfloat16"
    assert glm5_ep1["model.layers.3.mlp.experts.w13_weight"][0][0] == 257  # the fused shared expert
    assert "model.layers.3.mlp.shared_experts.gate_up_proj.weight" not in glm5_ep1
    assert "model.layers.3.mlp.shared_experts.gate_up_proj.weight" in glm5


@pytest.mark.parametrize(("model", "ep1", "option"), [
    pytest.param("GLM-4.5-Air", False, {"router_fp32": False}, id="glm-router-model-dtype"),
    pytest.param("GLM-5", False, {"dsa_indexer_fusion": False}, id="indexer-apart"),
    pytest.param("GLM-5", True, {"shared_experts_fusion": False}, id="shared-expert-apart-at-ep1"),
    pytest.param("Kimi-K2", False, {"dp": 1}, id="embedding-over-tp"),
])
def test_another_layout_is_told_apart(model: str, ep1: bool, option: dict):
    """The comparison above fails for a layout sglang 0.5.23 does not register there."""
    par = get_profile(model).rollout
    par = replace(par, ep=1) if ep1 else par
    other = replace(par, **option)
    assert _diff(_ours(get_model(model), other, 0), sglang_table(get_model(model), _args(par), 0))


@pytest.mark.parametrize("model", FAMILY_MODELS)
def test_engine_registers_sglangs_table(model: str):
    """A one-rank engine of each family (tiny): its parameters and its published table."""
    spec = get_model(model, "tiny")
    want = sglang_table(spec, ServerArgs(), 0)
    engine = Engine.build(spec, EngineGroups.single(), device=torch.device("cpu"))
    try:
        held = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in engine.store.items()}
        derived = set(engine.store.derived_names())
        assert _diff({n: v for n, v in held.items() if n not in derived}, want) == []
        published = engine.transfer_info().weights
        assert {n: v[1:] for n, v in published.items()} == {
            n: [math.prod(shape), DTYPE_BYTES[dtype]] for n, (shape, dtype) in want.items()}
    finally:
        engine.close()
