"""Checking an HF checkpoint against a model before any weight is read: every global tensor
present with its shape, nothing unknown, and a usable scale for every float8 weight.

Shared by the engine's loader and the trainer's ``prepare`` (both read the same checkpoints).
"""

from __future__ import annotations

import logging
import re

from weightsync.models.checkpoint import HFCheckpoint
from weightsync.models.hf import global_tensors
from weightsync.models.spec import ModelSpec

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = {"bfloat16", "float16", "float32", "float64", "float8_e4m3fn"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: unknown, missing or mis-shaped tensors."""


_MAX_NAMES = 50
"""At most this many names per category in a refusal message (the count is always given)."""


def _names(kind: str, names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES])
    more = f" ... ({len(names) - _MAX_NAMES} more)" if len(names) > _MAX_NAMES else ""
    return f"{len(names)} {kind}: {shown}{more}"


def validate_checkpoint(spec: ModelSpec, ckpt: HFCheckpoint) -> list[str]:
    """Check that ``ckpt`` holds exactly the global tensors of ``spec``, with their shapes.

    Tensors of layers at or beyond ``spec.num_layers`` (MTP / next-n layers, or the rest of a
    model loaded at ``layers=N``) are ignored with a warning; any other extra name is refused.
    ``weight_scale_inv`` tensors belong to the checkpoint's float8 weights: required for each
    (shaped by the checkpoint's ``weight_block_size``), absent for a bf16 / float32 weight (an
    fp8-serving engine quantizes that one on load).

    Args:
        spec: the model.
        ckpt: the open checkpoint.

    Returns:
        The ignored names.

    Raises:
        CheckpointError: listing every unknown, missing, mis-shaped and non-float tensor, and
            every fp8 weight without a usable scale.
    """
    table = global_tensors(spec)
    present = set(ckpt.names())
    block = ckpt.fp8_block()
    weights = [n for n, g in table.items() if g.quant_of is None]
    fp8 = {n for n in weights if n in present and ckpt.meta(n)[1] == "float8_e4m3fn"}
    scales = {n + "_scale_inv" for n in fp8}
    ignored, unknown = [], []
    for name in sorted(present - set(weights) - scales):
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= spec.num_layers:
            ignored.append(name)
        elif not (name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in table):
            unknown.append(name)  # a scale of a weight that is not fp8 here is as unknown as any name
    missing = [n for n in weights if n not in present]
    misshaped, mistyped, unscaled = [], [], []
    for name in weights:
        if name not in present:
            continue
        shape, dtype = ckpt.meta(name)
        if shape != table[name].shape:
            misshaped.append(f"{name} {list(shape)} (expected {list(table[name].shape)})")
        if dtype not in _FLOAT_DTYPES:
            mistyped.append(f"{name} {dtype}")
        if name in fp8:
            want = _scale_shape(shape, block) if block is not None else None
            got = ckpt.meta(name + "_scale_inv")[0] if name + "_scale_inv" in present else None
            if block is None:
                unscaled.append(f"{name} (config.json has no quantization_config.weight_block_size)")
            elif got != want:
                unscaled.append(f"{name}_scale_inv {'missing' if got is None else list(got)} (expected "
                                f"{list(want)} for blocks {list(block)})")
    problems = [
        _names(k, v)
        for k, v in (
            ("unknown tensors", unknown),
            ("missing tensors", missing),
            ("mis-shaped tensors", misshaped),
            ("non-float tensors", mistyped),
            ("fp8 weights without a usable weight_scale_inv", unscaled),
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


def _scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
