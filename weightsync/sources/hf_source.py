"""HF checkpoints as the trainer's source: check one against a model, read its tensors in the
trainer's dtype, write a synthetic one.

The model's spec comes from the checkpoint's own ``config.json``
(:func:`weightsync.models.resolve.model_spec`); :func:`check_hf_checkpoint` then refuses a
checkpoint whose tensors are not that model's: every tensor the trainer holds must be present
with its global shape, nothing unknown, and every float8 weight needs its ``weight_scale_inv``.
A model loaded at ``layers=N`` reads the first N layers (the other layers' tensors are ignored).

fp8 checkpoints (DeepSeek-V3 style): a float8_e4m3fn weight is dequantized with its
``weight_scale_inv`` in the checkpoint's own ``weight_block_size`` to the trainer's dtype on read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from weightsync.layout.box import Box
from weightsync.models.checkpoint import HFCheckpoint, hf_config_dict, synthetic_hf_tensor, write_hf_checkpoint
from weightsync.models.checkpoint_check import validate_checkpoint
from weightsync.models.hf import global_tensors
from weightsync.models.spec import ModelSpec
from weightsync.sources.torch_dist import ReadGlobal, torch_dtype

SHARD_BYTES = 2 << 30
"""Largest safetensors shard of a synthetic checkpoint."""


def check_hf_checkpoint(path: str | Path, spec: ModelSpec) -> None:
    """Refuse an HF checkpoint directory that does not hold ``spec``'s trainer tensors.

    Args:
        path: the directory (``config.json`` + safetensors).
        spec: the model at its scale.

    Raises:
        ValueError: naming every missing, mis-shaped and unexpected tensor and every fp8 weight
            without a usable scale (the message starts with the directory and the model).
    """
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"HF checkpoint {p} is not a directory")
    with HFCheckpoint(p) as ckpt:
        validate_checkpoint(spec, ckpt)


def global_reader(ckpt: HFCheckpoint, spec: ModelSpec) -> ReadGlobal:
    """``read(name, box)`` over an open checkpoint, in the trainer's dtype (fp8 dequantized).

    Slices are read lazily; an fp8 weight is dequantized whole (with the checkpoint's
    ``weight_block_size``) once and kept until another fp8 weight is read.
    """
    table = global_tensors(spec)
    block = ckpt.fp8_block()
    cache: dict[str, torch.Tensor] = {}

    def read(name: str, box: Box) -> torch.Tensor:
        dtype = torch_dtype(table[name].dtype)
        if ckpt.meta(name)[1] != "float8_e4m3fn":
            return ckpt.get_slice(name, box).to(dtype)
        if name not in cache:
            from weightsync.quant.fp8 import dequantize_block_fp8

            if block is None:
                raise ValueError(f"{ckpt.path}: {name} is float8 but config.json has no "
                                 "quantization_config.weight_block_size")
            cache.clear()
            cache[name] = dequantize_block_fp8(ckpt.get(name), ckpt.get(name + "_scale_inv"), block, dtype)
        return cache[name][tuple(slice(a, b) for a, b in box)]

    return read


def read_global_tensors(path: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Every trainer tensor of the checkpoint at ``path``, whole, in the trainer's dtype (fp8
    weights dequantized with the checkpoint's scales); no ``weight_scale_inv`` tensors.

    Small models only (all in memory): the run's reference copy of the trainer's weights.
    """
    with HFCheckpoint(path) as ckpt:
        read = global_reader(ckpt, spec)
        return {name: read(name, tuple((0, d) for d in g.shape))
                for name, g in global_tensors(spec).items() if g.quant_of is None}


def synthetic_bytes(spec: ModelSpec) -> int:
    """Bytes of the synthetic HF checkpoint of ``spec`` (to refuse absurd sizes early)."""
    return sum(g.nbytes for g in global_tensors(spec).values())


def write_synthetic_hf(path: str | Path, spec: ModelSpec, seed: int, *,
                       progress: Callable[[int], None] | None = None) -> Path:
    """Write a seeded random-init HF checkpoint of ``spec`` (synthetic weights, real layout).

    The whole checkpoint is built in memory (see :func:`synthetic_bytes`), then written in
    safetensors shards of at most 2 GiB with an index (one file when it fits).

    Args:
        path: target directory (created).
        spec: the model at its scale.
        seed: checkpoint seed.
        progress: called with each tensor's byte count as it is generated.

    Returns:
        The directory.
    """
    table = global_tensors(spec)
    tensors: dict[str, torch.Tensor] = {}
    for name in table:
        tensors[name] = synthetic_hf_tensor(spec, name, seed, table=table)
        if progress is not None:
            progress(tensors[name].numel() * tensors[name].element_size())
    limit = SHARD_BYTES if synthetic_bytes(spec) > SHARD_BYTES else None
    return write_hf_checkpoint(path, tensors, hf_config_dict(spec), max_shard_bytes=limit)
