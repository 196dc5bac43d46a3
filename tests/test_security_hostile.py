"""Contract: no request can take an engine down or hold it (one ``weightsync serve`` subprocess of
tiny Qwen3-4B, two CPU ranks, with a token, its descriptor limit lowered to 1024 as on a default
Linux account). After every hostile input below the engine still answers ``/health`` 200, serves a
greedy request with the same tokens as before, and publishes nothing it did not verify:

* a stop pattern that backtracks catastrophically in Python's ``re`` (``(a+)+b`` while
  ``logit_bias`` forces ``a``) costs linear time: health checks and a pause answer while it
  generates, and the request finishes; a backreference is a 400 naming the pattern;
* slowloris: 1,100 connections that send half their headers (more than the engine's descriptor
  limit) while 8 legitimate requests come in: every legitimate request is answered; a stalled
  connection is closed (408) after the header deadline, a trickled body after the body deadline;
  a request without the token is answered 401 before its body is sent;
* work and memory are counted before anything is allocated: ``"n": 2000000`` in an 80-byte body
  is a 413 at once with no memory growth, a body declared longer than any valid ``/generate`` a
  413 before it is sent, and 8 large bodies at once stay within the budget of bodies parsed at once.
"""

from __future__ import annotations

import json
import os
import random
import resource
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REPO_ROOT
from weightsync.proc import free_port
from weightsync.sync.engine_client import EngineClient, EngineError

pytestmark = pytest.mark.timeout(300)

ENGINE_FD_LIMIT = 1024
TOKEN = secrets.token_urlsafe(24)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GREEDY = {"input_ids": [5, 17, 250, 3], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
A = 97
"""The byte tokenizer's id of ``a``."""


HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 3.0, 5.0


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (ENGINE_FD_LIMIT, ENGINE_FD_LIMIT))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The engine: its URL, process, log, and the greedy answer it gave at start."""
    tmp = tmp_path_factory.mktemp("hostile")
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    port = free_port()
    log = tmp / "engine.log"
    argv = [sys.executable, "-m", "weightsync.cli", "serve", "Qwen3-4B", "--scale", "tiny", "--load-format", "dummy",
            "--tp", "2", "--port", str(port), "--token-file", str(token_file), "--log-level", "warning",
            "--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S)]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True,
                                preexec_fn=_limit_fds)
    url = f"http://127.0.0.1:{port}"
    client = EngineClient(url, token=TOKEN, timeout_s=60)
    try:
        client.wait_healthy(timeout_s=180, proc_alive=lambda: proc.poll() is None)
    except EngineError as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{exc}\n{log.read_text()}")
    info = {"url": url, "proc": proc, "log": log, "client": client, "greedy": client.generate(GREEDY)["output_ids"]}
    yield info
    client.close()
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _post(url: str, path: str, body: Any, timeout_s: float = 60.0) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=timeout_s)


def assert_serving(engine: dict[str, Any]) -> None:
    """The engine answers /health 200 and the same greedy tokens as at its start."""
    health = httpx.get(f"{engine['url']}/health", timeout=10)
    assert health.status_code == 200, health.text
    assert health.json()["weights_dirty"] is False, health.json()
    assert engine["client"].generate(GREEDY)["output_ids"] == engine["greedy"]


# -- stop patterns ----------------------------------------------------------------------------------


def test_a_backtracking_stop_pattern_costs_linear_time(engine: dict[str, Any]) -> None:
    """``(a+)+b`` searched after every token of a run of ``a``: Python's ``re`` needs ~2**n steps
    at n tokens (the engine stopped answering at ~30); RE2 matches in linear time, so the request
    runs to its length while health checks and a pause/continue answer within seconds."""
    url = engine["url"]
    body = {"text": "x", "sampling_params": {"max_new_tokens": 400, "temperature": 0.0, "stop_regex": "(a+)+b",
                                             "logit_bias": {str(A): 1e6}}}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_post, url, "/generate", body, 240.0)
        answered = 0
        while not fut.done():
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            answered += 1
            if answered == 3:  # a pause that retracts the request, then continue: it goes on
                assert _post(url, "/pause_generation", {"mode": "retract"}, 10).status_code == 200
                assert _post(url, "/continue_generation", {}, 10).status_code == 200
            time.sleep(0.2)
        r = fut.result()
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == [A] * 400, out["output_ids"][:20]
    assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
    refused = _post(url, "/generate", {"text": "x", "sampling_params": {"stop_regex": r"(a)\1"}})
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "stop_regex" in message, message
    assert "backreferences" in message, message
    assert_serving(engine)


# -- slowloris -------------------------------------------------------------------------------------


HALF = b"POST /generate HTTP/1.1\r\nhost: engine\r\ncontent-type: application/json\r\n"
"""Half a request's headers (the blank line that ends them never comes)."""


class Slowloris:
    """Holds ``n`` connections that each sent half their headers, reopening each one the engine
    closes, until stopped."""

    def __init__(self, port: int, n: int) -> None:
        self.port = port
        self.n = n
        self.reopened = 0
        self.timeouts = 0
        """Connections the engine answered 408 before closing."""
        self._sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> None:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        s.sendall(HALF)
        s.setblocking(False)
        self._sel.register(s, selectors.EVENT_READ)

    def __enter__(self) -> Slowloris:
        for _ in range(self.n):
            self._open()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.2):
                s = key.fileobj
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                self.timeouts += data.startswith(b"HTTP/1.1 408")
                self._sel.unregister(s)
                s.close()
                if not self._stop.is_set():
                    self._open()
                    self.reopened += 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        self._sel.close()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_half_sent_requests_cannot_lock_out_legitimate_ones(engine: dict[str, Any]) -> None:
    """More stalled connections than the engine has descriptors, reopened as fast as they are
    closed: 8 legitimate requests, each on a connection of its own, are all answered (before, 0
    of 8 in 40 s); the engine's descriptors stay below its limit and return to where they were."""
    url, port, pid = engine["url"], int(engine["url"].rsplit(":", 1)[1]), engine["proc"].pid
    before = _fds(pid)
    with Slowloris(port, 1100) as attack:
        time.sleep(1.0)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: _post(url, "/generate", GREEDY, 40.0), range(8)))
        during = _fds(pid)
    assert [a.status_code for a in answers] == [200] * 8, [a.text[:200] for a in answers]
    assert all(a.json()["output_ids"] == engine["greedy"] for a in answers)
    assert attack.reopened > 0, "the engine kept every stalled connection"
    assert during < ENGINE_FD_LIMIT, during
    end = time.monotonic() + 30
    while _fds(pid) > before + 16 and time.monotonic() < end:
        time.sleep(0.5)
    assert _fds(pid) <= before + 16, (before, _fds(pid))
    assert_serving(engine)


def test_stalled_requests_are_closed_at_their_deadlines(engine: dict[str, Any]) -> None:
    port = int(engine["url"].rsplit(":", 1)[1])

    def closed_after(s: socket.socket) -> tuple[float, bytes]:
        t0 = time.monotonic()
        s.settimeout(60)
        data = s.recv(4096)
        while data and s.recv(4096):  # up to the close
            pass
        return time.monotonic() - t0, data

    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(HALF)
        took, data = closed_after(s)
    assert data.startswith(b"HTTP/1.1 408"), data
    assert HEADER_TIMEOUT_S <= took < HEADER_TIMEOUT_S + 5, took
    body = b'{"input_ids": [1, 2, 3]}'
    head = (f"POST /generate HTTP/1.1\r\nhost: engine\r\nauthorization: Bearer {TOKEN}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head + body[:5])  # a body that stops coming
        took, data = closed_after(s)
    assert BODY_TIMEOUT_S <= took < BODY_TIMEOUT_S + 5, (took, data)
    no_token = (b"POST /generate HTTP/1.1\r\nhost: engine\r\ncontent-type: application/json\r\n"
                b"content-length: 100000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(no_token)  # and no body: the token is checked first
        s.settimeout(HEADER_TIMEOUT_S)
        assert s.recv(4096).startswith(b"HTTP/1.1 401"), "the token is checked before the body is read"
    assert_serving(engine)


# -- work and memory budgets --------------------------------------------------------------------------


def _mb(pid: int, field: str) -> float:
    """``VmRSS`` / ``VmHWM`` (the peak since the last reset) of ``pid``, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _reset_peak(pid: int) -> float:
    """Reset the peak resident size of ``pid`` (Linux ``clear_refs`` 5); its resident size now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _mb(pid, "VmRSS")


def _read_answer(s: socket.socket) -> bytes:
    """One HTTP answer from ``s``: its headers and its ``content-length`` body (one ``recv`` may
    return the headers alone)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = s.recv(4096)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_work_and_memory_are_counted_before_allocating(engine: dict[str, Any]) -> None:
    url, port, pid = engine["url"], int(engine["url"].rsplit(":", 1)[1]), engine["proc"].pid
    base = _reset_peak(pid)
    t0 = time.monotonic()
    r = _post(url, "/generate", {"input_ids": [1], "sampling_params": {"n": 2_000_000, "max_new_tokens": 1}})
    took = time.monotonic() - t0
    assert r.status_code == 413, r.text
    assert "2000000 generations" in r.json()["error"]["message"]
    assert took < 10, f"{took:.1f} s (it took 134 s and +836 MB when the requests were built first)"
    head = (f"POST /generate HTTP/1.1\r\nhost: engine\r\nauthorization: Bearer {TOKEN}\r\n"
            f"content-type: application/json\r\ncontent-length: {50 << 20}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head)  # the body never comes: the declared length is refused on the headers
        s.settimeout(HEADER_TIMEOUT_S)
        answer = _read_answer(s)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"for /generate" in answer, answer
    grew = _mb(pid, "VmHWM") - base
    assert grew < 20, f"+{grew:.0f} MB"

    big = json.dumps({"input_ids": [random.randrange(300) for _ in range(4_000_000)],
                      "sampling_params": {"max_new_tokens": 1}}).encode()
    base = _reset_peak(pid)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: httpx.post(f"{url}/generate", content=big, timeout=120,
                                                     headers={**AUTH, "content-type": "application/json"}), range(8)))
    grew = _mb(pid, "VmHWM") - base
    assert [a.status_code for a in answers] == [400] * 8, [a.text[:200] for a in answers]
    assert "exceeds the context length" in answers[0].json()["error"]["message"]
    print(f"8 bodies of {len(big) / 1e6:.1f} MB at once: rank 0 peaked at +{grew:.0f} MB")
    assert grew < 8 * 64, f"+{grew:.0f} MB"
    assert_serving(engine)
