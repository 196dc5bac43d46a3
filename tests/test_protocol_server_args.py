"""Contract: an engine's layout comes from sglang's ``/server_info`` alone, as sglang derives it,
for both releases' spellings; what weightsync cannot lay out is refused in one line naming every
setting and its flag.

The ``/server_info`` bodies are ``ServerArgs`` as sglang 0.5.16 (``dataclasses.asdict``,
``entrypoints/http_server.py`` ``get_server_info``) and 0.5.23 (``ServerArgs.resolved_dict``,
``utils/common.py`` ``build_server_info``) report it, at their defaults
(``server_args.py`` / ``arg_groups/fields/parallel.py``) unless a test sets a field.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from weightsync.layout.sglang_coords import engine_coords
from weightsync.models.parallel import RolloutParallel
from weightsync.sync.server_args import UNSUPPORTED, rollout_from_server_info

V0516 = {"tp_size": 1, "pp_size": 1, "dp_size": 1, "ep_size": 1, "moe_dp_size": 1, "attn_cp_size": 1, "dcp_size": 1,
         "enable_dp_attention": False, "enable_dp_lm_head": False, "moe_dense_tp_size": None,
         "moe_a2a_backend": "none", "ep_num_redundant_experts": 0, "rl_on_policy_target": None, "version": "0.5.16"}
V0523 = {**V0516, "attn_dp_size": 1, "shared_experts_tp_size": None, "enable_shared_experts_attn_tp": False,
         "enable_dense_mlp_attn_tp": False, "version": "0.5.23"}


def sglang_coords(*, tp: int, attn_dp: int, attn_cp: int, ep: int, moe_dp: int, r: int) -> dict[str, int]:
    """Rank ``r``'s coordinates by sglang's general formulas (0.5.23 ``runtime_context.py``
    ``derive_attn_tp_size`` / ``derive_attention_ranks`` / ``derive_parallel_widths``; the MoE
    groups of ``distributed/parallel_state.py`` ``initialize_model_parallel``)."""
    attn_tp = tp // attn_dp // attn_cp
    moe_tp = tp // ep // moe_dp
    return {"attn_tp_size": attn_tp, "attn_tp_rank": r % attn_tp, "attn_dp_rank": r // (attn_tp * attn_cp),
            "moe_tp_size": moe_tp, "moe_tp_rank": r % moe_tp, "moe_ep_rank": (r % (tp // moe_dp)) // moe_tp}


CASES = [(tp, dp, ep) for tp, dp, ep in itertools.product((1, 2, 4, 8), repeat=3) if tp % dp == 0 and tp % ep == 0]


@pytest.mark.parametrize(("tp", "dp", "ep"), CASES, ids=[f"tp{t}-dp{d}-ep{e}" for t, d, e in CASES])
def test_both_spellings_give_sglangs_coordinates(tp: int, dp: int, ep: int) -> None:
    """0.5.16 spells DP-attention ``dp_size N`` + ``enable_dp_attention``, 0.5.23 ``attn_dp_size N``
    (``dp_size`` 1); both give the same layout, whose every rank sits where sglang puts it."""
    old = rollout_from_server_info({**V0516, "tp_size": tp, "ep_size": ep, "dp_size": dp,
                                    "enable_dp_attention": dp > 1}, num_engines=2)
    new = rollout_from_server_info({**V0523, "tp_size": tp, "ep_size": ep, "attn_dp_size": dp,
                                    "enable_dp_attention": dp > 1}, num_engines=2)
    assert old == new == RolloutParallel(tp=tp, dp=dp, ep=ep, num_engines=2)
    for r in range(tp):
        c = engine_coords(new, r)
        ours = {"attn_tp_size": c.attn_tp_size, "attn_tp_rank": c.attn_tp_rank, "attn_dp_rank": c.attn_dp_rank,
                "moe_tp_size": c.moe_tp_size, "moe_tp_rank": c.moe_tp_rank, "moe_ep_rank": c.moe_ep_rank}
        assert ours == sglang_coords(tp=tp, attn_dp=dp, attn_cp=1, ep=ep, moe_dp=1, r=r), f"rank {r}"


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({**V0523, "pp_size": 2}, "pp_size=2 (--pp-size)"),
    ({**V0523, "tp_size": 2, "dp_size": 2}, "dp_size=2 (--dp-size without --enable-dp-attention)"),
    ({**V0516, "tp_size": 2, "dp_size": 2}, "dp_size=2 (--dp-size without --enable-dp-attention)"),
    ({**V0523, "tp_size": 2, "attn_cp_size": 2}, "attn_cp_size=2 (--attn-cp-size)"),
    ({**V0523, "tp_size": 2, "moe_dp_size": 2}, "moe_dp_size=2 (--moe-dp-size)"),
    ({**V0523, "tp_size": 2, "dcp_size": 2}, "dcp_size=2 (--dcp-size)"),
    ({**V0523, "moe_a2a_backend": "deepep"}, "moe_a2a_backend='deepep' (--moe-a2a-backend)"),
    ({**V0523, "ep_num_redundant_experts": 8}, "ep_num_redundant_experts=8 (--ep-num-redundant-experts)"),
    ({**V0516, "rl_on_policy_target": "fsdp"}, "rl_on_policy_target='fsdp' (--rl-on-policy-target)"),
    ({**V0523, "enable_dense_mlp_attn_tp": True}, "enable_dense_mlp_attn_tp=True (--enable-dense-mlp-attn-tp)"),
    ({**V0523, "enable_shared_experts_attn_tp": True},
     "enable_shared_experts_attn_tp=True (--enable-shared-experts-attn-tp)"),
    ({**V0523, "shared_experts_tp_size": 1}, "shared_experts_tp_size=1 (--shared-experts-tp-size)"),
]


@pytest.mark.parametrize(("info", "named"), REFUSED, ids=[n.split("=")[0] for _, n in REFUSED])
def test_what_cannot_be_laid_out_is_refused_in_one_line_naming_it(info: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match="engine settings weightsync cannot lay out") as err:
        rollout_from_server_info(info, num_engines=1)
    assert named in str(err.value)
    assert "\n" not in str(err.value)


def test_every_refusal_is_tested_and_all_are_named_at_once() -> None:
    assert {k for k, *_ in UNSUPPORTED} == {n.split("=")[0] for _, n in REFUSED}
    with pytest.raises(ValueError, match="engine settings weightsync cannot lay out") as err:
        rollout_from_server_info({**V0523, "tp_size": 4, "pp_size": 2, "attn_cp_size": 2, "moe_dp_size": 2},
                                 num_engines=1)
    message = str(err.value)
    assert all(f in message for f in ("--pp-size", "--attn-cp-size", "--moe-dp-size")), message
    assert "\n" not in message


def test_a_body_that_is_not_server_args_is_refused() -> None:
    with pytest.raises(ValueError, match=r"lacks.*tp_size.*not an sglang ServerArgs answer"):
        rollout_from_server_info({"version": "0.5.23"}, num_engines=1)
