"""An engine that dies during an update is dropped from it: the others verify and publish.

Three ``weightsync serve`` engines (Qwen3-4B tiny, TP 1, shm, dummy weights) and one trainer rank
(a gloo group of one, in this process). One engine is SIGKILLed while the update writes:

* ``on_engine_failure="drop"``: the update publishes on the two others (verified), names the dead
  one in ``UpdateStats.dropped``, and later updates leave it out without rebuilding anything (p2p);
  restarted on its URL (fresh weights), ``refresh()`` has it join the published version from a
  peer (``/join_from_peer``): it serves that version, fingerprint-identical to the peers, before
  any update; the next update verifies all three;
* ``abort``: the update fails on every engine and the survivors keep serving the old version;
* broadcast: the survivors' groups are rebuilt (the dead engine's receive-in-flight on the others
  ends when the old groups are destroyed) and they publish within 30 s (group timeout 60 s);
* a fourth engine at TP 2 added mid-run follows: it joins each published version from a peer.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import test_sync_updater_engine as base
from tests.e2e_helpers import serve_engine
from tests.test_faults_update import _pids_of, _state
from weightsync import UpdateError, UpdaterConfig, WeightUpdater
from weightsync.proc import free_port
from weightsync.sync.fleet import EngineRegistry

SPEC, TRAIN, _step, te_named_params = base.SPEC, base.TRAIN, base._step, base.te_named_params
group = base.group  # the fixture: a gloo group of this one trainer rank
ENGINE_ARGV = ["Qwen3-4B", "--scale", "tiny", "--tp", "1", "--transport", "shm", "--load-format", "dummy"]


class Fleet:
    """Three engines on fixed ports (a restarted one keeps its URL)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.ports = [free_port() for _ in range(3)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.stacks = [ExitStack() for _ in self.ports]

    def start(self, i: int) -> None:
        self.stacks[i].enter_context(serve_engine(ENGINE_ARGV, self.log_dir / f"engine{i}.log", port=self.ports[i]))

    def kill(self, i: int) -> None:
        """SIGKILL engine ``i``'s server and its rank processes (no goodbye)."""
        server, ranks = _pids_of(self.ports[i])
        for pid in (server, *ranks):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.stacks[i].close()
        self.stacks[i] = ExitStack()

    def close(self) -> None:
        for s in self.stacks:
            s.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        for i in range(3):
            f.start(i)
        yield f
    finally:
        f.close()


def _fingerprints(url: str) -> list[dict[str, str]]:
    """Every rank's per-tensor fingerprints of what ``url``'s engine serves."""
    r = httpx.post(f"{url}/weights_checker", json={"action": "fingerprint", "seed": 7}, timeout=60)
    r.raise_for_status()
    return [x["fingerprints"] for x in r.json()["ranks"]]


def _kill_during_write(updater: WeightUpdater, fleet: Fleet, i: int) -> None:
    """Engine ``i`` is SIGKILLed as the next write starts."""
    real = updater.write

    def write(mode: Any = "p2p", **kwargs: Any) -> Any:
        updater.write = real
        fleet.kill(i)
        time.sleep(0.5)
        return real(mode, **kwargs)

    updater.write = write


def _updater(fleet: Fleet, params: dict, group: object, urls: Any = None, **config: Any) -> WeightUpdater:
    cfg = UpdaterConfig(**{"mode": "p2p", "bucket_bytes": 1 << 18, "verify_every": 1, "http_timeout_s": 30.0,
                           **config})
    return WeightUpdater(params, spec=SPEC, train=TRAIN, engine_urls=urls or fleet.urls, group=group, config=cfg)


@pytest.mark.timeout(600)
def test_p2p_drops_a_killed_engine_and_takes_it_back(fleet: Fleet, group: object):
    params = te_named_params(21)
    registry = EngineRegistry(fleet.urls)
    with _updater(fleet, params, group, urls=registry) as updater:
        assert updater.update(1).verified
        sender = updater.p2p_sender
        _step(params, 2)
        _kill_during_write(updater, fleet, 1)
        stats = updater.update(2)
        assert stats.verified
        assert list(stats.dropped) == [1], stats.dropped
        assert fleet.urls[1] in stats.dropped[1], stats.dropped
        assert stats.engines == [fleet.urls[0], fleet.urls[2]]
        assert stats.group_rebuild_s == 0.0
        for u in (fleet.urls[0], fleet.urls[2]):
            s = _state(u)
            assert (s["state"], s["weights_dirty"], s["weight_version"]) == ("serving", False, "2"), s
        # the next update leaves it out and rebuilds nothing
        _step(params, 3)
        stats = updater.update(3)
        assert stats.verified
        assert stats.dropped == {}
        assert stats.engines == [fleet.urls[0], fleet.urls[2]]
        assert updater.p2p_sender is sender, "p2p rebuilt its sender after a drop"
        assert updater.excluded.keys() == {1}
        # back on its URL (fresh dummy weights): refresh() has it join version 3 from a peer,
        # verified engine to engine, before any update -- bit-identical to the peers
        fleet.start(1)
        assert _state(fleet.urls[1])["weight_version"] != "3"
        assert updater.refresh() is True
        assert updater.excluded == {}
        s = _state(fleet.urls[1])
        assert (s["state"], s["weights_dirty"], s["weight_version"]) == ("serving", False, "3"), s
        assert _fingerprints(fleet.urls[1]) == _fingerprints(fleet.urls[0])
        _step(params, 4)
        stats = updater.update(4)
        assert stats.verified
        assert stats.dropped == {}
        assert stats.engines == fleet.urls
        assert {_state(u)["weight_version"] for u in fleet.urls} == {"4"}


@pytest.mark.timeout(600)
def test_abort_keeps_all_or_nothing(fleet: Fleet, group: object):
    params = te_named_params(22)
    with _updater(fleet, params, group, on_engine_failure="abort") as updater:
        assert updater.update(1).verified
        _step(params, 2)
        _kill_during_write(updater, fleet, 2)
        with pytest.raises(UpdateError, match=rf"engine 2 at {fleet.urls[2]}"):
            updater.update(2)
        for u in fleet.urls[:2]:
            s = _state(u)
            assert (s["state"], s["weights_dirty"], s["weight_version"]) == ("serving", False, "1"), s
    fleet.start(2)


def _until_serving(url: str, version: str, timeout_s: float) -> float:
    """Seconds until ``url``'s engine serves ``version`` (clean); fails after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        s = _state(url)
        if (s["state"], s["weights_dirty"], s["weight_version"]) == ("serving", False, version):
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"{url} does not serve version {version} after {timeout_s:.0f} s: {_state(url)}")


@pytest.mark.timeout(600)
def test_an_engine_of_another_tp_added_mid_run_follows_each_version(fleet: Fleet, group: object):
    """A fourth engine at TP 2 (the others: TP 1) registered mid-run: ``refresh()`` has it join the
    published version from a peer (verified by the engine against the peer's fingerprints) before
    it returns; it is not planned for, and after each update it serves the new version within
    one update interval (a peer copy, not a trainer write)."""
    params = te_named_params(24)
    registry = EngineRegistry(fleet.urls)
    argv = [*ENGINE_ARGV[:4], "2", *ENGINE_ARGV[5:]]
    with _updater(fleet, params, group, urls=registry) as updater, \
            serve_engine(argv, fleet.log_dir / "engine3-tp2.log") as url:
        assert updater.update(1).verified
        registry.add(url)
        updater.refresh()
        assert updater.roster.followers == [url]
        assert updater.engines is not None
        assert updater.engines.urls == fleet.urls
        s = _state(url)
        assert (s["state"], s["weights_dirty"], s["weight_version"]) == ("serving", False, "1"), s
        for v in (2, 3):
            _step(params, v)
            stats = updater.update(v)
            assert stats.verified
            assert stats.engines == fleet.urls
            took = _until_serving(url, str(v), timeout_s=60)
            print(f"TP 2 follower serves version {v} {took:.2f} s after the update returned")
        assert len(_fingerprints(url)) == 2  # it serves in its own layout: two ranks


@pytest.mark.timeout(600)
def test_broadcast_rebuilds_the_group_for_the_survivors(fleet: Fleet, group: object):
    params = te_named_params(23)
    with _updater(fleet, params, group, mode="broadcast", group_timeout_s=60.0) as updater:
        assert updater.update(1).verified
        _step(params, 2)
        _kill_during_write(updater, fleet, 0)
        t0 = time.perf_counter()
        stats = updater.update(2)
        took = time.perf_counter() - t0
        assert stats.verified
        assert list(stats.dropped) == [0], stats.dropped
        assert stats.group_rebuild_s > 0.0
        assert stats.engines == fleet.urls[1:]
        assert took < 30.0, f"the survivors waited for the group timeout ({took:.1f} s)"
        for u in fleet.urls[1:]:
            s = _state(u)
            assert (s["state"], s["weights_dirty"], s["weight_version"]) == ("serving", False, "2"), s
        _step(params, 3)
        stats = updater.update(3)  # the survivors' groups stand: nothing rebuilt
        assert stats.verified
        assert stats.group_rebuild_s == 0.0
        assert stats.engines == fleet.urls[1:]
    fleet.start(0)
