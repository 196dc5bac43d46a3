"""Property tests of the trainer layout: random small specs and random Megatron configurations.

Contract: for any (spec, parallel config) that :func:`check_trainer_config` accepts, the three
contracts of ``test_layout_megatron`` hold (replica tiling of the global tensors, local tiling
except vocab padding, and the data round trip against the tensor-op oracle); any configuration
it refuses raises ``ValueError`` from ``trainer_layout`` too, never something else.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.test_layout_megatron import check_data_round_trip, check_local_tiling, check_replica_tiling
from weightsync.layout.megatron import check_trainer_config, trainer_layout
from weightsync.models import get_model
from weightsync.models.parallel import TrainParallel


@st.composite
def specs(draw):
    base = draw(st.sampled_from(["Qwen3-4B", "Qwen3-30B-A3B", "GLM-4.5-Air", "Kimi-K2", "GLM-5"]))
    spec = get_model(base, "tiny")
    layers = draw(st.integers(1, 5))
    groups = draw(st.sampled_from([1, 2, 4]))
    heads = groups * draw(st.sampled_from([1, 2, 3]))
    changes = {
        "num_layers": layers,
        "hidden_size": draw(st.sampled_from([16, 32])),
        "vocab_size": draw(st.integers(50, 700)),
        "intermediate_size": draw(st.sampled_from([8, 12, 24])),
        "tie_word_embeddings": draw(st.booleans()),
        "num_attention_heads": heads,
        "num_kv_heads": heads if spec.is_mla else groups,
    }
    if not spec.is_mla:
        changes["head_dim"] = draw(st.sampled_from([4, 8]))
        changes["attention_bias"] = draw(st.booleans())
    else:
        changes.update(
            q_lora_rank=draw(st.sampled_from([None, 8, 12, 24])),
            kv_lora_rank=draw(st.sampled_from([8, 12, 16])),
            qk_nope_head_dim=draw(st.sampled_from([4, 8])),
            v_head_dim=draw(st.sampled_from([4, 8])),
        )
    if spec.is_moe:
        changes.update(
            num_experts=draw(st.sampled_from([2, 4, 8])),
            num_experts_per_tok=1,
            moe_intermediate_size=draw(st.sampled_from([4, 8, 12])),
            num_shared_experts=draw(st.integers(0, 2)),
            first_k_dense_replace=draw(st.integers(0, layers)),
        )
    return spec.replace(**changes)


@st.composite
def parallels(draw, num_layers: int):
    tp, cp, dp = (draw(st.sampled_from(v)) for v in ([1, 2, 4], [1, 2], [1, 2]))
    pp = draw(st.integers(1, min(3, num_layers)))
    world = tp * pp * cp * dp
    per_stage = world // pp
    ep = draw(st.sampled_from([d for d in (1, 2, 4) if per_stage % d == 0]))
    etp = draw(st.sampled_from([d for d in (1, 2) if per_stage % (ep * d) == 0]))
    # mostly splits Megatron accepts (even, or an uneven last stage), sometimes any last-stage size
    valid = [n for n in range(1, num_layers) if pp > 1 and (num_layers - n) % (pp - 1) == 0]
    if num_layers % pp == 0:
        valid.append(None)
    last = draw(st.sampled_from(valid) if valid and draw(st.integers(0, 4)) else st.integers(1, num_layers))
    return TrainParallel(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, pp_last_stage_layers=last,
                         mla_down_proj_replicated=draw(st.booleans()))


@st.composite
def cases(draw):
    spec = draw(specs())
    return spec, draw(parallels(spec.num_layers))


def _accepted(spec, par) -> bool:
    try:
        check_trainer_config(spec, par)
    except ValueError as e:
        with pytest.raises(ValueError, match=re.escape(str(e))):
            trainer_layout(spec, par, 0)
        return False
    return True


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=cases(), naming=st.sampled_from(["sequential", "grouped"]))
def test_random_specs_and_configs_tile_and_round_trip(case, naming):
    spec, par = case
    accepted = _accepted(spec, par)
    event("accepted" if accepted else "refused")
    if not accepted:
        return
    check_replica_tiling(spec, par)
    check_local_tiling(spec, par)
    check_data_round_trip(spec, par, naming)
