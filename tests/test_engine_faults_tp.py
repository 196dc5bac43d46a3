"""Contract: a failure inside one rank's generation step ends the request with an error on every
rank instead of wedging the engine's collectives, and the engine keeps serving (two ranks, gloo,
tiny Qwen3-4B; rank 0 serves the HTTP app in process, rank 1 runs the worker loop):

* the bodies that wedged it before -- ``top_p: 1e-300`` (nothing survives the float32 nucleus
  test, so the probabilities are NaN and sampling raised on rank 0 while rank 1 waited in the
  token broadcast) and a denormal ``repetition_penalty`` -- are 400s naming the field; a denormal
  ``temperature`` is greedy;
* a step that raises on rank 0 (the sampler is made to fail once) answers that request with a
  500 naming the cause, without a traceback, and the next request is served; ``/health`` stays
  200;
* non-finite logits (NaN in rank 1's copy of a weight) end the request with a 500 naming them;
  restored weights are served again;
* ``sampling_seed`` beyond what a 64-bit generator takes is a 400 naming the field (such a seed
  faulted every rank), the bounds themselves sample reproducibly, and seeding that fails on rank 0
  ends that request only.

Both ranks run in one spawn (``_rank_main``); rank 0 saves what it saw, the assertions run here.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.engine_helpers import one_torch_thread, start_sessions, tiny  # noqa: F401 -- autouse fixture

MODEL = "Qwen3-4B"
BODY = {"input_ids": [5, 17, 250, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}


def _rank_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from fastapi.testclient import TestClient

    import weightsync.engine.engine as engine_module
    from weightsync.engine.control import Driver, Op, worker_loop
    from weightsync.engine.engine import Engine
    from weightsync.engine.http_api import ServerContext, build_app
    from weightsync.engine.tokenizer import ByteTokenizer
    from weightsync.engine.tp import EngineGroups
    from weightsync.models.parallel import RolloutParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    par = RolloutParallel(tp=2)
    spec = tiny(MODEL)
    engine = Engine.build(spec, EngineGroups.build(par, rank), device=torch.device("cpu"))
    engine.load_dummy(seed=3)
    if rank != 0:
        worker_loop(engine)  # rank 1 also corrupts and restores its own shard when told (below)
        engine.close()
        dist.destroy_process_group()
        return
    driver = Driver(engine)
    sessions = start_sessions(driver, weight_version="1")
    sched = sessions.scheduler
    tokenizer = ByteTokenizer(spec.vocab_size)
    engine.decode = tokenizer.decode
    seen: dict[str, Any] = {}
    app = build_app(ServerContext(sessions=sessions, tokenizer=tokenizer, par=par, server_info={}))
    with TestClient(app) as c:

        def gen(**sampling: Any) -> tuple[int, Any]:
            r = c.post("/generate", json={**BODY, "sampling_params": {**BODY["sampling_params"], **sampling}})
            return r.status_code, r.json()

        seen["greedy"] = gen()
        seen["bad_top_p"] = gen(temperature=1.0, top_p=1e-300)
        seen["bad_penalty"] = gen(repetition_penalty=1e-320)
        seen["denormal_temperature"] = gen(temperature=1e-320)
        real = engine_module.sample_tokens
        calls = {"n": 0}

        def failing(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 2:  # the second step of the batch
                raise RuntimeError("injected sampler failure")
            return real(*args, **kwargs)

        engine_module.sample_tokens = failing
        seen["step_failure"] = gen()
        engine_module.sample_tokens = real
        seen["after_step_failure"] = gen()
        seen["health"] = c.get("/health").status_code
        _seeds(seen, gen, engine)
        seen["health_after_seeds"] = c.get("/health").status_code
        # NaN in rank 1's copy of the final norm (rank 0 sees it only in the gathered logits);
        # injected behind the scheduler's back, on its driver thread
        assert c.post("/pause_generation", json={}).status_code == 200
        assert c.post("/weights_checker", json={"action": "snapshot"}).status_code == 200
        sched.call(lambda: _nan_on_rank1(driver, "model.norm.weight"))
        c.post("/continue_generation", json={})
        seen["nan_logits"] = gen()
        c.post("/pause_generation", json={})
        sched.call(lambda: driver.run(Op.LOAD_DUMMY, seed=3))
        seen["restored_equal"] = c.post("/weights_checker", json={"action": "compare"}).json()
        c.post("/continue_generation", json={})
        seen["restored"] = gen()
    sched.stop()
    torch.save(seen, out)
    engine.close()
    dist.destroy_process_group()


def _seeds(seen: dict[str, Any], gen: Any, engine: Any) -> None:
    """``sampling_seed`` at and beyond a 64-bit generator's bounds, and seeding that fails on rank 0."""
    for seed in (2**64, -(2**63) - 1, 2**200):
        seen[f"seed {seed}"] = gen(temperature=1.0, sampling_seed=seed)
    for seed in (2**64 - 1, -(2**63)):
        seen[f"seed {seed}"] = [gen(temperature=1.0, sampling_seed=seed) for _ in range(2)]
    real = engine._generators

    def failing(reqs: Any) -> Any:
        raise OverflowError("injected seeding failure")

    engine._generators = failing
    seen["seeding_failure"] = gen(temperature=1.0, sampling_seed=1)
    engine._generators = real
    seen["after_seeding_failure"] = gen()


def _nan_on_rank1(driver: Any, name: str) -> None:
    """A direct update in which rank 1 gets a NaN shard of ``name`` and rank 0 its own back."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    from weightsync.engine.control import Op

    def entry(t: torch.Tensor) -> str:
        buf = io.BytesIO()
        ForkingPickler(buf).dump([(name, t)])
        return base64.b64encode(buf.getvalue()).decode()

    mine = driver.engine.store[name].clone()
    driver.run(Op.UPDATE_FROM_TENSOR, entries=[entry(mine), entry(torch.full_like(mine, float("nan")))],
               load_format="direct")


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path_factory.mktemp("faults_tp") / "seen.pt"
    mp.start_processes(_rank_main, args=(port, str(out)), nprocs=2, start_method="spawn")
    return torch.load(Path(out), weights_only=False)


@pytest.mark.timeout(300)
def test_sampling_values_that_wedged_two_ranks_are_refused(seen: dict[str, Any]) -> None:
    status, body = seen["greedy"]
    assert status == 200
    for key, field in (("bad_top_p", "top_p"), ("bad_penalty", "repetition_penalty")):
        status, err = seen[key]
        assert status == 400, (key, err)
        assert field in err["error"]["message"]
    status, denormal = seen["denormal_temperature"]
    assert status == 200
    assert denormal["output_ids"] == body["output_ids"], "a denormal temperature is greedy"


@pytest.mark.timeout(300)
def test_a_failing_step_ends_the_request_on_every_rank_and_the_engine_serves_on(seen: dict[str, Any]) -> None:
    status, err = seen["step_failure"]
    assert status == 500
    message = err["error"]["message"]
    assert "injected sampler failure" in message
    assert "every rank" in message
    assert "Traceback" not in message
    status, after = seen["after_step_failure"]
    assert status == 200
    assert after["output_ids"] == seen["greedy"][1]["output_ids"]
    assert seen["health"] == 200


@pytest.mark.timeout(300)
def test_non_finite_logits_end_the_request_not_the_engine(seen: dict[str, Any]) -> None:
    status, err = seen["nan_logits"]
    assert status == 500, err
    assert "logits are not finite" in err["error"]["message"]
    status, restored = seen["restored"]
    assert status == 200
    assert restored["output_ids"] == seen["greedy"][1]["output_ids"]
    assert seen["restored_equal"]["success"], seen["restored_equal"]


@pytest.mark.timeout(300)
def test_no_sampling_seed_can_fault_the_engine(seen: dict[str, Any]) -> None:
    """Seeds beyond a 64-bit generator are 400s naming the field (they faulted both ranks: every
    request refused until a restart); the bounds themselves sample, reproducibly; seeding that
    fails on rank 0 ends that request only (it runs inside the step's error handling)."""
    for seed in (2**64, -(2**63) - 1, 2**200):
        status, err = seen[f"seed {seed}"]
        assert status == 400, (seed, err)
        assert "sampling_seed" in err["message"], err
    for seed in (2**64 - 1, -(2**63)):
        (s1, a), (s2, b) = seen[f"seed {seed}"]
        assert (s1, s2) == (200, 200), (seed, a, b)
        assert len(a["output_ids"]) == 4, (seed, a)
        assert a["output_ids"] == b["output_ids"], (seed, a, b)
    status, err = seen["seeding_failure"]
    assert status == 500, err
    assert "injected seeding failure" in err["error"]["message"]
    assert "every rank" in err["error"]["message"]
    status, after = seen["after_seeding_failure"]
    assert status == 200
    assert after["output_ids"] == seen["greedy"][1]["output_ids"]
    assert seen["health_after_seeds"] == 200
