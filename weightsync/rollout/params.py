"""The receiver's parameter memory: every parameter of one engine rank, in one arena, allocated once.

The engine's parameters are the local tensors of :func:`weightsync.layout.sglang.engine_layout`
(names, shapes, dtypes, pieces). :class:`ParamStore` carves them out of a single byte buffer
obtained from a :class:`ParamArena`, zero-filled (so vocab padding rows stay zero forever), and
never reallocates them: their addresses are published to senders through
``/get_remote_instance_transfer_engine_info`` as ``{name: [ptr, numel, element_size]}`` together
with the arena's transport session id, and senders write into them directly.

The arena is pluggable: :class:`TorchArena` (a plain torch allocation, the default) or any
object with the :class:`ParamArena` methods (e.g. a shared-memory arena for same-host CPU
writers, or a CUDA-IPC-exported one for same-host GPU writers), chosen by name through
:data:`ARENAS`.

Typical usage::

    store = ParamStore(engine_layout(spec, par, rank), device=torch.device("cpu"))
    w = store["model.layers.0.self_attn.qkv_proj.weight"]   # a view into the arena
    info = store.transfer_info()                              # {name: [ptr, numel, elem_size]}
"""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from weightsync.layout.box import LocalTensor, Piece

ALIGN_BYTES = 256
"""Every parameter starts at a multiple of this (CUDA allocation granularity; RDMA-friendly)."""


class ParamArena(Protocol):
    """Memory for all parameters of one engine rank; registered with its transport once.

    Lifecycle: the engine calls :meth:`allocate` exactly once at start, publishes
    :attr:`session_id` with the parameter addresses, and calls :meth:`close` at shutdown.
    """

    @property
    def session_id(self) -> str:
        """How a sender reaches this memory (transport-specific; published as is)."""
        ...

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A zero-filled 1-D uint8 tensor of ``nbytes`` bytes on the engine's device."""
        ...

    def close(self) -> None:
        """Release the memory and any registration (the parameters die with it)."""
        ...


class TorchArena:
    """A plain torch allocation: usable by in-process and two-sided (broadcast) writers only."""

    def __init__(self, device: torch.device, rank: int = 0) -> None:
        self.device = device
        self._session = f"torch://{socket.gethostname()}/{os.getpid()}/{device}/rank{rank}"
        self._buf: torch.Tensor | None = None

    @property
    def session_id(self) -> str:
        return self._session

    def allocate(self, nbytes: int) -> torch.Tensor:
        if self._buf is not None:
            raise RuntimeError("TorchArena.allocate called twice: parameters are allocated once")
        self._buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        return self._buf

    def close(self) -> None:
        self._buf = None


ArenaFactory = Callable[[torch.device, int], ParamArena]
"""Builds the arena of one engine rank from ``(device, rank)``."""

ARENAS: dict[str, str] = {
    "torch": "weightsync.rollout.params:TorchArena",
}
"""Arena name -> ``module:attribute`` of its factory (imported lazily: transports are optional)."""


def get_arena_factory(name: str) -> ArenaFactory:
    """The factory registered as ``name`` in :data:`ARENAS`.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    target = ARENAS.get(name)
    if target is None:
        raise ValueError(f"unknown parameter arena {name!r}; known: {', '.join(ARENAS)}")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class ParamStore:
    """All parameters of one engine rank, as views into one arena (see the module docstring)."""

    def __init__(self, layout: list[LocalTensor], device: torch.device, arena: ParamArena | None = None) -> None:
        """Allocate every tensor of ``layout`` once.

        Args:
            layout: the rank's local tensors (names unique).
            device: where the parameters live.
            arena: the memory provider; a :class:`TorchArena` on ``device`` when None.

        Raises:
            ValueError: duplicate names or unknown dtypes in ``layout``.
        """
        names = [t.name for t in layout]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"engine layout lists parameters twice: {dup}")
        self.device = device
        self.arena: ParamArena = arena if arena is not None else TorchArena(device)
        self.meta: dict[str, LocalTensor] = {t.name: t for t in layout}
        offsets: dict[str, int] = {}
        size = 0
        for t in layout:
            offsets[t.name] = size
            nbytes = t.numel * _torch_dtype(t.dtype).itemsize
            size += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        self.nbytes = size
        self._buf = self.arena.allocate(max(size, 1))
        if self._buf.dtype != torch.uint8 or self._buf.numel() < size or self._buf.device.type != device.type:
            raise ValueError(
                f"arena returned {self._buf.dtype} x {self._buf.numel()} on {self._buf.device}; "
                f"need uint8 x {size} on {device}"
            )
        self._tensors: dict[str, torch.Tensor] = {}
        for t in layout:
            dtype = _torch_dtype(t.dtype)
            off = offsets[t.name]
            raw = self._buf[off : off + t.numel * dtype.itemsize]
            self._tensors[t.name] = raw.view(dtype).view(t.shape)
        self._by_global: dict[str, list[tuple[str, Piece]]] = {}
        for t in layout:
            for p in t.pieces:
                self._by_global.setdefault(p.global_name, []).append((t.name, p))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> torch.Tensor | None:
        return self._tensors.get(name)

    def names(self) -> list[str]:
        return list(self._tensors)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._tensors.items()

    def global_names(self) -> list[str]:
        """The global tensors this rank holds a piece of, in layout order."""
        return list(self._by_global)

    def pieces_of(self, global_name: str) -> list[tuple[str, Piece]]:
        """``(local name, piece)`` for every piece of ``global_name`` on this rank ([] if none)."""
        return self._by_global.get(global_name, [])

    def derived_names(self) -> list[str]:
        return [n for n, t in self.meta.items() if t.derived]

    def transfer_info(self) -> dict[str, list[int]]:
        """``{name: [data_ptr, numel, element_size]}`` of every parameter (addresses never change)."""
        return {n: [t.data_ptr(), t.numel(), t.element_size()] for n, t in self._tensors.items()}

    def close(self) -> None:
        """Drop the views and release the arena."""
        self._tensors.clear()
        self.arena.close()
