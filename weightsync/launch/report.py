"""What a run prints and leaves behind: the per-step table, the summary, ``results.json`` and a plot.

A step record is a plain dict (JSON-safe) with at least ``step``, ``mode``, ``update_s``,
``phases`` (phase name -> seconds), ``bytes`` (bytes put on links), ``bytes_per_receiver``
(rollout rank -> bytes), ``buckets`` (p2p: staging buckets of all trainer ranks; broadcast: buckets
broadcast), ``validation`` (name -> "pass" / "fail: ..." / "skipped") and
``logprob_max_abs_diff``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PHASES = ("pause", "pack", "wire", "barrier", "post_load", "resume")
"""The phases an update is split into, in order (``pack``/``wire`` are the slowest sender's)."""


def _gb(n: float) -> float:
    return n / 1e9


def step_table(steps: Sequence[dict[str, Any]]) -> str:
    """A readable table: one line per step."""
    head = (
        f"{'step':>4} {'mode':<9} {'update s':>9} "
        + " ".join(f"{p:>9}" for p in PHASES)
        + f" {'GB':>8} {'GB/s':>8} {'validation':<12} {'logprob |d|':>11}"
    )
    lines = [head, "-" * len(head)]
    for s in steps:
        ph = s.get("phases", {})
        gbps = _gb(s["bytes"]) / s["update_s"] if s["update_s"] > 0 else 0.0
        val = s.get("validation", {})
        verdict = "pass" if val and all(v in ("pass", "skipped") for v in val.values()) else "FAIL"
        lp = s.get("logprob_max_abs_diff")
        lines.append(
            f"{s['step']:>4} {s['mode']:<9} {s['update_s']:>9.4f} "
            + " ".join(f"{ph.get(p, 0.0):>9.4f}" for p in PHASES)
            + f" {_gb(s['bytes']):>8.4f} {gbps:>8.3f} {verdict:<12} "
            + (f"{lp:>11.2e}" if lp is not None else f"{'-':>11}")
        )
    return "\n".join(lines)


TRAIN_COLUMNS = (("loss", "loss"), ("mean_reward", "reward"), ("grad_norm", "grad norm"),
                 ("logprob_diff", "lp |d| t/r"), ("clip_fraction", "clipped"))
"""The training stats a step record's ``train`` holds (megatron), and their column titles."""


def train_table(steps: Sequence[dict[str, Any]]) -> str:
    """The training stats of each step that trained (loss, mean reward, gradient norm, the
    train/rollout logprob difference, the share of clipped ratios)."""
    head = f"{'step':>4} " + " ".join(f"{title:>11}" for _, title in TRAIN_COLUMNS)
    lines = [head, "-" * len(head)]
    for s in steps:
        t = s.get("train") or {}
        if "loss" not in t:
            continue
        lines.append(f"{s['step']:>4} " + " ".join(f"{float(t.get(k, float('nan'))):>11.4g}" for k, _ in TRAIN_COLUMNS))
    return "\n".join(lines)


def summary(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean/min update time over the steps after the first (the first pays one-time costs)."""
    times = [s["update_s"] for s in steps]
    warm = times[1:] or times
    failed = [
        f"step {s['step']}: {k}: {v}"
        for s in steps
        for k, v in s.get("validation", {}).items()
        if v not in ("pass", "skipped")
    ]
    return {
        "steps": len(steps),
        "first_update_s": times[0] if times else None,
        "mean_update_s": sum(warm) / len(warm) if warm else None,
        "min_update_s": min(warm) if warm else None,
        "bytes_per_update": steps[-1]["bytes"] if steps else 0,
        "validation_passed": not failed,
        "validation_failures": failed,
    }


def write_results(log_dir: Path, meta: dict[str, Any], steps: Sequence[dict[str, Any]]) -> Path:
    """Write ``results.json`` (meta, steps, summary) into ``log_dir``; returns its path."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "steps": list(steps), "summary": summary(steps)}, indent=2))
    tmp.replace(path)
    return path


def plot_phases(log_dir: Path, steps: Sequence[dict[str, Any]], title: str) -> Path | None:
    """A stacked bar chart of update time by phase per step, as ``update_phases.png``.

    Returns None (with a warning) when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot written")
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [s["step"] for s in steps]
    bottom = [0.0] * len(steps)
    for p in PHASES:
        vals = [s.get("phases", {}).get(p, 0.0) * 1e3 for s in steps]
        ax.bar(xs, vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xlabel("step")
    ax.set_ylabel("update time (ms)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = log_dir / "update_phases.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
