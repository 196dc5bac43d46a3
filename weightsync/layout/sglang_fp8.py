"""The fp8 block an engine serves: the checkpoint's own, re-blocked only where sglang's shards would
cut it, checked on every rank before any rank starts; and the block an engine's table shows.

sglang serves a block-fp8 checkpoint in the checkpoint's ``quantization_config.weight_block_size``
(``layers/quantization/fp8.py``: ``Fp8Config.weight_block_size`` comes from the checkpoint) and
refuses a tensor-parallel layout whose shards cut a block (``Fp8LinearMethod.create_weights``,
``Fp8MoEMethod.create_weights``). Kimi-K2's checkpoint has ``[128, 128]`` blocks, which its
reference profile (tp 32: a dense FFN shard of 576 rows) cuts; the reference system therefore
serves ``[64, 64]`` blocks. A ``[64, 64]`` grid refines a ``[128, 128]`` one: each stored fp8 value
keeps its byte and each 128x128 scale becomes the scale of its four 64x64 sub-blocks, so the
dequantized weights stay bit for bit the checkpoint's (:func:`serving_fp8_block`; the loader does
the copy, :class:`weightsync.engine.loader.CheckpointReader`). Nothing is ever re-quantized.

A trainer quantizes into whatever block the engines serve: :func:`fp8_block_from_table` reads it
from the scale sizes an engine publishes.

Typical usage::

    spec = serving_fp8_block(model_spec("Kimi-K2", checkpoint=d), par, profile_block=(64, 64))
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

from weightsync.layout.sglang import Fp8BlockCut, engine_layout
from weightsync.models.parallel import RolloutParallel
from weightsync.models.spec import ModelSpec

logger = logging.getLogger(__name__)

_CANDIDATE_SIDES = tuple(2**k for k in range(13))
"""Block sides :func:`fp8_block_from_table` tries (1 .. 4096), besides the spec's own block."""


def check_engine_ranks(spec: ModelSpec, par: RolloutParallel) -> None:
    """Build every rank's layout, so that a refusal (an fp8 block cut by a shard, sizes that do not
    divide) comes before any rank starts, as one line.

    Raises:
        ValueError: the first rank's refusal (:class:`~weightsync.layout.sglang.Fp8BlockCut` for a cut block).
    """
    for rank in range(par.tp):
        engine_layout(spec, par, rank)


def divides(small: tuple[int, int], big: tuple[int, int]) -> bool:
    """Whether blocks of ``small`` tile blocks of ``big`` (each side divides)."""
    return big[0] % small[0] == 0 and big[1] % small[1] == 0


def serving_fp8_block(spec: ModelSpec, par: RolloutParallel, profile_block: tuple[int, int] | None) -> ModelSpec:
    """``spec`` with the fp8 block an engine of ``par`` serves, every rank's layout checked.

    ``spec.fp8_block`` is the block of the weights the engine loads (a block-fp8 checkpoint's own,
    else the profile's). It is served when no shard cuts it; otherwise, when ``profile_block``
    divides it, the engine serves ``profile_block`` (a lossless re-blocking, logged).

    Args:
        spec: the model, ``fp8_block`` the checkpoint's (or None: not quantized).
        par: the engine's layout.
        profile_block: the run profile's block (None: the profile serves no fp8).

    Returns:
        ``spec``, or ``spec`` with ``fp8_block = profile_block``.

    Raises:
        ValueError: one line: a refused layout, or a cut block that ``profile_block`` cannot refine.
    """
    try:
        check_engine_ranks(spec, par)
        return spec
    except Fp8BlockCut as cut:
        block = spec.fp8_block
        assert block is not None
        if profile_block is None or profile_block == block or not divides(profile_block, block):
            raise Fp8BlockCut(f"{cut}; the checkpoint's blocks {list(block)} cannot be re-blocked losslessly into "
                              f"{list(profile_block) if profile_block else 'another size'} (it must divide them)") \
                from None
        reblocked = spec.replace(fp8_block=profile_block)
        check_engine_ranks(reblocked, par)
        logger.warning("%s: the checkpoint's fp8 blocks %s are cut by tp %d / ep %d (%s); serving its fp8 values in "
                       "blocks %s, each scale copied to its sub-blocks (lossless: the dequantized weights are the "
                       "checkpoint's)", spec.name, list(block), par.tp, par.ep, cut, list(profile_block))
        return reblocked


def fp8_block_from_table(spec: ModelSpec, par: RolloutParallel, weights: Mapping[str, Sequence[int]]
                         ) -> tuple[int, int] | None:
    """The fp8 block an engine serves, from one rank's published ``{name: [ptr, numel, element_size]}``.

    Each ``..._scale_inv`` holds ``ceil(rows / bn) * ceil(cols / bk)`` scales per weight matrix of
    the rank; the block is the one that fits every published scale (the spec's own when it fits,
    so a table that cannot tell keeps it).

    Args:
        spec: the model (``fp8_block`` None: nothing to read).
        par: the engine's layout.
        weights: rank 0's table.

    Returns:
        The block, or ``spec.fp8_block`` when the table has no scale.

    Raises:
        ValueError: no block, or several blocks other than the spec's, fit every scale (named).
    """
    if spec.fp8_block is None:
        return None
    shapes = {t.name: t.shape for t in engine_layout(spec.replace(fp8_block=None), par, 0)}
    scaled = [(shapes[n], int(weights[n + "_scale_inv"][1])) for n in shapes if n + "_scale_inv" in weights]
    if not scaled:
        return spec.fp8_block

    def fits(block: tuple[int, int]) -> bool:
        return all(math.prod(shape[:-2]) * -(-shape[-2] // block[0]) * -(-shape[-1] // block[1]) == numel
                   for shape, numel in scaled)

    if fits(spec.fp8_block):
        return spec.fp8_block
    found = [(a, b) for a in _CANDIDATE_SIDES for b in _CANDIDATE_SIDES if fits((a, b))]
    if len(found) != 1:
        raise ValueError(f"{spec.name}: the engine's fp8 scale sizes fit {found or 'no block'} "
                         f"(tried sides {_CANDIDATE_SIDES[0]}..{_CANDIDATE_SIDES[-1]}): cannot tell which block it "
                         "serves")
    return found[0]
