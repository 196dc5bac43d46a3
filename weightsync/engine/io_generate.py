"""``/generate``'s request bodies (sglang's ``GenerateReqInput`` and ``SamplingParams``, field for
field, :mod:`weightsync.engine.io_base`) and their conversion: body -> tokenized
:class:`~weightsync.engine.engine.GenRequest` s -> sglang-shaped answers.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import Field

from weightsync.engine.engine import GenRequest, GenResult
from weightsync.engine.io_base import Effect, NoteTable, RequestBody, TooLarge
from weightsync.engine.sampling import MAX_ABS_LOGIT_BIAS, MAX_SEED, MIN_SEED, SamplingParams, check_computable
from weightsync.engine.stops import MAX_STOP_CHARS, MAX_STOPS, check_stops
from weightsync.engine.tokenizer import Tokenizer
from weightsync.models.spec import ModelSpec

_NO_CACHE = "no prefix cache: every batch prefills from scratch"
_NO_METRICS = "no request metrics, logs or tracing here"
_NO_DISAGG = "not a prefill/decode-disaggregated server"
_NO_DP_ROUTING = "one DP-attention group computes the whole batch"
_TEXT_ONLY = "text-only models: no multimodal input"


# ----------------------------------------------------------------------------------------------
# /generate


class SamplingParamsInput(RequestBody):
    """``sampling_params`` (sglang ``SamplingParams``); ``null`` for a scalar means its default."""

    max_new_tokens: int | None = Field(128, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int | None] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = Field(1.0, ge=0.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = -1
    min_p: float | None = Field(0.0, ge=0.0, le=1.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(1.0, gt=0.0, le=2.0)
    min_new_tokens: int | None = Field(0, ge=0)
    n: int | None = Field(1, ge=1)
    beam_width: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    custom_params: dict[str, Any] | None = None
    watermark: Any = None

    NOTES: ClassVar[NoteTable] = {
        "beam_width": (Effect.UNSUPPORTED, "no beam search"),
        "json_schema": (Effect.UNSUPPORTED, "no grammar-constrained decoding"),
        "regex": (Effect.UNSUPPORTED, "no grammar-constrained decoding"),
        "ebnf": (Effect.UNSUPPORTED, "no grammar-constrained decoding"),
        "structural_tag": (Effect.UNSUPPORTED, "no grammar-constrained decoding"),
        "stream_interval": (Effect.NO_EFFECT, "a streamed answer is one chunk (batches run to completion)"),
        "custom_params": (Effect.NO_EFFECT, "no custom logit processors run here"),
        "stop_regex": (Effect.SAME, f"matched by RE2 in linear time: backreferences and lookaround are refused "
                                    f"(400); at most {MAX_STOPS} patterns of {MAX_STOP_CHARS} characters"),
        "stop": (Effect.SAME, f"at most {MAX_STOPS} strings of {MAX_STOP_CHARS} characters"),
        "watermark": (Effect.UNSUPPORTED, "no watermarking"),
    }

    ACCEPTED: ClassVar[dict[str, tuple[Any, ...]]] = {"beam_width": (1,)}


class GenerateReqInput(RequestBody):
    """``/generate``: one prompt, or a batch (``text`` list or ``input_ids`` list of lists)."""

    rid: str | list[str] | None = None
    session_id: str | None = None
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    input_embeds: list[list[float]] | list[list[list[float]]] | None = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: bool = False
    video_config: dict[str, Any] | None = None
    sampling_params: SamplingParamsInput | list[SamplingParamsInput] | None = None
    watermark: Any = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_sampling_mask: bool | list[bool] | None = None
    sampling_logprobs_mode: Any = None
    return_text_in_logprobs: bool = False
    return_flat_raw_top_logprobs: bool = False
    return_flat_raw_output_top_logprobs: bool = False
    return_flat_raw_top_logprobs_b64: bool = False
    stream: bool = False
    log_metrics: bool = True
    return_hidden_states: Any = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_indexer_topk: bool = False
    modalities: list[str] | None = None
    session_params: dict[str, Any] | None = None
    lora_path: str | list[str | None] | None = None
    lora_id: str | list[str | None] | None = None
    custom_logit_processor: str | list[str | None] | None = None
    positional_embed_overrides: Any = None
    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int | None] | None = None
    bootstrap_pair_key: str | list[str | None] | None = None
    decode_tp_size: int | list[int | None] | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    http_worker_ipc: str | None = None
    background: bool = False
    require_reasoning: bool = False
    max_thinking_tokens: int | None = None
    priority: int | None = None
    extra_key: str | list[str] | None = None
    no_logs: bool = False
    custom_labels: dict[str, str] | None = None
    return_bytes: bool = False
    return_entropy: bool = False
    return_prompt_token_ids: bool = False
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None
    need_wait_for_mm_inputs: bool | None = None
    num_items_assigned: Any = None
    mm_data_mooncake: list[Any] | None = None
    encoder_urls: list[str] | None = None
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    image_max_dynamic_patch: int | None = None
    video_max_dynamic_patch: int | None = None
    images_config: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    multi_item_delimiter_indices: list[int] | list[list[int]] | None = None
    token_indices_to_pool: list[int] | list[list[int]] | None = None
    cache_salt: str | list[str] | None = None
    kv_hints: Any = None

    NOTES: ClassVar[NoteTable] = {
        "stream": (Effect.SAME, "the answer arrives as one chunk, then [DONE] (batches run to completion)"),
        "session_id": (Effect.UNSUPPORTED, "no sessions"),
        "session_params": (Effect.UNSUPPORTED, "no sessions"),
        "input_embeds": (Effect.UNSUPPORTED, "prompts are token ids or text"),
        **dict.fromkeys(
            (
                "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes", "use_audio_in_video",
                "video_config", "modalities", "need_wait_for_mm_inputs", "num_items_assigned", "mm_data_mooncake",
                "encoder_urls", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
                "video_max_dynamic_patch", "images_config", "mm_processor_kwargs",
            ),
            (Effect.UNSUPPORTED, _TEXT_ONLY),
        ),
        "watermark": (Effect.UNSUPPORTED, "no watermarking"),
        "return_sampling_mask": (Effect.UNSUPPORTED, "the sampling mask is not exported"),
        "sampling_logprobs_mode": (Effect.UNSUPPORTED, "logprobs are the sampling distribution's (sglang's default)"),
        "return_flat_raw_top_logprobs": (Effect.UNSUPPORTED, "top logprobs come nested only"),
        "return_flat_raw_output_top_logprobs": (Effect.UNSUPPORTED, "top logprobs come nested only"),
        "return_flat_raw_top_logprobs_b64": (Effect.UNSUPPORTED, "top logprobs come nested only"),
        "log_metrics": (Effect.NO_EFFECT, _NO_METRICS),
        "return_hidden_states": (Effect.UNSUPPORTED, "hidden states are not exported"),
        "return_routed_experts": (
            Effect.NO_EFFECT,
            "as sglang with enable_return_routed_experts off (server_info says so): nothing is returned",
        ),
        "routed_experts_start_len": (Effect.NO_EFFECT, "routed experts are not returned (see return_routed_experts)"),
        "return_indexer_topk": (
            Effect.NO_EFFECT,
            "as sglang with enable_return_indexer_topk off (server_info says so): nothing is returned",
        ),
        "lora_path": (Effect.UNSUPPORTED, "no LoRA adapters"),
        "lora_id": (Effect.UNSUPPORTED, "no LoRA adapters"),
        "custom_logit_processor": (Effect.UNSUPPORTED, "no custom logit processors"),
        "positional_embed_overrides": (Effect.UNSUPPORTED, "positions are the tokens' own"),
        **dict.fromkeys(
            ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size"),
            (Effect.NO_EFFECT, _NO_DISAGG),
        ),
        **dict.fromkeys(
            ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank"), (Effect.NO_EFFECT, _NO_DP_ROUTING)
        ),
        "routing_key": (Effect.NO_EFFECT, "routing happens in front of the engine (router)"),
        "conversation_id": (Effect.NO_EFFECT, _NO_METRICS),
        "http_worker_ipc": (Effect.NO_EFFECT, "one HTTP worker"),
        "background": (Effect.NO_EFFECT, "every request is answered when it finishes"),
        "require_reasoning": (Effect.UNSUPPORTED, "no reasoning parser"),
        "max_thinking_tokens": (Effect.UNSUPPORTED, "no reasoning parser"),
        "priority": (Effect.NO_EFFECT, "requests are served in arrival order"),
        "extra_key": (Effect.NO_EFFECT, _NO_CACHE),
        "cache_salt": (Effect.NO_EFFECT, _NO_CACHE),
        "kv_hints": (Effect.NO_EFFECT, _NO_CACHE),
        "no_logs": (Effect.NO_EFFECT, _NO_METRICS),
        "custom_labels": (Effect.NO_EFFECT, _NO_METRICS),
        "external_trace_header": (Effect.NO_EFFECT, _NO_METRICS),
        "received_time": (Effect.NO_EFFECT, _NO_METRICS),
        "return_bytes": (Effect.UNSUPPORTED, "text is returned as a string"),
        "return_entropy": (Effect.UNSUPPORTED, "entropies are not returned"),
        "multi_item_delimiter_indices": (Effect.UNSUPPORTED, "no multi-item scoring"),
        "token_indices_to_pool": (Effect.UNSUPPORTED, "no embedding pooling"),
    }


# ----------------------------------------------------------------------------------------------
# /generate: body -> requests -> response


def _per_item(value: Any, n: int, what: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{what} has {len(value)} entries for a batch of {n} prompts")
        return value
    return [value] * n


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _as_tuple(value: str | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


_SAMPLING_FLOATS = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "frequency_penalty": 0.0,
                    "presence_penalty": 0.0, "repetition_penalty": 1.0}
"""The float sampling fields and their defaults (``null`` means the default)."""


def _sampling(sp: SamplingParamsInput, spec: ModelSpec, prompt_len: int, where: str) -> SamplingParams:
    """sglang's ``SamplingParams.__post_init__`` + ``normalize`` + ``verify``, for one prompt."""
    context = spec.max_position_embeddings
    max_new = sp.max_new_tokens if sp.max_new_tokens is not None else context - prompt_len
    if prompt_len + max_new > context:
        raise ValueError(
            f"{where}prompt ({prompt_len} tokens) + max_new_tokens ({max_new}) exceeds the context length {context}"
        )
    top_k = _or(sp.top_k, -1)
    if top_k == 0 or top_k < -1:
        raise ValueError(f"{where}top_k must be -1 (disable) or at least 1, got {top_k}")
    bias = []
    for tok, value in (sp.logit_bias or {}).items():
        try:
            tid = int(tok)
        except ValueError:
            raise ValueError(f"{where}logit_bias keys must be token ids, got {tok!r}") from None
        if not 0 <= tid < spec.vocab_size:
            raise ValueError(f"{where}logit_bias must have keys in [0, {spec.vocab_size - 1}], got {tid}")
        if not math.isfinite(value):
            raise ValueError(f"{where}logit_bias[{tok}] must be a finite number, got {value}")
        bias.append((tid, max(-MAX_ABS_LOGIT_BIAS, min(MAX_ABS_LOGIT_BIAS, float(value)))))
    check_stops(_as_tuple(sp.stop), _as_tuple(sp.stop_regex), where)
    temperature = _or(sp.temperature, 1.0)
    floats = {name: _or(getattr(sp, name), default) for name, default in _SAMPLING_FLOATS.items()}
    check_computable(where, temperature, floats["top_p"], floats["repetition_penalty"], floats)
    return SamplingParams(
        max_new_tokens=max_new,
        # sglang: 0 <= temperature < 1e-6 is greedy
        temperature=0.0 if temperature < 1e-6 else temperature,
        top_p=_or(sp.top_p, 1.0),
        top_k=top_k,
        min_p=_or(sp.min_p, 0.0),
        frequency_penalty=_or(sp.frequency_penalty, 0.0),
        presence_penalty=_or(sp.presence_penalty, 0.0),
        repetition_penalty=_or(sp.repetition_penalty, 1.0),
        min_new_tokens=_or(sp.min_new_tokens, 0),
        stop_token_ids=tuple(sorted({t for t in sp.stop_token_ids or () if t is not None})),
        stop_strs=_as_tuple(sp.stop),
        stop_regex=_as_tuple(sp.stop_regex),
        ignore_eos=_or(sp.ignore_eos, False),
        logit_bias=tuple(bias),
        sampling_seed=sp.sampling_seed,
    )


def to_gen_requests(
    body: GenerateReqInput, spec: ModelSpec, tokenizer: Tokenizer, max_requests: int | None = None
) -> tuple[list[GenRequest], bool, list[SamplingParamsInput]]:
    """Validate a ``/generate`` body and tokenize it (``n > 1`` fans each prompt out, in sglang's
    order: all prompts once, then again, ``n`` times).

    The work a body asks for is counted before anything is built for it: more than
    ``max_requests`` generations (prompts times ``n``) is refused before a prompt is tokenized, a
    prompt longer than the context before its ids are checked; each prompt is validated once, its
    ``n`` copies share it.

    Returns:
        ``(requests, is_batch, sampling_params of each request)``.

    Raises:
        ValueError: what is wrong with the body (mapped to HTTP 400).
        TooLarge: more generations than ``max_requests`` (HTTP 413).
    """
    body.refuse_unsupported()
    if (body.text is None) == (body.input_ids is None):
        raise ValueError("give exactly one of 'text' and 'input_ids'")
    raw: Any = body.text if body.text is not None else body.input_ids
    is_batch = isinstance(raw, list) and (body.text is not None or (bool(raw) and isinstance(raw[0], list)))
    raw = raw if is_batch else [raw]
    n = len(raw)
    if n == 0:
        raise ValueError("empty batch")
    params = _per_item(body.sampling_params or SamplingParamsInput(), n, "sampling_params")
    fan = {_or(p.n, 1) for p in params}
    if len(fan) != 1:
        raise ValueError(f"sampling_params.n must be the same for every prompt of a batch, got {sorted(fan)}")
    copies = fan.pop()
    total = n * copies
    if max_requests is not None and total > max_requests:
        raise TooLarge(f"a request of {total} generations ({n} prompt(s), n={copies}): the engine queues at most "
                       f"{max_requests} (split it)")
    rids = _rids(body.rid, total)
    prompts = [tokenizer.encode(t) for t in raw] if body.text is not None else raw
    templates = [_prompt_request(body, spec, prompts[i], params[i], i, n, f"prompt {i}: " if is_batch else "")
                 for i in range(n)]
    reqs = [dataclasses.replace(templates[k % n], rid=rids[k]) for k in range(total)]
    return reqs, is_batch or copies > 1, [params[k % n] for k in range(total)]


def _rids(rid: str | list[str] | None, total: int) -> list[str]:
    """The requests' ids: the body's (one per generation, unique), else fresh ones."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(total)]
    rids = [rid] if isinstance(rid, str) else list(rid)
    if len(rids) != total:
        raise ValueError(f"rid has {len(rids)} entries for a batch of {total} requests")
    if len(set(rids)) != len(rids):
        raise ValueError("rid values must be unique within a request")
    return rids


def _prompt_request(body: GenerateReqInput, spec: ModelSpec, prompt: list[int], sp: SamplingParamsInput, i: int,
                    n: int, where: str) -> GenRequest:
    """Prompt ``i`` of ``n`` validated, as a request without its rid (the cheap checks first)."""
    sp.refuse_unsupported(f"{where}sampling_params.")
    if not prompt:
        raise ValueError(f"{where}the prompt is empty")
    sampling = _sampling(sp, spec, len(prompt), where)  # the prompt's length against the context first
    start = _per_item(_or(body.logprob_start_len, -1), n, "logprob_start_len")[i]
    top = _per_item(_or(body.top_logprobs_num, 0), n, "top_logprobs_num")[i]
    picked = body.token_ids_logprob
    picks = picked if picked and isinstance(picked[0], list) else [picked] * n
    if len(picks) != n:
        raise ValueError(f"token_ids_logprob has {len(picks)} entries for a batch of {n} prompts")
    bad = [t for t in prompt if not 0 <= t < spec.vocab_size]
    if bad:
        raise ValueError(f"{where}token ids {bad[:10]} are outside the vocab [0, {spec.vocab_size})")
    if start >= len(prompt):
        raise ValueError(f"{where}logprob_start_len {start} is not below the prompt length {len(prompt)}")
    if top < 0:
        raise ValueError(f"{where}top_logprobs_num must be >= 0, got {top}")
    bad_pick = [t for t in picks[i] or () if not 0 <= t < spec.vocab_size]
    if bad_pick:
        raise ValueError(f"{where}token_ids_logprob {bad_pick[:10]} are outside the vocab")
    return GenRequest(rid="", input_ids=tuple(prompt), sampling=sampling,
                      return_logprob=_per_item(_or(body.return_logprob, False), n, "return_logprob")[i],
                      logprob_start_len=start, top_logprobs_num=top, token_ids_logprob=tuple(picks[i] or ()))


def _rows(pairs: list[tuple[float | None, int]], decode: Callable[[list[int]], str] | None) -> list[list[Any]]:
    return [[v, t, decode([t]) if decode is not None else None] for v, t in pairs]


def _alternatives(
    positions: list[list[tuple[float, int]] | None], decode: Callable[[list[int]], str] | None
) -> list[list[list[Any]] | None]:
    return [None if p is None else _rows(p, decode) for p in positions]


def output_text(req: GenRequest, res: GenResult, tokenizer: Tokenizer, sp: SamplingParamsInput | None) -> str:
    """The answer's ``text``: sglang's detokenizer trim (``trim_matched_stop``) of the output.

    A matched stop token is dropped from the text unless ``no_stop_trim``; a matched stop string
    ends the text before it (after it with ``no_stop_trim``). ``output_ids`` keep every token.
    """
    no_trim = bool(sp is not None and sp.no_stop_trim)
    skip = True if sp is None or sp.skip_special_tokens is None else sp.skip_special_tokens
    spaces = True if sp is None or sp.spaces_between_special_tokens is None else sp.spaces_between_special_tokens
    ids = list(res.output_ids)
    matched = (res.finish_reason or {}).get("matched")
    if isinstance(matched, int) and not isinstance(matched, bool) and not no_trim and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    if isinstance(matched, str) and matched in req.sampling.stop_strs:
        pos = text.find(matched)
        if pos != -1:
            text = text[: pos + len(matched)] if no_trim else text[:pos]
    return text


def to_response(
    req: GenRequest,
    res: GenResult,
    version: str,
    tokenizer: Tokenizer,
    latency: float,
    body: GenerateReqInput,
    sp: SamplingParamsInput | None,
) -> dict[str, Any]:
    """The sglang-shaped ``/generate`` response of one request (``_handle_batch_output``)."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": res.finish_reason,
        "prompt_tokens": len(req.input_ids),
        "weight_version": version,
        **({"weight_version_spans": [[i, v] for i, v in res.version_spans]} if len(res.version_spans) > 1 else {}),
        "num_retractions": res.num_retractions,
        "reasoning_tokens": 0,
        "completion_tokens": len(res.output_ids),
        "cached_tokens": 0,
        "e2e_latency": latency,
    }
    if req.return_logprob:
        decode = (lambda ids: tokenizer.decode(ids)) if body.return_text_in_logprobs else None
        start = max(req.logprob_start_len, 0)
        prompt_lps = res.input_logprobs
        meta["input_token_logprobs"] = (
            _rows(list(zip(prompt_lps, req.input_ids[start:])), decode) if prompt_lps is not None else []
        )
        meta["output_token_logprobs"] = _rows(list(zip(res.output_logprobs, res.output_ids)), decode)
        meta["output_token_logprobs_length"] = len(res.output_logprobs)
        if req.top_logprobs_num:
            meta["input_top_logprobs"] = _alternatives(res.input_top_logprobs or [], decode)
            meta["output_top_logprobs"] = _alternatives(list(res.output_top_logprobs), decode)
        if req.token_ids_logprob:
            meta["input_token_ids_logprobs"] = _alternatives(res.input_token_ids_logprobs or [], decode)
            meta["output_token_ids_logprobs"] = _alternatives(list(res.output_token_ids_logprobs), decode)
    text = output_text(req, res, tokenizer, sp)
    out: dict[str, Any] = {"text": text, "output_ids": res.output_ids, "meta_info": meta}
    if body.return_prompt_token_ids:
        out["prompt_token_ids"] = list(req.input_ids)
    return out
