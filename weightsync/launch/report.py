"""What a run prints and leaves behind: the per-step table, the summary, ``results.json``, a plot,
and its error without stack frames (:func:`error_summary`).

A step record is a plain dict (JSON-safe) with at least ``step``, ``mode``, ``update_s`` (the
whole update), ``phases`` (phase name -> seconds, :data:`~weightsync.sync.update_result.PHASES`),
``bytes`` (bytes put on links), ``bytes_per_receiver`` (rollout rank -> bytes), ``buckets`` (p2p:
staging buckets of all trainer ranks; broadcast: buckets broadcast), ``validation`` (name ->
"pass" / "fail: ..." / "skipped") and ``logprob_max_abs_diff``; an update's record also has
``engine_idle_s`` (how long the engines stood still for it: the headline), ``idle_phases`` (the
phases inside that window), ``pause_free``, ``flip``, ``pause_reason``, ``write_s``, ``verify_s``
and ``control_s``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weightsync.plan.records import Mode
from weightsync.sync.update_result import PHASES

log = logging.getLogger(__name__)


PATHS = {
    "p2p": "one-sided writes",
    "group": "weight-update group",
    "tensor": "colocated, update_weights_from_tensor",
}
"""What each update path is, as the console names it: p2p writes straight into the engines'
parameters; broadcast goes through an NCCL/gloo weight-update group, or, colocated, hands full
tensors over through ``/update_weights_from_tensor`` (``results.json`` keeps the key: ``path``)."""


def fmt_bytes(n: float) -> str:
    """``n`` bytes in the unit that fits (decimal: B, KB, MB, GB, TB), three significant digits."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_rate(bytes_per_s: float | None) -> str:
    """A transfer rate in the unit that fits (KB/s, MB/s, GB/s); ``-`` when unknown."""
    return "-" if bytes_per_s is None else fmt_bytes(bytes_per_s) + "/s"


def _rate(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds if seconds > 0 else None


def how(step: dict[str, Any]) -> str:
    """How an update reached the engines: ``pause-free swap`` / ``pause-free copy`` / ``paused``."""
    return f"pause-free {step.get('flip') or ''}".strip() if step.get("pause_free") else "paused"


def _idle(step: dict[str, Any]) -> str:
    """``engines idle X ms (how), `` for an update's record; nothing where it has no idle time."""
    if "engine_idle_s" not in step:
        return ""
    return f"engines idle {fmt_ms(step['engine_idle_s'])} ({how(step)}), "


def fmt_ms(seconds: float) -> str:
    """Milliseconds with the precision that shows a flip (two decimals below 10 ms)."""
    ms = seconds * 1e3
    return f"{ms:.2f} ms" if ms < 10 else f"{ms:.1f} ms"


def verdict(validation: dict[str, str]) -> str:
    """One word for a step's validation: ``pass``, ``FAIL``, or ``part skipped`` (every gate that
    ran passed, one was skipped, e.g. check-weight-update-equal under ``SKIP_VALIDATION=1``)."""
    if not validation or any(v not in ("pass", "skipped") for v in validation.values()):
        return "FAIL"
    return "part skipped" if "skipped" in validation.values() else "pass"


def step_line(record: dict[str, Any]) -> str:
    """The console line of one step: mode and path, how long the engines stood still for the
    update and how it reached them, the whole update's time, bytes, validation (and what a skipped
    gate means), the trainer's stats and any retried attempts."""
    val = record.get("validation", {})
    word = verdict(val)
    if word == "part skipped":
        skipped = [k for k, v in val.items() if v == "skipped"]
        why = "; SKIP_VALIDATION=1" if "check_weight_update_equal" in skipped else ""
        ran = ", ".join(k for k, v in val.items() if v == "pass")
        shown = f"skipped ({', '.join(skipped)}{why})" + (f", {ran} pass" if ran else "")
    else:
        shown = word if word == "pass" else f"FAIL {val}"
    t = record.get("train") or {}
    trained = ""
    if t.get("trainer") == "megatron":
        trained = (f"; train loss {t['loss']:.4f}, mean reward {t['mean_reward']:.3f}, grad norm "
                   f"{t['grad_norm']:.3g}, train/rollout logprob |d| {t['logprob_diff']:.3g}")
    elif t:
        trained = "; trainer synthetic (no learning)"
    n = record.get("attempts", 1)
    retried = f" (attempt {n}; earlier: {'; '.join(record['failed_attempts'])[:300]})" if n > 1 else ""
    path = PATHS.get(record.get("path", ""), record.get("path", record["mode"]))
    return (f"step {record['step']}: {record['mode']} ({path}) {_idle(record)}update {record['update_s'] * 1e3:.1f} "
            f"ms{retried}, {fmt_bytes(record['bytes'])}, validation {shown}{trained}")


COLUMNS = (("engine_idle_s", "idle ms"), ("update_s", "update ms"), ("write_s", "write ms"),
           ("verify_s", "verify ms"), ("control_s", "control ms"))
"""The times of the step table, the engines' idle time first (milliseconds)."""


def step_table(steps: Sequence[dict[str, Any]]) -> str:
    """A readable table: one line per step, what the engines waited for first (milliseconds; bytes
    and the write's rate in the unit that fits their size). Every phase is in ``results.json``."""
    head = (
        f"{'step':>4} {'mode':<9} {'engines':<17} "
        + " ".join(f"{title:>10}" for _, title in COLUMNS)
        + f" {'moved':>9} {'rate':>11} {'validation':<12} {'logprob |d|':>11}"
    )
    lines = [head, "-" * len(head)]
    for s in steps:
        lp = s.get("logprob_max_abs_diff")
        lines.append(
            f"{s['step']:>4} {s['mode']:<9} {how(s):<17} "
            + " ".join(f"{s.get(k, 0.0) * 1e3:>10.2f}" for k, _ in COLUMNS)
            + f" {fmt_bytes(s['bytes']):>9} {fmt_rate(_rate(s['bytes'], s.get('write_s', 0.0))):>11} "
            + f"{verdict(s.get('validation', {})):<12} "
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
    """The run's figures, per mode: ``modes`` maps each mode that ran to its :func:`mode_figures`;
    with both modes, ``p2p_speedup`` is broadcast's mean update time over p2p's. Over every update
    after the first: the engines' idle time (``mean_engine_idle_s``, ``max_engine_idle_s``) and how
    many were pause-free. Validation over every step (``validation_passed``, and each failure named).
    Engines replaced (``run --replace-dead-engines``): ``engine_replacements``, where any was."""
    failed = [
        f"step {s['step']}: {k}: {v}"
        for s in steps
        for k, v in s.get("validation", {}).items()
        if v not in ("pass", "skipped")
    ]
    modes: dict[str, list[dict[str, Any]]] = {}
    for s in steps:
        modes.setdefault(str(s["mode"]), []).append(s)
    idle = [float(s.get("engine_idle_s", 0.0)) for s in steps[1:] or steps]
    out: dict[str, Any] = {
        "steps": len(steps),
        "mean_engine_idle_s": sum(idle) / len(idle) if idle else None,
        "max_engine_idle_s": max(idle, default=None),
        "pause_free_updates": sum(bool(s.get("pause_free")) for s in steps),
        "modes": {m: mode_figures(ss) for m, ss in modes.items()},
        "validation_passed": not failed,
        "validation_failures": failed,
    }
    p2p, bc = out["modes"].get("p2p"), out["modes"].get("broadcast")
    if p2p and bc and p2p["mean_update_s"]:
        out["p2p_speedup"] = bc["mean_update_s"] / p2p["mean_update_s"]
    replaced = [r for s in steps for r in s.get("replacements", ())]
    if replaced:  # run --replace-dead-engines
        out["engine_replacements"] = replaced
    return out


def mode_figures(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One mode's figures over its steps: time of its first update (which pays one-time costs:
    buffers, groups, connections), then mean / median / min over the later ones (all of them when
    there is only one), bytes put on links per update, and ``gbps``: GB (1e9 bytes) per second over
    the later updates (their bytes over their time)."""
    times = [float(s["update_s"]) for s in steps]
    warm = steps[1:] or steps
    warm_times = sorted(float(s["update_s"]) for s in warm)
    mid = len(warm_times) // 2
    median = warm_times[mid] if len(warm_times) % 2 else (warm_times[mid - 1] + warm_times[mid]) / 2
    return {
        "updates": len(steps),
        "first_update_s": times[0],
        "mean_update_s": sum(warm_times) / len(warm_times),
        "median_update_s": median,
        "min_update_s": warm_times[0],
        "bytes_per_update": int(steps[-1]["bytes"]),
        "gbps": _rate(sum(float(s["bytes"]) for s in warm) / 1e9, sum(warm_times)),
    }


def summary_text(s: dict[str, Any]) -> str:
    """The console summary of :func:`summary`: one line per mode, and with both modes how they compare."""
    idle = s.get("mean_engine_idle_s")
    engines = (f"engines idle {fmt_ms(idle)} per update after the first (max {fmt_ms(s['max_engine_idle_s'])}; "
               f"{s['pause_free_updates']} of {s['steps']} pause-free), " if idle is not None else "")
    lines = [f"summary: {s['steps']} updates, {engines}validation {'passed' if s['validation_passed'] else 'FAILED'}; "
             "per mode, after its first update:"]
    for mode, f in s["modes"].items():
        lines.append(f"  {mode:<9} mean {f['mean_update_s']:.4f} s, median {f['median_update_s']:.4f} s "
                     f"({f['updates']} updates, first {f['first_update_s']:.4f} s), "
                     f"{fmt_bytes(f['bytes_per_update'])} per update, {fmt_rate(f['gbps'] and f['gbps'] * 1e9)}")
    if "p2p_speedup" in s:
        p2p, bc = s["modes"]["p2p"], s["modes"]["broadcast"]
        share = f", {p2p['bytes_per_update'] / bc['bytes_per_update']:.2f}x the bytes" if bc["bytes_per_update"] else ""
        lines.append(f"  p2p vs broadcast: {s['p2p_speedup']:.2f}x faster (mean update time){share}")
    for r in s.get("engine_replacements", ()):
        when = "during" if r.get("during") else "before"
        lines.append(f"  engine {r['engine']} replaced {when} step {r['step']}'s {r['before']}: served version "
                     f"{r['version']} after {r['serve_s']:.1f} s, joined from {r['peer']}")
    return "\n".join(lines)


def write_results(log_dir: Path, meta: dict[str, Any], steps: Sequence[dict[str, Any]]) -> Path:
    """Write ``results.json`` (meta, steps, summary) into ``log_dir``; returns its path."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "steps": list(steps), "summary": summary(steps)}, indent=2))
    tmp.replace(path)
    return path


MODE_HATCH = {Mode.P2P: "", Mode.BROADCAST: "//"}
"""How a bar shows its mode in the plot: p2p plain, broadcast hatched (the colours are the phases)."""


def phase_figure(steps: Sequence[dict[str, Any]], title: str) -> Any:
    """A matplotlib figure of each step's update in two panels of stacked bars coloured by phase:
    above, what the engines waited for (every phase inside their idle window: paused, all of them;
    pause-free, the flip); below, the whole update. Under each bar its step, mode and how it reached
    the engines; with several modes, a hatch per mode in the legend.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, (idle_ax, whole_ax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    xs = [s["step"] for s in steps]
    hatches = [MODE_HATCH.get(str(s["mode"]), "..") for s in steps]
    names = list(dict.fromkeys([*PHASES, "flip"]))
    colors = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(names)}
    modes = list(dict.fromkeys(str(s["mode"]) for s in steps))
    for ax, key in ((idle_ax, "idle_phases"), (whole_ax, "phases")):
        bottom = [0.0] * len(steps)
        for p in names:
            vals = [s.get(key, {}).get(p, 0.0) * 1e3 for s in steps]
            if not any(vals):
                continue
            bars = ax.bar(xs, vals, bottom=bottom, label=p, color=colors[p])
            for bar, hatch in zip(bars, hatches, strict=True):
                bar.set_hatch(hatch)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_ylim(top=max(bottom, default=0.0) * 1.15 or 1.0)
        handles, labels = ax.get_legend_handles_labels()
        if len(modes) > 1:
            for m in modes:
                handles.append(Patch(facecolor="white", edgecolor="black", hatch=MODE_HATCH.get(m, "..")))
                labels.append(f"mode {m}")
        ax.legend(handles, labels, fontsize=7, ncol=2)
    idle_ax.set_title(f"{title}: what the engines waited for (every phase inside the idle window)", fontsize=9)
    idle_ax.set_ylabel("engines idle (ms)")
    whole_ax.set_title("the whole update, by phase", fontsize=9)
    whole_ax.set_ylabel("whole update (ms)")
    whole_ax.set_xticks(xs, [f"{s['step']}\n{s['mode']}\n{how(s)}" for s in steps], fontsize=7)
    whole_ax.set_xlabel("step, mode, and how the update reached the engines")
    fig.tight_layout()
    return fig


def plot_phases(log_dir: Path, steps: Sequence[dict[str, Any]], title: str) -> Path | None:
    """:func:`phase_figure` saved as ``update_phases.png`` in ``log_dir``.

    Returns None (with a warning) when matplotlib is missing.
    """
    try:
        fig = phase_figure(steps, title)
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot written")
        return None
    path = log_dir / "update_phases.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


TRACEBACK = "Traceback (most recent call last):"
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(: |$)")
"""A traceback's exception line (``RuntimeError: ...``, ``pkg.module.UpdateError: ...``)."""
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


def error_summary(text: str) -> str:
    """``text`` (a run's error, trainer ranks' tracebacks included) without stack frames: each
    traceback becomes the words that introduced it and its last exception line (the one a chain
    ends with); other lines stay as they are."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        head, found, _ = lines[i].partition(TRACEBACK)
        i += 1
        if not found:
            out.append(head)
            continue
        last = ""
        while i < len(lines):
            line = lines[i]
            if not line.strip() or line.startswith((" ", "\t", *_CHAINED)) or line.strip() == TRACEBACK:
                i += 1
            elif _EXCEPTION_LINE.match(line):
                last = line
                i += 1
            else:
                break
        out.append((head + last).strip())
    return "\n".join(out)
