"""sglang's rank coordinates inside one engine, and the vocab rows each rank holds.

Derived exactly as sglang derives them: ``layers/dp_attention.py``
(``compute_dp_attention_world_info``), ``distributed/parallel_state.py``
(``initialize_model_parallel``: the ``_MOE_EP`` / ``_MOE_TP`` groups) and
``layers/vocab_parallel_embedding.py`` (``pad_vocab_size``, ``VocabParallelEmbedding._get_indices``).
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.models.parallel import RolloutParallel
from weightsync.models.spec import ModelSpec

VOCAB_PADDING = 64
"""sglang ``DEFAULT_VOCAB_PADDING_SIZE``: the vocab is padded to a multiple of this (or of this times the
split, when the split does not divide the padded vocab), then split evenly."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineCoords:
    """A rank's coordinates inside one engine, as sglang's parallel groups assign them."""

    tp_rank: int
    tp_size: int
    attn_tp_rank: int
    """Rank in the attention-TP group (``dp_attention.compute_dp_attention_world_info``)."""
    attn_tp_size: int
    attn_dp_rank: int
    """DP-attention group this rank serves (0 when DP-attention is off)."""
    attn_dp_size: int
    moe_ep_rank: int
    """Rank in the MoE expert-parallel group (``parallel_state._MOE_EP``)."""
    moe_ep_size: int
    moe_tp_rank: int
    """Rank in the MoE tensor-parallel group (``parallel_state._MOE_TP``)."""
    moe_tp_size: int


def engine_coords(par: RolloutParallel, rank: int) -> EngineCoords:
    """The sglang coordinates of ``rank`` inside one engine.

    sglang lays ranks out as (attn_dp, attn_tp) with attention-TP fastest
    (``attn_tp_rank = tp_rank % attn_tp_size``, ``attn_dp_rank = tp_rank // attn_tp_size``), and
    as (moe_ep, moe_tp) with moe-TP fastest: the ``_MOE_TP`` groups are runs of ``moe_tp_size``
    consecutive ranks, the ``_MOE_EP`` groups stride by ``moe_tp_size``.

    Args:
        par: the engine's parallel sizes.
        rank: rank inside the engine, ``0 <= rank < par.tp``.

    Returns:
        The :class:`EngineCoords`.

    Raises:
        ValueError: ``rank`` out of range.
    """
    if not 0 <= rank < par.tp:
        raise ValueError(f"engine rank {rank} is outside [0, tp={par.tp})")
    attn_tp = par.attn_tp
    moe_tp = par.moe_tp
    return EngineCoords(
        tp_rank=rank,
        tp_size=par.tp,
        attn_tp_rank=rank % attn_tp,
        attn_tp_size=attn_tp,
        attn_dp_rank=rank // attn_tp,
        attn_dp_size=par.dp,
        moe_ep_rank=(rank // moe_tp) % par.ep,
        moe_ep_size=par.ep,
        moe_tp_rank=rank % moe_tp,
        moe_tp_size=moe_tp,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class VocabShard:
    """The vocab rows of one rank's embedding or lm_head (sglang ``VocabParallelEmbedding``)."""

    split: int
    """How many ranks share the vocab (1 = replicated)."""
    split_rank: int
    padded_vocab: int
    """Vocab padded to a multiple of :data:`VOCAB_PADDING` (of ``VOCAB_PADDING * split`` when ``split``
    does not divide that)."""
    rows: int
    """Local rows, padding included (``padded_vocab // split``)."""
    start: int
    """First token id held (``split_rank * rows``, clipped to the vocab)."""
    stop: int
    """One past the last real token id held; local rows ``[stop - start, rows)`` are padding."""


def vocab_shard(spec: ModelSpec, par: RolloutParallel, rank: int, *, lm_head: bool) -> VocabShard:
    """Which vocab rows ``rank`` holds in ``model.embed_tokens`` (or ``lm_head`` when ``lm_head``).

    ``embed_tokens`` is split over the attention-TP group (every model class builds it with
    ``use_attn_tp_group=is_dp_attention_enabled()``, or DeepseekV2Model through
    ``get_embedding_tp_kwargs``; attention-TP is the whole TP group without DP-attention);
    ``lm_head`` is split over the attention-TP group with ``--enable-dp-lm-head`` and over the
    full TP group otherwise. The vocab is padded to a multiple of :data:`VOCAB_PADDING`, or of
    ``VOCAB_PADDING * split`` when the split does not divide that
    (``VocabParallelEmbedding.__init__``: ``padding_size *= tp_size``).

    Args:
        spec: the model.
        par: the engine's parallel sizes.
        rank: rank inside the engine.
        lm_head: describe ``lm_head.weight`` instead of ``model.embed_tokens.weight``.

    Returns:
        The :class:`VocabShard`.

    Raises:
        ValueError: rank out of range.
    """
    c = engine_coords(par, rank)
    if lm_head and not par.dp_lm_head:
        split, split_rank = c.tp_size, c.tp_rank
    else:
        split, split_rank = c.attn_tp_size, c.attn_tp_rank
    padded = _pad(spec.vocab_size, VOCAB_PADDING)
    if padded % split:
        padded = _pad(spec.vocab_size, VOCAB_PADDING * split)
    rows = padded // split
    start = min(split_rank * rows, spec.vocab_size)
    stop = min(start + rows, spec.vocab_size)
    return VocabShard(split=split, split_rank=split_rank, padded_vocab=padded, rows=rows, start=start, stop=stop)


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
