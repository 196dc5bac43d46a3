"""The torch dtype of a dtype name as the model records write it (``"bfloat16"``, ``"float8_e4m3fn"``).

Global and local tensors carry their dtype as a name (:data:`weightsync.models.hf.DTYPE_BYTES`
lists the ones the models use), so that the records stay JSON-safe and the planner never imports
torch; the places that allocate or check tensors turn the name into a ``torch.dtype`` here. torch
is imported on first use, so importing this module does not import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` (or ``"torch.bfloat16"``, as sglang's request bodies write it) -> ``torch.bfloat16``.

    Raises:
        ValueError: ``name`` is no torch dtype.
    """
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: expected a torch dtype name such as 'bfloat16'")
    return dtype
