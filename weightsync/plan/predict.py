"""The calibrated cost model at full size, beside the reference's published update times.

For every reference profile (``REFERENCE_RESULTS_MS``) the planner computes the whole plan at full
size with the profile's parallel sizes and placement, for both modes, and
:func:`~weightsync.plan.cost.simulate_update` predicts one update on the reference clusters' links
(:data:`~weightsync.plan.cost.REFERENCE_LINKS`: NVLink 450 GB/s, one 50 GB/s NIC per GPU) with the
per-op, packing, per-tensor, per-bucket and post-load costs measured on the H200s. The reference
measured H100 + InfiniBand with 1 GB buckets; its Kimi-K2 p2p figure includes ~884 ms of
post-load requantization that this engine does not do (its ``w_kc``/``w_vc`` stay bf16).

Typical usage::

    rows = reference_rows(["Qwen3-30B-A3B"])   # or reference_rows() for every profile
    print(format_rows(rows))
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.plan.api import build_plan
from weightsync.plan.broadcast import DEFAULT_BUCKET_BYTES
from weightsync.plan.cost import REFERENCE_LINKS, REFERENCE_RESULTS_MS, Calibration, UpdateEstimate, simulate_update
from weightsync.plan.records import Mode


@dataclass(frozen=True, kw_only=True, slots=True)
class ReferenceRow:
    """One model's prediction for both modes and the reference's published figures."""

    model: str
    broadcast: UpdateEstimate
    p2p: UpdateEstimate
    reference_broadcast_ms: float | None
    reference_p2p_ms: float | None
    plan_s: float
    """Seconds the two plans took to compute (layouts included)."""


def reference_rows(models: Sequence[str] | None = None, *, cal: Calibration = REFERENCE_LINKS,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[ReferenceRow]:
    """Predict both modes for each model at full size on its reference profile.

    Args:
        models: registry names (default: every model with published reference figures).
        cal: the links and costs to predict with.
        bucket_bytes: the broadcast bucket size.

    Raises:
        KeyError: a model that is not in the registry.
    """
    from weightsync.layout.megatron import trainer_layout
    from weightsync.layout.sglang import engine_layout
    from weightsync.models import get_model, get_profile
    from weightsync.plan.inputs import build_inputs

    rows = []
    for name in models or list(REFERENCE_RESULTS_MS):
        t0 = time.perf_counter()
        profile = get_profile(name)
        inputs = build_inputs(get_model(name, "full"), profile.train, profile.rollout,
                              trainer_layout=trainer_layout, engine_layout=engine_layout)
        est = {m: simulate_update(build_plan(inputs, m, **({"bucket_bytes": bucket_bytes} if m is Mode.BROADCAST
                                                             else {})), inputs, cal)
               for m in (Mode.BROADCAST, Mode.P2P)}
        ref = REFERENCE_RESULTS_MS.get(name)
        rows.append(ReferenceRow(model=name, broadcast=est[Mode.BROADCAST], p2p=est[Mode.P2P],
                                 reference_broadcast_ms=ref[0] if ref else None,
                                 reference_p2p_ms=ref[1] if ref else None, plan_s=time.perf_counter() - t0))
    return rows


def format_rows(rows: Sequence[ReferenceRow]) -> str:
    """The prediction table (ms), with the reference's figures and p2p's parts."""

    def ms(x: float | None) -> str:
        return f"{x:,.0f}" if x is not None else "-"

    head = (f"{'model':<16} {'broadcast':>10} {'(ref)':>8} {'p2p':>8} {'(ref)':>8} {'speedup':>8} {'(ref)':>6}  "
            "p2p parts: wire / ops / pack / post-load ms (slowest)")
    lines = [head]
    for r in rows:
        b, p = r.broadcast.seconds * 1e3, r.p2p.seconds * 1e3
        ref = (f"{r.reference_broadcast_ms / r.reference_p2p_ms:.2f}x"
               if r.reference_broadcast_ms and r.reference_p2p_ms else "-")
        parts = (f"{r.p2p.wire_s * 1e3:,.0f} / {r.p2p.ops_s * 1e3:,.0f} / {r.p2p.pack_s * 1e3:,.0f} / "
                 f"{r.p2p.post_load_s * 1e3:,.1f} ({r.p2p.slowest})")
        lines.append(f"{r.model:<16} {ms(b):>10} {ms(r.reference_broadcast_ms):>8} {ms(p):>8} "
                     f"{ms(r.reference_p2p_ms):>8} {b / p:>7.2f}x {ref:>6}  {parts}")
    lines.append("links: NVLink 450 GB/s, one 50 GB/s NIC per GPU; per-op, packing, per-tensor, per-bucket and "
                 "post-load costs measured on H200 (plan/cost.py Calibration); ref = the reference's published "
                 "H100 + InfiniBand figures, 1 GB buckets (its Kimi-K2 p2p includes ~884 ms of requantization)")
    return "\n".join(lines)
