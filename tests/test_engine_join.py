"""Contract: a (re)joining engine gets the fleet's current version from a healthy peer engine,
verified, before it serves -- and never from a peer that lost it.

Engines are ``weightsync serve`` processes (tiny Qwen3-MoE, CPU, shm). Peer A serves version v3 at
TP 2 / EP 2 (dummy weights of seed 7). What is checked, on what the engines answer:

* an engine started ``--join-from FAKE,A`` (TP 1: another layout) answers ``/generate`` 503
  naming the join while it copies; its first peer writes wrong bytes into it and dies (SIGKILL)
  mid-copy, the joiner falls back to A and then serves v3 with exactly the weights a TP 1 engine
  loads from the same checkpoint: ``/weights_checker fingerprint`` of every tensor equals the
  fingerprint computed here over that engine's layout, loaded directly;
* ``/mark_stale`` makes a serving engine (TP 2 / DP-attention 2) stale: ``/health`` says so,
  ``/generate`` answers 503 naming both versions; a rejoin from a peer that holds another version
  than the fleet's is refused (still stale); ``/join_from_peer`` from A brings it back to v3,
  bit-identical.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.engine_helpers import serve_process
from weightsync.engine.checker import WeightChecker
from weightsync.engine.loader import load_dummy
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.parallel import RolloutParallel
from weightsync.proc import free_port
from weightsync.sync.params import ParamStore

MODEL = "Qwen3-30B-A3B"
SEED = 7
FP_SEED = 12345


def _serve(args: list[str], port: int, log: Path) -> AbstractContextManager[subprocess.Popen]:
    return serve_process([MODEL, "--scale", "tiny", "--load-format", "dummy", "--transport", "shm", *args], port,
                         log, log_level="info")


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def _health(port: int) -> dict[str, Any] | None:
    try:
        return httpx.get(f"{_url(port)}/health", timeout=5).json()
    except httpx.TransportError:
        return None


def _wait(port: int, proc: subprocess.Popen, log: Path, until: Any, what: str, timeout_s: float = 60) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, f"engine exited:\n{log.read_text()[-3000:]}"
        h = _health(port)
        if h is not None and until(h):
            return h
        time.sleep(0.1)
    pytest.fail(f"{what} not within {timeout_s} s (last /health {_health(port)}):\n{log.read_text()[-3000:]}")


def _generate(port: int) -> httpx.Response:
    return httpx.post(f"{_url(port)}/generate", timeout=30,
                      json={"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})


def _expected(par: RolloutParallel) -> list[dict[str, str]]:
    """Every rank's fingerprints of an engine of ``par`` that loaded the dummy weights of SEED itself."""
    spec = get_model(MODEL, "tiny")
    out = []
    for rank in range(par.tp):
        store = ParamStore(engine_layout(spec, par, rank), torch.device("cpu"))
        load_dummy(store, spec, SEED)
        out.append(WeightChecker(store, parallelism_info={}).fingerprint(FP_SEED, ())["fingerprints"])
    return out


def _fingerprints(port: int) -> list[dict[str, str]]:
    r = httpx.post(f"{_url(port)}/weights_checker", json={"action": "fingerprint", "seed": FP_SEED}, timeout=60)
    assert r.status_code == 200, r.text
    return [x["fingerprints"] for x in r.json()["ranks"]]


def fake_peer_main(port: int, marker: str) -> None:
    """A peer that says it serves v3, writes wrong weights (random values, real plan) into the
    joiner through the real donor code, then hangs until it is killed."""
    from weightsync.sync.peer_sender import PeerDonation
    from weightsync.transport import TransportConfig

    spec, par = get_model(MODEL, "tiny"), RolloutParallel()

    class Handler(BaseHTTPRequestHandler):
        def _json(self, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # /health
            self._json({"status": "ok", "state": "serving", "weights_dirty": False, "weight_version": "v3"})

        def do_POST(self) -> None:  # /donate_weights: write wrong bytes, then die mid-answer
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            store = ParamStore(engine_layout(spec, par, 0), torch.device("cpu"))
            for _, t in store.items():
                t.copy_(torch.randn(t.shape).to(t.dtype))
            donation = PeerDonation(store, spec, par, 0, RolloutParallel(**body["joiner"]), body["ranks"],
                                    transport=TransportConfig(kind="shm"), seed=body["seed"], deadline_s=30)
            donation.wait(30)
            Path(marker).write_text(json.dumps(donation.result()))
            time.sleep(600)

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


@pytest.fixture(scope="module")
def peer_a(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port, log = free_port(), tmp_path_factory.mktemp("a") / "a.log"
    with _serve(["--tp", "2", "--ep", "2", "--seed", str(SEED), "--weight-version", "v3"], port, log) as proc:
        _wait(port, proc, log, lambda h: h["state"] == "serving", "peer A serving")
        yield port


@pytest.mark.timeout(120)
def test_joiner_copies_from_a_peer_after_the_first_dies_mid_copy(peer_a: int, tmp_path: Path) -> None:
    fake_port, port, marker = free_port(), free_port(), tmp_path / "fake_wrote.json"
    fake = subprocess.Popen([sys.executable, "-c", f"from tests.test_engine_join import fake_peer_main; "
                             f"fake_peer_main({fake_port}, {str(marker)!r})"], start_new_session=True)
    log = tmp_path / "b.log"
    try:
        end = time.monotonic() + 30
        while not _up(fake_port):
            assert time.monotonic() < end, "the fake peer did not start"
            time.sleep(0.1)
        with _serve(["--join-from", f"{_url(fake_port)},{_url(peer_a)}"], port, log) as proc:
            h = _wait(port, proc, log, lambda h: "copying version 'v3'" in h.get("reason", ""), "joining from FAKE")
            assert h["state"] == "joining"
            end = time.monotonic() + 60
            while not marker.exists():
                assert time.monotonic() < end, "the fake peer wrote nothing"
                time.sleep(0.1)
            assert json.loads(marker.read_text())["nbytes"] > 0  # wrong bytes landed in the joiner
            r = _generate(port)
            assert (r.status_code, r.json()["error"]["message"]) == (
                503, f"joining: copying version 'v3' from {_url(fake_port)}"), r.text
            os.killpg(fake.pid, signal.SIGKILL)  # the peer dies mid-copy
            h = _wait(port, proc, log, lambda h: h["state"] != "joining", "the join's end")
            assert h == {"status": "ok", "state": "serving", "weights_dirty": False, "weight_version": "v3"}, h
            assert _fingerprints(port) == _expected(RolloutParallel(tp=1))
            r = _generate(port)
            assert (r.status_code, r.json()["meta_info"]["weight_version"]) == (200, "v3"), r.text
            assert f"join from {_url(fake_port)} failed" in log.read_text()
    finally:
        if fake.poll() is None:
            os.killpg(fake.pid, signal.SIGKILL)
        fake.wait()


def _up(port: int) -> bool:
    try:
        httpx.get(f"{_url(port)}/health", timeout=5)
        return True
    except httpx.TransportError:
        return False


@pytest.mark.timeout(120)
def test_a_stale_engine_rejoins_through_join_from_peer(peer_a: int, tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "c.log"
    with _serve(["--tp", "2", "--dp", "2", "--seed", "1", "--weight-version", "v1"], port, log) as proc:
        _wait(port, proc, log, lambda h: h["state"] == "serving", "engine C serving")
        same = httpx.post(f"{_url(port)}/mark_stale", json={"published_version": "v1"}, timeout=30).json()
        assert (same["stale"], same["state"]) == (False, "serving")  # it holds the fleet's version
        marked = httpx.post(f"{_url(port)}/mark_stale", json={"published_version": "v9"}, timeout=30).json()
        assert marked["state"] == "stale", marked
        r = _generate(port)
        assert (r.status_code, r.json()["error"]["message"]) == (503, "stale: holds version 'v1', fleet published 'v9'")
        refused = httpx.post(f"{_url(port)}/join_from_peer", json={"peers": [_url(peer_a)], "wait": True}, timeout=60)
        assert refused.status_code == 503, refused.text
        assert "holds version 'v3', the fleet published 'v9'" in refused.text
        assert _health(port)["state"] == "stale"  # type: ignore[index]
        httpx.post(f"{_url(port)}/mark_stale", json={"published_version": "v3"}, timeout=30).raise_for_status()
        h = _health(port)
        assert h is not None
        assert (h["state"], h["reason"]) == ("stale", "stale: holds version 'v1', fleet published 'v3'"), h
        joined = httpx.post(f"{_url(port)}/join_from_peer", json={"peers": [_url(peer_a)], "wait": True}, timeout=60)
        assert joined.status_code == 200, joined.text
        assert (joined.json()["weight_version"], joined.json()["state"]) == ("v3", "serving")
        assert _fingerprints(port) == _expected(RolloutParallel(tp=2, dp=2))
        assert _generate(port).json()["meta_info"]["weight_version"] == "v3"
