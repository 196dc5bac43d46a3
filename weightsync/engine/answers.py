"""What a generation request's answer is made of, across the runs it takes: a request stopped and
requeued with its tokens (``retract``, a ``recompute`` flip) is answered once, with every token,
the logprobs recorded when each was generated, ``num_retractions`` and every weight version it
generated with (:attr:`~weightsync.engine.engine.GenResult.version_spans`).

The scheduler (:mod:`weightsync.engine.scheduler`) keeps one :class:`Pending` per request and
builds its answer with these functions.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass

from weightsync.engine.engine import GenRequest, GenResult


@dataclass(slots=True)
class Pending:
    """A request queued or running, and the future its answer resolves."""

    req: GenRequest
    """What runs next: the request itself, or its continuation after a retract."""
    future: Future
    partial: GenResult | None = None
    """What the request generated before it was retracted (None: never retracted)."""


def spans_of(p: Pending, r: GenResult, version: str) -> list[tuple[int, str]]:
    """Every version of ``p``'s answer after a run that started at ``version`` and produced ``r``
    (whose own spans are the flips during that run, indices relative to its output)."""
    offset = len(p.partial.output_ids) if p.partial is not None else 0
    spans = list(p.partial.version_spans) if p.partial is not None else []
    for i, v in [(0, version), *r.version_spans]:
        if spans and spans[-1][1] == v:
            continue
        if spans and spans[-1][0] == i + offset:
            spans.pop()  # a version that produced no token of the answer
        spans.append((i + offset, v))
    return spans


def aborted(req: GenRequest, why: str, partial: GenResult | None = None) -> GenResult:
    """The answer of a request ended early (finish reason ``abort``), with what it had generated."""
    res = partial if partial is not None else GenResult(rid=req.rid)
    res.finish_reason = {"type": "abort", "message": why}
    return res


def merged(partial: GenResult | None, new: GenResult) -> GenResult:
    """A retracted request's result so far followed by what its continuation generated."""
    if partial is None:
        return new
    return GenResult(
        rid=partial.rid,
        output_ids=partial.output_ids + new.output_ids,
        output_logprobs=partial.output_logprobs + new.output_logprobs,
        input_logprobs=partial.input_logprobs,
        output_top_logprobs=partial.output_top_logprobs + new.output_top_logprobs,
        output_token_ids_logprobs=partial.output_token_ids_logprobs + new.output_token_ids_logprobs,
        input_top_logprobs=partial.input_top_logprobs,
        input_token_ids_logprobs=partial.input_token_ids_logprobs,
        finish_reason=new.finish_reason,
        num_retractions=partial.num_retractions,
        version_spans=partial.version_spans,
    )


def continuation(req: GenRequest, done: GenResult) -> GenRequest:
    """The request that goes on from ``done``: prompt + generated tokens, no prompt logprobs again."""
    original = req.input_ids[: len(req.input_ids) - len(req.prior_output_ids)]
    return dataclasses.replace(
        req,
        input_ids=original + tuple(done.output_ids),
        prior_output_ids=tuple(done.output_ids),
        logprob_start_len=-1,
    )
