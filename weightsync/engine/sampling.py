"""Sampling parameters, logit processing, token selection and log-probabilities (rank 0 samples,
then broadcasts).

Order of operations per row and step (sglang's): the raw logits get the ``logit_bias``, the
penalties over the tokens generated so far (repetition: divide positive / multiply negative
logits; frequency: minus ``count * f``; presence: minus ``p`` once seen) and, until
``min_new_tokens`` are out, the stop tokens masked; then temperature; then top-k, top-p and
min-p truncation of the probabilities, and one draw.

Log-probability conventions (sglang's): a generated token's logprob is taken from the
distribution it was sampled from before top-p/top-k/min-p truncation, i.e. ``log_softmax(processed
logits / temperature)`` (plain ``log_softmax`` for greedy, ``temperature == 0``); prompt tokens'
logprobs come from ``log_softmax(logits)`` at the previous position (the first prompt token has
none).

What the kernels can compute (checked when a request is parsed, :func:`check_computable`): every
float is finite; ``sampling_seed`` is a 64-bit value (:data:`MIN_SEED`, :data:`MAX_SEED`), and
rank 0 seeds its generators inside the step's error handling (a failure ends the batch on every
rank, not the engine); ``temperature`` below ``1e-6`` is greedy (sglang's rule), so no division by
a denormal happens; ``top_p`` is at least float32's smallest normal (below it the nucleus test in
float32 keeps nothing); ``repetition_penalty`` is at least ``1e-6``; ``logit_bias`` values are
clamped to ``[-1e6, 1e6]``. Sampling also always keeps the most probable token, and a row whose
logits or probabilities still come out non-finite is reported (:func:`sample_tokens`'s
``errors``) instead of raising, so one request never ends its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MIN_TOP_P = float(torch.finfo(torch.float32).tiny)
"""The smallest ``top_p`` the float32 nucleus test distinguishes from 0."""
MIN_REPETITION_PENALTY = 1e-6
"""Below this, dividing a logit by the penalty overflows float32 for ordinary logits."""
MAX_ABS_LOGIT_BIAS = 1e6
"""``logit_bias`` values are clamped to +-this (a larger one changes nothing a float32 softmax can show)."""
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
"""``sampling_seed`` bounds: what a torch generator takes (a signed or an unsigned 64-bit value)."""


def generator_seed(seed: int, progress: int) -> int:
    """The seed of a request's generator after ``progress`` tokens (a resumed request goes on from
    its own seed and progress): ``seed + progress`` modulo 2**64, which is how torch reads a
    negative seed too, so it never overflows the generator."""
    return (seed + progress) % 2**64


def check_computable(where: str, temperature: float, top_p: float, repetition_penalty: float,
                     floats: dict[str, float]) -> None:
    """Refuse sampling parameters outside what the sampling kernels compute (module docstring).

    Raises:
        ValueError: names the field, its value and the bound.
    """
    for name, value in floats.items():
        if not math.isfinite(value):
            raise ValueError(f"{where}{name} must be a finite number, got {value}")
    if not temperature >= 0:
        raise ValueError(f"{where}temperature must be >= 0, got {temperature}")
    if top_p < MIN_TOP_P:
        raise ValueError(f"{where}top_p must be at least {MIN_TOP_P:.3g} (float32's smallest normal; smaller "
                         f"values keep no token), got {top_p}")
    if repetition_penalty < MIN_REPETITION_PENALTY:
        raise ValueError(f"{where}repetition_penalty must be at least {MIN_REPETITION_PENALTY:g} (1.0 = no penalty), "
                         f"got {repetition_penalty}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """Per-request sampling settings (sglang ``sampling_params``, already normalized)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 = all tokens."""
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop_strs: tuple[str, ...] = field(default_factory=tuple)
    """Stop strings (sglang ``stop``): generation ends when the decoded output contains one."""
    stop_regex: tuple[str, ...] = field(default_factory=tuple)
    """Stop patterns (sglang ``stop_regex``), searched in the decoded output."""
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    """``(token id, bias)`` pairs added to the logits."""
    sampling_seed: int | None = None
    """Seed of this request's generator (None: drawn from the engine's generator)."""

    def __post_init__(self) -> None:
        check_computable("", self.temperature, self.top_p, self.repetition_penalty,
                         {n: getattr(self, n) for n in ("temperature", "top_p", "min_p", "frequency_penalty",
                                                        "presence_penalty", "repetition_penalty")})
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.sampling_seed is not None and not MIN_SEED <= self.sampling_seed <= MAX_SEED:
            raise ValueError(f"sampling_seed must be in [{MIN_SEED}, {MAX_SEED}], got {self.sampling_seed}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {self.repetition_penalty}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], got {self.min_new_tokens}"
            )

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


def process_logits(
    logits: torch.Tensor, sp: SamplingParams, output_ids: Sequence[int], stop_ids: Sequence[int]
) -> torch.Tensor:
    """Bias, penalties and the ``min_new_tokens`` mask applied to one row's float32 logits.

    Args:
        logits: ``[vocab]`` float32 (not modified).
        sp: the row's sampling parameters.
        output_ids: the tokens generated so far (before a pause too).
        stop_ids: stop tokens masked while fewer than ``min_new_tokens`` were generated.

    Returns:
        The processed logits (a new tensor, or ``logits`` itself when nothing applies).
    """
    if not (sp.logit_bias or sp.penalized or (stop_ids and len(output_ids) < sp.min_new_tokens)):
        return logits
    out = logits.clone()
    for tok, bias in sp.logit_bias:
        out[tok] += bias
    if sp.penalized and output_ids:
        ids = torch.tensor(list(output_ids), dtype=torch.int64)
        counts = torch.bincount(ids, minlength=out.numel()).to(out.dtype)
        seen = counts > 0
        if sp.repetition_penalty != 1.0:
            out = torch.where(seen & (out > 0), out / sp.repetition_penalty, out)
            out = torch.where(seen & (out <= 0), out * sp.repetition_penalty, out)
        out -= sp.frequency_penalty * counts + sp.presence_penalty * seen.to(out.dtype)
    if stop_ids and len(output_ids) < sp.min_new_tokens:
        out[torch.tensor(sorted(set(stop_ids)), dtype=torch.int64)] = float("-inf")
    return out


def _truncate(probs: torch.Tensor, top_p: float, top_k: int, min_p: float) -> torch.Tensor:
    """Zero all but the top-k tokens, the smallest nucleus of mass >= top_p, and tokens below
    ``min_p`` times the top probability (then renormalize)."""
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        # Keep a token while the mass before it is below top_p.
        keep &= (sorted_p.cumsum(0) - sorted_p) < top_p
    if min_p > 0.0:
        # relative to the top probability, so renormalizing after top-k/top-p changes nothing
        keep &= sorted_p >= min_p * sorted_p[0]
    keep[0] = True  # the most probable token always stays, whatever float32 made of the bounds
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_p * keep)
    return kept / kept.sum()


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    histories: list[Sequence[int]] | None = None,
    stop_ids: list[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str | None]]:
    """Pick one token per row.

    Args:
        logits: ``[B, vocab]`` float32.
        params: one :class:`SamplingParams` per row.
        generators: one CPU generator per row (advanced by sampling).
        histories: per row, the tokens generated so far (penalties, ``min_new_tokens``).
        stop_ids: per row, the stop tokens ``min_new_tokens`` holds back.

    Returns:
        ``(tokens [B] int64, logprobs [B] float32, logprob rows [B, vocab] float32, errors)`` on
        CPU; the rows are the distributions the tokens were drawn from (before truncation);
        ``errors[b]`` is None, or why row ``b`` has no token (non-finite logits or probabilities;
        its token is then 0).
    """
    logits = logits.float().cpu()
    tokens = torch.zeros(len(params), dtype=torch.int64)
    rows = torch.zeros_like(logits)
    errors: list[str | None] = [None] * len(params)
    for b, sp in enumerate(params):
        row = process_logits(logits[b], sp, histories[b] if histories else (), stop_ids[b] if stop_ids else ())
        if torch.isnan(row).any() or torch.isposinf(row).any() or not torch.isfinite(row).any():
            errors[b] = "sampling failed: the logits are not finite (the weights or the sampling parameters)"
            continue
        if sp.temperature == 0.0:
            logp = torch.log_softmax(row, dim=-1)
            tok = int(row.argmax())
        else:
            logp = torch.log_softmax(row / sp.temperature, dim=-1)
            probs = _truncate(logp.exp(), sp.top_p, sp.top_k, sp.min_p)
            if not (torch.isfinite(probs).all() and probs.sum() > 0):
                errors[b] = (f"sampling failed: no finite probability at temperature {sp.temperature}, "
                             f"top_p {sp.top_p}, top_k {sp.top_k}, min_p {sp.min_p}")
                continue
            tok = int(torch.multinomial(probs, 1, generator=generators[b]))
        tokens[b] = tok
        rows[b] = logp
    return tokens, rows.gather(1, tokens[:, None])[:, 0], rows, errors


def prompt_logprobs(logits: torch.Tensor, ids: list[int]) -> list[float | None]:
    """Logprob of each prompt token given the ones before it (``None`` for the first).

    Args:
        logits: ``[len(ids), vocab]`` logits at the prompt positions.
        ids: the prompt.

    Returns:
        ``len(ids)`` values.
    """
    if len(ids) < 2:
        return [None] * len(ids)
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    picked = logp.gather(1, torch.tensor(ids[1:], device=logp.device)[:, None])[:, 0]
    return [None, *picked.cpu().tolist()]
