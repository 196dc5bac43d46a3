"""Fuzz: hostile HTTP bodies against every route of a live engine; none may get a 5xx or take it down.

One ``weightsync serve`` engine (Qwen3-4B tiny, TP 2, shm, weights from a synthetic checkpoint, a
token) gets ``--requests`` requests, seeded: for a route drawn from every route the engine serves
(:data:`weightsync.engine.http_api.ROUTES`), a valid body of the route (the field names of
sglang's ``io_struct`` request classes, as the engine's ``io_struct`` declares them) mutated one
to three times -- a field dropped, a field (or a new one) set to a hostile value (huge or negative
integers, NaN, infinities, wrong types, long strings, deep nesting, lone surrogates), a nested
field mutated -- or, one POST in seven, replaced whole by bytes that are not a JSON object
(truncated, binary, 100,000 levels of nesting); a GET route's fields go in its query string; sent
with the route's own method nine times in ten, one in ten without the token or with another.
Control routes take effect: the fuzz pauses, opens sessions, resets weights, joins groups on ports
nobody listens on. After every request ``/health`` must answer 200.

Reported: answers by status; every 5xx with its route, body and message (the failures); 503s, each
of which must be one the engine documents for the state the fuzz left it in (dirty weights, a
request queued past its deadline behind a pause, sglang's bodyless ``/health_generate`` 503 while
paused or dirty, a stale or joining engine's ``/generate``, a ``/join_from_peer`` with ``wait``
whose every peer failed); and every
``--restore-every`` requests and at the end, the engine brought back the way a trainer would (an
open session aborted, pause, a session that loads the checkpoint and publishes, continue), after
which its greedy answer must be the one it gave at start. Exit status 0 when there is no 5xx but
the documented 503s, ``/health`` answered 200 after every request and every restore served the
first answer again::

    .venv/bin/python scripts/fuzz_engine.py --requests 500 --out logs/fuzz.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import secrets
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import quote

GREEDY = {"input_ids": [5, 17, 250, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
TEMPLATES: dict[str, dict[str, Any]] = {
    "/generate": {"text": "What is 12 + 30?", "input_ids": [1, 2, 3], "rid": "r", "stream": False,
                  "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                  "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
                                      "min_p": 0.0, "n": 1, "stop": ["x"], "stop_token_ids": [7],
                                      "stop_regex": "a+b", "ignore_eos": True, "repetition_penalty": 1.1,
                                      "frequency_penalty": 0.1, "presence_penalty": 0.1,
                                      "sampling_seed": 3, "logit_bias": {"97": 1.0}}},
    "/pause_generation": {"mode": "abort"},
    "/continue_generation": {"torch_empty_cache": True},
    "/flush_cache": {"timeout_s": 1.0},
    "/abort_request": {"rid": "r", "abort_all": False},
    "/begin_weight_update": {"selector": "all", "pause_free": True, "flip": "swap"},
    "/update_weight_version": {"new_version": "v9", "abort_all_requests": False},
    "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1,
                                   "world_size": 2, "group_name": "g", "backend": "gloo"},
    "/update_weights_from_distributed": {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                                         "group_name": "g", "weight_version": "v9"},
    "/update_weights_from_tensor": {"serialized_named_tensors": ["AAAA"], "load_format": "direct"},
    "/destroy_weights_update_group": {"group_name": "g"},
    "/update_weights_from_disk": {"model_path": "/nonexistent", "weight_version": "v9"},
    "/weights_checker": {"action": "checksum", "seed": 1, "skip_tensor_list": ["norm"]},
    "/mark_stale": {"published_version": "v9"},
    "/join_from_peer": {"peers": ["http://127.0.0.1:9"], "wait": False},
    "/donate_weights": {"model_key": "0" * 32, "joiner": {"tp": 1, "dp": 1, "ep": 1}, "seed": 1, "deadline_s": 1.0,
                        "ranks": [{"session_id": "s", "weights": {"model.norm.weight": [0, 64, 4]},
                                   "descriptor": {"kind": "shm", "name": "x"}}]},
    "/release_memory_occupation": {"tags": ["kv_cache", "weights"]},
    "/resume_memory_occupation": {"tags": ["weights"]},
    "/parallelism_config": {"rank": 0},
    "/get_remote_instance_transfer_engine_info": {"rank": 0},
    "/remote_instance_transfer_engine_info": {"rank": 1},
}
"""A valid body per route (routes not listed take an empty object)."""
GET_ROUTES = ("/health", "/health_generate", "/server_info", "/get_server_info", "/model_info", "/get_model_info",
              "/get_weight_version", "/parallelism_config", "/remote_instance_transfer_engine_info",
              "/get_remote_instance_transfer_engine_info")
"""Routes the engine answers on GET only (their fields are query parameters)."""
HOSTILE: list[Any] = [None, True, -1, 0, 2**64, -(2**63) - 1, 10**400, 1e308, float("nan"), float("inf"),
                      -float("inf"), "", "x" * 100_000, "\ud800", [], [[]], {}, [2**63] * 1000, {"a": {"b": {}}},
                      list(range(5000)), ["a"] * 64, "(a+)+b", 1.5, "nccl", "snapshot", "reset_tensors"]
RAW: list[bytes] = [b"", b"{", b"[1, 2", b"\x00\xff" * 64, b"null", b"[]", b"42", b'"text"', b"[" * 100_000,
                    b'{"a": ' * 50_000, json.dumps({"sampling_params": GREEDY}).encode()[:-3], b"NaN"]
DOCUMENTED_503 = ("dirty", "not answered within", "/health_generate while", "join failed:", "stale:", "joining:")
"""Words of the 503s the engine documents (docs/engine.md, "Endpoints" and "Limits")."""


def _hostile(rng: random.Random) -> Any:
    """A copy of one hostile value (a body may hold it and be mutated again)."""
    return copy.deepcopy(rng.choice(HOSTILE))


def mutate(body: Any, rng: random.Random, depth: int = 0) -> Any:
    """``body`` with one mutation (module docstring)."""
    if not isinstance(body, dict) or not body or rng.random() < 0.1:
        return _hostile(rng)
    key = rng.choice(sorted(body))
    op = rng.random()
    if op < 0.2:
        body.pop(key)
    elif op < 0.35:
        body[rng.choice(["extra", "n", "input_ids", "sampling_params", key + "_"])] = _hostile(rng)
    elif op < 0.55 and isinstance(body[key], (dict, list)) and depth < 3:
        if isinstance(body[key], dict):
            body[key] = mutate(body[key], rng, depth + 1)
        elif body[key]:
            body[key][rng.randrange(len(body[key]))] = _hostile(rng)
    else:
        body[key] = _hostile(rng)
    return body


def request(rng: random.Random, routes: tuple[str, ...]) -> tuple[str, str, bytes, str]:
    """(method, route, raw body, query) of one fuzzed request: the route's own method nine times in
    ten (a GET route's fields go in the query), the other one else."""
    from weightsync.engine.http_api import ROUTES

    route = rng.choice(routes or ROUTES)
    method = "GET" if route in GET_ROUTES else "POST"
    if rng.random() < 0.1:
        method = "POST" if method == "GET" else "GET"
    body = copy.deepcopy(TEMPLATES.get(route, {}))
    for _ in range(rng.randint(1, 3)):
        body = mutate(body, rng)
    if route in GET_ROUTES:
        items = body.items() if isinstance(body, dict) else [("x", body)]
        query = "&".join(f"{quote(str(k).encode('utf-8', 'surrogatepass'))}="
                         f"{quote(str(v)[:2000].encode('utf-8', 'surrogatepass'))}" for k, v in items)
        return method, route, b"", query
    raw = rng.choice(RAW) if rng.random() < 0.15 else json.dumps(body).encode()
    return method, route, raw, ""


def restore(client: Any, url: str, token: str, ckpt: str, version: str) -> None:
    """Bring the engine back as a trainer would: let a join end, abort an open session, pause, load
    the checkpoint in a session of its own and publish it (a stale engine too), continue."""
    import httpx

    from weightsync.engine.http_api import SESSION_HEADER

    end = time.monotonic() + 120
    while client.engine_state()["state"] == "joining" and time.monotonic() < end:  # a join the fuzz started
        time.sleep(0.2)
    state = client.engine_state()
    if state["state"] in ("updating", "ended", "shadow_updating", "shadow_ended"):
        client.abort_weight_update()
    client.pause_generation()
    client.begin_weight_update()
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": ckpt}, timeout=120,
                   headers={"Authorization": f"Bearer {token}", SESSION_HEADER: client.session_id or ""})
    r.raise_for_status()
    client.end_weight_update()
    client.update_weight_version(version)
    client.continue_generation()


def fuzz(args: argparse.Namespace, url: str, token: str, ckpt: str) -> dict[str, Any]:
    """Send the requests (module docstring); the counts and the failures."""
    import httpx

    from weightsync.sync.engine_client import EngineClient

    rng = random.Random(args.seed)
    client = EngineClient(url, token=token, timeout_s=120)
    first = client.generate(GREEDY)["output_ids"]
    statuses: Counter[int] = Counter()
    failures: list[dict[str, Any]] = []
    refusals: Counter[str] = Counter()
    restores = 0
    with httpx.Client(timeout=args.request_timeout_s + 60) as http:
        for i in range(1, args.requests + 1):
            method, route, raw, query = request(rng, tuple(args.route))
            auth = rng.choice([f"Bearer {token}"] * 18 + ["", "Bearer not-the-token-0123456789"])  # 1 in 10
            try:
                r = http.request(method, f"{url}{route}?{query}" if query else url + route, content=raw, headers={
                    "Authorization": auth, "Content-Type": "application/json"})
                status, text = r.status_code, r.text[:300]
            except httpx.HTTPError as exc:
                status, text = -1, f"{type(exc).__name__}: {exc}"
            statuses[status] += 1
            if status == 503 and route == "/health_generate" and not text:  # sglang's: no body, the log says why
                state = client.engine_state()
                if state["state"] != "serving" or state["weights_dirty"]:
                    text = f"/health_generate while {state['state']}, dirty {state['weights_dirty']}"
            if status == 503 and any(w in text for w in DOCUMENTED_503):
                refusals[text[:120]] += 1
            elif status >= 500 or status < 0:
                failures.append({"i": i, "method": method, "route": route, "body": raw[:300].decode("latin-1"),
                                 "query": query[:300], "status": status, "answer": text})
            health, _ = client.health(timeout_s=30)
            if health != 200:
                failures.append({"i": i, "route": route, "body": raw[:300].decode("latin-1"), "health": health})
                break
            if i % args.restore_every == 0 or i == args.requests:
                restore(client, url, token, ckpt, f"restored-{i}")
                restores += 1
                again = client.generate(GREEDY)["output_ids"]
                if again != first:
                    failures.append({"i": i, "restore": "the greedy answer changed", "got": again, "want": first})
    client.close()
    return {"requests": sum(statuses.values()), "by_status": {str(k): v for k, v in sorted(statuses.items())},
            "documented_503": dict(refusals), "restores": restores, "failures": failures,
            "passed": not failures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--route", action="append", default=[], help="only these routes (repeatable; default: all)")
    p.add_argument("--restore-every", type=int, default=25)
    p.add_argument("--request-timeout-s", type=float, default=10.0,
                   help="the engine's --request-timeout-s (a /generate queued behind a pause waits this long)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--log", type=Path, default=Path("logs/fuzz_engine.log"))
    args = p.parse_args(argv)
    from weightsync.launch.procs import EngineProc, serve_argv
    from weightsync.models import get_model
    from weightsync.models.checkpoint import hf_config_dict, synthetic_hf_tensors, write_hf_checkpoint
    from weightsync.proc import free_port
    from weightsync.transport import TransportConfig

    args.log.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="fuzz-ckpt-") as ckpt:
        spec = get_model("Qwen3-4B", "tiny")
        write_hf_checkpoint(Path(ckpt), synthetic_hf_tensors(spec, 1), hf_config_dict(spec))
        port = free_port()
        argv_ = serve_argv(model="Qwen3-4B", scale="tiny", tp=2, ep=1, dp=1, device="cpu", port=port, checkpoint=ckpt,
                           transport=TransportConfig(kind="shm"),
                           extra=["--die-with-parent", "--request-timeout-s", str(args.request_timeout_s),
                                  "--group-timeout-s", "5"])
        proc = EngineProc(0, argv_, f"http://127.0.0.1:{port}", args.log, dict(os.environ), token=token)
        t0 = time.monotonic()
        try:
            proc.client.wait_healthy(timeout_s=180, proc_alive=proc.alive)
            result = fuzz(args, proc.url, token, ckpt)
            result["engine_alive_at_end"] = proc.alive()
        finally:
            proc.stop()
    result.update({"seconds": time.monotonic() - t0, "seed": args.seed})
    result["passed"] = result["passed"] and result["engine_alive_at_end"]
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
