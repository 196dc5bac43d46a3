"""Filling the engine's parameters: from an HF checkpoint, from seeded dummy values, from one
received global tensor; and the post-load derivations.

Every path goes through :func:`weightsync.sync.params.write_global`: for each piece of global tensor ``G`` this rank
holds, ``local[piece.local_box] = G[piece.global_box]`` (cast to the local dtype). A local
float8_e4m3fn weight fed with a bf16 global weight is block-quantized on the way
(:func:`weightsync.quant.fp8.quantize_block_fp8`, the rule the senders use) and its
``weight_scale_inv`` pieces are written from the same quantization; a float8 source is copied
as is, and its scale tensor arrives as a global tensor of its own.

Derived tensors (MLA ``w_kc``/``w_vc``) are recomputed by :func:`run_post_load` after every
load or update.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightsync.layout.box import box_slices
from weightsync.models.checkpoint import HFCheckpoint, synthetic_hf_tensor
from weightsync.models.hf import GlobalTensor, global_tensors
from weightsync.models.spec import ModelSpec
from weightsync.quant.mla import derive_all, mla_layers
from weightsync.sync.params import ParamStore, write_global

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
_FLOAT_DTYPES = {"bfloat16", "float16", "float32", "float64", "float8_e4m3fn"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MAX_NAMES = 50
"""At most this many names per category in a refusal message (the count is always given)."""


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: unknown, missing or mis-shaped tensors."""



def _names(kind: str, names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES])
    more = f" ... ({len(names) - _MAX_NAMES} more)" if len(names) > _MAX_NAMES else ""
    return f"{len(names)} {kind}: {shown}{more}"


def validate_checkpoint(spec: ModelSpec, ckpt: HFCheckpoint) -> list[str]:
    """Check that ``ckpt`` holds exactly the global tensors of ``spec``, with their shapes.

    Tensors of layers at or beyond ``spec.num_layers`` (MTP / next-n layers, or the rest of a
    model loaded at ``layers=N``) are ignored with a warning; any other extra name is refused.

    Args:
        spec: the model.
        ckpt: the open checkpoint.

    Returns:
        The ignored names.

    Raises:
        CheckpointError: listing every unknown, missing, mis-shaped and non-float tensor.
    """
    table = global_tensors(spec)
    present = set(ckpt.names())
    ignored, unknown = [], []
    for name in sorted(present - set(table)):
        m = _LAYER.match(name)
        (ignored if m and int(m.group(1)) >= spec.num_layers else unknown).append(name)
    missing = [n for n in table if n not in present]
    misshaped, mistyped = [], []
    for name in table:
        if name not in present:
            continue
        shape, dtype = ckpt.meta(name)
        if shape != table[name].shape:
            misshaped.append(f"{name} {list(shape)} (expected {list(table[name].shape)})")
        if dtype not in _FLOAT_DTYPES:
            mistyped.append(f"{name} {dtype}")
    problems = [
        _names(k, v)
        for k, v in (
            ("unknown tensors", unknown),
            ("missing tensors", missing),
            ("mis-shaped tensors", misshaped),
            ("non-float tensors", mistyped),
        )
        if v
    ]
    if problems:
        raise CheckpointError(
            f"checkpoint {ckpt.path} does not match {spec.name} (scale {spec.scale}): " + "; ".join(problems)
        )
    if ignored:
        logger.warning(
            "checkpoint %s: ignoring %d tensors of layers >= %d (e.g. %s)",
            ckpt.path,
            len(ignored),
            spec.num_layers,
            ignored[0],
        )
    return ignored




def _scale_comes_with_weight(gt: GlobalTensor, source_dtype: Callable[[str], str]) -> bool:
    """A scale tensor whose weight is not fp8 at the source is computed when that weight is quantized."""
    return gt.quant_of is not None and source_dtype(gt.quant_of) != "float8_e4m3fn"


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
    table = global_tensors(spec)
    nbytes = 0
    with HFCheckpoint(path) as ckpt:
        validate_checkpoint(spec, ckpt)
        for name in store.global_names():
            if _scale_comes_with_weight(table[name], lambda n: ckpt.meta(n)[1]):
                continue
            nbytes += write_global(store, spec, name, lambda box, n=name: ckpt.get_slice(n, box))
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
