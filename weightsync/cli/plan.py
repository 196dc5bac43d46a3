"""``weightsync plan``: compute (and verify) the transfer plan of a model and print its figures.

Defaults come from the model's reference run profile; ``--train`` and ``--rollout`` replace the
sizes they name and keep the profile's other ones (the same meaning in every command, see
:func:`weightsync.models.parallel.override_train`), e.g. ``--train tp=2,pp=1 --rollout
tp=4,dp=2,engines=2``. ``--bucket-gb`` is in GiB (2**30 bytes), as ``BUCKET_SIZE_GB`` of ``run``.
With ``--json`` the command prints one JSON object (keys documented in :func:`plan_report`),
else a table.

Examples::

    weightsync plan Kimi-K2 --verify --json
    weightsync plan Qwen3-4B --mode broadcast --scale tiny --train tp=1,cp=1,world=2 --rollout tp=2,engines=1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.plan.broadcast import DEFAULT_BUCKET_GB
from weightsync.plan.records import Mode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="registry model name (see `weightsync list`)")
    parser.add_argument("--mode", choices=[m.value for m in Mode.BOTH.transfers], default=Mode.P2P.value,
                        help="transfer mode (default p2p)")
    parser.add_argument("--scale", default="full", help="full | tiny | layers=N (default full)")
    parser.add_argument("--train", default="", metavar="K=V,...",
                        help="trainer sizes replacing the profile's: tp, pp, cp, ep, etp, world, dp, last (last "
                             "PP stage's layers), mla_rep (1: MLA down projections whole on every TP rank, as "
                             "Megatron's TE spec, the profiles' setting for MLA models; 0: split over TP, as its "
                             "local spec); keys not given keep the profile's, the world size too unless world= or "
                             "dp= is given")
    parser.add_argument("--rollout", default="", metavar="K=V,...",
                        help="rollout sizes replacing the profile's: tp, ep, dp, engines")
    parser.add_argument("--verify", action="store_true", help="run the plan verifier")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--bucket-gb", type=float, default=DEFAULT_BUCKET_GB,
                        help="broadcast bucket size in GiB, 2**30 bytes, as BUCKET_SIZE_GB (default 1)")
    parser.add_argument("--cache-dir", default=None, help="load/store plans in this directory")
    parser.add_argument("--save", default=None, metavar="PATH", help="write the plan (.npz)")
    parser.add_argument("--simulate", action="store_true",
                        help="predict one update of both modes at full size on the reference profile with the "
                             "calibrated cost model, beside the reference's published times (MODEL 'all': every "
                             "reference profile)")


def resolve_parallel(args: argparse.Namespace) -> tuple[TrainParallel, RolloutParallel]:
    """The run profile's sizes with ``--train`` / ``--rollout`` applied
    (:func:`weightsync.models.fit.profile_sizes`, as in ``run``, ``prepare`` and ``bench``).

    Raises:
        ValueError: unknown model, or a bad ``--train`` / ``--rollout``.
    """
    from weightsync.models.fit import profile_sizes

    return profile_sizes(args.model, args.train, args.rollout)


def _par_dict(p: TrainParallel | RolloutParallel) -> dict[str, Any]:
    d = dataclasses.asdict(p)
    if isinstance(p, TrainParallel):
        d.update(dp=p.dp, edp=p.edp)
    else:
        d.update(attn_tp=p.attn_tp, moe_tp=p.moe_tp, world_size=p.world_size)
    return d


def plan_report(args: argparse.Namespace) -> dict[str, Any]:
    """Build the plan the arguments describe and return the figures ``--json`` prints.

    Keys: model, mode, scale, train, rollout, ops, zero_copy_ops, bytes_total, dest_bytes,
    max_sender_bytes, max_receiver_bytes, senders, gather_bytes, bucket_bytes and buckets
    (broadcast: the bucket size and the number of buckets; p2p: None and 0), link_bytes,
    estimate_seconds, verified, verify_seconds, plan_seconds, layout_seconds, cache_hit.
    """
    from weightsync.layout.megatron import trainer_layout
    from weightsync.layout.sglang import engine_layout
    from weightsync.models import get_model
    from weightsync.plan.api import build_plan, summarize, verify_plan
    from weightsync.plan.broadcast import bucket_bytes_from_gb
    from weightsync.plan.cost import estimate
    from weightsync.plan.inputs import build_inputs
    from weightsync.plan.serialize import cached_plan, save_plan

    spec = get_model(args.model, args.scale)
    train, rollout = resolve_parallel(args)
    mode = Mode.transfer(args.mode)
    bucket = bucket_bytes_from_gb(args.bucket_gb, what="--bucket-gb") if mode is Mode.BROADCAST else None
    t0 = time.perf_counter()
    inputs = build_inputs(spec, train, rollout, trainer_layout=trainer_layout, engine_layout=engine_layout)
    t1 = time.perf_counter()
    options = {"bucket_bytes": bucket} if bucket is not None else {}
    plan, hit = cached_plan(lambda: build_plan(inputs, mode, **options),  # type: ignore[arg-type]
                            inputs.cache_key(mode, **options), args.cache_dir)
    t2 = time.perf_counter()
    verified: bool | None = None
    verify_seconds = None
    if args.verify:
        verify_plan(plan, inputs)
        verified = True
        verify_seconds = time.perf_counter() - t2
    if args.save:
        save_plan(plan, args.save)
    s = summarize(plan, inputs)
    cost = estimate(plan, inputs)
    return {
        "model": args.model, "mode": mode, "scale": args.scale,
        "train": _par_dict(train), "rollout": _par_dict(rollout),
        **dataclasses.asdict(s), "bucket_bytes": bucket, "buckets": len(plan.buckets),
        "link_bytes": cost.link_bytes, "estimate_seconds": cost.seconds, "estimate_slowest": cost.slowest,
        "verified": verified, "verify_seconds": verify_seconds,
        "plan_seconds": t2 - t1, "layout_seconds": t1 - t0, "cache_hit": hit,
    }


def _gb(n: int) -> str:
    """Bytes in decimal units (B, KB, MB, GB, TB)."""
    x = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if x < 1000:
            return f"{x:,.0f} {unit}" if unit == "B" else f"{x:,.2f} {unit}"
        x /= 1000
    return f"{x:,.2f} TB"


def format_table(r: dict[str, Any]) -> str:
    """The report as aligned ``key  value`` lines."""
    t, ro = r["train"], r["rollout"]
    rows = [
        ("model", f"{r['model']} ({r['scale']})"),
        ("mode", r["mode"]),
        ("train", f"{t['world_size']} ranks: tp {t['tp']} pp {t['pp']} cp {t['cp']} ep {t['ep']} etp {t['etp']} "
                  f"dp {t['dp']}" + (f" (last stage {t['pp_last_stage_layers']} layers)"
                                     if t["pp_last_stage_layers"] else "")),
        ("rollout", f"{ro['num_engines']} engines x {ro['tp']}: attn-tp {ro['attn_tp']} dp {ro['dp']} "
                    f"ep {ro['ep']} moe-tp {ro['moe_tp']}"),
        ("ops", f"{r['ops']:,} ({r['zero_copy_ops']:,} zero-copy)"),
        ("bytes on links", _gb(r["bytes_total"])),
        ("destination bytes", _gb(r["dest_bytes"])),
        ("max per sender", _gb(r["max_sender_bytes"])),
        ("max per receiver", _gb(r["max_receiver_bytes"])),
        ("senders", str(r["senders"])),
    ]
    if r["mode"] == Mode.BROADCAST:
        rows.append(("trainer gather", _gb(r["gather_bytes"])))
        rows.append(("buckets", f"{r['buckets']} of at most {r['bucket_bytes'] / (1 << 30):g} GiB"))
    rows += [
        ("links", ", ".join(f"{k} {_gb(v)}" for k, v in r["link_bytes"].items())),
        ("estimate", f"{r['estimate_seconds']:.2f} s ({r['estimate_slowest']})"),
        ("verified", f"yes ({r['verify_seconds']:.1f} s)" if r["verified"] else "not run (--verify)"),
        ("plan time", f"{r['plan_seconds']:.1f} s" + (" (cached)" if r["cache_hit"] else "")
         + f", layouts {r['layout_seconds']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(args: argparse.Namespace) -> int:
    from weightsync.plan.verify import PlanVerificationError

    if args.simulate:
        return _simulate(args)
    try:
        report = plan_report(args)
    except PlanVerificationError as exc:
        print(f"weightsync plan: {exc}", file=sys.stderr)
        return 1
    except (KeyError, ValueError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"weightsync plan: error: {msg}", file=sys.stderr)
        if args.scale != "full":
            print("(the reference profile is sized for the full model: set sizes with --train/--rollout)",
                  file=sys.stderr)
        return 2
    print(json.dumps(report) if args.json else format_table(report))
    return 0


def _simulate(args: argparse.Namespace) -> int:
    """``--simulate``: the calibrated model's full-size table (:mod:`weightsync.plan.predict`)."""
    from weightsync.plan.predict import format_rows, reference_rows

    try:
        rows = reference_rows(None if args.model == "all" else [args.model])
    except (KeyError, ValueError) as exc:
        print(f"weightsync plan: error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows]))
    else:
        print(format_rows(rows))
    return 0
