"""Fault injection into one :class:`WeightUpdater` over a live engine: every failed update ends
within its deadline naming the cause, leaves the engine serving the old version (the update was
pause-free: its writes went to the shadow copy, nothing of them is served), and the retry or the
next update verifies and publishes.

One trainer rank (a gloo group of one, in this process) and ``weightsync serve`` engines
(Qwen3-4B tiny, TP 2, shm, dummy weights). Faults come from ``tests/fault_hooks.py`` (test-only
wrappers of the updater's write and transport); the engine-rank kill and the refused broadcast
announcement act on the real engine.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import weightsync.sync.broadcast_groups as groups_module
from tests import test_sync_updater_engine as base
from tests.e2e_helpers import serve_engine
from tests.fault_hooks import INJECTED, dropping, failing, on_write, slowing
from weightsync import UpdateError, UpdaterConfig, WeightUpdater
from weightsync.proc import free_port
from weightsync.sync.engine_client import EngineClient, EngineError

ENGINE_ARGV, SPEC, TRAIN, _step, te_named_params = (base.ENGINE_ARGV, base.SPEC, base.TRAIN, base._step,
                                                    base.te_named_params)
group = base.group  # the fixture: a gloo group of this one trainer rank

PROBE = {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
         "return_logprob": True, "logprob_start_len": 0}
"""A greedy request whose prompt logprobs are a fingerprint of the weights that computed them."""


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve_engine(ENGINE_ARGV, tmp_path_factory.mktemp("engine") / "engine.log") as url:
        yield url


def _state(url: str) -> dict[str, Any]:
    c = EngineClient(url)
    try:
        return c.engine_state()
    finally:
        c.close()


def _assert_held(url: str, version: str) -> None:
    """Serving ``version``, clean, no session left open: the failed pause-free update wrote only
    the shadow copy, so what is served is untouched and answers as ``version``."""
    s = _state(url)
    assert (s["state"], s["weights_dirty"], s["weight_version"], s["session_id"]) == ("serving", False, version,
                                                                                       None), s
    c = EngineClient(url, timeout_s=30.0)
    try:
        assert c.generate(PROBE)["meta_info"]["weight_version"] == version
    finally:
        c.close()


def _fingerprint(answer: dict[str, Any]) -> list[float]:
    return [row[0] for row in answer["meta_info"]["input_token_logprobs"] if row[0] is not None]


def _updater(url: str, params: dict, group: object, **config: Any) -> WeightUpdater:
    cfg = UpdaterConfig(**{"mode": "p2p", "bucket_bytes": 1 << 18, "verify_every": 1, **config})
    return WeightUpdater(params, spec=SPEC, train=TRAIN, engine_urls=[url], group=group, config=cfg)


@pytest.mark.timeout(240)
def test_failed_write_and_slow_receiver_leave_the_engine_serving_the_old_version(engine: str, group: object):
    params = te_named_params(11)
    with _updater(engine, params, group, deadline_s=1.0) as updater:
        assert updater.update(1).verified
        # a transport write that fails on one op
        _step(params, 2)
        on_write(updater, 0, failing)
        t0 = time.monotonic()
        with pytest.raises(UpdateError, match=rf"trainer rank 0: p2p write: RuntimeError: {INJECTED}: shm write"):
            updater.update(2)
        assert time.monotonic() - t0 < 10
        _assert_held(engine, "1")
        # a receiver slower than the write deadline (1 s)
        on_write(updater, 0, slowing(3.0))
        t0 = time.monotonic()
        with pytest.raises(UpdateError, match=rf"TimeoutError: {INJECTED}"):
            updater.update(2)
        assert time.monotonic() - t0 < 10
        _assert_held(engine, "1")
        # the next update recovers the engine: verified, published, serving
        stats = updater.update(2)
        assert stats.verified
        assert stats.attempts == 1
        s = _state(engine)
        assert (s["state"], s["weights_dirty"], s["weight_version"]) == ("serving", False, "2"), s


@pytest.mark.timeout(240)
def test_dropped_writes_are_caught_and_retried_before_any_answer(engine: str, group: object):
    """Writes silently dropped at update k: the verification catches it before publication, the
    retry rewrites and verifies; every answer given meanwhile is recorded with its weight version
    and the logprobs it was computed with, and no answer labelled k comes from other weights."""
    params = te_named_params(12)
    with _updater(engine, params, group, update_retries=1) as updater:
        assert updater.update(1).verified
        c = EngineClient(engine)
        before = _fingerprint(c.generate(PROBE))
        answers: list[tuple[str, list[float]]] = []
        refused: list[int | None] = []
        stop = threading.Event()

        def client() -> None:
            mine = EngineClient(engine)
            while not stop.is_set():
                try:
                    out = mine.generate(PROBE)
                except EngineError as exc:  # refused meanwhile: recorded, retried as a rollout client does
                    refused.append(exc.status)
                    continue
                assert (out["meta_info"].get("finish_reason") or {}).get("type") != "abort", "a pause-free update"
                answers.append((out["meta_info"]["weight_version"], _fingerprint(out)))
            mine.close()

        _step(params, 2)
        on_write(updater, 0, dropping)
        t = threading.Thread(target=client)
        t.start()
        time.sleep(0.5)
        try:
            stats = updater.update(2)
        finally:
            time.sleep(0.5)
            stop.set()
            t.join(30)
        assert stats.attempts == 2, stats
        assert stats.verified
        assert refused == [], refused
        assert "fingerprints differ: engine 0" in stats.failed_attempts[0]
        after = _fingerprint(c.generate(PROBE))
        c.close()
        assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-3  # the update changed them
        versions = [v for v, _ in answers]
        assert set(versions) == {"1", "2"}, versions
        assert versions == sorted(versions), "an answer of version 1 after one of version 2"
        for v, fp in answers:
            want = before if v == "1" else after
            assert max(abs(a - b) for a, b in zip(fp, want, strict=True)) < 1e-4, (v, fp, want)


@pytest.mark.timeout(240)
def test_refused_broadcast_ends_the_update_within_seconds(engine: str, group: object,
                                                          monkeypatch: pytest.MonkeyPatch):
    """An engine that refuses a broadcast bucket (here: an announcement whose dtype is not the
    parameter's) ends the update at once with the engine's message -- the source does not wait out
    the group's timeout in the collective -- and the next update rebuilds the groups and verifies."""
    params = te_named_params(13)
    with _updater(engine, params, group, mode="broadcast", group_timeout_s=120.0) as updater:
        assert updater.update(1).verified
        real = groups_module.announcement

        def wrong_dtype(inputs: Any, names: Any) -> Any:
            n, dtypes, shapes = real(inputs, names)
            return n, ["float32" if d != "float32" else "bfloat16" for d in dtypes], shapes

        monkeypatch.setattr(groups_module, "announcement", wrong_dtype)
        _step(params, 2)
        t0 = time.monotonic()
        with pytest.raises(UpdateError, match=r"update_weights_from_distributed: engine 0 at .*HTTP 400"):
            updater.update(2)
        assert time.monotonic() - t0 < 15, "the source waited in the broadcast"
        _assert_held(engine, "1")
        monkeypatch.setattr(groups_module, "announcement", real)
        assert updater.update(2).verified
        assert _state(engine)["weight_version"] == "2"


@pytest.mark.timeout(120)
def test_a_session_left_open_by_a_dead_holder_is_recovered(engine: str, group: object):
    """An update session whose holder died (a killed run) does not block the next run: its first
    update aborts that session and verifies its own."""
    params = te_named_params(14)
    with _updater(engine, params, group) as updater:
        c = EngineClient(engine)
        c.pause_generation()
        c.begin_weight_update()  # ... and the holder is gone
        c.close()
        assert updater.update(7).verified
        s = _state(engine)
        assert (s["state"], s["weights_dirty"], s["weight_version"]) == ("serving", False, "7"), s


def _pids_of(port: int) -> tuple[int, list[int]]:
    """The ``serve`` process listening on ``port`` and its rank processes."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and str(port).encode() in argv:
            kids = []
            for task in (d / "task").iterdir():
                kids += [int(x) for x in (task / "children").read_text().split()]
            return int(d.name), kids
    raise AssertionError(f"no serve process on port {port}")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return True
    return state == "Z"


@pytest.mark.timeout(300)
def test_engine_rank_killed_mid_update_then_restarted(group: object, tmp_path: Path):
    """An engine rank killed while the update writes: the update fails naming the engine, the
    engine ends (its shm unlinked); restarted on the same URL it is re-queried and re-planned by
    ``refresh()`` (new addresses, never the old ones) and the next update verifies."""
    from weightsync.transport.shm import segment_owner

    port = free_port()
    params = te_named_params(15)
    with serve_engine(ENGINE_ARGV, tmp_path / "engine.log", port=port) as url:
        server, ranks = _pids_of(port)
        assert len(ranks) >= 2, ranks
        updater = _updater(url, params, group)
        try:
            assert updater.update(1).verified

            def kill_rank1(transport: Any) -> Any:
                os.kill(ranks[-1], signal.SIGKILL)
                time.sleep(0.5)
                return lambda: None

            on_write(updater, 0, kill_rank1)
            _step(params, 2)
            t0 = time.monotonic()
            with pytest.raises(UpdateError, match=rf"engine 0 at {url}"):
                updater.update(2)
            assert time.monotonic() - t0 < 60
            end = time.monotonic() + 30
            while not _gone(server) and time.monotonic() < end:
                time.sleep(0.2)
            assert _gone(server), "the engine outlived its rank"
            owners = {server, *ranks}
            left = [p.name for p in Path("/dev/shm").glob("weightsync-*")
                    if (segment_owner(p.name) or (None,))[0] in owners]
            assert not left, left
            old = dict(updater.discovered.infos or {})
        except BaseException:
            updater.close()
            raise
    with serve_engine(ENGINE_ARGV, tmp_path / "engine.log", port=port) as url:
        try:
            assert updater.refresh() is True
            new = updater.discovered.infos or {}
            assert all(new[r]["session_id"] != old[r]["session_id"] for r in old), "old addresses"
            stats = updater.update(3)
            assert stats.verified
        finally:
            updater.close()
