"""Request bodies of the HTTP API (pydantic, sglang's field names) and their conversion.

Strict parsing: a wrong type is an error (no ``"5"`` for 5), and unknown fields of
``/generate`` and its ``sampling_params`` are refused rather than silently ignored. The control
requests accept the sglang fields the engine has no use for (say so in their docstrings).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from weightsync.engine.engine import GenRequest, GenResult
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import Tokenizer
from weightsync.models.spec import ModelSpec


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SamplingParamsInput(_Body):
    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = None


class GenerateReqInput(_Body):
    """``/generate``: one prompt, or a batch (``text`` list or ``input_ids`` list of lists)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsInput | list[SamplingParamsInput] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None


class PauseGenerationReqInput(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightVersionReqInput(_Body):
    new_version: str
    abort_all_requests: bool = True


class InitWeightsUpdateGroupReqInput(_Body):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "nccl"


class UpdateWeightsFromDistributedReqInput(_Body):
    """``flush_cache``, ``abort_all_requests`` and ``load_format`` are accepted and have no effect:
    no KV outlives a batch, and an update while generating is refused (409)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class DestroyWeightsUpdateGroupReqInput(_Body):
    group_name: str = "weight_update_group"


class UpdateWeightFromDiskReqInput(_Body):
    """``load_format``, ``flush_cache`` and ``abort_all_requests`` are accepted and have no effect."""

    model_path: str
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class CheckWeightsReqInput(_Body):
    """``allow_quant_error`` and ``selector`` are accepted and have no effect: compare is bitwise."""

    action: Literal["snapshot", "reset_tensors", "compare", "checksum"]
    seed: int = 0
    """Seed of ``reset_tensors``' random values."""
    rank: int | None = None
    """Answer with this rank's result only (its fields also at the top level); the action runs on
    every rank regardless."""
    allow_quant_error: bool = False
    selector: str | None = None


def _per_item(value: Any, n: int, what: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{what} has {len(value)} entries for a batch of {n} prompts")
        return value
    return [value] * n


def to_gen_requests(body: GenerateReqInput, spec: ModelSpec, tokenizer: Tokenizer) -> tuple[list[GenRequest], bool]:
    """Validate a ``/generate`` body and tokenize it.

    Returns:
        ``(requests, is_batch)``.

    Raises:
        ValueError: what is wrong with the body (mapped to HTTP 400).
    """
    if body.stream:
        raise ValueError("stream=true is not supported by the built-in engine")
    if (body.text is None) == (body.input_ids is None):
        raise ValueError("give exactly one of 'text' and 'input_ids'")
    if body.text is not None:
        is_batch = isinstance(body.text, list)
        texts = body.text if is_batch else [body.text]
        prompts = [tokenizer.encode(t) for t in texts]
    else:
        ids = body.input_ids
        is_batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if is_batch else [ids]
    n = len(prompts)
    if n == 0:
        raise ValueError("empty batch")
    params = _per_item(body.sampling_params or SamplingParamsInput(), n, "sampling_params")
    want_lp = _per_item(body.return_logprob, n, "return_logprob")
    starts = _per_item(body.logprob_start_len, n, "logprob_start_len")
    rids = _per_item(body.rid, n, "rid") if body.rid is not None else [uuid.uuid4().hex for _ in range(n)]
    reqs = []
    for k, prompt in enumerate(prompts):
        where = f"prompt {k}: " if is_batch else ""
        if not prompt:
            raise ValueError(f"{where}the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < spec.vocab_size]
        if bad:
            raise ValueError(f"{where}token ids {bad[:10]} are outside the vocab [0, {spec.vocab_size})")
        sp = params[k]
        if len(prompt) + sp.max_new_tokens > spec.max_position_embeddings:
            raise ValueError(
                f"{where}prompt ({len(prompt)} tokens) + max_new_tokens ({sp.max_new_tokens}) exceeds "
                f"the context length {spec.max_position_embeddings}"
            )
        if starts[k] >= len(prompt):
            raise ValueError(f"{where}logprob_start_len {starts[k]} is not below the prompt length {len(prompt)}")
        sampling = SamplingParams(
            max_new_tokens=sp.max_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            stop_token_ids=tuple(sp.stop_token_ids or ()),
            ignore_eos=sp.ignore_eos,
            sampling_seed=sp.sampling_seed,
        )
        reqs.append(
            GenRequest(
                rid=rids[k],
                input_ids=tuple(prompt),
                sampling=sampling,
                return_logprob=want_lp[k],
                logprob_start_len=starts[k],
            )
        )
    return reqs, is_batch


def _logprob_rows(values: list[float | None], ids: list[int], tokenizer: Tokenizer | None) -> list[list[Any]]:
    return [[v, t, tokenizer.decode([t]) if tokenizer is not None else None] for v, t in zip(values, ids)]


def to_response(
    req: GenRequest, res: GenResult, version: str, tokenizer: Tokenizer, latency: float, text_in_logprobs: bool
) -> dict[str, Any]:
    """The sglang-shaped ``/generate`` response of one request."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": res.finish_reason,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(res.output_ids),
        "cached_tokens": 0,
        "weight_version": version,
        "e2e_latency": latency,
    }
    if req.return_logprob:
        tok = tokenizer if text_in_logprobs else None
        start = max(req.logprob_start_len, 0)
        meta["input_token_logprobs"] = (
            _logprob_rows(res.input_logprobs, list(req.input_ids[start:]), tok)
            if res.input_logprobs is not None
            else []
        )
        meta["output_token_logprobs"] = _logprob_rows(res.output_logprobs, res.output_ids, tok)
    return {"text": tokenizer.decode(res.output_ids), "output_ids": res.output_ids, "meta_info": meta}
