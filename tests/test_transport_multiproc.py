"""Two-process byte-exactness tests of every CPU transport (shm, mooncake tcp, dist over gloo).

Contract: a receiver process allocates its destination in ``new_arena``, fills it with a
sentinel, registers it and publishes its descriptor (JSON, through a queue); a sender process
registers its source, connects by that descriptor and writes a list of scattered runs (a strided
column box, random runs, adjacent runs that coalesce, one large run); after ``wait`` every
written byte equals its source byte and every other destination byte still holds the sentinel.
The same prepared batch written a second time changes nothing (replay). No shm segment is left
behind. For dist (two-sided) a write whose receive is never posted times out at its deadline.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any

import numpy as np
import pytest
import torch

from weightsync.proc import free_port
from weightsync.transport import PeerDescriptor, deadline_after, make_transport
from weightsync.transport.mooncake import mooncake_available
from weightsync.transport.shm import list_segments

ARENA_BYTES = 1 << 20
SRC_BYTES = 1 << 19
SENTINEL = 0xAB
SEED = 7
TIMEOUT_S = 60.0

MOONCAKE_SKIP = pytest.mark.skipif(
    not mooncake_available(),
    reason="mooncake.engine is not importable: pip install mooncake-transfer-engine-non-cuda "
    "(needs the Debian packages libibverbs1 librdmacm1 ibverbs-providers)",
)


def source_bytes() -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, 256, SRC_BYTES, dtype=np.uint8)


def scattered_runs() -> list[tuple[int, int, int]]:
    """(src offset, dst offset, nbytes) runs with disjoint destinations."""
    rng = np.random.default_rng(SEED + 1)
    runs = [(1000 + 128 * i, 4096 + 96 * i, 48) for i in range(64)]  # column box: one 2-D block
    runs += [(50_000 + 16 * i, 20_000 + 16 * i, 16) for i in range(32)]  # adjacent: coalesce to one
    runs.append((100_000, 300_000, 200_000))  # one large run
    slots = rng.choice(np.arange(30_000, 290_000, 4096), size=40, replace=False)
    for d in slots.tolist():
        n = int(rng.integers(1, 4000))
        runs.append((int(rng.integers(0, SRC_BYTES - n)), d + int(rng.integers(0, 4096 - n)), n))
    return runs


def expected_destination() -> np.ndarray:
    src, out = source_bytes(), np.full(ARENA_BYTES, SENTINEL, dtype=np.uint8)
    for s, d, n in scattered_runs():
        out[d : d + n] = src[s : s + n]
    return out


def _side(kind: str, rank: int, port: int) -> Any:
    if kind == "dist":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        return make_transport("dist", group=dist.group.WORLD)
    return make_transport(kind)


def _worker(role: str, tasks: Any, inbox: Any, outbox: Any, results: Any) -> None:
    """A long-lived child (spawning costs seconds of torch import): run tasks until None.

    Each task is ``(kind, port)``; the result is ("ok", payload) or ("error", traceback), so the
    parent sees a child's failure, whatever it is. ``inbox``/``outbox`` connect it to its peer.
    """
    for kind, port in iter(tasks.get, None):
        try:
            fn = _receive if role == "receiver" else _send
            results.put((role, "ok", fn(kind, port, inbox, outbox)))
        except BaseException:
            results.put((role, "error", traceback.format_exc()))
        if kind == "dist":
            import torch.distributed as dist

            dist.destroy_process_group()


def _receive(kind: str, port: int, inbox: Any, outbox: Any) -> dict[str, Any]:
    with _side(kind, 1, port) as t:
        arena = t.new_arena(ARENA_BYTES)
        dest = arena.empty((ARENA_BYTES,), torch.uint8)
        dest.fill_(SENTINEL)
        t.register("params", arena.base, arena.nbytes)
        outbox.put(t.descriptor().to_json())
        sender = PeerDescriptor.from_json(inbox.get(timeout=TIMEOUT_S))
        if not t.one_sided:
            peer = t.connect(sender)
            sbase = sender.region("src").addr
            runs = [(sbase + s, arena.base + d, n) for s, d, n in scattered_runs()]
            for _ in range(2):  # the sender writes twice; its third write finds no receive
                t.wait(t.post_recv(peer, runs), deadline_after(TIMEOUT_S))
        assert inbox.get(timeout=TIMEOUT_S) == "done"
        got = dest.numpy().copy()
    want = expected_destination()
    return {"equal": bool(np.array_equal(got, want)), "mismatches": int((got != want).sum())}


def _send(kind: str, port: int, inbox: Any, outbox: Any) -> dict[str, Any]:
    src = torch.from_numpy(source_bytes())
    timed_out = False
    with _side(kind, 0, port) as t:
        t.register_tensor("src", src)
        desc = PeerDescriptor.from_json(inbox.get(timeout=TIMEOUT_S))
        outbox.put(t.descriptor().to_json())
        peer = t.connect(desc)
        base = desc.region("params").addr
        batch = t.prepare(peer, [(src.data_ptr() + s, base + d, n) for s, d, n in scattered_runs()])
        for _ in range(2):
            t.wait(t.write(peer, batch), deadline_after(TIMEOUT_S))
        if not t.one_sided:  # no receive is posted for this one: the deadline must expire
            try:
                t.wait(t.write(peer, batch), deadline_after(0.3))
            except TimeoutError:
                timed_out = True
        outbox.put("done")
        num_runs, nbytes = batch.num_runs, batch.nbytes
    return {"num_runs": num_runs, "nbytes": nbytes, "timed_out": timed_out}


class WorkerPair:
    """Two spawned worker processes, a receiver and a sender, reused across tests."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.tasks = {role: ctx.Queue() for role in ("receiver", "sender")}
        self.results = ctx.Queue()
        to_sender, to_receiver = ctx.Queue(), ctx.Queue()
        self.links = {"receiver": (to_receiver, to_sender), "sender": (to_sender, to_receiver)}  # kept alive
        self.procs = [
            ctx.Process(target=_worker, args=(role, self.tasks[role], *self.links[role], self.results), daemon=True)
            for role in ("receiver", "sender")
        ]
        for p in self.procs:
            p.start()

    def segments(self) -> list[str]:
        """shm segments owned by the workers that still exist (each task must unlink its own)."""
        pids = {str(p.pid) for p in self.procs}
        return [name for name in list_segments() if name.split("-")[1] in pids]

    def run(self, kind: str) -> dict[str, dict[str, Any]]:
        port = free_port()
        for q in self.tasks.values():
            q.put((kind, port))
        out: dict[str, dict[str, Any]] = {}
        for _ in range(2):
            role, status, payload = self.results.get(timeout=TIMEOUT_S * 2)
            if status != "ok":
                pytest.fail(f"{kind} {role} failed:\n{payload}")
            out[role] = payload
        return out

    def close(self) -> None:
        for q in self.tasks.values():
            q.put(None)
        for p in self.procs:
            p.join(timeout=TIMEOUT_S)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def workers():
    pair = WorkerPair()
    try:
        yield pair
    finally:
        pair.close()


@pytest.mark.parametrize(
    "kind",
    [pytest.param("shm", id="shm"), pytest.param("mooncake", id="mooncake-tcp", marks=MOONCAKE_SKIP), "dist"],
)
def test_two_process_write_is_byte_exact(kind: str, workers: WorkerPair) -> None:
    out = workers.run(kind)
    assert out["receiver"]["equal"], f"{out['receiver']['mismatches']} destination bytes differ"
    runs = scattered_runs()
    assert out["sender"]["nbytes"] == sum(n for _, _, n in runs)
    assert out["sender"]["num_runs"] < len(runs)  # the adjacent runs coalesced
    assert out["sender"]["timed_out"] is (kind == "dist")
    assert workers.segments() == [], "shm segments leaked"
