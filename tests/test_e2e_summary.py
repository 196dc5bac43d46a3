"""What a run shows of its updates: the summary per mode, the step lines, the units, the plot.

Contracts:

* ``--mode both``: ``results.json``'s summary has one entry per mode with that mode's own figures
  (its updates, mean / median after its first update, its bytes per update, its rate), and how
  the modes compare (``p2p_speedup``); the console says the same, one line per mode.
* Byte counts and rates are printed in the unit that fits their size (KB at tiny scale, GB at
  full scale), never as a fraction of a GB.
* A step's line names its update path in words (one-sided writes, the weight-update group,
  colocated ``update_weights_from_tensor``) and how long the engines stood still for it and how it
  reached them, and a skipped gate reads "skipped", never "pass".
* The plot shows what the engines waited for and the whole update, says under each bar which mode
  it is and how it reached the engines, and, with both modes, tells them apart in its legend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e_helpers import (
    assert_bytes_exact,
    assert_run_passed,
    e2e_ckpt_fixture,  # noqa: F401 -- the e2e_ckpt fixture
    model_bytes,
    run_in_process,
)
from weightsync.launch.report import fmt_bytes, fmt_rate, phase_figure, step_line, summary, summary_text

pytestmark = pytest.mark.timeout(600)


def _step(step: int, mode: str, update_s: float, nbytes: int, path: str | None = None,
          validation: dict[str, str] | None = None) -> dict[str, Any]:
    return {"step": step, "mode": mode, "path": path or ("p2p" if mode == "p2p" else "group"), "update_s": update_s,
            "phases": {"wire": update_s / 2}, "bytes": nbytes, "engine_idle_s": 8e-5, "pause_free": True,
            "flip": "swap", "idle_phases": {"flip": 8e-5},
            "validation": validation or {"checksums": "pass", "logprob_parity": "pass"}}


def test_both_modes_summary_per_mode(e2e_ckpt: Path, tmp_path: Path):
    """A real ``--mode both`` run: each mode's figures come from its own steps."""
    run = run_in_process(["Qwen3-4B", "--mode", "both", "--num-rollout", "3"], ckpt_dir=e2e_ckpt, log_dir=tmp_path)
    assert_run_passed(run, modes=["p2p", "broadcast", "p2p", "broadcast"])
    assert_bytes_exact(run, model_bytes("Qwen3-4B"))
    assert run.results is not None
    s, steps = run.results["summary"], run.steps
    assert set(s["modes"]) == {"p2p", "broadcast"}
    for mode in ("p2p", "broadcast"):
        own = [x for x in steps if x["mode"] == mode]
        f = s["modes"][mode]
        assert f["updates"] == 2
        assert f["bytes_per_update"] == own[-1]["bytes"] == own[0]["bytes"]
        assert f["first_update_s"] == own[0]["update_s"]
        assert f["mean_update_s"] == f["median_update_s"] == own[1]["update_s"]  # after the mode's first
        assert f["gbps"] == pytest.approx(own[1]["bytes"] / 1e9 / own[1]["update_s"])
        assert f"  {mode:<9} mean {f['mean_update_s']:.4f} s" in run.output
        assert f"{fmt_bytes(f['bytes_per_update'])} per update" in run.output
    p2p, bc = s["modes"]["p2p"], s["modes"]["broadcast"]
    assert p2p["bytes_per_update"] < bc["bytes_per_update"], "p2p moves each rank's shard, broadcast the model"
    assert s["p2p_speedup"] == pytest.approx(bc["mean_update_s"] / p2p["mean_update_s"])
    assert f"p2p vs broadcast: {s['p2p_speedup']:.2f}x faster" in run.output
    assert "step 1: broadcast (weight-update group) engines idle " in run.output
    assert "step 2: p2p (one-sided writes) engines idle " in run.output
    assert s["pause_free_updates"] == len(steps), "CPU engines hold a shadow: every update is pause-free"
    assert s["mean_engine_idle_s"] == pytest.approx(sum(x["engine_idle_s"] for x in steps[1:]) / (len(steps) - 1))
    assert " GB " not in run.output.split("summary:")[1], "tiny sizes are printed in KB, not as fractions of a GB"


def test_one_mode_summary_has_no_comparison():
    s = summary([_step(0, "p2p", 0.5, 1000), _step(1, "p2p", 0.1, 1000), _step(2, "p2p", 0.3, 1000),
                 _step(3, "p2p", 0.2, 1000)])
    assert list(s["modes"]) == ["p2p"]
    f = s["modes"]["p2p"]
    assert (f["first_update_s"], f["min_update_s"], f["median_update_s"]) == (0.5, 0.1, 0.2)
    assert f["mean_update_s"] == pytest.approx(0.2)
    assert f["gbps"] == pytest.approx(3000 / 1e9 / 0.6)
    assert "p2p_speedup" not in s
    text = summary_text(s)
    assert "p2p vs broadcast" not in text
    assert "mean 0.2000 s, median 0.2000 s (4 updates, first 0.5000 s), 1 KB per update, 5 KB/s" in text


def test_a_failed_gate_is_named_in_the_summary():
    s = summary([_step(0, "broadcast", 0.1, 10, validation={"checksums": "fail: engine 0", "logprob_parity": "pass"})])
    assert not s["validation_passed"]
    assert s["validation_failures"] == ["step 0: checksums: fail: engine 0"]
    assert "validation FAILED" in summary_text(s)


@pytest.mark.parametrize(("nbytes", "text"), [
    pytest.param(0, "0 B", id="zero"),
    pytest.param(999, "999 B", id="bytes"),
    pytest.param(336_128, "336 KB", id="tiny-p2p"),
    pytest.param(2_500_000, "2.5 MB", id="mb"),
    pytest.param(21_200_000_000, "21.2 GB", id="gb"),
    pytest.param(3.2e12, "3.2 TB", id="tb"),
])
def test_bytes_in_the_unit_that_fits(nbytes: float, text: str):
    assert fmt_bytes(nbytes) == text
    assert fmt_rate(nbytes) == text + "/s"


def test_rate_unknown():
    assert fmt_rate(None) == "-"


@pytest.mark.parametrize(("path", "words"), [
    pytest.param("p2p", "p2p (one-sided writes)", id="p2p"),
    pytest.param("group", "broadcast (weight-update group)", id="group"),
    pytest.param("tensor", "broadcast (colocated, update_weights_from_tensor)", id="colocated"),
])
def test_step_line_names_the_path_in_words(path: str, words: str):
    mode = "p2p" if path == "p2p" else "broadcast"
    line = step_line(_step(3, mode, 0.0123, 336_128, path=path))
    assert line.startswith(f"step 3: {words} engines idle 0.08 ms (pause-free swap), update 12.3 ms, 336 KB, "
                           f"validation pass"), line


def test_skipped_gate_reads_skipped_not_pass():
    skipped = {"check_weight_update_equal": "skipped", "checksums": "pass"}
    line = step_line(_step(0, "p2p", 0.01, 10, validation=skipped))
    assert "validation skipped (check_weight_update_equal; SKIP_VALIDATION=1), checksums pass" in line
    assert "validation pass" not in line


def test_plot_labels_each_bar_with_its_mode():
    import matplotlib.pyplot as plt

    steps = [_step(0, "p2p", 0.04, 10), _step(1, "broadcast", 0.1, 20), _step(2, "p2p", 0.04, 10)]
    steps[1].update(pause_free=False, flip=None, idle_phases={"wire": 0.05})
    fig = phase_figure(steps, "title")
    try:
        idle, whole = fig.axes[:2]
        assert [t.get_text() for t in whole.get_xticklabels()] == ["0\np2p\npause-free swap", "1\nbroadcast\npaused",
                                                                   "2\np2p\npause-free swap"]
        for ax in (idle, whole):
            legend = [t.get_text() for t in ax.get_legend().get_texts()]
            assert {"mode p2p", "mode broadcast"} <= set(legend)
            hatches = {b.get_hatch() or "" for b in ax.patches[:3]}
            assert len(hatches) == 2, "p2p and broadcast bars must look different"
        assert {"flip", "wire"} <= {t.get_text() for t in idle.get_legend().get_texts()}, "every phase in the window"
    finally:
        plt.close(fig)
