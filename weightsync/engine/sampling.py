"""Sampling parameters, token selection and log-probabilities (rank 0 samples, then broadcasts).

Log-probability conventions (sglang's): a generated token's logprob is taken from the
distribution it was sampled from before top-p/top-k truncation, i.e. ``log_softmax(logits /
temperature)`` (plain ``log_softmax(logits)`` for greedy, ``temperature == 0``); prompt tokens'
logprobs come from ``log_softmax(logits)`` at the previous position (the first prompt token
has none).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """Per-request sampling settings (sglang ``sampling_params`` subset)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 = all tokens."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    sampling_seed: int | None = None
    """Seed of this request's generator (None: drawn from the engine's generator)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")


def _truncate(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Zero all but the top-k tokens and the smallest nucleus of mass >= top_p (then renormalize)."""
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        # Keep a token while the mass before it is below top_p (the top token always stays).
        keep &= (sorted_p.cumsum(0) - sorted_p) < top_p
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_p * keep)
    return kept / kept.sum()


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    Args:
        logits: ``[B, vocab]`` float32.
        params: one :class:`SamplingParams` per row.
        generators: one CPU generator per row (advanced by sampling).

    Returns:
        ``(tokens [B] int64, logprobs [B] float32)`` on CPU.
    """
    logits = logits.float().cpu()
    tokens = torch.empty(len(params), dtype=torch.int64)
    logprobs = torch.empty(len(params), dtype=torch.float32)
    for b, sp in enumerate(params):
        if sp.temperature == 0.0:
            logp = torch.log_softmax(logits[b], dim=-1)
            tok = int(logits[b].argmax())
        else:
            logp = torch.log_softmax(logits[b] / sp.temperature, dim=-1)
            probs = _truncate(logp.exp(), sp.top_p, sp.top_k)
            tok = int(torch.multinomial(probs, 1, generator=generators[b]))
        tokens[b] = tok
        logprobs[b] = logp[tok]
    return tokens, logprobs


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
