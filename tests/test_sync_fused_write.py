"""Contract: a p2p sender's direct writes that fingerprint what they copy
(:mod:`weightsync.sync.fused_write`) write exactly the ops' boxes into both published copies, and
add into each (rollout rank, parameter) slot what the share's separate hash
(:class:`~weightsync.sync.share_fingerprint.ShareFingerprint`) adds for the same ops.

On the CPU through Triton's interpreter (the kernel is the one a GPU runs): host tensors stand for
the engine's copies, and a transport that maps destination addresses as they are (what CUDA IPC's
``translate`` gives in a process that opened them). Ops of three element sizes, whole tensors and
row boxes (destination element indices not starting at 0), two rollout ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from tests.conftest import REPO_ROOT
from weightsync.fingerprint.batch import triton_available
from weightsync.layout.box import full_box
from weightsync.plan.ops import CopyOp
from weightsync.sync.fused_write import fused_batches, self_check
from weightsync.sync.p2p_pack import DestParam, Packer
from weightsync.sync.share_fingerprint import ShareFingerprint

SEED = 0x1234_5678_9ABC


@dataclass
class _MapAsIs:
    """What the batches need of a transport: destination runs mapped into this process (as is here)."""

    launches_on_device: bool = True
    seen: list[int] = field(default_factory=list)

    def translate(self, peer: int, runs: np.ndarray) -> np.ndarray:
        self.seen.append(peer)
        return runs


@dataclass
class _Published:
    params: dict[str, DestParam]


def _dest(t: torch.Tensor) -> DestParam:
    return DestParam(addr=t.data_ptr(), shape=tuple(t.shape), dtype=t.dtype)


def run_fused_on_cpu() -> None:
    gen = torch.Generator().manual_seed(4)
    params = {"a": torch.randn(6, 10, generator=gen).to(torch.bfloat16),
              "b": torch.randn(8, 4, generator=gen),
              "c": torch.randint(0, 256, (4, 16), generator=gen, dtype=torch.uint8)}
    shapes = {"A": ((6, 10), torch.bfloat16), "B": ((3, 4), torch.float32), "C": ((4, 16), torch.uint8)}
    engines = [{r: {n: torch.zeros(s, dtype=d) for n, (s, d) in shapes.items()} for r in (0, 1)} for _ in range(2)]
    ops = [CopyOp(global_name="a", global_box=full_box((6, 10)), src_rank=0, src_param="a", src_box=full_box((6, 10)),
                  dst_rank=0, dst_param="A", dst_box=full_box((6, 10))),
           CopyOp(global_name="b", global_box=((2, 5), (0, 4)), src_rank=0, src_param="b", src_box=((2, 5), (0, 4)),
                  dst_rank=1, dst_param="B", dst_box=full_box((3, 4))),
           CopyOp(global_name="c", global_box=((1, 3), (0, 16)), src_rank=0, src_param="c", src_box=((1, 3), (0, 16)),
                  dst_rank=1, dst_param="C", dst_box=((1, 3), (0, 16)))]
    copies = [{r: _Published({n: _dest(t) for n, t in eng[r].items()}) for r in eng} for eng in engines]
    slots = {(r, n): i for i, (r, n) in enumerate((r, n) for r in (0, 1) for n in shapes)}
    transport = _MapAsIs()
    batches = fused_batches(transport, {0: 0, 1: 1}, ops, params, copies, slots)
    assert sorted(transport.seen) == [0, 0, 1, 1, 1, 1]
    tables = {r: p.params for r, p in copies[0].items()}
    share = ShareFingerprint(ops, params, tables, Packer([], params, tables, bucket_bytes=1 << 20), slots,
                             lambda i: torch.empty(0, dtype=torch.uint8))
    want = torch.zeros(len(slots), dtype=torch.int64)
    share.hash_direct(want, SEED)
    assert want.count_nonzero() == 3
    for copy, eng in zip(batches, engines, strict=True):
        got = torch.zeros(len(slots), dtype=torch.int64)
        for r in (0, 1):
            copy[r].run(got, SEED)
        assert got.tolist() == want.tolist()
        assert torch.equal(eng[0]["A"], params["a"])
        assert torch.equal(eng[1]["B"], params["b"][2:5])
        assert torch.equal(eng[1]["C"][1:3], params["c"][1:3])
        assert eng[1]["C"][0].count_nonzero() == eng[1]["C"][3].count_nonzero() == 0  # outside the box: untouched
        assert all(t.count_nonzero() == 0 for n, t in eng[0].items() if n != "A")
    assert self_check(torch.device("cpu"))  # the device check a sender runs first, passing here
    print("fused ok")


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed (the GPU images have it; the CPU "
                    "set-up does not install it)")
@pytest.mark.timeout(600)
def test_fused_writes_copy_the_boxes_and_hash_as_the_share_does() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from tests.test_sync_fused_write import run_fused_on_cpu; run_fused_on_cpu()"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=580)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "fused ok" in done.stdout, done.stdout


def test_a_kernel_that_cannot_run_keeps_the_separate_copy_and_hash() -> None:
    """Without the interpreter, Triton cannot run on host tensors: the check says no (and logs
    why), and a sender keeps the transport's copy and the separate hash."""
    assert not self_check(torch.device("cpu"))
