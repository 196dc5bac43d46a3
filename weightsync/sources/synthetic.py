"""The SYNTHETIC trainer: the CPU default weight source. It does not learn anything.

Each rank holds its trainer-layout shards (read from the torch_dist checkpoint) and, per
``step()``, applies a deterministic weight change: an Adam update driven by seeded
*pseudo-gradients*. The pseudo-gradient of an element is a hash of
``(seed, step, global tensor name, global element index)``, so the update of every element is a
function of global coordinates only: replicas (DP / TP-replicated copies) and differently
sharded layouts make the same change, and a reference copy of the full HF tensors updated by
:func:`full_tensors_at_step` equals the gathered shards bit for bit. Everything is elementwise
IEEE arithmetic (no fused multiply-add, no transcendental functions), so CPU and CUDA agree.

Every element changes every step: when the Adam step is too small to move an element's stored
(bf16) value, the element moves by one unit in the last place in the update's direction.
Padded vocab rows belong to no global tensor and stay zero.

Parameters live in one flat buffer per dtype (:meth:`SyntheticTrainer.regions`), so a transport
registers the trainer's memory once.

Typical usage::

    trainer = SyntheticTrainer.from_torch_dist(ckpt, spec, par, rank, seed=1234)
    trainer.step()                                  # weights change in place
    read = reference_global_tensors(hf_dir, spec, step=1, seed=1234)
    assert torch.equal(read("model.norm.weight"), gathered_from_all_ranks)
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weightsync.layout.box import Box, LocalTensor, Piece, box_shape, box_slices, box_volume, full_box
from weightsync.layout.megatron import trainer_layout
from weightsync.models.checkpoint import HFCheckpoint
from weightsync.models.hf import global_tensors
from weightsync.models.parallel import TrainParallel
from weightsync.models.spec import ModelSpec
from weightsync.sources.hf_source import global_reader
from weightsync.sources.torch_dist import read_rank_tensors, torch_dtype

_M32 = 0xFFFFFFFF
_SLAB = 1 << 22
"""Elements per slab when hashing a large box (bounds the temporaries)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticUpdate:
    """The synthetic Adam update."""

    seed: int = 0
    """Seeds the pseudo-gradients (the run's seed)."""
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if not (self.lr > 0 and 0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.eps > 0):
            raise ValueError(f"bad synthetic update {self}: need lr > 0, 0 <= betas < 1, eps > 0")


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of int64 tensors holding values in [0, 2^32) (products stay < 2^63)."""
    x = (x ^ (x >> 16)) & _M32
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & _M32
    return x ^ (x >> 16)


def _key(seed: int, step: int, name: str) -> int:
    """A 32-bit key of (seed, step, tensor name)."""
    k = zlib.crc32(f"{seed}:{step}:{name}".encode())
    return int(_hash32(torch.tensor(k, dtype=torch.int64)))


def _flat_index(gshape: tuple[int, ...], box: Box, device: torch.device) -> torch.Tensor:
    """Row-major flat indices (int64) of the elements of ``box`` in a tensor of ``gshape``."""
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(gshape))):
        a, b = box[d]
        r = torch.arange(a, b, dtype=torch.int64, device=device) * stride
        idx = idx.unsqueeze(0) + r.view(-1, *([1] * idx.dim()))
        stride *= gshape[d]
    return idx


def pseudo_gradient(name: str, gshape: tuple[int, ...], box: Box, step: int, seed: int,
                    device: str | torch.device = "cpu") -> torch.Tensor:
    """The pseudo-gradient of the elements of ``box`` of global tensor ``name`` at ``step``.

    Args:
        name: global (HF) tensor name.
        gshape: its global shape.
        box: the region.
        step: the update number (1 for the first update).
        seed: the run's seed.
        device: where to compute.

    Returns:
        float32 values in [-1, 1) of ``box``'s shape, a function of (seed, step, name, index) only.
    """
    dev = torch.device(device)
    key = _key(seed, step, name)
    idx = _flat_index(gshape, box, dev)
    h = _hash32((idx & _M32) ^ key)
    h = _hash32(h ^ (idx >> 32))
    return (h >> 8).to(torch.float32) * (2.0 ** -23) - 1.0


def _nudge(old: torch.Tensor, new: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """``new``, except that elements equal to ``old`` move one ulp in ``direction`` (> 0: up)."""
    same = new == old
    if not bool(same.any()):
        return new
    itype = {2: torch.int16, 4: torch.int32}[old.element_size()]
    bits = old.view(itype)
    up = direction > 0
    away = ((old > 0) & up) | ((old < 0) & ~up)  # moving away from zero grows the magnitude bits
    stepped = torch.where(away, bits + 1, bits - 1)
    smallest = torch.where(up, torch.ones_like(bits), torch.full_like(bits, torch.iinfo(itype).min + 1))
    stepped = torch.where(old == 0, smallest, stepped)
    return torch.where(same, stepped.view(old.dtype), new)


def adam_update(param: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, step: int,
                cfg: SyntheticUpdate) -> None:
    """One elementwise Adam step on a region, in place (``m``, ``v`` float32; see module docstring).

    Each arithmetic operation is a separate IEEE-rounded op, so the result of an element does
    not depend on the region it is computed in or on the device.
    """
    m.mul_(cfg.beta1).add_(grad * (1.0 - cfg.beta1))
    v.mul_(cfg.beta2).add_((grad * grad) * (1.0 - cfg.beta2))
    # Multiply by reciprocals: CUDA turns a division by a scalar into exactly this, CPU does not.
    m_hat = m * (1.0 / (1.0 - cfg.beta1 ** step))
    v_hat = v * (1.0 / (1.0 - cfg.beta2 ** step))
    delta = (m_hat / (v_hat.sqrt() + cfg.eps)) * cfg.lr
    old = param.clone()
    new = (old.float() - delta).to(param.dtype)
    param.copy_(_nudge(old, new, -delta))


def _slabs(box: Box) -> Iterator[Box]:
    """``box`` cut along dim 0 into slabs of at most about ``_SLAB`` elements."""
    a, b = box[0]
    rows = max(1, _SLAB // max(1, box_volume(box) // (b - a)))
    for s in range(a, b, rows):
        yield ((s, min(s + rows, b)), *box[1:])



def update_pieces(tensor: LocalTensor, data: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
                  cfg: SyntheticUpdate, global_shapes: dict[str, tuple[int, ...]]) -> None:
    """Apply update ``step`` to every piece of one local tensor (``data``, ``m``, ``v`` of its shape)."""
    for piece in tensor.pieces:
        for gbox in _slabs(piece.global_box):
            lbox = piece.local_of(gbox)
            g = pseudo_gradient(piece.global_name, global_shapes[piece.global_name], gbox, step, cfg.seed,
                                data.device).reshape(box_shape(lbox))
            region = box_slices(lbox)
            adam_update(data[region], m[region], v[region], g, step, cfg)


class SyntheticTrainer:
    """One trainer rank of the synthetic trainer (see the module docstring).

    Typical usage::

        trainer = SyntheticTrainer.from_torch_dist(ckpt, spec, par, rank, device="cpu", seed=1234)
        for _ in range(3):
            trainer.step()
        trainer.params["decoder.final_layernorm.weight"]
    """

    def __init__(self, spec: ModelSpec, par: TrainParallel, rank: int, initial: dict[str, torch.Tensor], *,
                 device: str | torch.device = "cpu", update: SyntheticUpdate | None = None,
                 expert_naming: str = "sequential") -> None:
        """Copy this rank's initial local tensors into the trainer's buffers.

        Args:
            spec: the model.
            par: the training job's parallel sizes.
            rank: this rank.
            initial: local name -> initial tensor, for every tensor of the rank's trainer layout.
            device: where the parameters and the Adam state live.
            update: the update rule (default: ``SyntheticUpdate()``).
            expert_naming: as in :func:`trainer_layout`.

        Raises:
            ValueError: a tensor of the layout is missing from ``initial`` or has another shape.
        """
        self.spec, self.par, self.rank = spec, par, rank
        self.update = update if update is not None else SyntheticUpdate()
        self.device = torch.device(device)
        self.layout: list[LocalTensor] = trainer_layout(spec, par, rank, expert_naming=expert_naming)
        self._global_shapes = {n: g.shape for n, g in global_tensors(spec).items()}
        self.step_count = 0
        self._arenas: dict[str, torch.Tensor] = {}
        self.params: dict[str, torch.Tensor] = self._allocate(initial)
        self._m = {n: torch.zeros(p.shape, dtype=torch.float32, device=self.device) for n, p in self.params.items()}
        self._v = {n: torch.zeros(p.shape, dtype=torch.float32, device=self.device) for n, p in self.params.items()}

    def _allocate(self, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        sizes: dict[str, int] = {}
        for t in self.layout:
            src = initial.get(t.name)
            if src is None or tuple(src.shape) != t.shape:
                got = None if src is None else list(src.shape)
                raise ValueError(f"rank {self.rank}: initial tensor {t.name} is {got}, "
                                 f"the layout needs {list(t.shape)}")
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel
        self._arenas = {d: torch.zeros(n, dtype=torch_dtype(d), device=self.device) for d, n in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        params = {}
        for t in self.layout:
            view = self._arenas[t.dtype][offsets[t.dtype]:offsets[t.dtype] + t.numel].view(t.shape)
            view.copy_(initial[t.name])
            offsets[t.dtype] += t.numel
            params[t.name] = view
        return params

    @classmethod
    def from_torch_dist(cls, ckpt_dir: str | Path, spec: ModelSpec, par: TrainParallel, rank: int, *,
                        device: str | torch.device = "cpu", seed: int = 0, lr: float = 1e-3,
                        expert_naming: str = "sequential") -> SyntheticTrainer:
        """Build rank ``rank``'s trainer from a torch_dist checkpoint (reads only its chunks).

        Args:
            ckpt_dir: the ``<MODEL>_torch_dist`` directory.
            spec, par, rank, expert_naming: as in :func:`trainer_layout`.
            device: where the parameters live.
            seed: the pseudo-gradient seed (the run's seed).
            lr: Adam learning rate.
        """
        initial = read_rank_tensors(ckpt_dir, spec, par, rank, expert_naming=expert_naming)
        return cls(spec, par, rank, initial, device=device, update=SyntheticUpdate(seed=seed, lr=lr),
                   expert_naming=expert_naming)

    def step(self, samples: Any = None) -> dict[str, Any]:
        """Apply the next synthetic update to every parameter (``samples`` is ignored: synthetic).

        Returns:
            ``{"step": n, "synthetic": True}``.
        """
        self.step_count += 1
        for t in self.layout:
            update_pieces(t, self.params[t.name], self._m[t.name], self._v[t.name], self.step_count, self.update,
                          self._global_shapes)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"step": self.step_count, "synthetic": True}

    def regions(self) -> list[tuple[str, torch.Tensor]]:
        """The flat buffers every parameter is a view of (register these once with a transport)."""
        return [(f"synthetic_params_{d}", a) for d, a in self._arenas.items()]


def full_tensors_at_step(initial: dict[str, torch.Tensor], spec: ModelSpec, step: int, update: SyntheticUpdate,
                         *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The full HF global tensors after ``step`` synthetic updates of ``initial`` (a reference copy).

    Args:
        initial: global name -> initial tensor in the trainer's dtype (fp8 scale tensors, if
            given, are ignored).
        spec: the model.
        step: number of updates to apply.
        update: the update rule (same seed as the trainer).
        device: where to compute.

    Returns:
        global name -> tensor; equal bit for bit to the trainer ranks' shards gathered.
    """
    table = global_tensors(spec)
    out = {}
    for name, t0 in initial.items():
        if table[name].quant_of is not None:
            continue
        p = t0.to(device=device, dtype=torch_dtype(table[name].dtype)).clone()
        out[name] = advance(name, p, step, update)
    return out


def advance(name: str, tensor: torch.Tensor, step: int, update: SyntheticUpdate,
            first: int = 1) -> torch.Tensor:
    """Apply updates ``first .. step`` of global tensor ``name`` to ``tensor`` (in place); return it."""
    shape = tuple(tensor.shape)
    whole = LocalTensor(name=name, shape=shape, dtype=str(tensor.dtype).removeprefix("torch."),
                        pieces=(_whole_piece(name, shape),))
    m = torch.zeros(shape, dtype=torch.float32, device=tensor.device)
    v = torch.zeros_like(m)
    for s in range(first, step + 1):
        update_pieces(whole, tensor, m, v, s, update, {name: shape})
    return tensor


def _whole_piece(name: str, shape: tuple[int, ...]) -> Piece:
    return Piece(name, full_box(shape), full_box(shape))


def reference_global_tensors(hf_dir: str | Path, spec: ModelSpec, *, step: int, seed: int, lr: float = 1e-3,
                             device: str | torch.device = "cpu") -> Callable[[str], torch.Tensor]:
    """A reader of the trainer's global tensors at ``step``, computed from the HF checkpoint.

    The initial weights are the checkpoint's tensors in the trainer's dtype (fp8 weights
    dequantized, as ``prepare`` does); ``_scale_inv`` names give the block scales of the
    weight at that step (the senders' quantization rule).

    Args:
        hf_dir: the HF checkpoint ``prepare`` wrote or used.
        spec: the model.
        step: number of synthetic updates applied (0 = the checkpoint).
        seed: the run's seed.
        lr: the trainer's learning rate.
        device: where to compute.

    Returns:
        ``read(global_name) -> tensor`` (computed on first use, cached).
    """
    update = SyntheticUpdate(seed=seed, lr=lr)
    table = global_tensors(spec)
    cache: dict[str, torch.Tensor] = {}

    def read(name: str) -> torch.Tensor:
        if name in cache:
            return cache[name]
        gt = table[name]
        if gt.quant_of is not None:
            from weightsync.quant.fp8 import quantize_block_fp8

            assert gt.block is not None
            cache[name] = quantize_block_fp8(read(gt.quant_of), gt.block)[1]
            return cache[name]
        with HFCheckpoint(hf_dir) as ckpt:
            full = global_reader(ckpt, spec)(name, tuple((0, d) for d in gt.shape))
        t = full.to(device=device, dtype=torch_dtype(gt.dtype)).clone()
        cache[name] = advance(name, t, step, update)
        return cache[name]

    return read
