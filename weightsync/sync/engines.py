"""The rollout engines of an update, found from their URLs: sizes, parameter tables, control calls.

Only what sglang itself publishes is read, so a real sglang server is discovered the same way as
the built-in engine:

* ``/server_info``: ``ServerArgs`` -> the :class:`RolloutParallel` of the engines (every engine
  must agree), every rank's coordinates derived as sglang derives them, and the settings
  weightsync cannot lay out refused in one line (:mod:`weightsync.sync.server_args`);
* per rank, ``/parallelism_config`` where it exists (miles' build; checked against the derived
  coordinates; release sglang answers 404, said once) and ``/remote_instance_transfer_engine_info``:
  sglang's ``[session_id, {name: (ptr, numel, element_size)}]``, plus this project's engine's
  ``transport_descriptor`` (an extension; an engine without one is written over Mooncake at
  ``session_id``, :func:`~weightsync.sync.p2p_sender.dest_rank_from_info`). The published names,
  sizes and element sizes are checked against the derived layout -- for p2p always, for
  broadcast where the engine publishes them (:meth:`Engines.check_tables`).

Every error names the engine (index and URL) and the rank.

Typical usage::

    engines = Engines(["http://10.0.0.5:30000"])
    rollout = engines.rollout_parallel()
    infos = engines.transfer_infos(rollout, dest_layout)     # global rollout rank -> info
    engines.each(lambda c: c.pause_generation())
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

from weightsync.layout.box import LocalTensor
from weightsync.layout.sglang_coords import engine_coords
from weightsync.layout.sglang_fp8 import fp8_block_from_table
from weightsync.layout.sglang_options import options_from_table, stale_router_warning
from weightsync.models.parallel import RolloutParallel
from weightsync.models.spec import ModelSpec
from weightsync.sync.engine_client import EngineClient, EngineError
from weightsync.sync.p2p_sender import SGLANG_TRANSPORT, dest_rank_from_info
from weightsync.sync.server_args import rollout_from_server_info
from weightsync.sync.update_options import CONTROL_EXTENSIONS

log = logging.getLogger(__name__)

T = TypeVar("T")

class Engines:
    """HTTP clients of the engines of one update, in engine order (module docstring)."""

    def __init__(self, urls: Sequence[str] | Sequence[EngineClient], *, timeout_s: float = 600.0,
                 token: str | None = None) -> None:
        """Args:
            urls: one base URL (or a ready client) per engine.
            timeout_s: per HTTP request.
            token: the engines' access token (sent by the clients made here); None: none.
        """
        if not urls:
            raise ValueError("no engine URLs: give one URL per engine")
        self.clients = [u if isinstance(u, EngineClient) else EngineClient(str(u), timeout_s=timeout_s, token=token)
                        for u in urls]
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.clients)))
        self.server_infos: list[dict[str, Any]] | None = None
        """Each engine's last ``/server_info`` answer (read by :meth:`rollout_parallel`)."""

    @property
    def urls(self) -> list[str]:
        return [c.base_url for c in self.clients]

    def where(self, index: int) -> str:
        """``engine i at URL`` (for messages)."""
        return f"engine {index} at {self.clients[index].base_url}"

    def each(self, fn: Callable[[EngineClient], T], *, what: str = "") -> list[T]:
        """``fn(client)`` on every engine at once; results in engine order.

        Raises:
            EngineError: naming every engine that failed (and ``what`` was being done).
        """
        futures = [self._pool.submit(fn, c) for c in self.clients]
        out: list[Any] = []
        errors: list[str] = []
        for i, f in enumerate(futures):
            try:
                out.append(f.result())
            except Exception as exc:  # every engine's failure is reported, not only the first
                errors.append(f"{self.where(i)}: {exc}")
                out.append(None)
        if errors:
            raise EngineError((f"{what}: " if what else "") + "; ".join(errors))
        return out

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Any:
        """``fn`` in the engines' thread pool (a future)."""
        return self._pool.submit(fn, *args, **kwargs)

    def each_of(self, engines: Sequence[int], fn: Callable[[EngineClient], T], *, what: str = ""
                ) -> tuple[dict[int, T], dict[int, str]]:
        """``fn(client)`` on the engines ``engines`` (indices) at once, none of them raising.

        Returns:
            Each engine's result, and each failed engine's error (``what`` and the engine named).
        """
        futures = {e: self._pool.submit(fn, self.clients[e]) for e in engines}
        out: dict[int, T] = {}
        failed: dict[int, str] = {}
        for e, f in futures.items():
            try:
                out[e] = f.result()
            except Exception as exc:  # every engine's failure is reported, not only the first
                failed[e] = (f"{what}: " if what else "") + f"{self.where(e)}: {exc}"
        return out, failed

    def rollout_parallel(self, spec: ModelSpec | None = None) -> RolloutParallel:
        """The engines' layout from ``/server_info`` (all engines must have the same); with
        ``spec``, its layout options as engine 0's rank 0 publishes them
        (:func:`~weightsync.layout.sglang_options.options_from_table`; sglang 0.5.23's rules where
        the engine publishes no table), warning when the engine ignores router updates
        (:func:`~weightsync.layout.sglang_options.stale_router_warning`).

        Raises:
            ValueError: an engine's answer lacks a size, or two engines differ (named).
        """
        infos = self.each(lambda c: c.server_info(), what="/server_info")
        self.server_infos = infos
        layouts = []
        for i, info in enumerate(infos):
            try:
                layouts.append(rollout_from_server_info(info, len(self.clients)))
            except ValueError as exc:
                raise ValueError(f"{self.where(i)}: {exc}") from None
        for i, r in enumerate(layouts[1:], start=1):
            if r != layouts[0]:
                raise ValueError(f"{self.where(i)} has another layout ({r}) than {self.where(0)} ({layouts[0]})")
        if spec is None:
            return layouts[0]
        return self._published_options(spec, layouts[0], infos[0])

    def _table0(self) -> dict[str, Any]:
        """Rank 0's published parameter table of engine 0 ({} when it publishes none: logged)."""
        try:
            return dict(self.clients[0].transfer_engine_info(0)["remote_instance_transfer_engine_info"][1])
        except (EngineError, KeyError, IndexError, TypeError, ValueError) as exc:
            log.warning("%s publishes no parameter table (%s): its layout options and fp8 block are taken as "
                        "sglang 0.5.23's rules and the model's", self.where(0), exc)
            return {}

    def fp8_block(self, spec: ModelSpec, rollout: RolloutParallel) -> tuple[int, int] | None:
        """The fp8 block the engines serve (:func:`~weightsync.layout.sglang_fp8.fp8_block_from_table`
        on engine 0's rank 0; ``spec.fp8_block`` when it publishes no scale), which a trainer
        quantizes into.

        Raises:
            ValueError: the table fits no single block.
        """
        if spec.fp8_block is None:
            return None
        return fp8_block_from_table(spec, rollout, self._table0())

    def _published_options(self, spec: ModelSpec, rollout: RolloutParallel, info: dict[str, Any]) -> RolloutParallel:
        found = options_from_table(spec, rollout, self._table0())
        if "weightsync" not in info:  # this project's engine computes with the router it holds
            warning = stale_router_warning(spec, found, info.get("version"))
            if warning is not None:
                log.warning("%s: %s", self.where(0), warning)
        return found

    def kinds(self) -> list[tuple[bool, bool]]:
        """Per engine: (this project's engine rather than sglang, parameters on GPUs) -- from
        ``/server_info``: the built-in engine adds a ``weightsync`` key; ``device`` is ServerArgs'
        (sglang resolves an unset one to the GPU it runs on)."""
        infos = self.server_infos or self.each(lambda c: c.server_info(), what="/server_info")
        self.server_infos = infos
        return [("weightsync" in i, (i.get("device") or "cuda") != "cpu") for i in infos]

    def transfer_infos(self, rollout: RolloutParallel, dest_layout: Callable[[int], Sequence[LocalTensor]],
                       kind: str | None = None) -> dict[int, dict[str, Any]]:
        """Every rollout rank's published parameter table, checked, by global rollout rank.

        Args:
            rollout: the engines' layout.
            dest_layout: global rollout rank -> the local tensors the plan writes there.
            kind: the transport the writer uses; None: whatever the engines publish (all the same).

        Returns:
            ``{rank: {"session_id", "weights", "descriptor", "copies"}}`` (descriptor None: sglang's
            table only; ``copies``: every published copy's table, or None when the engine
            publishes one copy or sglang's table only).

        Raises:
            ValueError: ``/parallelism_config`` differs from the layout's coordinates, a rank
                publishes no table (sglang without its transfer engine: the flag is named), the
                engine publishes another transport than ``kind`` (or only sglang's table while
                ``kind`` is not Mooncake), or its parameters are not the layout's (each named
                with engine and rank).
        """
        out: dict[int, dict[str, Any]] = {}
        for e, client in enumerate(self.clients):
            for r in range(rollout.tp):
                self._check_coordinates(e, rollout, r)
                info = client.transfer_engine_info(r)
                if info is None:
                    raise ValueError(f"{self.where(e)}, rank {r} publishes no parameter table: p2p writes into a "
                                     "real sglang need its transfer engine (start it with --remote-instance-weight-"
                                     "loader-start-seed-via-transfer-engine, without --enable-memory-saver)")
                session, weights = info["remote_instance_transfer_engine_info"]
                descriptor = info.get("transport_descriptor")
                have = SGLANG_TRANSPORT if descriptor is None else str(descriptor.get("kind"))
                if kind is None:
                    kind = have
                if descriptor is None and kind != SGLANG_TRANSPORT:
                    raise ValueError(f"{self.where(e)}, rank {r} publishes sglang's transfer-engine info only (no "
                                     f"transport descriptor): only --transport {SGLANG_TRANSPORT} can write into it")
                if have != kind:
                    raise ValueError(f"{self.where(e)}, rank {r} receives through {have!r}, this update sends "
                                     f"through {kind!r}: start it with --transport {kind}")
                g = e * rollout.tp + r
                copies = info.get("weight_copies")
                out[g] = {"session_id": session, "weights": weights, "descriptor": descriptor,
                          "copies": copies if isinstance(copies, list) and len(copies) > 1 else None}
                self._check_table(e, r, g, out[g], dest_layout)
        return out

    def check_tables(self, rollout: RolloutParallel, dest_layout: Callable[[int], Sequence[LocalTensor]]) -> None:
        """Without p2p: each rank's coordinates (where ``/parallelism_config`` exists) and its
        published parameter table (where it publishes one) against the layout.

        Raises:
            ValueError: as :meth:`transfer_infos` (named).
        """
        for e, client in enumerate(self.clients):
            for r in range(rollout.tp):
                self._check_coordinates(e, rollout, r)
                info = client.transfer_engine_info(r)
                if info is not None:
                    session, weights = info["remote_instance_transfer_engine_info"]
                    self._check_table(e, r, e * rollout.tp + r, {"session_id": session, "weights": weights,
                                                                 "descriptor": info.get("transport_descriptor")},
                                      dest_layout)

    def _check_coordinates(self, e: int, rollout: RolloutParallel, r: int) -> None:
        """Rank ``r``'s ``/parallelism_config`` (miles' build) against the derived coordinates;
        an engine without the route (release sglang) is said once and trusted to ``/server_info``."""
        client = self.clients[e]
        got = client.parallelism_config(r)
        if got is None:
            if r == 0:
                log.info("%s has no /parallelism_config (release sglang): its ranks' coordinates are derived from "
                         "/server_info", self.where(e))
            return
        c = engine_coords(rollout, r)
        expect = {"tp_size": c.tp_size, "tp_rank": c.tp_rank, "attn_tp_size": c.attn_tp_size,
                  "attn_tp_rank": c.attn_tp_rank, "attn_dp_size": c.attn_dp_size, "attn_dp_rank": c.attn_dp_rank,
                  "ep_size": c.moe_ep_size, "ep_rank": c.moe_ep_rank, "moe_tp_size": c.moe_tp_size,
                  "moe_tp_rank": c.moe_tp_rank, "pp_size": 1}
        bad = [f"{k}={got[k]} (plan: {v})" for k, v in expect.items() if k in got and got[k] != v]
        if bad:
            raise ValueError(f"{self.where(e)}, rank {r}: /parallelism_config differs: " + ", ".join(bad))

    def _check_table(self, e: int, r: int, g: int, info: dict[str, Any],
                     dest_layout: Callable[[int], Sequence[LocalTensor]]) -> None:
        try:  # the parameters it publishes are the ones the plan writes (names, sizes)
            dest_rank_from_info(g, info, dest_layout(g))
        except ValueError as exc:
            raise ValueError(f"{self.where(e)}, rank {r}: {exc}") from None

    def pause_free(self, infos: dict[int, dict[str, Any]] | None = None, tp: int = 1) -> str | None:
        """Why the engines cannot all take pause-free updates (each engine named), or None.

        Args:
            infos: what :meth:`transfer_infos` found, when p2p writes the engines (a shadow that
                senders address needs its published table); None: no p2p.
            tp: ranks per engine (``infos`` is by global rollout rank).
        """
        why = []
        for e, shadow in enumerate(self.each(lambda c: c.shadow(), what="/server_info")):
            if not (shadow or {}).get("pause_free"):
                why.append(f"{self.where(e)} holds no shadow copy")
            elif infos is not None and any(rank.get("published", 1) > 1 for rank in shadow.get("ranks", [])) and any(
                    infos[e * tp + r].get("copies") is None for r in range(tp)):
                why.append(f"{self.where(e)} publishes no table of its shadow copy (--transfer-info-format sglang)")
        return "; ".join(why) or None

    def control_extensions(self) -> bool:
        """Whether every engine takes every control extension of
        :data:`~weightsync.sync.update_options.CONTROL_EXTENSIONS` (then an update sends them)."""
        found = self.each(lambda c: c.control_extensions(), what="/server_info")
        return all(set(CONTROL_EXTENSIONS) <= set(f) for f in found)

    def begin_weight_update(self, *, pause_free: bool = False, flip: str | None = None,
                            pause_generation: str | None = None) -> list[Any]:
        """``begin_weight_update`` on every engine (each answer in engine order; ``pause_free``,
        ``flip`` and ``pause_generation``: :meth:`EngineClient.begin_weight_update`); an engine whose earlier session
        is still open (its holder gone: a killed run, an abort that did not arrive) has that
        session aborted first -- this caller drives the engine now, and the new session recovers it.

        Raises:
            EngineError: naming every engine that refused or could not be reached.
        """
        return self.each(lambda c: begin_recovering(c, pause_free=pause_free, flip=flip,
                                                    pause_generation=pause_generation), what="begin_weight_update")

    def abort_sessions(self, wait_s: float, engines: Sequence[int] | None = None) -> None:
        """End every engine's session (or those of ``engines``) without publishing
        (:meth:`EngineClient.drop_session`: the built-in engine's ``abort_weight_update``, sglang's
        ``end_weight_update``), waiting at most ``wait_s`` (an engine that is gone or refuses is
        logged: its session was not opened, or the next one replaces it)."""
        which = range(len(self.clients)) if engines is None else engines
        futures = {self._pool.submit(self.clients[i].drop_session): i for i in which}
        done, late = wait(futures, timeout=wait_s)
        for f in done:
            if f.exception() is not None:
                log.warning("%s: ending the failed update's session: %s", self.where(futures[f]), f.exception())
        for f in late:
            log.warning("%s: ending the failed update's session: not answered within %.0f s",
                        self.where(futures[f]), wait_s)

    def sglang_held(self) -> str:
        """What a failed update leaves on the engines that are real sglang servers (for the error
        message; "" when there is none)."""
        sglang = [self.where(i) for i, c in enumerate(self.clients) if c.builtin is False]
        if not sglang:
            return ""
        return ("; sglang engines -- " + ", ".join(sglang) + " -- have no abort: their session was ended, their "
                "weights are partly written until the next update rewrites them; do not continue their generation "
                "before it")

    def close(self) -> None:
        """Close the clients (the engines keep running)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()


def begin_recovering(client: EngineClient, **kwargs: Any) -> Any:
    """``begin_weight_update`` on one engine (``kwargs``: its options), ending a stale session first
    (:meth:`Engines.begin_weight_update`; the built-in engine answers 409 "in progress", sglang 400
    "already open").

    Raises:
        EngineError: the engine refused or could not be reached.
    """
    try:
        return client.begin_weight_update(**kwargs)
    except EngineError as exc:
        stale = (exc.status == 409 and "in progress" in str(exc)) or (
            exc.status == 400 and "already open" in str(exc))
        if not stale:
            raise
    log.warning("%s: an earlier update's session is still open; ending it to begin this one", client.base_url)
    client.session_id = None  # whichever session is open
    client.drop_session()
    return client.begin_weight_update(**kwargs)
