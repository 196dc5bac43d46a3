"""``weightsync list``: the registry models, their sizes and their reference run profiles.

Sizes come from :func:`weightsync.models.hf.global_tensors` at full scale: ``params`` counts the
weights a weight update moves (MTP layers and fp8 scale tensors excluded), ``bytes`` is their
size in the trainer's dtype, ``engine_bytes`` their size in the engine's storage (fp8 weights 1
byte each, plus their float32 scales).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from weightsync.models.hf import DTYPE_BYTES, global_tensors
from weightsync.models.profiles import PROFILES
from weightsync.models.registry import get_model, list_models
from weightsync.models.spec import ModelSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of a table")


def model_sizes(spec: ModelSpec) -> dict[str, int]:
    """Parameter count and byte sizes of ``spec``'s global tensors.

    Args:
        spec: the model (any scale).

    Returns:
        ``{"params", "bytes", "engine_bytes"}`` (see the module docstring).
    """
    params = nbytes = engine_bytes = 0
    for t in global_tensors(spec).values():
        if t.quant_of is not None:
            engine_bytes += t.nbytes
            continue
        params += t.numel
        nbytes += t.nbytes
        engine_bytes += t.numel * DTYPE_BYTES["float8_e4m3fn"] if t.block is not None else t.nbytes
    return {"params": params, "bytes": nbytes, "engine_bytes": engine_bytes}


def model_row(name: str) -> dict[str, Any]:
    """One model's entry of ``weightsync list --json``."""
    spec = get_model(name)
    row: dict[str, Any] = {
        "model": name,
        "family": spec.family.value,
        "hf_architecture": spec.hf_architecture,
        "num_layers": spec.num_layers,
        "fp8_block": list(spec.fp8_block) if spec.fp8_block else None,
        **model_sizes(spec),
        "profile": None,
    }
    profile = PROFILES.get(name)
    if profile is not None:
        t, r = profile.train, profile.rollout
        row["profile"] = {
            "nodes": profile.num_nodes,
            "train_gpus": profile.num_train_gpus,
            "rollout_gpus": profile.num_rollout_gpus,
            "train": {"tp": t.tp, "pp": t.pp, "cp": t.cp, "ep": t.ep, "etp": t.etp, "dp": t.dp, "edp": t.edp,
                      "pp_last_stage_layers": t.pp_last_stage_layers, "sequence_parallel": t.sequence_parallel},
            "rollout": {"tp": r.tp, "dp": r.dp, "ep": r.ep, "attn_tp": r.attn_tp, "moe_tp": r.moe_tp,
                        "num_engines": r.num_engines, "moe_dense_tp": r.moe_dense_tp, "dp_lm_head": r.dp_lm_head},
            "sglang_args": list(profile.sglang_args),
            "megatron_args": list(profile.megatron_args),
        }
    return row


def _human(n: float, suffixes: tuple[str, ...]) -> str:
    """``n`` in steps of 1000 with the given suffixes (first one for units)."""
    for suffix in suffixes:
        if abs(n) < 1000 or suffix == suffixes[-1]:
            return f"{n:.1f}{suffix}" if suffix != suffixes[0] else f"{n:.0f}{suffix}"
        n /= 1000
    raise AssertionError("unreachable")


_COUNT = ("", "K", "M", "B", "T")
_BYTES = ("B", "KB", "MB", "GB", "TB")


def _table_line(row: dict[str, Any]) -> str:
    params, nbytes = _human(row["params"], _COUNT), _human(row["bytes"], _BYTES)
    head = f"{row['model']:<16} {row['family']:<12} {params:>7} {nbytes:>8}"
    p = row["profile"]
    if p is None:
        return head + "  (no reference profile)"
    t, r = p["train"], p["rollout"]
    last = f"({t['pp_last_stage_layers']})" if t["pp_last_stage_layers"] is not None else ""
    train = f"tp{t['tp']} pp{t['pp']}{last} cp{t['cp']} ep{t['ep']} etp{t['etp']}"
    rollout = f"{r['num_engines']}x tp{r['tp']} ep{r['ep']} dp{r['dp']}"
    gpus = f"{p['nodes']:>2} ({p['train_gpus']}+{p['rollout_gpus']})"
    return f"{head}  {gpus:<14} {train:<26} {rollout}"


def main(args: argparse.Namespace) -> int:
    rows = [model_row(name) for name in list_models()]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'model':<16} {'family':<12} {'params':>7} {'bytes':>8}  {'nodes (GPUs)':<14} {'train':<26} rollout")
    for row in rows:
        print(_table_line(row))
    return 0
