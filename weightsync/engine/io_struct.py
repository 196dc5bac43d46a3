"""The control, weight-update and checker request bodies of the HTTP API, field for field sglang's
(:mod:`weightsync.engine.io_base` says how a field is honoured), and :data:`BODIES`: every body by
endpoint, ``/generate``'s (:mod:`weightsync.engine.io_generate`) included. docs/engine.md
tabulates every field; a test holds the table to :data:`BODIES`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from weightsync.engine.io_base import Effect, NoteTable, RequestBody, Selector
from weightsync.engine.io_generate import GenerateReqInput, SamplingParamsInput


class _ControlBody(RequestBody):
    """sglang's ``BaseReq``: every control request also takes ``rid`` and ``http_worker_ipc``."""

    rid: str | None = None
    http_worker_ipc: str | None = None

    NOTES: ClassVar[NoteTable] = {
        "rid": (Effect.NO_EFFECT, "control requests are not tracked by id"),
        "http_worker_ipc": (Effect.NO_EFFECT, "one HTTP worker"),
    }


# ----------------------------------------------------------------------------------------------
# Control requests


class PauseGenerationReqInput(_ControlBody):
    mode: Literal["abort", "retract", "in_place"] = "abort"

    NOTES: ClassVar[NoteTable] = {
        **_ControlBody.NOTES,
        "mode": (
            Effect.SAME,
            "in_place keeps the requests but, unlike sglang, not their KV cache: they re-prefill their prompt "
            "and generated tokens on continue, as retract does",
        ),
    }


class ContinueGenerationReqInput(_ControlBody):
    torch_empty_cache: bool = True

    NOTES: ClassVar[NoteTable] = {**_ControlBody.NOTES,
                                  "torch_empty_cache": (Effect.NO_EFFECT, "no transient allocations to return")}


class FlushCacheReqInput(_ControlBody):
    timeout_s: float | None = None

    NOTES: ClassVar[NoteTable] = {**_ControlBody.NOTES,
                                  "timeout_s": (Effect.NO_EFFECT, "answered at once: no KV outlives a batch")}


class AbortReq(_ControlBody):
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None
    weight_versions: Any = None

    NOTES: ClassVar[NoteTable] = {
        **_ControlBody.NOTES,
        "rid": (Effect.SAME, "the request to abort"),
        "finished_reason": (Effect.NO_EFFECT, "aborted requests finish with reason abort"),
        "weight_versions": (Effect.NO_EFFECT, "scheduler-internal"),
    }


_NO_KV_FLUSH = "no KV outlives a batch: there is nothing to flush"
_NO_DRAFT = "no speculative decoding: the target model is the only model"


class UpdateWeightVersionReqInput(_ControlBody):
    new_version: str
    abort_all_requests: bool = True
    continue_generation: bool = False
    """Extension: after a publication or a label, continue generation in the same call (as
    ``/continue_generation``); nothing more while the version is only pending inside a session."""

    EXTENSIONS: ClassVar[tuple[str, ...]] = ("continue_generation",)
    """Fields of this engine that sglang does not have (documented, not typos)."""


class InitWeightsUpdateGroupReqInput(_ControlBody):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "nccl"

    NOTES: ClassVar[NoteTable] = {**_ControlBody.NOTES, "backend": (Effect.SAME, "gloo or nccl")}


class UpdateWeightsFromDistributedReqInput(_ControlBody):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False

    NOTES: ClassVar[NoteTable] = {
        **_ControlBody.NOTES,
        "flush_cache": (Effect.NO_EFFECT, _NO_KV_FLUSH),
        "abort_all_requests": (Effect.NO_EFFECT, "an update while generating is refused (409): pause first"),
        "load_format": (Effect.UNSUPPORTED, "tensors are broadcast one by one (flattened_bucket is not built)"),
        "selector": (Effect.NO_EFFECT, _NO_DRAFT),
        "torch_empty_cache": (Effect.NO_EFFECT, "no transient allocations to return"),
    }


class UpdateWeightsFromTensorReqInput(_ControlBody):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Selector = "all"
    disable_draft_model: bool | None = None
    torch_empty_cache: bool = False

    NOTES: ClassVar[NoteTable] = {
        **_ControlBody.NOTES,
        "load_format": (Effect.SAME, "None, direct or flattened_bucket (no custom loaders)"),
        "flush_cache": (Effect.NO_EFFECT, _NO_KV_FLUSH),
        "abort_all_requests": (Effect.NO_EFFECT, "an update while generating is refused (409): pause first"),
        "selector": (Effect.NO_EFFECT, _NO_DRAFT),
        "disable_draft_model": (Effect.NO_EFFECT, _NO_DRAFT),
        "torch_empty_cache": (Effect.NO_EFFECT, "no transient allocations to return"),
    }


class DestroyWeightsUpdateGroupReqInput(_ControlBody):
    group_name: str = "weight_update_group"


class BeginWeightUpdateReqInput(_ControlBody):
    selector: Selector = "all"
    pause_free: bool = False
    """Extension: open a pause-free session (it writes the shadow copy; the engine keeps generating)."""
    flip: Literal["swap", "copy"] = "swap"
    """Extension: how the session's copy is published (an engine whose shadow is not published copies)."""
    pause_generation: Literal["abort", "retract", "in_place"] | None = None
    """Extension: pause first (``/pause_generation`` with this mode), then begin, in one call."""

    NOTES: ClassVar[NoteTable] = {**_ControlBody.NOTES, "selector": (Effect.NO_EFFECT, _NO_DRAFT)}
    EXTENSIONS: ClassVar[tuple[str, ...]] = ("pause_free", "flip", "pause_generation")
    """Fields of this engine that sglang does not have (documented, not typos)."""


class EndWeightUpdateReqInput(_ControlBody):
    fingerprint_seed: int | None = Field(None, ge=0, lt=1 << 63)
    """Extension: after the post-load, answer the fingerprints of the session's copy with this
    seed (as ``/weights_checker`` ``fingerprint``), before anything is published."""

    EXTENSIONS: ClassVar[tuple[str, ...]] = ("fingerprint_seed",)
    """Fields of this engine that sglang does not have (documented, not typos)."""


class AbortWeightUpdateReqInput(_ControlBody):
    """``/abort_weight_update`` (an extension: sglang has no such route)."""


class UpdateWeightFromDiskReqInput(_ControlBody):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None

    NOTES: ClassVar[NoteTable] = {
        **_ControlBody.NOTES,
        "load_format": (Effect.NO_EFFECT, "the directory's safetensors are read"),
        "abort_all_requests": (Effect.NO_EFFECT, "an update while generating is refused (409): pause first"),
        "is_async": (Effect.NO_EFFECT, "the call returns when the weights are loaded"),
        "torch_empty_cache": (Effect.NO_EFFECT, "no transient allocations to return"),
        "keep_pause": (Effect.NO_EFFECT, "the engine stays in the state it was in (paused stays paused)"),
        "recapture_cuda_graph": (Effect.NO_EFFECT, "no CUDA graphs"),
        "token_step": (Effect.NO_EFFECT, "the weight version names the step"),
        "flush_cache": (Effect.NO_EFFECT, _NO_KV_FLUSH),
        "manifest": (Effect.NO_EFFECT, "the checkpoint is validated against the model instead"),
    }


_KEPT = ("the memory stays allocated (registered with the senders) and keeps the weights; no KV cache or CUDA "
         "graph outlives a batch")


class ReleaseMemoryOccupationReqInput(_ControlBody):
    tags: list[str] | None = None

    NOTES: ClassVar[NoteTable] = {**_ControlBody.NOTES, "tags": (Effect.NO_EFFECT, _KEPT + " (tags checked, recorded)")}


class ResumeMemoryOccupationReqInput(_ControlBody):
    tags: list[str] | None = None

    NOTES: ClassVar[NoteTable] = {**_ControlBody.NOTES, "tags": (Effect.NO_EFFECT, _KEPT + " (tags checked, cleared)")}


class CheckWeightsReqInput(_ControlBody):
    action: Literal["snapshot", "reset_tensors", "compare", "checksum", "fingerprint"] = "checksum"
    """sglang's actions, and ``fingerprint`` (an extension: the seeded fingerprint of every
    non-derived parameter, :mod:`weightsync.fingerprint`)."""
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    selector: Selector = "all"
    seed: int = 0
    """Extension: seed of ``reset_tensors``' random values, and of the ``fingerprint``."""
    rank: int | None = None
    """Extension: answer with this rank's result only (its fields also at the top level); the
    action runs on every rank regardless."""

    NOTES: ClassVar[NoteTable] = {
        **_ControlBody.NOTES,
        "selector": (Effect.NO_EFFECT, _NO_DRAFT),
    }
    EXTENSIONS: ClassVar[tuple[str, ...]] = ("seed", "rank")
    """Fields of this engine that sglang does not have (documented, not typos)."""


BODIES: dict[str, type[RequestBody]] = {
    "/generate": GenerateReqInput,
    "/generate sampling_params": SamplingParamsInput,
    "/pause_generation": PauseGenerationReqInput,
    "/continue_generation": ContinueGenerationReqInput,
    "/flush_cache": FlushCacheReqInput,
    "/abort_request": AbortReq,
    "/update_weight_version": UpdateWeightVersionReqInput,
    "/init_weights_update_group": InitWeightsUpdateGroupReqInput,
    "/update_weights_from_distributed": UpdateWeightsFromDistributedReqInput,
    "/update_weights_from_tensor": UpdateWeightsFromTensorReqInput,
    "/destroy_weights_update_group": DestroyWeightsUpdateGroupReqInput,
    "/begin_weight_update": BeginWeightUpdateReqInput,
    "/end_weight_update": EndWeightUpdateReqInput,
    "/abort_weight_update": AbortWeightUpdateReqInput,
    "/update_weights_from_disk": UpdateWeightFromDiskReqInput,
    "/weights_checker": CheckWeightsReqInput,
    "/release_memory_occupation": ReleaseMemoryOccupationReqInput,
    "/resume_memory_occupation": ResumeMemoryOccupationReqInput,
}
"""Every request body, by endpoint (docs/engine.md tabulates them)."""
