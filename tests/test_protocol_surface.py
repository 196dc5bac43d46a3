"""Contract: the engine's request bodies have exactly sglang's fields, and docs/engine.md says what
each one does here.

``SGLANG_FIELDS`` is the union of the fields of sglang 0.5.16, 0.5.18 and 0.5.23 (PyPI wheels),
``python/sglang/srt/managers/io_struct.py`` (the request classes named below; control requests
inherit ``rid`` and ``http_worker_ipc`` from ``BaseReq``) and ``sampling/sampling_params.py``
(``SamplingParams``' API section; the fields under "Internal fields (populated by __post_init__
or normalize(), not API-facing)" are left out). A field sglang adds later shows up here as a
failing test to decide on, not as a silent 400.
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO_ROOT
from weightsync.engine.io_struct import BODIES, Effect, RequestBody

SGLANG_FIELDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "/generate": ("GenerateReqInput", (
        "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data",
        "mm_hashes", "use_audio_in_video", "sampling_params", "return_logprob", "logprob_start_len",
        "top_logprobs_num", "token_ids_logprob", "return_sampling_mask", "return_text_in_logprobs", "stream",
        "log_metrics", "return_hidden_states", "return_routed_experts", "routed_experts_start_len",
        "return_indexer_topk", "modalities", "session_params", "lora_path", "lora_id", "custom_logit_processor",
        "positional_embed_overrides", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
        "decode_tp_size", "routed_dp_rank", "disagg_prefill_dp_rank", "routing_key", "conversation_id",
        "http_worker_ipc", "background", "require_reasoning", "priority", "extra_key", "no_logs", "custom_labels",
        "return_bytes", "return_entropy", "return_prompt_token_ids", "external_trace_header", "received_time",
        "need_wait_for_mm_inputs", "num_items_assigned", "mm_data_mooncake", "encoder_urls", "max_dynamic_patch",
        "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
        "multi_item_delimiter_indices", "mm_content_hashes", "return_flat_raw_top_logprobs",
        "return_flat_raw_top_logprobs_b64", "data_parallel_rank", "max_thinking_tokens", "cache_salt",
        "video_config", "watermark", "sampling_logprobs_mode", "return_flat_raw_output_top_logprobs",
        "mm_processor_kwargs", "token_indices_to_pool", "kv_hints",
    )),
    "/generate sampling_params": ("SamplingParams", (
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
        "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
        "custom_params", "watermark",
    )),
    "/pause_generation": ("PauseGenerationReqInput", ("rid", "http_worker_ipc", "mode")),
    "/continue_generation": ("ContinueGenerationReqInput", ("rid", "http_worker_ipc", "torch_empty_cache")),
    "/flush_cache": ("FlushCacheReqInput", ("rid", "http_worker_ipc", "timeout_s")),
    "/abort_request": ("AbortReq", (
        "rid", "http_worker_ipc", "abort_all", "finished_reason", "abort_message", "weight_versions",
    )),
    "/update_weight_version": ("UpdateWeightVersionReqInput", (
        "rid", "http_worker_ipc", "new_version", "abort_all_requests",
    )),
    "/init_weights_update_group": ("InitWeightsUpdateGroupReqInput", (
        "rid", "http_worker_ipc", "master_address", "master_port", "rank_offset", "world_size", "group_name",
        "backend",
    )),
    "/update_weights_from_distributed": ("UpdateWeightsFromDistributedReqInput", (
        "rid", "http_worker_ipc", "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
        "weight_version", "load_format", "torch_empty_cache", "selector",
    )),
    "/update_weights_from_tensor": ("UpdateWeightsFromTensorReqInput", (
        "rid", "http_worker_ipc", "serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
        "weight_version", "disable_draft_model", "torch_empty_cache", "selector",
    )),
    "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", ("rid", "http_worker_ipc", "group_name")),
    "/begin_weight_update": ("BeginWeightUpdateReqInput", ("rid", "http_worker_ipc", "selector")),
    "/end_weight_update": ("EndWeightUpdateReqInput", ("rid", "http_worker_ipc")),
    "/update_weights_from_disk": ("UpdateWeightFromDiskReqInput", (
        "rid", "http_worker_ipc", "model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
        "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest",
    )),
    "/weights_checker": ("CheckWeightsReqInput", (
        "rid", "http_worker_ipc", "action", "allow_quant_error", "skip_tensor_list", "selector",
    )),
    "/release_memory_occupation": ("ReleaseMemoryOccupationReqInput", ("rid", "http_worker_ipc", "tags")),
    "/resume_memory_occupation": ("ResumeMemoryOccupationReqInput", ("rid", "http_worker_ipc", "tags")),
}


@pytest.mark.parametrize("endpoint", sorted(SGLANG_FIELDS))
def test_bodies_have_exactly_sglangs_fields(endpoint: str) -> None:
    """Every sglang field is accepted; nothing else is, but the documented extensions."""
    model = BODIES[endpoint]
    ours = set(model.model_fields) - set(getattr(model, "EXTENSIONS", ()))
    assert ours == set(SGLANG_FIELDS[endpoint][1])
    for name, (effect, why) in model.NOTES.items():
        assert name in model.model_fields, f"{endpoint}: a note for a field that does not exist: {name}"
        assert effect is Effect.SAME or why, f"{endpoint}.{name}: say why it has no effect or is unsupported"


def _doc_section(endpoint: str) -> str:
    text = (REPO_ROOT / "docs" / "engine.md").read_text()
    fields = text[text.index("### Request fields") :]
    start = fields.index(f"`{endpoint}`:\n")
    nxt = re.search(r"\n`/[^`]+`:\n|\n### ", fields[start + 1 :])
    return fields[start : start + 1 + nxt.start()] if nxt else fields[start:]


@pytest.mark.parametrize("endpoint", sorted(BODIES))
def test_docs_table_says_what_each_field_does(endpoint: str) -> None:
    """docs/engine.md has a row for every field (the control requests' ``rid`` and
    ``http_worker_ipc`` are described once), labelled with its effect."""
    model: type[RequestBody] = BODIES[endpoint]
    section = _doc_section(endpoint)
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    for name in model.model_fields:
        effect, _ = model.effect(name)
        hits = [r for r in rows if f"`{name}`" in r.split(" | ")[0]]
        if not hits and name in ("rid", "http_worker_ipc") and effect is Effect.NO_EFFECT:
            continue
        assert len(hits) == 1, f"{endpoint}: field {name!r} has {len(hits)} rows in docs/engine.md"
        if name in getattr(model, "EXTENSIONS", ()):
            assert "extension" in hits[0]
        elif effect is Effect.NO_EFFECT:
            assert "no effect here" in hits[0], hits[0]
        elif effect is Effect.UNSUPPORTED:
            assert "another value is a 400" in hits[0], hits[0]
        else:
            assert "same as sglang" in hits[0], hits[0]
