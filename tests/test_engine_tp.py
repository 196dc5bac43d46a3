"""Contract: a two-rank engine (two processes, gloo) computes what the single-process reference
computes, for every family at TP 2, every MoE family at EP 2, and with DP-attention for the
MLA models (GLM-5 with EP and replicated dense MLPs, Kimi-K2 with a DP lm_head, and with both
plus EP as its profile runs them); and rank 0
drives rank 1 through the control protocol: the weight checker, the broadcast update path
(from a trainer thread in this process that builds its group as miles does) and error propagation.

All multi-rank work runs in one spawn of two processes (``_rank_main``), to keep the test fast;
rank 0 saves what it saw, the assertions run here.
"""

from __future__ import annotations

import datetime
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.engine_helpers import (
    FAMILY_MODELS,
    LOGIT_ATOL,
    LOGIT_RTOL,
    LOGPROB_ATOL,
    MOE_MODELS,
    PROMPTS,
    one_torch_thread,  # noqa: F401 -- autouse fixture
    tiny,
    write_tiny_checkpoint,
)
from tests.sglang_fake import join_group_sglang_way
from weightsync.engine.reference import Reference
from weightsync.layout.sglang import engine_layout
from weightsync.models.checkpoint import HFCheckpoint
from weightsync.models.parallel import RolloutParallel

CONFIGS: list[tuple[str, RolloutParallel]] = (
    [(m, RolloutParallel(tp=2)) for m in FAMILY_MODELS]
    + [(m, RolloutParallel(tp=2, ep=2)) for m in MOE_MODELS]
    + [
        ("GLM-5", RolloutParallel(tp=2, dp=2, ep=2, moe_dense_tp=1)),
        ("Kimi-K2", RolloutParallel(tp=2, dp=2, dp_lm_head=True)),
        # The reference profiles' engine flags together (serve --moe-dense-tp-size 1 --enable-dp-lm-head).
        ("Kimi-K2", RolloutParallel(tp=2, dp=2, ep=2, moe_dense_tp=1, dp_lm_head=True)),
        ("GLM-5", RolloutParallel(tp=2, dp=2, ep=2, moe_dense_tp=1, dp_lm_head=True)),
    ]
)
DRIVER_MODEL, DRIVER_PAR = "Kimi-K2", RolloutParallel(tp=2, ep=2)
"""The engine rank 0 drives through the control protocol (fp8 weights, derived w_kc/w_vc, EP)."""
MAX_NEW = 5


def _cfg_id(name: str, par: RolloutParallel) -> str:
    extra = "".join(f"-{k}{getattr(par, k)}" for k in ("dp", "ep") if getattr(par, k) > 1)
    flags = ("-densetp1" if par.moe_dense_tp == 1 else "") + ("-dplmhead" if par.dp_lm_head else "")
    return f"{name}-tp{par.tp}{extra}{flags}"


def _rank_main(rank: int, port: int, trainer_port: int, ckpts: dict[str, str], out: str) -> None:
    import torch.distributed as dist

    from weightsync.engine.control import Driver, Op, RankError, worker_loop
    from weightsync.engine.engine import Engine, GenRequest
    from weightsync.engine.sampling import SamplingParams
    from weightsync.engine.tp import EngineGroups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    seen: dict[str, Any] = {}
    greedy = [
        GenRequest(
            rid=str(k),
            input_ids=tuple(p),
            sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0),
            return_logprob=True,
        )
        for k, p in enumerate(PROMPTS)
    ]
    for name, par in CONFIGS:
        engine = Engine.build(tiny(name), EngineGroups.build(par, rank), device=torch.device("cpu"))
        engine.load_checkpoint(ckpts[name])
        logits = engine.prompt_logits([list(p) for p in PROMPTS])
        gen = engine.generate(greedy)
        seen[_cfg_id(name, par)] = {"logits": logits, "gen": [(g.output_ids, g.output_logprobs) for g in gen]}
        engine.close()
    engine = Engine.build(tiny(DRIVER_MODEL), EngineGroups.build(DRIVER_PAR, rank), device=torch.device("cpu"))
    engine.load_checkpoint(ckpts[DRIVER_MODEL])
    if rank == 0:
        seen["driver"] = _drive(Driver(engine), trainer_port, ckpts[DRIVER_MODEL], Op, RankError)
        torch.save(seen, out)
    else:
        worker_loop(engine)
    engine.close()
    dist.destroy_process_group()


def _drive(driver: Any, trainer_port: int, ckpt: str, op: Any, rank_error: type) -> dict[str, Any]:
    """Rank 0: checker cycle through a broadcast update, then a bad command."""
    log: dict[str, Any] = {}
    driver.run(op.CHECK_WEIGHTS, action="snapshot")
    driver.run(op.CHECK_WEIGHTS, action="reset_tensors", seed=3)
    log["after_reset"] = driver.run(op.CHECK_WEIGHTS, action="compare")
    driver.run(
        op.INIT_GROUP,
        master_address="127.0.0.1",
        master_port=trainer_port,
        rank_offset=1,
        world_size=3,
        group_name="wu",
        backend="gloo",
    )
    with HFCheckpoint(ckpt) as c:
        metas = [(n, *c.meta(n)) for n in c.names()]
    log["num_sent"] = len(metas)
    log["update"] = driver.run(
        op.UPDATE_FROM_DISTRIBUTED,
        names=[m[0] for m in metas],
        dtypes=[m[2] for m in metas],
        shapes=[list(m[1]) for m in metas],
        group_name="wu",
    )
    driver.run(op.POST_LOAD)
    log["after_update"] = driver.run(op.CHECK_WEIGHTS, action="compare")
    log["checksums"] = driver.run(op.CHECK_WEIGHTS, action="checksum")
    driver.run(op.DESTROY_GROUP, group_name="wu")
    try:
        driver.run(op.LOAD_CHECKPOINT, path="/nonexistent/checkpoint")
    except rank_error as exc:
        log["bad_load"] = (exc.user_error, str(exc), [r.rank for r in exc.failed])
    driver.shutdown()
    return log


def _trainer(port: int, ckpt: str) -> None:
    """Group rank 0 of the broadcast path, as miles' trainer is (its group built by torch's
    rendezvous and group helper, miles ``utils/distributed_utils.py`` ``init_process_group``; one
    asynchronous broadcast per tensor, then a wait on all, ``update_weight_from_distributed/
    broadcast.py`` ``update_weights_from_distributed``): every checkpoint tensor, in checkpoint
    order, to the engine's ranks 1 and 2 (``rank_offset`` 1 + each rank's TP rank)."""
    pg = join_group_sglang_way(master_address="127.0.0.1", master_port=port, rank=0, world_size=3, group_name="wu",
                               backend="gloo", timeout=datetime.timedelta(seconds=120))
    with HFCheckpoint(ckpt) as c:
        handles = [torch.distributed.broadcast(c.get(name).contiguous(), 0, group=pg, async_op=True)
                   for name in c.names()]
    for h in handles:
        h.wait()
    torch.distributed.destroy_process_group(pg)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Reference]]:
    root = tmp_path_factory.mktemp("tp")
    ckpts, refs = {}, {}
    for name in FAMILY_MODELS:
        tensors = write_tiny_checkpoint(name, root / name)
        ckpts[name] = str(root / name)
        refs[name] = Reference(tiny(name), tensors)
    ports = []
    for _ in range(2):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    out = root / "seen.pt"
    trainer = threading.Thread(target=_trainer, args=(ports[1], ckpts[DRIVER_MODEL]), daemon=True)
    trainer.start()
    mp.start_processes(_rank_main, args=(ports[0], ports[1], ckpts, str(out)), nprocs=2, start_method="spawn")
    trainer.join(timeout=30)
    return torch.load(Path(out), weights_only=False), refs


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "par"), CONFIGS, ids=[_cfg_id(n, p) for n, p in CONFIGS])
def test_two_rank_engine_matches_reference(
    two_ranks: tuple[dict[str, Any], dict[str, Reference]], name: str, par: RolloutParallel
) -> None:
    seen, refs = two_ranks
    got = seen[_cfg_id(name, par)]
    ref = refs[name]
    for prompt, logits in zip(PROMPTS, got["logits"]):
        torch.testing.assert_close(logits, ref.logits(list(prompt)), atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
    for prompt, (ids, logprobs) in zip(PROMPTS, got["gen"]):
        logp = torch.log_softmax(ref.logits(list(prompt) + ids), dim=-1)[len(prompt) - 1 : -1]
        assert ids == logp.argmax(dim=-1).tolist()
        torch.testing.assert_close(
            torch.tensor(logprobs), logp.gather(1, torch.tensor(ids)[:, None])[:, 0], atol=LOGPROB_ATOL, rtol=0
        )


@pytest.mark.timeout(600)
def test_rank0_drives_checker_and_broadcast_update(two_ranks: tuple[dict[str, Any], dict[str, Reference]]) -> None:
    """reset_tensors makes every written tensor differ on both ranks; a full broadcast of the
    checkpoint (bf16 weights quantized on arrival, scales, derived w_kc/w_vc recomputed) restores
    every byte; checksums come from both ranks (every parameter but the constant fp8 k/v scales); a
    bad checkpoint path fails on every rank as a user error."""
    log = two_ranks[0]["driver"]
    for rank_result in log["after_reset"]:
        assert not rank_result["equal"]
        names = {m["name"] for m in rank_result["mismatches"]}
        assert any(n.endswith(".w_kc") for n in names)
        assert any(n.endswith("w13_weight") for n in names)
    assert all(r["equal"] and r["mismatches"] == [] for r in log["after_update"]), log["after_update"]
    assert [u["num_tensors"] for u in log["update"]] == [log["num_sent"]] * 2
    # sglang's listing: an fp8 weight is hashed with its scale (not listed), derived tensors are not
    # parameters, the constant fp8 k/v scales are skipped (sglang marks them _skip_weight_check)
    listed = [[t.name for t in engine_layout(tiny(DRIVER_MODEL), DRIVER_PAR, r)
               if not t.derived and t.constant is None and not t.name.endswith("_scale_inv")] for r in range(2)]
    assert [sorted(c["checksums"]) for c in log["checksums"]] == [sorted(n) for n in listed]
    user_error, message, failed = log["bad_load"]
    assert user_error
    assert failed == [0, 1]
    assert "/nonexistent/checkpoint" in message
