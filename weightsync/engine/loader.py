"""Filling the engine's parameters: from an HF checkpoint, from seeded dummy values, from one
received global tensor; and the post-load derivations.

Every path goes through :func:`weightsync.sync.params.write_global`: for each piece of global tensor ``G`` this rank
holds, ``local[piece.local_box] = G[piece.global_box]`` (cast to the local dtype). A local
float8_e4m3fn weight fed with a bf16 global weight is block-quantized on the way
(:func:`weightsync.quant.fp8.quantize_block_fp8`, the rule the senders use) and its
``weight_scale_inv`` pieces are written from the same quantization; a float8 source is copied
as is, and its scale tensor arrives as a global tensor of its own.

Checkpoints (:class:`CheckpointReader`): a float8 weight (block fp8 with ``weight_scale_inv``, the
block size from its ``quantization_config``) loads as stored when the engine's blocks are the
checkpoint's, or tile them (a ``[128, 128]`` checkpoint re-blocked into ``[64, 64]`` where its own
blocks would be cut: each scale copied to its sub-blocks, the dequantized weights unchanged); an
engine that keeps it unquantized dequantizes it with its scales; it is never re-quantized. A bf16
or float32 weight for an fp8-serving engine is quantized on load.

Derived tensors (MLA ``w_kc``/``w_vc``) are recomputed by :func:`run_post_load` after every
load or update.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightsync.layout.box import Box, box_slices
from weightsync.layout.sglang_fp8 import divides
from weightsync.models.checkpoint import HFCheckpoint, synthetic_hf_tensor
from weightsync.models.checkpoint_check import CheckpointError, validate_checkpoint
from weightsync.models.hf import GlobalTensor, global_tensors
from weightsync.models.spec import ModelSpec
from weightsync.quant.fp8 import dequantize_block_fp8, reblock_scale_inv
from weightsync.quant.mla import derive_all, mla_layers
from weightsync.sync.params import ParamStore, write_global

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
def _scale_comes_with_weight(gt: GlobalTensor, source_dtype: Callable[[str], str]) -> bool:
    """A scale tensor whose weight is not fp8 at the source is computed when that weight is quantized."""
    return gt.quant_of is not None and source_dtype(gt.quant_of) != "float8_e4m3fn"


class CheckpointReader:
    """The global tensors of a checkpoint as the engine loads them: ``reader(name)(box)``.

    A float8 weight loads as stored when the engine stores it in fp8 blocks of the checkpoint's
    size, or of a size that tiles them (the re-blocking of :mod:`weightsync.layout.sglang_fp8`: its
    scale then loads copied to every sub-block); a float8 weight the engine keeps unquantized (a
    profile without fp8) is dequantized with the checkpoint's scales (whole, once). An fp8 weight
    whose blocks the engine's do not tile is refused on construction: it would be re-quantized.
    """

    def __init__(self, ckpt: HFCheckpoint, spec: ModelSpec) -> None:
        """Raises:
        CheckpointError: an fp8 weight the engine stores in blocks that do not tile the checkpoint's.
        """
        self.ckpt = ckpt
        self.spec = spec
        self.block = ckpt.fp8_block()
        self.table = global_tensors(spec)
        self._cache: dict[str, torch.Tensor] = {}
        clash = [n for n, g in self.table.items() if g.block is not None and g.quant_of is None and n in ckpt
                 and self.is_fp8(n) and not self.as_stored(n)]
        if clash:
            raise CheckpointError(
                f"checkpoint {ckpt.path} stores {len(clash)} fp8 weights (e.g. {clash[0]}) in blocks "
                f"{list(self.block or ())}; this engine serves blocks {list(spec.fp8_block or ())}, which do not tile "
                "them: serving them would re-quantize the checkpoint's weights (serve it in its own blocks)")

    def is_fp8(self, name: str) -> bool:
        return self.ckpt.meta(name)[1] == "float8_e4m3fn"

    def as_stored(self, name: str) -> bool:
        """Whether fp8 weight ``name`` loads as stored: the engine's blocks are the checkpoint's or tile them."""
        engine = self.table[name].block
        return engine is not None and self.block is not None and divides(engine, self.block)

    def skip(self, name: str) -> bool:
        """A scale tensor that is not loaded: its weight is quantized on load, or not stored in fp8."""
        weight = self.table[name].quant_of
        return weight is not None and not (self.is_fp8(weight) and self.as_stored(weight))

    def __call__(self, name: str) -> Callable[[Box], torch.Tensor]:
        weight = self.table[name].quant_of
        if weight is not None and self.table[name].block != self.block:
            return self._reblocked_scale(name, weight)
        if not self.is_fp8(name) or self.as_stored(name):
            return lambda box: self.ckpt.get_slice(name, box)

        def dequantized(box: Box) -> torch.Tensor:
            if name not in self._cache:
                assert self.block is not None, "validate_checkpoint refuses fp8 weights without a block size"
                self._cache.clear()
                self._cache[name] = dequantize_block_fp8(self.ckpt.get(name), self.ckpt.get(name + "_scale_inv"),
                                                         self.block, dtype=getattr(torch, self.spec.dtype))
            return self._cache[name][box_slices(box)]

        return dequantized

    def _reblocked_scale(self, name: str, weight: str) -> Callable[[Box], torch.Tensor]:
        """The checkpoint's scales of ``weight`` copied to the engine's finer blocks."""
        engine, shape = self.table[name].block, self.table[weight].shape
        assert engine is not None
        assert self.block is not None

        def read(box: Box) -> torch.Tensor:
            if name not in self._cache:
                self._cache.clear()
                self._cache[name] = reblock_scale_inv(self.ckpt.get(name), (shape[0], shape[1]), self.block, engine)
            return self._cache[name][box_slices(box)]

        return read


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadStats:
    """What one load wrote, and how long it took."""

    num_tensors: int
    nbytes: int
    seconds: float


def load_checkpoint(store: ParamStore, spec: ModelSpec, path: str) -> LoadStats:
    """Load this rank's pieces from the HF checkpoint at ``path`` (validated first), then derive.

    Args:
        store: the rank's parameters.
        spec: the model.
        path: checkpoint directory.

    Returns:
        :class:`LoadStats`.

    Raises:
        CheckpointError: the checkpoint does not match ``spec`` (nothing was written).
    """
    t0 = time.perf_counter()
    nbytes = 0
    with HFCheckpoint(path) as ckpt:
        validate_checkpoint(spec, ckpt)
        reader = CheckpointReader(ckpt, spec)
        for name in store.global_names():
            if reader.skip(name):
                continue  # written with its weight, which write_global quantizes
            nbytes += write_global(store, spec, name, reader(name))
    run_post_load(store, spec)
    return LoadStats(num_tensors=len(store.global_names()), nbytes=nbytes, seconds=time.perf_counter() - t0)


def load_dummy(store: ParamStore, spec: ModelSpec, seed: int = 0) -> LoadStats:
    """Fill this rank's pieces with the synthetic checkpoint of ``spec`` (consistent across ranks).

    Each global tensor the rank holds a piece of is generated whole on the rank's device
    (:func:`weightsync.models.checkpoint.synthetic_hf_tensor`) and sliced; values depend on the
    device's random generator, so a CPU engine and a CUDA engine differ.

    Args:
        store: the rank's parameters.
        spec: the model.
        seed: checkpoint seed.

    Returns:
        :class:`LoadStats`.
    """
    t0 = time.perf_counter()
    table = global_tensors(spec)
    device = str(store.device)
    nbytes = 0
    for name in store.global_names():
        if _scale_comes_with_weight(table[name], lambda n: table[n].dtype):
            continue
        full = synthetic_hf_tensor(spec, name, seed, device, table=table)
        nbytes += write_global(store, spec, name, lambda box, t=full: t[box_slices(box)])
    run_post_load(store, spec)
    return LoadStats(num_tensors=len(store.global_names()), nbytes=nbytes, seconds=time.perf_counter() - t0)


def run_post_load(store: ParamStore, spec: ModelSpec) -> float:
    """Recompute every derived tensor from the written ones (MLA ``w_kc``/``w_vc``).

    Args:
        store: the rank's parameters.
        spec: the model.

    Returns:
        Seconds spent (device-synchronized).
    """
    t0 = time.perf_counter()
    derive_all(mla_layers(store.derived_names(), store.get), qk_nope_head_dim=spec.qk_nope_head_dim,
               v_head_dim=spec.v_head_dim, block=spec.fp8_block)  # one launch for every layer on a GPU
    if store.device.type == "cuda":
        torch.cuda.synchronize(store.device)
    return time.perf_counter() - t0


__all__ = ["CheckpointError", "CheckpointReader", "LoadStats", "load_checkpoint", "load_dummy", "run_post_load",
           "validate_checkpoint"]
