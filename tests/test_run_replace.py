"""The launcher's engine replacement (:mod:`weightsync.launch.replace`) over a placement whose
engines are scripted: which engines it restarts, with which command line, and how it stops when
it cannot (no process starts here; ``tests/test_faults_replace.py`` runs the real thing)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from weightsync.launch.placement import EngineEndpoint, Placement, RankChannel
from weightsync.launch.procs import AttachedEngine
from weightsync.launch.replace import EngineReplacer, ReplaceError
from weightsync.launch.trainer_worker import WorkerConfig
from weightsync.models.fit import plan_nodes
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.sync.engine_client import EngineError


class _Client:
    def __init__(self, health: Sequence[tuple[int | None, dict[str, Any]]], peer: str = "") -> None:
        self.answers = list(health)
        self.peer = peer

    def health(self, timeout_s: float = 5.0) -> tuple[int | None, dict[str, Any]]:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def wait_healthy(self, *, timeout_s: float, proc_alive: Any = None) -> None:
        """The run's first start: every scripted engine started."""

    def server_info(self) -> dict[str, Any]:
        return {"internal_states": [{"last_join": {"peer": self.peer} if self.peer else None}]}


class _Engine:
    """An engine handle whose process lives (or not) and whose ``/health`` answers as scripted."""

    def __init__(self, index: int, client: _Client, *, alive: bool = True, why: str = "") -> None:
        self.index = index
        self.url = f"http://127.0.0.1:{30000 + index}"
        self.client = client
        self._alive = alive
        self.why = why
        self.stopped = False

    def alive(self) -> bool:
        return self._alive

    def tail(self, n: int = 30) -> str:
        return "the replacement's log"

    def diagnose(self) -> str:
        return self.why

    def request_stop(self) -> None:
        pass

    def stop(self) -> None:
        self.stopped = True


SERVING = (200, {"state": "serving", "weight_version": "4"})
JOINING = (200, {"state": "joining", "weight_version": None})


class _Placement(Placement):
    """Engines started from scripted handles: ``starts`` gives each start (first ones, then replacements)."""

    kind = "fake"

    def __init__(self, tmp: Path, starts: list[_Engine]) -> None:
        super().__init__(tmp, plan_nodes(TrainParallel(world_size=1), RolloutParallel(tp=1, num_engines=3)))
        self.starts = starts
        self.argvs: list[list[str]] = []

    def trainer_host(self, rank: int) -> str:
        return "127.0.0.1"

    def trainer_port(self, rank: int) -> int:
        return 29500

    def engine_endpoints(self) -> list[EngineEndpoint]:
        return [EngineEndpoint(index=e, node=0, host="127.0.0.1", port=30000 + e, remote=False) for e in range(3)]

    def _start_engine(self, ep: EngineEndpoint, argv: list[str], *, replacement: int = 0) -> Any:
        self.argvs.append(argv)
        return self.starts.pop(0)

    def _spawn_trainer(self, rank: int, cfg: WorkerConfig) -> RankChannel:
        raise AssertionError("no trainer rank here")


def _started(tmp: Path, first: list[_Engine], replacements: list[_Engine]) -> _Placement:
    p = _Placement(tmp, [*first, *replacements])
    p.token = "t"
    p.start_engines(lambda ep: ["serve", "--port", str(ep.port)], timeout_s=1.0)
    return p


def _live(index: int) -> _Engine:
    return _Engine(index, _Client([SERVING]))


def test_only_the_dead_engine_is_restarted_on_its_own_command_line_joining_from_the_others(tmp_path: Path):
    dead = _Engine(1, _Client([(None, {"error": "refused"})]), alive=False, why="engine 1 exited (killed by SIGKILL)")
    joiner = _Engine(1, _Client([JOINING, JOINING, SERVING], peer="http://127.0.0.1:30000"))
    p = _started(tmp_path, [_live(0), dead, _live(2)], [joiner])
    said: list[str] = []
    done = EngineReplacer(p, timeout_s=10.0, say=said.append).replace_dead(3, "4", "generate")
    assert p.argvs[-1] == ["serve", "--port", "30001", "--join-from", "http://127.0.0.1:30000,http://127.0.0.1:30002"]
    assert dead.stopped
    assert p.engines[1] is joiner
    assert p.replaced(1) == 1
    assert [(r["engine"], r["step"], r["before"], r["version"], r["peer"]) for r in done] == \
        [(1, 3, "generate", "4", "http://127.0.0.1:30000")]
    assert said == [f"replaced engine 1 before step 3's generate: engine 1 exited (killed by SIGKILL); its "
                    f"replacement serves version 4 {done[0]['serve_s']:.1f} s after its start, joined from "
                    "http://127.0.0.1:30000"]
    assert EngineReplacer(p, timeout_s=10.0, say=said.append).replace_dead(3, "4", "update") == []


def test_a_replacement_that_exits_stops_with_both_causes(tmp_path: Path):
    dead = _Engine(1, _Client([(None, {})]), alive=False, why="engine 1 exited (killed by SIGKILL)")
    broken = _Engine(1, _Client([(None, {})]), alive=False, why="engine 1 exited (code 1): port in use")
    p = _started(tmp_path, [_live(0), dead, _live(2)], [broken])
    with pytest.raises(ReplaceError) as err:
        EngineReplacer(p, timeout_s=10.0, say=lambda _: None).replace_dead(2, "4", "update")
    first = str(err.value).splitlines()[0]
    assert first == ("engine 1 exited (killed by SIGKILL); its replacement did not serve: engine 1 exited (code 1): "
                     "port in use"), first
    assert "engine1-replacement1.log" in str(err.value)


def test_a_replacement_whose_join_fails_stops_with_both_causes(tmp_path: Path):
    dead = _Engine(1, _Client([(None, {})]), alive=False, why="engine 1 exited (killed by SIGKILL)")
    stale = _Engine(1, _Client([JOINING, (200, {"state": "stale", "reason": "every peer failed: refused"})]))
    p = _started(tmp_path, [_live(0), dead, _live(2)], [stale])
    with pytest.raises(ReplaceError, match=r"^engine 1 exited \(killed by SIGKILL\); its replacement did not join "
                                           r"version 4: every peer failed: refused$"):
        EngineReplacer(p, timeout_s=10.0, say=lambda _: None).replace_dead(2, "4", "update")


def test_a_replacement_that_never_serves_stops_at_the_deadline(tmp_path: Path):
    dead = _Engine(1, _Client([(None, {})]), alive=False, why="engine 1 exited (killed by SIGKILL)")
    p = _started(tmp_path, [_live(0), dead, _live(2)], [_Engine(1, _Client([JOINING]))])
    with pytest.raises(ReplaceError, match=r"did not serve version 4 within 0.5 s \(the engine start deadline"):
        EngineReplacer(p, timeout_s=0.5, say=lambda _: None).replace_dead(2, "4", "update")


def test_nothing_restarts_without_a_healthy_peer(tmp_path: Path):
    gone = [_Engine(i, _Client([(None, {})]), alive=False, why=f"engine {i} exited") for i in range(3)]
    p = _started(tmp_path, gone, [])
    with pytest.raises(ReplaceError, match="no engine is left healthy to join from"):
        EngineReplacer(p, timeout_s=1.0, say=lambda _: None).replace_dead(2, "4", "update")
    assert p.replaced(0) == 0


def test_an_engine_the_run_did_not_start_is_never_restarted(tmp_path: Path):
    p = _Placement(tmp_path, [])
    p.attach_engines(["http://127.0.0.1:9"])  # nothing listens there
    with pytest.raises(ReplaceError, match=r"engine 0 \(http://127.0.0.1:9\) does not answer /health .* \(an engine "
                                           r"this run did not start is never restarted\)"):
        EngineReplacer(p, timeout_s=1.0, say=lambda _: None).replace_dead(2, "4", "update")
    assert isinstance(p.engines[0], AttachedEngine)


def test_a_call_that_fails_on_a_dead_engine_is_sent_once_to_its_replacement(tmp_path: Path):
    dead = _Engine(1, _Client([(None, {})]), alive=False, why="engine 1 exited (killed by SIGKILL)")
    joiner = _Engine(1, _Client([SERVING], peer="http://127.0.0.1:30000"))
    p = _started(tmp_path, [_live(0), dead, _live(2)], [joiner])
    rejoined: list[list[dict[str, Any]]] = []

    def call(i: int) -> str:
        if p.engines[i] is dead:
            raise EngineError("http://127.0.0.1:30001/generate: engine unreachable (ReadError)")
        return f"answer {i}"

    outs, done = EngineReplacer(p, timeout_s=10.0, say=lambda _: None).call_each(2, "4", "generate", call,
                                                                                   rejoined.append)
    assert outs == ["answer 0", "answer 1", "answer 2"]
    assert [(r["engine"], r["step"], r["before"], r["during"]) for r in done] == [(1, 2, "generate", True)]
    assert rejoined == [done]


def test_a_second_failure_on_the_replacement_stops_with_both_causes(tmp_path: Path):
    dead = _Engine(1, _Client([(None, {})]), alive=False, why="engine 1 exited (killed by SIGKILL)")
    joiner = _Engine(1, _Client([SERVING], peer="http://127.0.0.1:30000"))
    p = _started(tmp_path, [_live(0), dead, _live(2)], [joiner])

    def call(i: int) -> str:
        if i == 1:
            which = "first" if p.engines[1] is dead else "again"
            raise EngineError(f"http://127.0.0.1:30001/generate: HTTP 500: {which}", 500)
        return f"answer {i}"

    with pytest.raises(ReplaceError) as err:
        EngineReplacer(p, timeout_s=10.0, say=lambda _: None).call_each(2, "4", "generate", call, lambda _: None)
    assert str(err.value) == ("engine 1 exited (killed by SIGKILL), failing step 2's generate "
                              "(http://127.0.0.1:30001/generate: HTTP 500: first); sent again to its replacement, it "
                              "failed too: http://127.0.0.1:30001/generate: HTTP 500: again")


def test_a_call_that_fails_on_an_engine_that_serves_is_not_retried(tmp_path: Path):
    p = _started(tmp_path, [_live(0), _live(1), _live(2)], [])

    def call(i: int) -> str:
        if i == 2:
            raise EngineError("http://127.0.0.1:30002/generate: HTTP 400: bad body", 400)
        return f"answer {i}"

    with pytest.raises(EngineError, match="HTTP 400: bad body"):
        EngineReplacer(p, timeout_s=10.0, say=lambda _: None).call_each(2, "4", "generate", call, lambda _: None)
    assert p.replaced(2) == 0
