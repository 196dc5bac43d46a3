"""Benchmark data: deterministic random global tensors, poisoning, and the bit-exact check (with
the post-load phase's derived tensors).

The transfer benchmark fills every trainer rank's shards with values of the *global* tensors
(so replicas agree and every layout slices the same model), and each engine rank checks that
what landed equals the same global tensors sliced by its own layout. Both sides generate any
box of any global tensor locally, without materializing the whole tensor:

    G[row, col] = pool[(h(G, row) + col) mod P]

where ``row`` is the flat index of the leading dims, ``h`` a hash of (tensor, row) and ``pool``
``P`` seeded random values. A box is then one gather of ``rows x width`` windows of the pool
(memory-bound, about 1 GB/s on one CPU core; fast on a GPU), while every row of every tensor is
an unrelated stretch of random values, so a misplaced row, column shift or missing run is seen.

Legend: ``P`` = pool size, ``W`` = widest last dim of any global tensor.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import torch

from weightsync.layout.box import Box, LocalTensor, box_shape, box_slices
from weightsync.models.hf import GlobalTensor
from weightsync.models.spec import ModelSpec
from weightsync.quant.mla import derive_all, mla_layers
from weightsync.sync.params import ParamStore, write_global

POOL_SIZE = 1 << 22
_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of int64 values in [0, 2^32)."""
    x = (x ^ (x >> 16)) & _M32
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & _M32
    return x ^ (x >> 16)


class GlobalData:
    """Any box of any global tensor of a model, generated on ``device`` (module docstring)."""

    def __init__(self, globals_: Mapping[str, GlobalTensor], *, seed: int, device: torch.device) -> None:
        """Args:
        globals_: the model's global tensors (``global_tensors(spec)``).
        seed: the values' seed (every process of a run passes the same).
        device: where boxes are generated.
        """
        self.globals = globals_
        self.seed = seed
        self.device = device
        widest = max((g.shape[-1] for g in globals_.values() if g.shape), default=1)
        self.pool_size = max(POOL_SIZE, widest)
        gen = torch.Generator().manual_seed(seed)
        # Generated on the CPU so that CPU and CUDA runs hold the same values.
        pool = torch.rand(self.pool_size + widest, generator=gen, dtype=torch.float32) * 2 - 1
        self._pool32 = pool.to(device)
        self._pools: dict[torch.dtype, torch.Tensor] = {}

    def _pool(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._pools:
            self._pools[dtype] = self._pool32.to(dtype)
        return self._pools[dtype]

    def box(self, name: str, box: Box) -> torch.Tensor:
        """The region ``box`` of global tensor ``name``, in the tensor's dtype (a new tensor)."""
        g = self.globals[name]
        dtype = getattr(torch, g.dtype)
        shape = box_shape(box)
        if not g.shape:
            return self._pool(dtype)[:1].reshape(()).clone()
        lead, (c0, c1) = box[:-1], box[-1]
        rows = torch.zeros((), dtype=torch.int64, device=self.device)
        stride = 1
        for d in reversed(range(len(lead))):
            a, b = lead[d]
            r = torch.arange(a, b, dtype=torch.int64, device=self.device) * stride
            rows = rows.unsqueeze(0) + r.view(-1, *([1] * rows.dim()))
            stride *= g.shape[d]
        key = zlib.crc32(f"{self.seed}:{name}".encode())
        start = (_mix32((rows.reshape(-1) ^ key) & _M32) + c0) % self.pool_size
        windows = self._pool(dtype).unfold(0, c1 - c0, 1)
        return torch.index_select(windows, 0, start).reshape(shape)


def fill_params(data: GlobalData, layout: Sequence[LocalTensor], params: Mapping[str, torch.Tensor]) -> int:
    """Write every piece of every local tensor of ``layout`` with the global values (cast to the
    local dtype); padding is left as it is. Returns the bytes written."""
    written = 0
    for t in layout:
        dst = params[t.name]
        for p in t.pieces:
            region = dst[box_slices(p.local_box)]
            region.copy_(data.box(p.global_name, p.global_box).reshape(region.shape))
            written += region.numel() * region.element_size()
    return written


def poison(store: ParamStore) -> None:
    """Overwrite every byte a transfer must write (each piece of each non-derived parameter) with
    NaN (floats) or -1 (integers), so that a region no transfer wrote fails :func:`compare`."""
    for t in store.layout:
        if t.derived:
            continue
        dst = store[t.name]
        value = float("nan") if dst.is_floating_point() else -1
        for p in t.pieces:
            dst[box_slices(p.local_box)].fill_(value)


def expected_store(data: GlobalData, store: ParamStore, spec: ModelSpec) -> ParamStore:
    """A plain copy of ``store``'s layout holding what a complete update must leave in it
    (the engine's own loading rule, :func:`weightsync.engine.loader.write_global`)."""
    expected = ParamStore(store.layout, store.device)
    for name in expected.global_names():
        g = data.globals[name]
        # fp8 scales are written together with their weight when the source is not fp8.
        if g.quant_of is not None and data.globals[g.quant_of].dtype != "float8_e4m3fn":
            continue
        write_global(expected, spec, name, lambda box, n=name: data.box(n, box))
    return expected


def compare(store: ParamStore, expected: ParamStore) -> list[str]:
    """Names of the non-derived parameters whose bytes differ from ``expected`` (bit for bit)."""
    bad = []
    for t in store.layout:
        if t.derived:
            continue
        a, b = store[t.name], expected[t.name]
        if a.dim() == 0:
            a, b = a.reshape(1), b.reshape(1)
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            bad.append(t.name)
    return bad


# -- post-load -------------------------------------------------------------------------------


def reference_derived(expected: ParamStore, spec: ModelSpec) -> None:
    """Derive ``expected``'s derived tensors (MLA ``w_kc`` / ``w_vc``) with the per-layer reference,
    the truth the engine's post-load phase (:func:`weightsync.engine.loader.run_post_load`) is
    checked against."""
    derive_all(mla_layers(expected.derived_names(), expected.get), qk_nope_head_dim=spec.qk_nope_head_dim,
               v_head_dim=spec.v_head_dim, block=spec.fp8_block, use_kernel=False)


def compare_derived(store: ParamStore, expected: ParamStore) -> list[str]:
    """Names of the derived tensors whose bytes differ from ``expected``."""
    bad = []
    for name in store.derived_names():
        if not torch.equal(store[name].view(torch.uint8), expected[name].view(torch.uint8)):
            bad.append(name)
    return bad
