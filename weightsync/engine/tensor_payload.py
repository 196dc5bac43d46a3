"""Decoding the tensors of sglang's ``/update_weights_from_tensor`` (the colocated path).

A trainer sends one entry per engine TP rank in ``serialized_named_tensors``: base64 of a
``ForkingPickler`` dump (sglang ``MultiprocessingSerializer.serialize(obj, output_str=True)``).
With ``load_format="flattened_bucket"`` the object is ``{"flattened_tensor": uint8 tensor,
"metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]}`` with byte
offsets into the buffer (sglang ``weight_sync/tensor_bucket.py``); with ``load_format`` None or
``"direct"`` it is a list of ``(name, tensor)`` pairs.

Unpickling is restricted to an allow-list, as sglang's ``SafeUnpickler`` does
(``utils/common.py``): Python containers, torch dtypes and sizes, torch's tensor and storage
rebuild functions (inline bytes, shared-memory file names and descriptors, CUDA IPC handles), and
sglang's ``FlattenedTensorMetadata``, which maps to :class:`FlattenedTensorMetadata` here (the
engine does not import sglang). Anything else is refused with the global's name.

Tensors shared through CUDA IPC or shared memory stay owned by the sender, which must keep them
alive until the call returns (as with sglang).
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

LOAD_FORMATS = (None, "direct", "flattened_bucket")
"""``load_format`` values of ``/update_weights_from_tensor`` this engine applies."""

_SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


@dataclass
class FlattenedTensorMetadata:
    """sglang's record of one tensor in a flattened bucket (same fields, same order)."""

    name: str
    shape: Any
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_ALLOWED = {
    ("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list",
                              "set", "slice", "str", "tuple")
} | {
    ("collections", "OrderedDict"),
    ("copyreg", "__newobj__"),
    ("copyreg", "__newobj_ex__"),
    ("multiprocessing.reduction", "_rebuild_partial"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "dtype"),
    ("torch", "Tensor"),
    ("torch", "UntypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch.nn.parameter", "Parameter"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
}


def _load_storage_bytes(data: bytes) -> Any:
    """``torch.storage._load_from_bytes`` without its unrestricted nested ``torch.load``."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _SGLANG_METADATA:
            return FlattenedTensorMetadata
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage_bytes
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to unpickle global {module}.{name} (not an allowed tensor type)")


def _raw(entry: str | bytes) -> bytes:
    if isinstance(entry, bytes) and entry[:1] == b"\x80":
        return entry
    try:
        return base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"serialized_named_tensors entry is not base64 of a pickle ({exc})") from None


def decode_named_tensors(entry: str | bytes, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of one rank's ``serialized_named_tensors`` entry.

    Args:
        entry: the rank's entry (base64 string, or raw pickle bytes).
        load_format: ``None``, ``"direct"`` or ``"flattened_bucket"``.

    Returns:
        The tensors in the order they were sent (on the device they were shared from).

    Raises:
        ValueError: bad base64, a refused pickle global, or an object of the wrong shape.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported here; use one of {LOAD_FORMATS}")
    try:
        obj = _Unpickler(io.BytesIO(_raw(entry))).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError) as exc:
        raise ValueError(f"serialized_named_tensors: cannot decode the payload: {exc}") from None
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
            raise ValueError("a flattened_bucket payload is {'flattened_tensor': tensor, 'metadata': [...]}")
        flat = obj["flattened_tensor"]
        if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
            raise ValueError("flattened_tensor must be a 1-D uint8 tensor")
        out = []
        for m in obj["metadata"]:
            if not isinstance(m, FlattenedTensorMetadata):
                raise ValueError(f"metadata entries must be FlattenedTensorMetadata, got {type(m).__name__}")
            if not 0 <= m.start_idx <= m.end_idx <= flat.numel():
                raise ValueError(f"{m.name}: bytes [{m.start_idx}, {m.end_idx}) lie outside the bucket")
            out.append((m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(tuple(m.shape))))
        return out
    if not isinstance(obj, (list, tuple)) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in obj
    ):
        raise ValueError("a named-tensor payload is a list of (name, tensor) pairs")
    return [(str(n), t) for n, t in obj]
