"""GPU tests of the cuda_ipc and local transports (marked ``gpu``: skipped without CUDA).

Contract (as the CPU two-process test): a receiver process allocates its destination on its GPU
(``cuda:1`` when two are visible, else ``cuda:0``), fills it with a sentinel and publishes its
descriptor (CUDA IPC handle, base64); a writer process on ``cuda:0`` writes scattered runs (a
strided column box that becomes one 2-D copy, coalescing runs, random runs, a large run); every
written byte equals its source and every other byte keeps the sentinel. cuda_ipc refuses host
memory and its own process's handles; the local transport copies on-device exactly.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any

import numpy as np
import pytest
import torch

from tests.test_transport_multiproc import (
    ARENA_BYTES,
    SENTINEL,
    TIMEOUT_S,
    expected_destination,
    scattered_runs,
    source_bytes,
)
from weightsync.transport import PeerDescriptor, deadline_after, make_transport

pytestmark = pytest.mark.gpu


def _dest_device() -> int:
    return 1 if torch.cuda.device_count() > 1 else 0


def _receiver(conn: Any) -> None:
    try:
        dev = _dest_device()
        torch.cuda.set_device(dev)
        with make_transport("cuda_ipc", device=dev) as t:
            arena = t.new_arena(ARENA_BYTES, device=f"cuda:{dev}")
            dest = arena.empty((ARENA_BYTES,), torch.uint8)
            dest.fill_(SENTINEL)
            torch.cuda.synchronize()
            t.register("params", arena.base, arena.nbytes, device=dev)
            conn.send(t.descriptor().to_json())
            assert conn.recv() == "done"
            got = dest.cpu().numpy()
        want = expected_destination()
        conn.send(("ok", int((got != want).sum())))
    except BaseException:  # ship the failure to the parent, whatever it is
        conn.send(("error", traceback.format_exc()))


def _sender(conn: Any) -> None:
    try:
        torch.cuda.set_device(0)
        src = torch.from_numpy(source_bytes()).to("cuda:0")
        with make_transport("cuda_ipc", device=0) as t:
            t.register_tensor("staging", src)
            desc = PeerDescriptor.from_json(conn.recv())
            peer = t.connect(desc)
            base = desc.region("params").addr
            batch = t.prepare(peer, [(src.data_ptr() + s, base + d, n) for s, d, n in scattered_runs()])
            for _ in range(2):
                t.wait(t.write(peer, batch), deadline_after(TIMEOUT_S))
            conn.send(("ok", {"num_runs": batch.num_runs, "num_blocks": len(batch.blocks)}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def test_cuda_ipc_two_process_write_is_byte_exact() -> None:
    ctx = mp.get_context("spawn")
    r_parent, r_child = ctx.Pipe()
    s_parent, s_child = ctx.Pipe()
    procs = [ctx.Process(target=_receiver, args=(r_child,)), ctx.Process(target=_sender, args=(s_child,))]
    for p in procs:
        p.start()
    try:
        assert r_parent.poll(TIMEOUT_S), "receiver published no descriptor"
        desc = r_parent.recv()
        if isinstance(desc, tuple):
            pytest.fail(f"receiver failed:\n{desc[1]}")
        s_parent.send(desc)
        assert s_parent.poll(TIMEOUT_S), "sender did not finish"
        status, payload = s_parent.recv()
        if status != "ok":
            pytest.fail(f"sender failed:\n{payload}")
        assert payload["num_blocks"] < payload["num_runs"]  # the column box went as one 2-D copy
        r_parent.send("done")
        assert r_parent.poll(TIMEOUT_S)
        status, mismatches = r_parent.recv()
        if status != "ok":
            pytest.fail(f"receiver failed:\n{mismatches}")
        assert mismatches == 0
    finally:
        for p in procs:
            p.join(timeout=TIMEOUT_S)
            if p.is_alive():
                p.kill()


def test_cuda_ipc_refuses_host_memory_and_own_handles() -> None:
    with make_transport("cuda_ipc", device=0) as t:
        host = torch.zeros(64, dtype=torch.uint8)
        with pytest.raises(ValueError, match="moves device memory only"):
            t.register_tensor("host", host)
        with pytest.raises(ValueError, match="is not CUDA device memory"):
            t.register("lying", host.data_ptr(), 64, device=0)
        dev = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
        t.register_tensor("params", dev)
        with pytest.raises(ValueError, match="use the local transport"):
            t.connect(t.descriptor())


def test_local_device_copies_are_exact() -> None:
    src = torch.from_numpy(source_bytes()).to("cuda:0")
    dest = torch.full((ARENA_BYTES,), SENTINEL, dtype=torch.uint8, device="cuda:0")
    with make_transport("local", device=0) as t:
        t.register_tensor("staging", src)
        t.register_tensor("params", dest)
        peer = t.connect(t.descriptor())
        runs = [(src.data_ptr() + s, dest.data_ptr() + d, n) for s, d, n in scattered_runs()]
        t.wait(t.write(peer, runs), deadline_after(TIMEOUT_S))
    assert np.array_equal(dest.cpu().numpy(), expected_destination())
