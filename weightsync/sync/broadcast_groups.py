"""The trainer side of the engines' weight-update groups: create them, announce each bucket, leave them.

Broadcast over a group (not colocated) needs one collective group per pipeline stage holding its
stage source (rank 0 of the group) and every rollout rank. :class:`BroadcastGroups` makes them the
way sglang's engines expect (``/init_weights_update_group``: ``master_address``, ``master_port``,
``rank_offset`` = 1 + engine index x TP, ``world_size``, ``group_name``, ``backend``): the stage
sources pick a free port each, every trainer rank learns them, rank 0 asks every engine to join --
all of them at once, before the sources build their stores -- while the sources host the groups
(both sides block until the rendezvous completes: a source's store waits until every member
joined, so posting to one engine at a time would wait for a group that cannot form). The groups
are sglang's (:mod:`weightsync.transport.group`), so the engines may be real sglang servers. Each bucket is
then announced to the engines (``/update_weights_from_distributed``: names, dtypes, shapes) while
its source broadcasts it. Group names carry a generation (``{prefix}_src{rank}_{n}``), so groups
rebuilt after a failure never meet an engine's stale one; the engines leave them on close.

Typical usage (every trainer rank; inside :class:`~weightsync.sync.updater.WeightUpdater`)::

    groups = BroadcastGroups(engines, rank=rank, prefix="weightsync", master_address=host, timeout_s=600)
    spec, joins = groups.open(inputs, pg, device_type="cuda")   # collective over the trainer ranks
    sender = BroadcastSender(..., group=spec, ...); BroadcastGroups.wait_joined(joins)
    stats = groups.send_bucket(sender, inputs, bucket, http_timeout_s=600)
    groups.leave()
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from weightsync.plan.broadcast import stage_sources
from weightsync.plan.inputs import PlanInputs
from weightsync.plan.records import Bucket
from weightsync.proc import free_port
from weightsync.sync.broadcast_sender import BroadcastSender, announcement

if TYPE_CHECKING:  # the HTTP client (httpx) is imported only by an updater that drives engines
    from weightsync.sync.engines import Engines

log = logging.getLogger(__name__)


class BroadcastGroups:
    """The weight-update groups of one updater and the engines' part in them (module docstring)."""

    def __init__(self, engines: Engines | None, *, rank: int, prefix: str, master_address: str,
                 timeout_s: float) -> None:
        """Args:
        engines: the engines that join (rank 0 drives them; None: no engine to drive).
        rank: this trainer rank in the updater's group.
        prefix: group names are ``{prefix}_src{source rank}_{generation}``.
        master_address: where the engines reach the sources' group stores.
        timeout_s: joining a group and one broadcast over it.
        """
        self.engines = engines
        self.rank = rank
        self.prefix = prefix
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.members: list[int] = []
        """The engines (indices) in the groups."""
        self.names: dict[str, str] = {}
        """Stage source rank (as a string) -> the name of its group, while the engines are in it."""
        self._generation = 0

    def open(self, inputs: PlanInputs, pg: Any, *, device_type: str, members: Sequence[int] | None = None
             ) -> tuple[dict[str, Any], list[Future]]:
        """New groups, one per stage source (collective over ``pg``: the sources' ports are shared),
        of the engines ``members`` (indices; default every engine: the plan's).

        Returns:
            The groups' description for :class:`BroadcastSender` (``group=``), and, on rank 0, the
            engines' pending joins (:meth:`wait_joined` them once the sources host their groups).
        """
        self._generation += 1
        sources = sorted(set(stage_sources(inputs).values()))
        host = self.master_address
        mine = {str(self.rank): free_port(host)} if self.rank in sources else {}
        everyone: list[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(everyone, mine, group=pg)
        ports = {k: v for part in everyone for k, v in part.items()}
        tp = inputs.rollout.tp
        members = list(range(inputs.rollout.num_engines)) if members is None else list(members)
        world = 1 + len(members) * tp
        backend = "nccl" if device_type == "cuda" else "gloo"
        names = {str(s): f"{self.prefix}_src{s}_{self._generation}" for s in sources}
        spec = {"master_address": host, "world_size": world, "backend": backend, "ports": ports,
                "group_names": names, "timeout_s": self.timeout_s}
        joins: list[Future] = []
        if self.rank == 0 and self.engines is not None:  # the engines join while the sources host (both block)
            clients = [self.engines.clients[e] for e in members]
            joins = [self.engines.submit(c.init_weights_update_group, master_address=host,
                                         master_port=int(ports[str(s)]), rank_offset=1 + i * tp, world_size=world,
                                         group_name=names[str(s)], backend=backend)
                     for s in sources for i, c in enumerate(clients)]
        self.names = names
        self.members = members
        return spec, joins

    @staticmethod
    def wait_joined(joins: list[Future]) -> None:
        """Wait for the engines' joins.

        Raises:
            RuntimeError: an engine could not join (every failure named).
        """
        failed = []
        for j in joins:
            try:
                j.result()
            except Exception as exc:  # an engine's HTTP error, reported on every rank
                failed.append(f"init_weights_update_group: {exc}")
        if failed:
            raise RuntimeError("; ".join(failed))

    def send_bucket(self, sender: BroadcastSender, inputs: PlanInputs, bucket: Bucket, *,
                    http_timeout_s: float) -> dict[str, Any]:
        """One bucket over the groups: rank 0 announces it to the engines (which then receive)
        while the sources broadcast it.

        Returns:
            The sender's stats of the bucket (``pack_s``, ``wire_s``, ``bytes``).

        Raises:
            EngineError: an engine refused the bucket (its refusal is the cause, not the broadcast's end).
        """
        announce = None
        if self.rank == 0 and self.engines is not None and self.names:
            names, dtypes, shapes = announcement(inputs, bucket.names)
            group_name = self.names[str(bucket.src_rank)]
            eng = self.engines
            announce = eng.submit(self._on_members, lambda c: c.update_weights_from_distributed(
                names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=False),
                what="update_weights_from_distributed")
            # An engine that refuses the bucket never receives it: the source's broadcast would
            # wait out the group's timeout. Taking the engines off the group ends it at once (the
            # peers close their connections); the next attempt builds new groups.
            announce.add_done_callback(lambda f, name=group_name: f.exception() is not None and self.drop(name))
        try:
            r = sender.send_bucket(bucket.names)
        except Exception:
            if announce is not None and announce.done() and announce.exception() is not None:
                raise announce.exception() from None  # the engine's refusal is the cause
            raise
        if announce is not None:
            announce.result(timeout=http_timeout_s)
        return r

    def _on_members(self, fn: Any, *, what: str) -> None:
        """``fn(client)`` on every engine in the groups.

        Raises:
            EngineError: naming every engine that failed.
        """
        from weightsync.sync.engine_client import EngineError  # httpx: only where engines are driven

        assert self.engines is not None
        _, failed = self.engines.each_of(self.members, fn, what=what)
        if failed:
            raise EngineError("; ".join(failed.values()))

    def drop(self, name: str) -> None:
        """Every engine leaves group ``name`` (best effort; it is not joined again)."""
        assert self.engines is not None
        for e in self.members:
            try:
                self.engines.clients[e].destroy_weights_update_group(name)
            except Exception as exc:  # it may never have joined
                log.warning("[rank%d] %s: leaving weight-update group %s: %s", self.rank, self.engines.where(e),
                            name, exc)
        self.names = {k: v for k, v in self.names.items() if v != name}

    def leave(self) -> None:
        """Every engine leaves every group (rank 0; best effort: an engine may be stopping)."""
        if self.rank != 0 or self.engines is None:
            return
        for name in self.names.values():
            for e in self.members:
                try:
                    self.engines.clients[e].destroy_weights_update_group(name)
                except Exception as exc:  # best effort: the engine may be stopping
                    log.warning("[rank%d] engine %d: could not leave weight-update group %s: %s", self.rank, e, name,
                                exc)
        self.names = {}
