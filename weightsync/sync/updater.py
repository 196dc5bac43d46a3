"""The weight-update facade: one object per trainer rank, ``update(version)`` after each optimizer step.

A training loop that already exists (Megatron, miles, verl, NeMo-style) constructs a
:class:`WeightUpdater` on every trainer rank from

* the rank's live parameters -- a megatron-core model (:meth:`WeightUpdater.from_megatron`: its
  parameters, the parallel sizes read from megatron's ``parallel_state``), or a mapping of
  Megatron-layout names to tensors plus a :class:`~weightsync.models.parallel.TrainParallel`;
  the names of both megatron-core layer specs are accepted (:mod:`weightsync.sync.names`);
* the engine URLs (the engines' layouts, parameter tables and transport are discovered from what
  sglang publishes, :mod:`weightsync.sync.engines`);
* an :class:`~weightsync.sync.updater_config.UpdaterConfig` (mode, bucket size, transport,
  verification, deadlines, the engines' access token);
* an explicit process group of the trainer ranks (never the default group deep inside).

Construction computes this rank's share of the static plan once, registers memory once and
checks everything before any byte moves; it is collective over the group. Rank 0 of the group
drives the engines' control endpoints over HTTP; every rank writes.

One update (:meth:`WeightUpdater.update`, collective over the group) is a transaction, step by
step in :mod:`~weightsync.sync.update_flow`: pause-free where every engine holds a shadow copy of
its parameters (begin, write into the shadow, end, verify, publish by a flip; the engines keep
generating and stop only for the flip), else paused (pause, begin, write, end, verify, publish,
continue). Only verified weights are published (every ``verify_every`` updates: fingerprints,
hashed by each trainer rank while it writes, against each engine's of the copy its session
wrote). On any
failure rank 0 aborts every engine's session (nothing of the attempt is ever served: a pause-free
engine keeps serving its old version, a paused one stays paused, dirty where the session wrote
what it serves; a real sglang has no abort: its session is ended and it stays paused,
:meth:`~weightsync.sync.engine_client.EngineClient.drop_session`) and :class:`UpdateError` names
the failing rank or engine; with
``UpdaterConfig.update_retries`` the attempt is first repeated from scratch (engines re-queried,
senders rebuilt). The next update after a failure rebuilds the senders too, and recovers an
engine left paused, dirty or with a dead holder's session open. :meth:`WeightUpdater.refresh`
picks up engines added or restarted between updates; :meth:`WeightUpdater.close` releases
everything. Broadcast over a group has its groups made and left by
:mod:`~weightsync.sync.broadcast_groups`; a megatron-core job's sizes come from
:mod:`~weightsync.sync.from_megatron`.

Typical usage (every trainer rank)::

    group = torch.distributed.new_group(backend="gloo")       # the trainer ranks
    with WeightUpdater(params, spec=spec, train=train, engine_urls=urls, group=group,
                       config=UpdaterConfig(mode="p2p")) as updater:
        for step in range(1, steps + 1):
            train_step()
            stats = updater.update(step)      # UpdateStats (rank 0's phases)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models.parallel import Device, RolloutParallel, TrainParallel
from weightsync.models.spec import ModelSpec
from weightsync.plan.broadcast import plan_broadcast
from weightsync.plan.inputs import PlanInputs, build_inputs
from weightsync.plan.ops import CopyOp
from weightsync.plan.records import Mode
from weightsync.sync.broadcast_groups import BroadcastGroups
from weightsync.sync.broadcast_sender import BroadcastSender
from weightsync.sync.discover import Discovered, discover
from weightsync.sync.fleet import EngineRegistry, FleetError, Roster
from weightsync.sync.from_megatron import megatron_train_parallel
from weightsync.sync.names import module_tensors, place_params
from weightsync.sync.p2p_pack import fp8_blocks
from weightsync.sync.p2p_sender import P2PSender, dest_rank_from_info
from weightsync.sync.rank_group import agree
from weightsync.sync.sglang_verify import ShareChecksum, new_verifier
from weightsync.sync.tensor_sender import TensorSender
from weightsync.sync.update_flow import ABORT_WAIT_S, run_attempt
from weightsync.sync.update_result import UpdateError, UpdateStats
from weightsync.sync.updater_config import UpdaterConfig
from weightsync.sync.verify import Verifier
from weightsync.transport import TransportConfig

if TYPE_CHECKING:  # the HTTP client (httpx) is imported only by an updater that drives engines
    from weightsync.sync.engines import Engines

log = logging.getLogger(__name__)


class WeightUpdater:
    """Moves one trainer rank's weights into the engines (see the module docstring)."""

    def __init__(self, params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *, spec: ModelSpec,
                 train: TrainParallel, engine_urls: Sequence[str] | EngineRegistry | None, group: Any,
                 config: UpdaterConfig | None = None, rollout: RolloutParallel | None = None,
                 published: Mapping[int, Mapping[str, Any]] | None = None,
                 broadcast_group: Mapping[str, Any] | None = None,
                 source_regions: Sequence[tuple[str, torch.Tensor]] | None = None,
                 placement: tuple[Sequence[Device], Sequence[Device]] | None = None) -> None:
        """Set everything up (collective over ``group``).

        Args:
            params: this rank's parameters (names of either megatron-core spec), contiguous
                tensors that stay allocated; updated in place by the training step.
            spec: the model (``weightsync.models.resolve.model_spec``).
            train: the training job's parallel sizes; ``world_size`` must be ``group``'s size.
            engine_urls: one base URL per engine, or an :class:`EngineRegistry` that
                :meth:`refresh` reads again; None only with ``published`` (no engine to drive:
                :meth:`write` only, as the benchmark uses it).
            group: the trainer ranks' process group (gloo: the control messages are host objects).
            config: how to update (default :class:`UpdaterConfig`).
            rollout: the engines' layout; default: read from their ``/server_info``.
            published: rollout rank -> what it published (``session_id``, ``weights``,
                ``descriptor``); default: read from the engines.
            broadcast_group: without engines, the weight-update groups the stage sources host
                (:class:`BroadcastSender`'s ``group``); the receivers join them themselves.
            source_regions: memory to register as the p2p write source (default: each parameter).
            placement: (trainer devices, rollout devices) for the plan's holder rule.

        Raises:
            ValueError: a parameter that cannot be placed, engines of another layout or model,
                a transport the engines do not receive through (all named, before any write).
            UpdateError: an engine could not be reached (named).
        """
        self.config = config or UpdaterConfig()
        self.spec = spec
        self.train = train
        self.pg = group
        self.rank = dist.get_rank(group)
        if dist.get_world_size(group) != train.world_size:
            raise ValueError(f"the group has {dist.get_world_size(group)} ranks, the training job "
                             f"{train.world_size} ({train}): pass the group of every trainer rank")
        self.params = agree(self.pg, lambda: place_params(params, spec, train, self.rank), "placing the parameters")
        self.device = next(iter(self.params.values())).device
        self.engines: Engines | None = None
        self.roster = Roster(engine_urls)
        """Who serves and who takes part (:class:`~weightsync.sync.fleet.Roster`)."""
        if engine_urls is not None:
            self.engines = _engines(self.roster.fleet, self.config)
        elif published is None or rollout is None:
            raise ValueError("give engine_urls, or rollout and published (no engine to drive)")
        self._source_regions = source_regions
        self._placement = placement
        self._broadcast_group_given = broadcast_group
        self._fixed = (rollout, published)
        self.plan_s = 0.0
        self.num_ops = 0
        self._count = 0
        self.p2p_sender: P2PSender | None = None
        self._bcast: BroadcastSender | None = None
        self._tensor: TensorSender | None = None
        self._verifier: Verifier | ShareChecksum | None = None

        self._groups = BroadcastGroups(self.engines, rank=self.rank, prefix=self.config.group_prefix,
                                       master_address=self.config.master_address,
                                       timeout_s=self.config.group_timeout_s)
        self._stale = False
        """An attempt failed since the senders were built: the next update rebuilds them first."""
        self.inputs: PlanInputs
        self._set_up(self._discover())

    # -- construction helpers ------------------------------------------------------------------

    @classmethod
    def from_megatron(cls, model: torch.nn.Module, *, spec: ModelSpec, engine_urls: Sequence[str], group: Any,
                      config: UpdaterConfig | None = None, **kwargs: Any) -> WeightUpdater:
        """A :class:`WeightUpdater` for this rank of a megatron-core ``GPTModel`` (either layer spec).

        The parallel sizes come from megatron-core's ``parallel_state`` (and the model's config);
        the rank is this process's rank in ``group``, whose order must be megatron's.

        Raises:
            ValueError: megatron's parallel state is not initialized, or its ranks are not
                ``group``'s (the message says which coordinate differs); see :meth:`__init__`.
        """
        train = megatron_train_parallel(model, spec, group)
        return cls(module_tensors(model), spec=spec, train=train, engine_urls=engine_urls, group=group,
                   config=config, **kwargs)

    def _discover(self) -> Discovered:
        rollout, published = self._fixed
        return discover(self.engines, self.spec, self.config, self.pg, self._inputs, rollout=rollout,
                        published=published)

    def _inputs(self, rollout: RolloutParallel, spec: ModelSpec | None = None) -> PlanInputs:
        return build_inputs(spec or self.spec, self.train, rollout, trainer_layout=trainer_layout,
                            engine_layout=engine_layout,
                            placement=self._placement)

    def _transport(self, kind: str | None) -> TransportConfig:
        want = self.config.transport
        if isinstance(want, TransportConfig):
            cfg = want
        else:
            chosen = kind if want == "auto" else str(want)
            if chosen is None:
                raise ValueError("the engines publish different transports: pass UpdaterConfig(transport=...)")
            cfg = TransportConfig(kind=chosen)
        return cfg.on_device(self.device.index if self.device.type == "cuda" else None)

    def _set_up(self, found: Discovered) -> None:
        """Plan, connect and register (collective); every rank's failure is reported on all."""
        self.discovered = found
        if found.fp8_block != self.spec.fp8_block:
            log.info("[rank%d] the engines serve fp8 blocks %s: quantizing into them (not %s)", self.rank,
                     found.fp8_block, self.spec.fp8_block)
            self.spec = self.spec.replace(fp8_block=found.fp8_block)
        self.inputs = self._inputs(found.rollout)
        verify = bool(self.config.verify_every) and self.engines is not None
        ops: list[CopyOp] = []
        if verify or Mode.P2P in self.config.modes:
            ops = agree(self.pg, self._plan_share, "planning this rank's share")
        if verify:
            self._verifier = agree(self.pg, lambda: new_verifier(found.engines, self.inputs, ops, self.params,
                                                                  rank=self.rank, pg=self.pg,
                                                                  bucket_bytes=self.config.bucket_bytes),
                                   "verifier set-up")
        if Mode.P2P in self.config.modes:
            agree(self.pg, lambda: self._set_up_p2p(found, ops), "p2p set-up")
        if Mode.BROADCAST in self.config.modes:
            self._set_up_broadcast()

    def _plan_share(self) -> list[CopyOp]:
        """This rank's share of the p2p plan: what p2p writes, and what the verification hashes."""
        from weightsync.plan.p2p import plan_p2p_for_rank

        t0 = time.perf_counter()
        ops = list(plan_p2p_for_rank(self.inputs, src_rank=self.rank).ops)
        self.plan_s = time.perf_counter() - t0
        return ops

    def _set_up_p2p(self, found: Discovered, ops: Sequence[CopyOp]) -> None:
        assert found.infos is not None
        self.num_ops = len(ops)
        needed = sorted({op.dst_rank for op in ops})
        dests = {r: dest_rank_from_info(r, found.infos[r], self.inputs.dest_layout(r)) for r in needed}
        # engines with a published shadow copy: its table too (a swap alternates the copies); an
        # engine without one is only ever asked for copy 0
        shadows = {r: dest_rank_from_info(r, {**found.infos[r], "weights": found.infos[r]["copies"][1]},
                                          self.inputs.dest_layout(r)) if found.infos[r].get("copies") else dests[r]
                   for r in needed}
        two = any(found.infos[r].get("copies") for r in needed)
        self.transport_config = self._transport(found.kind)
        slots = self._verifier.slots if isinstance(self._verifier, Verifier) else None
        self.p2p_sender = P2PSender(ops, self.params, self.transport_config.make(), dests,
                                    bucket_bytes=self.config.bucket_bytes, source_regions=self._source_regions,
                                    fp8_blocks=fp8_blocks(self.inputs), fingerprint_slots=slots,
                                    shadow_dests=shadows if two else None)

    def _gatherer(self) -> BroadcastSender:
        if self._bcast is None:
            self._bcast = BroadcastSender(self.spec, self.inputs, self.rank, trainer_layout(self.spec, self.train,
                                                                                             self.rank),
                                          self.params, group=None, device=self.device.type, pg=self.pg)
        return self._bcast

    def _set_up_broadcast(self, members: Sequence[int] | None = None) -> None:
        self._buckets = plan_broadcast(self.inputs, bucket_bytes=self.config.bucket_bytes, dst_rank=0).buckets
        tp = self.inputs.rollout.tp
        if self.config.colocated:
            self._tensor = agree(self.pg, lambda: TensorSender(self._gatherer(), self.engines, tp=tp),
                                 "broadcast set-up")
            return
        layout = trainer_layout(self.spec, self.train, self.rank)

        def sender(group: Mapping[str, Any]) -> BroadcastSender:
            return BroadcastSender(self.spec, self.inputs, self.rank, layout, self.params, group=group,
                                   device=self.device.type, pg=self.pg)

        if self._broadcast_group_given is not None:
            given = self._broadcast_group_given
            self._bcast = agree(self.pg, lambda: sender(given), "broadcast set-up")
            return
        assert self.engines is not None
        if members is None:
            members = [e for e in range(len(self.engines.clients)) if e not in self.excluded]
        group, joins = self._groups.open(self.inputs, self.pg, device_type=self.device.type, members=members)

        def join() -> BroadcastSender:
            joined = sender(group)
            self._groups.wait_joined(joins)
            return joined

        self._bcast = agree(self.pg, join, "broadcast set-up (joining the weight-update groups)")

    # -- the update -----------------------------------------------------------------------------

    def _due(self) -> bool:
        k = self.config.verify_every
        return bool(k) and (self._count - 1) % k == 0

    def update(self, version: int | str, *, mode: str | Mode | None = None) -> UpdateStats:
        """One whole update into every engine, as a transaction (collective over the group; see
        the module docstring).

        Pause-free where every engine holds a shadow copy (the engines generate throughout and
        stop only for the flip that publishes the verified shadow), else paused from
        ``pause_generation`` until the written weights verified, published and continued
        (:mod:`~weightsync.sync.update_flow`). A failed attempt aborts every engine's session
        (nothing of it is served) and, with :attr:`UpdaterConfig.update_retries`, is retried from
        scratch (engines re-queried, senders rebuilt, every byte rewritten and verified).

        Args:
            version: the weight version the engines report afterwards.
            mode: ``p2p`` or ``broadcast`` (one that was set up); default: alternate the set-up modes.

        Returns:
            The update's stats (the same on every rank).

        Raises:
            UpdateError: every attempt failed: a rank's write, an engine call or the verification
                (the last attempt's cause named); the engines serve their old version (pause-free)
                or stay paused and dirty at it.
        """
        if self.engines is None:
            raise UpdateError("this updater drives no engines (it was built from published tables): use write()")
        m = self._mode(mode)
        self._count += 1
        version = str(version)
        attempts = 1 + self.config.update_retries
        failures: list[str] = []
        for attempt in range(1, attempts + 1):
            try:
                if attempt > 1 or self._stale:
                    self._rebuild()
                stats = run_attempt(self, version, m, verify=self._due() or attempt > 1, excluded=self.excluded)
            except UpdateError as exc:
                failures.append(str(exc))
                if attempt == attempts:
                    if attempts > 1:
                        raise UpdateError(f"update to version {version}: all {attempts} attempts failed; the last: "
                                          f"{exc}") from None
                    raise
                log.warning("[rank%d] update to version %s, attempt %d of %d failed; trying again from scratch: %s",
                            self.rank, version, attempt, attempts, exc)
                continue
            except BaseException:  # the trainer group itself failed (a rank died): nothing to retry with
                self._stale = True
                if self.rank == 0 and self.engines is not None:
                    self.engines.abort_sessions(min(ABORT_WAIT_S, self.config.http_timeout_s))
                raise
            self.roster.published_by(version, stats.dropped)
            if self.rank == 0 and self.roster.followers:
                self.roster.lead(stats.engines, self._client)
            if stats.dropped:
                log.warning("[rank%d] update to version %s published by %d engine(s); dropped: %s", self.rank,
                            version, len(stats.engines), "; ".join(stats.dropped.values()))
            log.info("[rank%d] update to version %s: %s, engines idle %.1f ms", self.rank, version,
                     f"pause-free ({stats.flip})" if stats.pause_free else f"paused ({stats.pause_reason})",
                     stats.engine_idle_s * 1e3)
            return replace(stats, attempts=attempt, failed_attempts=failures)
        raise AssertionError("unreachable")

    def _rebuild(self) -> None:
        """Before a retry: query the engines again and rebuild every sender (a restarted engine's
        new addresses, fresh weight-update groups; collective).

        Raises:
            UpdateError: the engines cannot be reached or set up (named).
        """
        try:
            self._close_senders()
            if self.excluded:  # a dropped engine that is gone leaves the plan; one that is back rejoins
                self._replan(None)
            self._set_up(self._discover())
        except ValueError as exc:
            raise UpdateError(f"setting the update up again: {exc}") from None
        self._stale = False

    def _mode(self, mode: str | Mode | None) -> Mode:
        modes = self.config.modes
        m = modes[self._count % len(modes)] if mode is None else Mode.transfer(mode)
        if m not in modes:
            raise ValueError(f"mode {m} was not set up (UpdaterConfig(mode='{self.config.mode}'))")
        return m

    def path(self, mode: Mode) -> str:
        """How ``mode`` moves the bytes: ``p2p``, ``tensor`` (colocated broadcast) or ``group``."""
        return "p2p" if mode is Mode.P2P else "tensor" if self.config.colocated else "group"

    def broadcast_buckets(self, mode: Mode) -> int | None:
        """The broadcast plan's buckets (None for p2p, whose ranks count their own)."""
        return None if mode is Mode.P2P else len(self._buckets)

    def regroup(self, engines: Sequence[int]) -> bool:
        """Broadcast over a group: rebuild the weight-update groups for ``engines`` (indices) where
        they hold others (collective; after a drop). p2p and colocated broadcast have no group.

        Returns:
            Whether the groups were rebuilt.
        """
        if (Mode.BROADCAST not in self.config.modes or self.config.colocated
                or self._broadcast_group_given is not None or list(engines) == self._groups.members):
            return False
        self._close_broadcast(sources_first=True)
        self._set_up_broadcast(members=engines)
        return True

    def mark_stale(self) -> None:
        """An attempt failed: the next update rebuilds the senders first."""
        self._stale = True

    @property
    def verifier(self) -> Verifier | ShareChecksum | None:
        """The verification: fingerprints, or sglang's checksums against a real sglang (None when
        ``verify_every`` is 0)."""
        return self._verifier

    def write(self, mode: str | Mode = Mode.P2P, *, targets: Mapping[int, int] | None = None,
              fingerprint: tuple[torch.Tensor, int] | None = None, skip: Collection[int] = (),
              tolerate: bool = False) -> dict[str, Any]:
        """Only the write phase of an update, on this rank (collective over the group for
        broadcast): no engine control call except broadcast's per-bucket announcement.

        Args:
            mode: ``p2p`` or ``broadcast``.
            targets: p2p: rollout rank -> the copy its engine's session writes (default: copy
                0; broadcast: the engines write their session's copy themselves).
            fingerprint: p2p only: ``(slot vector, seed)`` to hash what is written into, while it
                is written (:meth:`P2PSender.send`).
            skip: p2p only: rollout ranks not written (engines left out of this update).
            tolerate: p2p only: a rank whose write fails is named in ``failed``, the others are
                written to the end (broadcast's groups are rebuilt instead: :meth:`regroup`).

        Returns:
            This rank's ``{"pack_s", "wire_s", "bytes", "bytes_by_dest", "buckets", "total_s",
            "failed"}`` (``failed``: rollout rank -> error).
        """
        m = Mode.transfer(mode)
        if m is Mode.P2P:
            if self.p2p_sender is None:
                raise ValueError("p2p was not set up (UpdaterConfig(mode='p2p' or 'both'))")
            s = self.p2p_sender.send(deadline_s=self.config.deadline_s, targets=targets, fingerprint=fingerprint,
                                     skip=skip, tolerate=tolerate)
            return {"pack_s": s.pack_s, "wire_s": s.wire_s, "total_s": s.total_s, "bytes": s.nbytes,
                    "bytes_by_dest": s.bytes_by_dest, "buckets": self.p2p_sender.num_buckets, "failed": s.failed}
        if Mode.BROADCAST not in self.config.modes:
            raise ValueError("broadcast was not set up (UpdaterConfig(mode='broadcast' or 'both'))")
        t0 = time.perf_counter()
        pack = wire = 0.0
        sent = 0
        for b in self._buckets:
            if self._tensor is not None:
                r = self._tensor.send_bucket(b.names)
            else:
                assert self._bcast is not None
                r = self._groups.send_bucket(self._bcast, self.inputs, b, http_timeout_s=self.config.http_timeout_s)
            pack += r["pack_s"]
            wire += r["wire_s"]
            sent += r["bytes"]
        return {"pack_s": pack, "wire_s": wire, "total_s": time.perf_counter() - t0, "bytes": sent,
                "bytes_by_dest": {}, "buckets": len(self._buckets), "failed": {}}

    def full_tensors(self) -> Iterator[dict[str, torch.Tensor]]:
        """The trainer's full (global) tensors, bucket by bucket of the broadcast plan, in the
        trainer's dtype: on each stage source the tensors of its stage, {} elsewhere (collective
        over the group: every rank must exhaust the iterator)."""
        buckets = plan_broadcast(self.inputs, bucket_bytes=self.config.bucket_bytes, dst_rank=0).buckets
        for b in buckets:
            weights = [n for n in b.names if self.inputs.globals[n].quant_of is None]
            yield self._gatherer().full_tensors(b.src_rank, weights)

    # -- engines between updates ----------------------------------------------------------------

    @property
    def excluded(self) -> dict[int, str]:
        """Engines (indices into :attr:`engines`) left out of updates (dropped, not back yet), with why."""
        return self.roster.excluded

    def refresh(self, engine_urls: Sequence[str] | None = None) -> bool:
        """Pick up engines added, removed (``engine_urls``: the new list, the same on every rank;
        default: the :class:`EngineRegistry`'s now, else the list as it was) or restarted since
        the last update, and engines dropped from an update that are back (collective).

        An engine that is back or new but does not serve the published version joins it from a
        peer that does (``/join_from_peer``: copied and verified engine to engine; this waits up
        to ``UpdaterConfig.join_timeout_s``) and takes part in the next update
        (:func:`~weightsync.sync.fleet.survey`); one that does not answer is left out of the plan.

        Returns:
            True when something changed and the senders were rebuilt (new plan share when the
            engine count changed, new addresses and transport connections otherwise).

        Raises:
            ValueError / UpdateError: as at construction.
        """
        if self.engines is None:
            raise UpdateError("this updater drives no engines (it was built from published tables)")
        old = self.discovered
        new_urls = self._replan(engine_urls)
        found = self._discover()
        # A restarted engine publishes new addresses (p2p sees it); it has also left the
        # weight-update groups, which nothing published shows: those are always joined again.
        groups = Mode.BROADCAST in self.config.modes and not self.config.colocated
        if found == old and not new_urls and not groups:
            return False
        self._close_senders()
        self._set_up(found)
        self._stale = False
        return True

    def _replan(self, engine_urls: Sequence[str] | None) -> bool:
        """The engines planned for from now (:meth:`Roster.replan <weightsync.sync.fleet.Roster.replan>`;
        collective); whether they changed."""
        assert self.engines is not None
        try:
            planned = self.roster.replan(self.engines.urls, engine_urls, self.pg, self._client,
                                         self.config.join_timeout_s)
        except FleetError as exc:
            raise UpdateError(str(exc)) from None
        if planned is None:
            return False
        self._groups.leave()
        self.engines.close()
        self.engines = _engines(planned, self.config)
        self._groups.engines = self.engines
        return True

    def _client(self, url: str) -> Any:
        """An :class:`~weightsync.sync.engine_client.EngineClient` of ``url`` (the caller closes it)."""
        from weightsync.sync.engine_client import EngineClient  # httpx: only where engines are driven

        return EngineClient(url, timeout_s=self.config.http_timeout_s, token=self.config.token)

    # -- resources ------------------------------------------------------------------------------

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds for updates: its parameters (the training job's own memory), the
        p2p staging buffers, the colocated broadcast's flat buffer, the verification's packing
        scratch (broadcast with transformed ops only)."""
        out = {"params": sum(t.numel() * t.element_size() for t in self.params.values())}
        if self.p2p_sender is not None:
            out["p2p_staging"] = self.p2p_sender.staging_bytes
        if self._tensor is not None:
            out["tensor_buffer"] = self._tensor.buffer_bytes
        if self._verifier is not None and self._verifier.scratch_bytes:
            out["verify_scratch"] = self._verifier.scratch_bytes
        return out

    @property
    def transport(self) -> Any:
        """The p2p transport (None when p2p is not set up)."""
        return None if self.p2p_sender is None else self.p2p_sender.transport

    def _close_senders(self) -> None:
        self._close_broadcast()
        if self.p2p_sender is not None:
            self.p2p_sender.close()
            self.p2p_sender = None
        if self._tensor is not None:
            self._tensor.close()
            self._tensor = None
        if self._verifier is not None:
            self._verifier.close()
            self._verifier = None

    def _close_broadcast(self, sources_first: bool = False) -> None:
        """The weight-update groups closed: the engines leave, then the sources' side ends; after
        a failed broadcast (``sources_first``) the other way round -- the survivors may still wait
        in the broken broadcast, which the sources' end breaks off."""
        if not sources_first:
            self._groups.leave()
        if self._bcast is not None:
            group = self._bcast.group
            if group is not None and hasattr(group, "shutdown"):
                group.shutdown()
            self._bcast.close()
            self._bcast = None
        self._groups.leave()

    def close(self) -> None:
        """Release registrations, connections, buffers and the engines' weight-update groups
        (idempotent; the engines keep running)."""
        self._close_senders()
        if self.engines is not None:
            self.engines.close()
            self.engines = None

    def __enter__(self) -> WeightUpdater:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _engines(urls: Sequence[str], config: UpdaterConfig) -> Engines:
    from weightsync.sync.engines import Engines

    return Engines(list(urls), timeout_s=config.http_timeout_s, token=config.token)


__all__ = ["UpdateError", "WeightUpdater"]
