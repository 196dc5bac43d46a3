"""The copies of one engine rank's parameters: the served one, and a shadow that update sessions write.

An engine rank holds one or two :class:`~weightsync.sync.params.ParamStore` copies of its
parameters, all of one layout (:class:`WeightCopies`):

* copy 0 is the **home** copy: its addresses are the ones sglang's
  ``/get_remote_instance_transfer_engine_info`` publishes (and miles caches at start-up);
* the **published** copies (``stores[:published]``) are the ones senders can address: their
  tables are all published (weightsync's ``weight_copies`` extension), copy 0 first;
* the **served** copy is the one the model reads; every other copy is a **shadow**.

An update session targets one copy (:meth:`WeightCopies.begin`). A session opened the sglang way
(on a paused engine, without the pause-free flag) targets the home copy, as sglang and miles
expect: in place when the home copy is served, else a shadow refreshed from the served copy. A
pause-free session targets the shadow, so the engine keeps generating from the served copy while
the shadow is written. A session whose copy is not the served one begins by copying the served
copy into it (:meth:`WeightCopies.begin`: writes made there before the session are wiped, and a
caller that rewrites only some tensors keeps the others), and is published by a **flip**
(:meth:`WeightCopies.flip`):

* ``swap`` -- the session's copy becomes the served one (one reference per rank; the model reads
  its store by name on every call); the next session then writes the other copy. Only where both
  copies are published (a sender can address either);
* ``copy`` -- the session's copy is copied into the served one (pointer-stable: the served
  addresses never change).

An aborted session (:meth:`WeightCopies.abort`) never touched the served copy unless it wrote it
in place. Layouts by transport (:meth:`~weightsync.sync.p2p_receiver.Receiver.open`):

* shm (staged): copy 0 is the registered segment, the served copy is private memory no sender can
  address (so a write outside a session never reaches what is served): two copies, one published,
  flips are copies;
* cuda_ipc, mooncake and no transport, with a shadow: both copies in one registered block, both
  published, swap or copy; without a shadow (no memory for it): copy 0 alone, sessions write it
  in place and generation must be paused around them.

Typical usage (one engine rank)::

    copies = WeightCopies([live, shadow], published=2)
    copies.begin(pause_free=True, flip="swap")   # shadow := served; the session writes copies.session_store()
    ...                                          # writes, post-load on the session's copy
    copies.flip()                                # at a step boundary: the shadow is served
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from weightsync.sync.params import ParamStore
from weightsync.sync.update_options import FLIPS

HOME = 0
"""The copy whose addresses sglang's transfer-engine info publishes."""

SHADOW_HEADROOM_BYTES = 2 << 30
"""GPU memory left free beside both copies before ``--shadow auto`` takes a shadow (activations,
KV cache); at least 5 % of the device as well."""


def shadow_fits(nbytes: int, device: torch.device) -> bool:
    """Whether a second copy of ``nbytes`` fits on ``device`` beside the first (module constants)."""
    if device.type != "cuda":
        return True
    free, total = torch.cuda.mem_get_info(device)
    return free >= 2 * nbytes + max(SHADOW_HEADROOM_BYTES, total // 20)


class WeightCopies:
    """The copies of one engine rank's parameters and the open session's target (module docstring)."""

    def __init__(self, stores: Sequence[ParamStore], *, published: int, served: int = HOME,
                 pause_free: bool = True) -> None:
        """Args:
        stores: one or two stores of one layout.
        published: how many of ``stores`` (from the first) senders can address.
        served: the copy the model reads at start.
        pause_free: pause-free sessions are allowed (a shadow exists and ``serve --shadow`` is
            not ``off``).

        Raises:
            ValueError: no store, more than two, layouts that differ, or indices out of range.
        """
        if not 1 <= len(stores) <= 2:
            raise ValueError(f"an engine rank holds one or two copies of its parameters, got {len(stores)}")
        if any(s.names() != stores[0].names() or s.nbytes != stores[0].nbytes for s in stores[1:]):
            raise ValueError("the copies of an engine rank's parameters must share one layout")
        if not 1 <= published <= len(stores) or not 0 <= served < len(stores):
            raise ValueError(f"published={published}, served={served} do not fit {len(stores)} copies")
        self.stores = list(stores)
        self.published = published
        self.served = served
        self.pause_free = pause_free and len(stores) == 2
        self.target: int | None = None
        """The open session's copy (None: no session)."""
        self.kind: str | None = None
        """How the open session is published: ``swap``, ``copy``, or None (in place: nothing to flip)."""

    # ------------------------------------------------------------------ what is where

    @property
    def served_store(self) -> ParamStore:
        return self.stores[self.served]

    @property
    def has_shadow(self) -> bool:
        return len(self.stores) == 2

    @property
    def can_swap(self) -> bool:
        """Both copies are published: a swap leaves every copy addressable by senders."""
        return self.published == 2

    def session_store(self) -> ParamStore:
        """The store the open session writes (the served one when no session is open)."""
        return self.stores[self.target] if self.target is not None else self.served_store

    @property
    def in_place(self) -> bool:
        """The open session writes the served copy (it becomes dirty, generation must wait)."""
        return self.target is not None and self.target == self.served

    def tables(self) -> list[dict[str, list[int]]]:
        """``{name: [ptr, numel, element_size]}`` of every published copy, copy 0 first."""
        return [s.transfer_info() for s in self.stores[: self.published]]

    def describe(self) -> dict[str, Any]:
        """``{"copies", "published", "served", "pause_free", "swap"}`` (for ``/server_info``)."""
        return {"copies": len(self.stores), "published": self.published, "served": self.served,
                "pause_free": self.pause_free, "swap": self.can_swap}

    # ------------------------------------------------------------------ a session

    def begin(self, *, pause_free: bool, flip: str = "swap") -> dict[str, Any]:
        """Open a session: choose its copy (module docstring) and copy the served one into it
        when it is another.

        Args:
            pause_free: write a shadow (generation goes on); else the home copy (sglang's way).
            flip: ``swap`` or ``copy``; a swap where both copies are not published is a copy.

        Returns:
            ``{"target_copy", "flip" (None: in place), "in_place", "refreshed_bytes", "seconds"}``.

        Raises:
            ValueError: pause-free without a shadow, or an unknown flip.
        """
        if flip not in FLIPS:
            raise ValueError(f"flip must be one of {', '.join(FLIPS)}, got {flip!r}")
        if pause_free and not self.pause_free:
            raise ValueError("this engine rank holds no shadow copy for a pause-free update")
        t0 = time.perf_counter()
        target = 1 - self.served if pause_free else HOME
        nbytes = 0
        if target != self.served:
            nbytes = self.stores[target].copy_from(self.served_store)
            _sync(self.served_store)
        self.target = target
        self.kind = None if target == self.served else flip if self.can_swap else "copy"
        return {"target_copy": target, "flip": self.kind, "in_place": target == self.served,
                "refreshed_bytes": nbytes, "seconds": time.perf_counter() - t0}

    def flip(self) -> dict[str, Any]:
        """Publish the open session's copy: swap or copy it in (nothing for an in-place session);
        the session closes. Returns ``{"flip", "seconds", "served"}``."""
        t0 = time.perf_counter()
        kind = self.kind
        if self.target is not None and self.target != self.served:
            if kind == "swap":
                self.served = self.target
            else:
                self.served_store.copy_from(self.stores[self.target])
                _sync(self.served_store)
        self.target = self.kind = None
        return {"flip": kind, "seconds": time.perf_counter() - t0, "served": self.served}

    def abort(self) -> None:
        """Close the session unpublished (its copy is left as it is; the next session refreshes it)."""
        self.target = self.kind = None

    def close(self) -> None:
        for s in self.stores:
            s.close()


def _sync(store: ParamStore) -> None:
    """Wait for the copies queued on ``store``'s device (the flip is over when its bytes are)."""
    if store.device.type == "cuda":
        torch.cuda.synchronize(store.device)
