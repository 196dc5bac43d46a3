"""Checking an update from the trainer side: what every engine rank must hold, against what it reports.

After the write, each engine rank's parameters must equal the trainer's weights laid out by the
engine's own loading rule. The trainer ranks compute that expectation without the engines and
without the update's plan: bucket by bucket of the broadcast plan, each stage source gathers the
full tensors of its stage (:meth:`BroadcastSender.full_tensors`, the broadcast path's gather) and
writes them into host copies of every engine rank's parameters with
:func:`~weightsync.sync.params.write_global` (the loader's rule: slices, fp8 quantization and
scales); then it hashes every parameter as sglang's ``/weights_checker`` ``checksum`` does (xxh64
of the raw bytes). The driving rank fetches the engines' checksums and names every tensor that
differs, per engine and rank.

Derived tensors (MLA ``w_kc`` / ``w_vc``, recomputed by the engine after an update) are left out
of both sides; every other parameter of every rank is compared, vocab padding included (zero on
both sides).

Cost: one gather of the model on the stage sources and host copies of one engine's parameters
(every engine holds the same), hence :class:`~weightsync.sync.updater_config.UpdaterConfig`'s
``verify_every``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weightsync.plan.broadcast import plan_broadcast, stage_sources
from weightsync.plan.inputs import PlanInputs
from weightsync.sync.broadcast_sender import BroadcastSender

if TYPE_CHECKING:
    from weightsync.sync.engines import Engines
from weightsync.sync.params import ParamStore, write_global

log = logging.getLogger(__name__)


def xxh64_hex(t: torch.Tensor) -> str:
    """The checksum sglang's weight checker reports for a tensor: xxh64 of its raw bytes."""
    import xxhash

    raw = t.detach().contiguous().to("cpu").view(torch.uint8).reshape(-1)
    return xxhash.xxh64(raw.numpy()).hexdigest()


class Verifier:
    """Expected engine checksums from the trainer's weights, and the comparison (module docstring)."""

    def __init__(self, gatherer: BroadcastSender, inputs: PlanInputs, *, rank: int, pg: Any,
                 bucket_bytes: int) -> None:
        """Args:
            gatherer: this rank's :class:`BroadcastSender` (its gather; no weight-update group needed).
            inputs: both layouts.
            rank: this trainer rank in ``pg``.
            pg: the trainer ranks' process group.
            bucket_bytes: gather this much at a time.

        Raises:
            ValueError: an engine parameter holds pieces of tensors of two pipeline stages (its
                expectation would need two sources).
        """
        self.gatherer = gatherer
        self.inputs = inputs
        self.rank = rank
        self.pg = pg
        self.buckets = plan_broadcast(inputs, bucket_bytes=bucket_bytes, dst_rank=0).buckets
        owner = stage_sources(inputs)
        self._mine: dict[int, list[str]] = {}
        for r, layout in enumerate(inputs.engine_layouts):
            names = []
            for t in layout:
                if t.derived:
                    continue
                owners = {owner[p.global_name] for p in t.pieces}
                if len(owners) > 1:
                    raise ValueError(f"engine rank {r}: {t.name} holds tensors of the stages of trainer ranks "
                                     f"{sorted(owners)}; the verifier expects one source per parameter")
                if owners == {rank}:
                    names.append(t.name)
            self._mine[r] = names
        self._stores: list[ParamStore] | None = None
        self.derived = sorted({t.name for ts in inputs.engine_layouts for t in ts if t.derived})

    def _host_stores(self) -> list[ParamStore]:
        if self._stores is None:
            # page-locked where CUDA is: the full tensors come from the GPU (ParamStore's ``pin``)
            self._stores = [ParamStore(list(layout), torch.device("cpu"), pin=True)
                            for layout in self.inputs.engine_layouts]
        return self._stores

    def expected(self) -> dict[int, dict[str, str]] | None:
        """Every engine rank's expected checksums, on rank 0 of ``pg`` (None elsewhere); collective.

        Returns:
            ``{rank inside an engine: {parameter: xxh64 hex}}`` without derived tensors.
        """
        spec = self.inputs.spec
        mine = any(self._mine.values())
        stores = self._host_stores() if mine else []
        for b in self.buckets:
            weights = [n for n in b.names if self.inputs.globals[n].quant_of is None]
            full = self.gatherer.full_tensors(b.src_rank, weights)
            for name, t in full.items():
                for store in stores:
                    if store.pieces_of(name):
                        write_global(store, spec, name, lambda box, t=t: t[tuple(slice(a, c) for a, c in box)])
        digests = {r: {n: xxh64_hex(stores[r][n]) for n in names} for r, names in self._mine.items() if names}
        everyone: list[Any] = [None] * dist.get_world_size(self.pg)
        dist.all_gather_object(everyone, digests, group=self.pg)
        if self.rank != 0:
            return None
        out: dict[int, dict[str, str]] = {r: {} for r in range(len(self.inputs.engine_layouts))}
        for part in everyone:
            for r, sums in part.items():
                out[int(r)].update(sums)
        return out

    def compare(self, engines: Engines, expected: Mapping[int, Mapping[str, str]]) -> list[str]:
        """The engines' checksums against ``expected``: one line per (engine, rank) that differs."""
        tp = len(self.inputs.engine_layouts)
        bad: list[str] = []
        for e, client in enumerate(engines.clients):
            for r in range(tp):
                got = client.weights_checker("checksum", rank=r, skip_tensor_list=self.derived)["checksums"]
                got = {n: v for n, v in got.items() if n not in self.derived}
                diff = sorted([n for n, v in expected[r].items() if got.get(n) != v]
                              + [n for n in got if n not in expected[r]])
                if diff:
                    bad.append(f"{engines.where(e)}, rank {r}: {len(diff)} of {len(expected[r])} tensors differ, "
                               f"e.g. {diff[:3]}")
        return bad

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copies of the engine parameters (0 until the first verification)."""
        return sum(s.nbytes for s in self._stores or [])

    def close(self) -> None:
        for s in self._stores or []:
            s.close()
        self._stores = None
