"""An engine's parallel layout from sglang's ``/server_info`` (its ``ServerArgs``), as sglang derives it.

Release sglang (0.5.16, 0.5.23) publishes no per-rank parallelism record -- ``/parallelism_config``
exists only in miles' build -- so every rank's coordinates are derived from the server's
arguments with sglang's own formulas (0.5.23 ``runtime_context.py`` ``derive_attn_tp_size``,
``derive_attention_ranks``, ``derive_parallel_widths``; 0.5.16 ``layers/dp_attention.py``
``compute_dp_attention_world_info`` and ``distributed/parallel_state.py``
``initialize_model_parallel``)::

    attn_dp      = attn_dp_size                        (0.5.23: --dp-size N --enable-dp-attention
                                                        resolves to attn_dp_size N, dp_size 1)
                 | dp_size if enable_dp_attention else 1   (0.5.16: no attn_dp_size field)
    attn_tp      = tp // attn_dp // attn_cp
    attn_tp_rank = r % attn_tp,  attn_dp_rank = r // (attn_tp * attn_cp)
    moe_ep       = ep_size,  moe_tp = tp // moe_ep // moe_dp
    moe_ep_rank  = (r % (tp // moe_dp)) // moe_tp,  moe_tp_rank = r % moe_tp

which is :func:`weightsync.layout.sglang_coords.engine_coords` when ``attn_cp`` and ``moe_dp`` are 1.
The settings weightsync cannot lay out are refused when the engines are found, in one line that
names each (:data:`UNSUPPORTED`), then those of the layout options' own list
(:func:`weightsync.layout.sglang_options.check_server_args`: expert placement, EPLB), before
anything is planned or written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weightsync.layout.sglang_options import check_server_args
from weightsync.models.parallel import RolloutParallel

SIZE_FIELDS = ("tp_size", "dp_size", "ep_size", "pp_size", "moe_dense_tp_size", "enable_dp_lm_head")
"""The ``ServerArgs`` fields an update's destination layout depends on (present in every release)."""


def _more_than_one(key: str) -> Callable[[dict[str, Any]], bool]:
    return lambda info: int(info.get(key) or 1) > 1


def _set(key: str, unset: tuple[Any, ...] = (None, False)) -> Callable[[dict[str, Any]], bool]:
    return lambda info: info.get(key, unset[0]) not in unset


def data_parallel_replicas(info: dict[str, Any]) -> int:
    """How many data-parallel replicas of the model one server runs (not DP-attention: 0.5.16
    counts DP-attention groups in ``dp_size`` when ``enable_dp_attention`` is set)."""
    dp = int(info.get("dp_size") or 1)
    if "attn_dp_size" not in info and info.get("enable_dp_attention"):
        return 1
    return dp


UNSUPPORTED: tuple[tuple[str, str, Callable[[dict[str, Any]], bool], str], ...] = (
    ("pp_size", "--pp-size", _more_than_one("pp_size"), "pipeline-parallel engines are not laid out"),
    ("dp_size", "--dp-size without --enable-dp-attention", lambda info: data_parallel_replicas(info) > 1,
     "several model replicas in one server (sglang's weight updates need dp_size 1): start one server per "
     "replica and give each URL"),
    ("attn_cp_size", "--attn-cp-size", _more_than_one("attn_cp_size"), "attention context parallelism is not laid out"),
    ("moe_dp_size", "--moe-dp-size", _more_than_one("moe_dp_size"), "MoE data parallelism is not laid out"),
    ("dcp_size", "--dcp-size", _more_than_one("dcp_size"),
     "decode context parallelism (its extra attention parameters) is not laid out"),
    ("moe_a2a_backend", "--moe-a2a-backend", _set("moe_a2a_backend", (None, "none")),
     "an all-to-all MoE backend replicates the shared experts, which is not laid out"),
    ("ep_num_redundant_experts", "--ep-num-redundant-experts", _set("ep_num_redundant_experts", (None, 0)),
     "redundant (EPLB) experts are not laid out"),
    ("rl_on_policy_target", "--rl-on-policy-target", _set("rl_on_policy_target", (None,)),
     "it keeps norms and embeddings in float32, which is not laid out"),
    ("enable_dense_mlp_attn_tp", "--enable-dense-mlp-attn-tp", _set("enable_dense_mlp_attn_tp"),
     "dense MLPs over attention-TP are not laid out"),
    ("enable_shared_experts_attn_tp", "--enable-shared-experts-attn-tp", _set("enable_shared_experts_attn_tp"),
     "shared experts over attention-TP are not laid out"),
    ("shared_experts_tp_size", "--shared-experts-tp-size", _set("shared_experts_tp_size", (None,)),
     "a shared-expert TP size of its own is not laid out"),
)
"""``(ServerArgs field, its flag, refused when, why)`` for every setting weightsync cannot lay out."""


def unsupported_settings(info: dict[str, Any]) -> list[str]:
    """One ``field=value (flag): why`` per setting of ``info`` in :data:`UNSUPPORTED`."""
    return [f"{key}={info.get(key)!r} ({flag}): {why}" for key, flag, refused, why in UNSUPPORTED if refused(info)]


def attention_dp_size(info: dict[str, Any]) -> int:
    """The DP-attention size (1 = off), from either release's fields (module docstring)."""
    if "attn_dp_size" in info:
        return int(info["attn_dp_size"] or 1)
    return int(info.get("dp_size") or 1) if info.get("enable_dp_attention") else 1


def rollout_from_server_info(info: dict[str, Any], num_engines: int) -> RolloutParallel:
    """The engine layout that ``/server_info`` describes (sglang 0.5.16, 0.5.23, miles' build,
    or this project's engine).

    Raises:
        ValueError: a field is missing, or settings weightsync cannot lay out (every one named,
            with its flag, in one line).
    """
    missing = [k for k in SIZE_FIELDS if k not in info]
    if missing:
        raise ValueError(f"/server_info lacks {missing}: not an sglang ServerArgs answer")
    refused = unsupported_settings(info)
    if refused:
        raise ValueError("engine settings weightsync cannot lay out: " + "; ".join(refused))
    check_server_args(info)  # the layout options' own list (expert placement, EPLB, ...)
    dense = info["moe_dense_tp_size"]
    return RolloutParallel(tp=int(info["tp_size"]), dp=attention_dp_size(info), ep=int(info["ep_size"]),
                           num_engines=num_engines, moe_dense_tp=None if dense is None else int(dense),
                           dp_lm_head=bool(info["enable_dp_lm_head"]))
