"""``weightsync plan``: compute (and verify) the transfer plan of a model and print its figures.

Defaults come from the model's reference run profile; ``--train`` and ``--rollout`` override
single sizes, e.g. ``--train tp=2,pp=1 --rollout tp=4,dp=2,engines=2``. With ``--json`` the
command prints one JSON object (keys documented in :func:`plan_report`), else a table.

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
from weightsync.plan.records import MODES

TRAIN_KEYS = {"tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "etp": "etp", "world": "world_size",
              "last": "pp_last_stage_layers", "mla_rep": "mla_down_proj_replicated"}
TRAIN_FLAGS = ("mla_down_proj_replicated",)
"""Boolean trainer fields: given as 0 or 1."""
ROLLOUT_KEYS = {"tp": "tp", "ep": "ep", "dp": "dp", "engines": "num_engines"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="registry model name (see `weightsync list`)")
    parser.add_argument("--mode", choices=MODES, default="p2p", help="transfer mode (default p2p)")
    parser.add_argument("--scale", default="full", help="full | tiny | layers=N (default full)")
    parser.add_argument("--train", default="", metavar="K=V,...",
                        help="trainer sizes overriding the profile: tp, pp, cp, ep, etp, world, last (last PP "
                             "stage's layers), mla_rep (1: MLA down projections whole on every TP rank, as "
                             "Megatron's TE spec, the profiles' setting for MLA models; 0: split over TP, as its "
                             "local spec)")
    parser.add_argument("--rollout", default="", metavar="K=V,...",
                        help="rollout sizes overriding the profile: tp, ep, dp, engines")
    parser.add_argument("--verify", action="store_true", help="run the plan verifier")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--bucket-gb", type=float, default=1.0, help="broadcast bucket size in GB (default 1)")
    parser.add_argument("--cache-dir", default=None, help="load/store plans in this directory")
    parser.add_argument("--save", default=None, metavar="PATH", help="write the plan (.npz)")


def parse_sizes(text: str, keys: dict[str, str], what: str) -> dict[str, int]:
    """``"tp=2,pp=1"`` -> ``{"tp": 2, "pp": 1}`` (field names of the config dataclass).

    Raises:
        ValueError: an unknown key or a value that is not a positive integer.
    """
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in keys:
            raise ValueError(f"--{what}: expected K=V with K in {', '.join(keys)}, got {item!r}")
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"--{what}: {key} must be an integer, got {value!r}") from None
        out[keys[key]] = n
    return out


def resolve_parallel(model: str, train_text: str, rollout_text: str) -> tuple[TrainParallel, RolloutParallel]:
    """The profile's configs with the command line's overrides applied."""
    from weightsync.models import get_profile

    profile = get_profile(model)
    t: dict[str, int | bool | None] = dict(parse_sizes(train_text, TRAIN_KEYS, "train"))
    r = parse_sizes(rollout_text, ROLLOUT_KEYS, "rollout")
    for flag in TRAIN_FLAGS:
        if flag in t:
            if t[flag] not in (0, 1):
                key = next(k for k, v in TRAIN_KEYS.items() if v == flag)
                raise ValueError(f"--train: {key} must be 0 or 1, got {t[flag]}")
            t[flag] = bool(t[flag])
    if "pp" in t and "pp_last_stage_layers" not in t:
        t["pp_last_stage_layers"] = None  # the profile's uneven split belongs to its pp
    train = dataclasses.replace(profile.train, **t)
    rollout = dataclasses.replace(profile.rollout, **r)
    return train, rollout


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
    max_sender_bytes, max_receiver_bytes, senders, gather_bytes, link_bytes, estimate_seconds,
    verified, verify_seconds, plan_seconds, layout_seconds, cache_hit.
    """
    from weightsync.layout.megatron import trainer_layout
    from weightsync.layout.sglang import engine_layout
    from weightsync.models import get_model
    from weightsync.plan.api import build_plan, summarize, verify_plan
    from weightsync.plan.cost import estimate
    from weightsync.plan.inputs import build_inputs
    from weightsync.plan.serialize import cached_plan, save_plan

    spec = get_model(args.model, args.scale)
    train, rollout = resolve_parallel(args.model, args.train, args.rollout)
    t0 = time.perf_counter()
    inputs = build_inputs(spec, train, rollout, trainer_layout=trainer_layout, engine_layout=engine_layout)
    t1 = time.perf_counter()
    bucket = int(args.bucket_gb * 1e9)
    options = {"bucket_bytes": bucket} if args.mode == "broadcast" else {}
    plan, hit = cached_plan(lambda: build_plan(inputs, args.mode, **options),  # type: ignore[arg-type]
                            inputs.cache_key(args.mode, **options), args.cache_dir)
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
        "model": args.model, "mode": args.mode, "scale": args.scale,
        "train": _par_dict(train), "rollout": _par_dict(rollout),
        **dataclasses.asdict(s),
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
    if r["mode"] == "broadcast":
        rows.append(("trainer gather", _gb(r["gather_bytes"])))
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
