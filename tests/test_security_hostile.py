"""Contract: no request can take an engine down or hold it (one ``weightsync serve`` subprocess of
tiny Qwen3-4B, two CPU ranks, with a token, its descriptor limit lowered to 1024 as on a default
Linux account). After every hostile input below the engine still answers ``/health`` 200, serves a
greedy request with the same tokens as before, and publishes nothing it did not verify:

* a stop pattern that backtracks catastrophically in Python's ``re`` (``(a+)+b`` while
  ``logit_bias`` forces ``a``) costs linear time: health checks and a pause answer while it
  generates, and the request finishes; a backreference is a 400 naming the pattern.
"""

from __future__ import annotations

import os
import resource
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (ENGINE_FD_LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


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
            "--tp", "2", "--port", str(port), "--token-file", str(token_file), "--log-level", "warning"]
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
