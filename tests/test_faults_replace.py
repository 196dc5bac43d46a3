"""``run --replace-dead-engines`` (tiny Qwen3-4B on CPU, shm, two engines of TP 1): engine 1 is
SIGKILLed between step 2's generation and its update, or as update 2 begins
(``tests/fault_hooks.py``'s ``kill_engine``, reached through ``WEIGHTSYNC_FAULT_HOOK``). With the
option the launcher starts it again on its port, it joins the current version from engine 0, the
trainer's updater picks it up, and the run completes every step, its own per-step checks passing
on both engines -- the replacement's checksums and logprobs included; ``results.json`` names the
replacement. Killed as the update begins, the update drops it and engine 0 publishes alone; the
replacement joins that version before the step is validated. Killed as step 2's generation is
sent to it (a run in this process), its replacement joins version 1 and generates engine 1's
chunk again: the step's samples are complete. Without the option the same kill stops the run,
naming the dead engine first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e_helpers import e2e_ckpt_fixture, run_cli, run_in_process  # noqa: F401 -- the e2e_ckpt fixture
from tests.fault_hooks import kill_serve
from weightsync.launch.session import RunSession

RUN = ["run", "Qwen3-4B", "--train", "tp=1,cp=1,world=1", "--rollout", "tp=1,engines=2", "--num-rollout", "3"]
KILL = "tests.fault_hooks:kill_engine:2:1"
"""Engine 1 killed as trainer step 2 runs (after step 2's generation, before its update)."""

CASES = [
    pytest.param("p2p", "", "update", "1", id="p2p-before-update"),
    pytest.param("broadcast", "", "update", "1", id="broadcast-before-update"),
    pytest.param("p2p", ":update", "validate", "2", id="p2p-in-update"),
]
"""(mode, when the kill comes, what the replacement comes before, the version it joins)."""


def _every_step_passed(run: Any) -> list[dict[str, Any]]:
    """The run's steps 0-3, step 2 with one replacement, each step's own checks passed on both engines."""
    steps = run.steps
    assert [s["step"] for s in steps] == [0, 1, 2, 3], steps
    assert [len(s.get("replacements", [])) for s in steps] == [0, 0, 1, 0], steps
    for s in steps:
        assert s["validation"]["checksums"] == "pass", s
        assert s["validation"]["logprob_parity"] == "pass", s
    assert run.results["summary"]["validation_passed"], run.results["summary"]
    return steps


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mode", "when", "before", "joins"), CASES)
def test_a_killed_engine_is_replaced_and_the_run_completes(mode: str, when: str, before: str, joins: str,
                                                           e2e_ckpt: Path, tmp_path: Path):
    run = run_cli([*RUN, "--mode", mode, "--replace-dead-engines"], ckpt_dir=e2e_ckpt, log_dir=tmp_path,
                  env={"WEIGHTSYNC_FAULT_HOOK": KILL + when})
    assert run.returncode == 0, run.describe()
    line = next((ln for ln in run.output.splitlines() if ln.startswith("replaced engine 1")), "")
    assert line.startswith(f"replaced engine 1 before step 2's {before}: engine 1 (http://127.0.0.1:"), \
        run.describe()
    assert "exited (killed by SIGKILL)" in line, line
    urls = run.meta["placement"]["engine_urls"]
    assert f"its replacement serves version {joins} " in line, line
    assert line.endswith(f"after its start, joined from {urls[0]}"), line
    [r] = run.results["summary"]["engine_replacements"]
    assert (r["engine"], r["step"], r["before"], r["version"], r["peer"]) == (1, 2, before, joins, urls[0]), r
    assert 0 < r["serve_s"] < 120, r
    steps = _every_step_passed(run)  # the replacement holds versions 2 and 3 bit for bit
    # killed in update 2, that update dropped it; no other update dropped an engine
    assert [list(s.get("dropped", {})) for s in steps] == [[], [], ["1"] if when else [], []], steps
    # every update but a dropping one wrote engine 1 as any engine (p2p: its rollout rank received bytes)
    if mode == "p2p":
        assert all(s["bytes_per_receiver"].get("1", 0) > 0 for s in steps if not s.get("dropped")), steps
    assert "exited" not in (tmp_path / "engine1-replacement1.log").read_text()


@pytest.mark.timeout(300)
def test_an_engine_killed_while_the_step_generates_is_replaced_and_its_chunk_resent(
        e2e_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    real = RunSession._on_engines
    calls: list[tuple[int, str]] = []

    def on_engines(self: RunSession, step: int, what: str, call: Any) -> list[Any]:
        def killing(i: int) -> Any:
            calls.append((step, what))
            if (step, what, i) == (2, "generate", 1) and calls.count((2, "generate")) <= 2:  # not the resend
                kill_serve(self.procs.engines[1].url)
            return call(i)

        return real(self, step, what, killing)

    monkeypatch.setattr(RunSession, "_on_engines", on_engines)
    run = run_in_process([*RUN[1:], "--mode", "p2p", "--replace-dead-engines"], ckpt_dir=e2e_ckpt, log_dir=tmp_path)
    assert run.returncode == 0, run.describe()
    urls = run.meta["placement"]["engine_urls"]
    line = next((ln for ln in run.output.splitlines() if ln.startswith("replaced engine 1")), "")
    assert line.startswith("replaced engine 1 during step 2's generate: engine 1 (http://127.0.0.1:"), run.describe()
    assert "exited (killed by SIGKILL)" in line, line
    assert "its replacement serves version 1 " in line, line
    assert line.endswith(f"after its start, joined from {urls[0]}"), line
    [r] = run.results["summary"]["engine_replacements"]
    assert (r["engine"], r["step"], r["before"], r["during"], r["version"], r["peer"]) == \
        (1, 2, "generate", True, "1", urls[0]), r
    assert calls.count((2, "generate")) == 3, calls  # both engines, then engine 1's chunk once more
    steps = _every_step_passed(run)
    assert not any(s.get("dropped") for s in steps), steps
    assert all(s["bytes_per_receiver"].get("1", 0) > 0 for s in steps), steps  # update 2 wrote the replacement


@pytest.mark.timeout(300)
def test_without_the_option_the_killed_engine_stops_the_run(e2e_ckpt: Path, tmp_path: Path):
    run = run_cli([*RUN, "--mode", "p2p"], ckpt_dir=e2e_ckpt, log_dir=tmp_path, env={"WEIGHTSYNC_FAULT_HOOK": KILL})
    assert run.returncode == 1, run.describe()
    message = run.output[run.output.index("weightsync run:"):].strip().splitlines()
    assert message[0].startswith("weightsync run: engine 1 (http://127.0.0.1:"), message
    assert "exited (killed by SIGKILL)" in message[0], message
    assert message[1].startswith("(the run stopped at step 2: "), message
    assert "\nstep 1:" in run.output, run.describe()
    assert "\nstep 2:" not in run.output, run.describe()
    assert "replaced engine" not in run.output
