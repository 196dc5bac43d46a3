"""Contract tests of the transport interface's pure parts and of the factory.

Contracts: runs are validated (positive addresses and lengths); coalescing merges exactly the
runs whose source and destination both follow on (and never across region keys) and keeps the
byte stream's order; strided grouping reproduces the same bytes as the runs; region lookup
names the region a bad run hits; descriptors survive a JSON round trip; arenas hand out aligned,
disjoint views and say when they are full; the selection policy is DESIGN.md's table.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.transport_mock import MockTransport
from weightsync.models.parallel import Device
from weightsync.transport import (
    HOST,
    PeerDescriptor,
    Region,
    TransportKind,
    arena_bytes,
    available_transports,
    choose_transport,
    make_transport,
    transport_class,
)
from weightsync.transport._host import copy_blocks, host_array, split_blocks
from weightsync.transport.arena import TensorArena
from weightsync.transport.region_table import RegionTable
from weightsync.transport.runs import as_runs, coalesce_runs, strided_blocks


def test_as_runs_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="triples"):
        as_runs([(1, 2)])
    with pytest.raises(ValueError, match=r"run 1 .* must be positive"):
        as_runs([(8, 16, 4), (8, 16, 0)])
    assert as_runs([]).shape == (0, 3)


@pytest.mark.parametrize(
    ("runs", "keys", "expected"),
    [
        pytest.param([(100, 200, 10), (110, 210, 5)], None, [(100, 200, 15)], id="both-follow"),
        pytest.param([(100, 200, 10), (110, 220, 5)], None, [(100, 200, 10), (110, 220, 5)], id="dst-gap"),
        pytest.param([(100, 200, 10), (120, 210, 5)], None, [(100, 200, 10), (120, 210, 5)], id="src-gap"),
        pytest.param([(110, 210, 5), (100, 200, 10)], None, [(110, 210, 5), (100, 200, 10)], id="reversed-kept"),
        pytest.param([(100, 200, 10), (110, 210, 5)], [0, 1], [(100, 200, 10), (110, 210, 5)], id="key-boundary"),
        pytest.param(
            [(1, 1, 1), (2, 2, 1), (3, 3, 1), (10, 10, 2), (12, 12, 2)], None, [(1, 1, 3), (10, 10, 4)], id="chains"
        ),
    ],
)
def test_coalesce_runs(runs, keys, expected) -> None:
    k = None if keys is None else np.array(keys)
    assert [tuple(r) for r in coalesce_runs(as_runs(runs), keys=k).tolist()] == expected


@pytest.mark.parametrize(
    ("runs", "expected"),
    [
        pytest.param([(100, 1000, 8)], [(100, 1000, 8, 1, 8, 8)], id="single"),
        pytest.param([(100, 1000, 8), (132, 1016, 8), (164, 1032, 8)], [(100, 1000, 8, 3, 32, 16)], id="column-box"),
        pytest.param(
            [(100, 1000, 8), (132, 1016, 8), (160, 1032, 8)],
            [(100, 1000, 8, 2, 32, 16), (160, 1032, 8, 1, 8, 8)],
            id="pitch-break",
        ),
        pytest.param(
            [(100, 1000, 8), (104, 1016, 8)], [(100, 1000, 8, 1, 8, 8), (104, 1016, 8, 1, 8, 8)], id="overlap"
        ),
        pytest.param([(100, 1000, 8), (132, 1016, 4)], [(100, 1000, 8, 1, 8, 8), (132, 1016, 4, 1, 4, 4)], id="width"),
    ],
)
def test_strided_blocks(runs, expected) -> None:
    assert [tuple(b) for b in strided_blocks(as_runs(runs)).tolist()] == expected


def test_blocks_copy_the_same_bytes_as_runs() -> None:
    """2-D block copies (and their split over threads) write exactly the runs' bytes."""
    rng = np.random.default_rng(0)
    src = rng.integers(0, 255, 1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    sb, db = src.ctypes.data, dst.ctypes.data
    runs = [(sb + 64 * i + 3, db + 100 * i + 7, 40) for i in range(200)] + [(sb + 30000, db + 40000, 5000)]
    expected = dst.copy()
    for s, d, n in runs:
        expected[d - db : d - db + n] = src[s - sb : s - sb + n]
    blocks = strided_blocks(as_runs(runs))
    assert len(blocks) == 2
    for part in split_blocks(blocks, 3):
        copy_blocks(part)
    assert np.array_equal(dst, expected)
    assert host_array(db, 16).tolist() == dst[:16].tolist()


def test_region_table_names_the_region() -> None:
    table = RegionTable([Region(name="b", addr=2000, nbytes=100), Region(name="a", addr=1000, nbytes=100)])
    idx = table.locate(np.array([1000, 2050]), np.array([100, 50]), what="dst")
    assert [table.regions[i].name for i in idx] == ["a", "b"]
    with pytest.raises(ValueError, match=r"crosses the end of region 'a'.* by 1 bytes"):
        table.locate(np.array([1050]), np.array([51]), what="dst")
    with pytest.raises(ValueError, match=r"outside every registered region \(nearest: 'a'"):
        table.locate(np.array([1500]), np.array([1]), what="dst")
    with pytest.raises(ValueError, match="outside every registered region"):
        table.locate(np.array([10]), np.array([1]), what="dst")
    with pytest.raises(ValueError, match="overlap"):
        RegionTable([Region(name="a", addr=1000, nbytes=100), Region(name="b", addr=1099, nbytes=1)])


def test_descriptor_json_round_trip() -> None:
    desc = PeerDescriptor(
        kind="cuda_ipc",
        session_id="10.0.0.1:1234",
        host_id="h/boot",
        pid=42,
        regions=(
            Region(
                name="params", addr=0x7F00_0000_0000, nbytes=1 << 30, handle="aGFuZGxl", handle_offset=512, device=3
            ),
        ),
    )
    assert PeerDescriptor.from_json(json.loads(json.dumps(desc.to_json()))) == desc
    assert desc.region("params").device == 3
    with pytest.raises(KeyError, match="has no region 'x'"):
        desc.region("x")
    with pytest.raises(ValueError, match="duplicate region names"):
        PeerDescriptor(kind="shm", session_id="s", host_id="h", pid=1, regions=desc.regions * 2)


def test_arena_views_are_aligned_and_disjoint() -> None:
    sizes = [3 * 4, 1000 * 2, 7]
    arena = TensorArena(arena_bytes(sizes, align=256), align=256)
    a = arena.empty((3,), torch.float32)
    b = arena.empty((10, 100), torch.bfloat16)
    c = arena.empty((7,), torch.uint8)
    assert [t.data_ptr() % 256 for t in (a, b, c)] == [0, 0, 0]
    assert a.data_ptr() + 12 <= b.data_ptr()
    assert b.data_ptr() + 2000 <= c.data_ptr()
    assert arena.used <= arena.nbytes
    with pytest.raises(ValueError, match=r"arena of .* bytes is full"):
        arena.empty((1,), torch.uint8)


def test_register_rejects_duplicates_overlap_and_wrong_memory() -> None:
    buf = torch.zeros(1024, dtype=torch.uint8)
    with make_transport("local") as t:
        t.register("a", buf.data_ptr(), 512)
        with pytest.raises(ValueError, match="already registered"):
            t.register("a", buf.data_ptr() + 512, 512)
        with pytest.raises(ValueError, match="overlap"):
            t.register("b", buf.data_ptr() + 256, 512)
        with pytest.raises(ValueError, match="construct it with device=0"):
            t.register("c", buf.data_ptr() + 512, 8, device=0)
        assert [r.name for r in t.regions] == ["a"]
    with pytest.raises(RuntimeError, match="closed"):
        t.register("d", buf.data_ptr() + 512, 8)


def test_connect_refuses_other_kinds_and_processes() -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    with make_transport("local") as a, MockTransport() as b:
        b.register_tensor("x", buf)
        with pytest.raises(ValueError, match="both sides must use the same transport kind"):
            a.connect(b.descriptor())
        foreign = PeerDescriptor(kind="local", session_id="s", host_id="h", pid=1, regions=())
        with pytest.raises(ValueError, match="needs the peer in this process"):
            a.connect(foreign)


CPU = False
GPU = True


@pytest.mark.parametrize(
    ("src", "dst", "on_gpu", "same_process", "expected"),
    [
        pytest.param(Device(0, 1), Device(0, 1), GPU, True, TransportKind.LOCAL, id="colocated-gpu"),
        pytest.param(Device(0, 1), Device(0, 1), CPU, True, TransportKind.LOCAL, id="colocated-cpu"),
        pytest.param(Device(0, 1), Device(0, 1), GPU, False, TransportKind.CUDA_IPC, id="same-gpu-2-procs"),
        pytest.param(Device(0, 0), Device(0, 5), GPU, True, TransportKind.CUDA_IPC, id="same-host-gpu"),
        pytest.param(Device(0, 0), Device(0, 5), CPU, True, TransportKind.SHM, id="same-host-cpu"),
        pytest.param(Device(0, 3), Device(1, 3), GPU, True, TransportKind.MOONCAKE, id="other-host-gpu"),
        pytest.param(Device(2, 0), Device(0, 0), CPU, True, TransportKind.MOONCAKE, id="other-host-cpu"),
    ],
)
def test_choose_transport(src, dst, on_gpu, same_process, expected) -> None:
    assert choose_transport(src, dst, on_gpu, same_process=same_process) is expected


def test_factory() -> None:
    with pytest.raises(ValueError, match="unknown transport 'rdma'"):
        make_transport("rdma")
    assert {TransportKind.LOCAL, TransportKind.SHM, TransportKind.DIST} <= set(
        available_transports()
    )
    for kind in TransportKind:
        cls = transport_class(kind)
        assert cls.kind == kind.value
        assert cls.supports_host_memory or cls.supports_device_memory
    assert transport_class("dist").one_sided is False
    assert transport_class("shm").dest_needs_arena is True
    assert HOST == -1


def test_ipc_handle_bytes_round_trip_keeps_nul_bytes() -> None:
    """CUDA IPC handles hold NUL bytes; the ctypes record must carry all 64 (no GPU needed)."""
    from weightsync.transport._cuda import IpcMemHandle

    raw = bytes([0, 7, 0, 255] * 16)
    assert IpcMemHandle.from_bytes(raw).to_bytes() == raw
    with pytest.raises(ValueError, match="64 bytes"):
        IpcMemHandle.from_bytes(raw[:10])


def test_translate_checks_each_run_and_launch_needs_a_device_transport() -> None:
    """``translate`` checks runs as ``prepare`` does and keeps one row per run, in order (nothing
    coalesced: device work given to ``launch`` addresses each); a transport that takes no device
    work refuses ``launch`` naming itself."""
    src, dst = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    with make_transport("local") as t:
        t.register_tensor("src", src)
        t.register_tensor("dst", dst)
        peer = t.connect(t.descriptor())
        runs = np.array([(src.data_ptr(), dst.data_ptr(), 8), (src.data_ptr() + 8, dst.data_ptr() + 8, 8)])
        assert t.translate(peer, runs).tolist() == runs.tolist()
        assert len(t.prepare(peer, runs).runs) == 1  # prepare coalesces the two
        with pytest.raises(ValueError, match="crosses the end of region 'dst'"):
            t.translate(peer, np.array([(src.data_ptr(), dst.data_ptr() + 60, 8)]))
        assert not t.launches_on_device
        with pytest.raises(ValueError, match="local transport takes no device work"):
            t.launch(peer, lambda: None, 8)
