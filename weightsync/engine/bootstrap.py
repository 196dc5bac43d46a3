"""Bringing up one engine rank: process group, groups, transport and parameters, engine, weights.

Used by :mod:`weightsync.engine.serve` for rank 0 (this process) and the spawned ranks. Loading
ends with a startup agreement over the control group: if any rank failed to load, every rank
raises (the failing one its own error), so no rank waits forever for a peer that died.

Listeners: the engine's ranks share one host, so their process group's store and gloo pairs
listen on loopback only (the store is bound by :func:`weightsync.transport.net.bound_store`; gloo
devices follow ``GLOO_SOCKET_IFNAME``, which each rank sets to the loopback interface before it
builds a group). An engine whose HTTP address is not loopback must have a token
(:func:`check_access`).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weightsync.engine.engine import Engine
from weightsync.engine.tp import EngineGroups
from weightsync.layout.sglang_fp8 import serving_fp8_block
from weightsync.models.parallel import RolloutParallel
from weightsync.models.resolve import model_spec, profile_fp8_block
from weightsync.models.spec import ModelSpec
from weightsync.transport import TransportConfig
from weightsync.transport.net import bound_store, interface_of, is_loopback, is_wildcard

if TYPE_CHECKING:
    from weightsync.engine.config import ServeConfig

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def check_access(cfg: ServeConfig) -> None:
    """Refuse an engine reachable beyond this machine without a token.

    Raises:
        ValueError: ``cfg.host`` is not a loopback address and ``cfg.token`` is None.
    """
    if cfg.token is None and not is_loopback(cfg.host):
        raise ValueError(
            f"--host {cfg.host} makes the engine reachable from other machines: its control API and weight "
            f"endpoints need a token then (set WEIGHTSYNC_TOKEN or pass --token-file FILE; clients send it as "
            f"'Authorization: Bearer <token>'), or serve on 127.0.0.1"
        )


def check_config(cfg: ServeConfig) -> tuple[ModelSpec, RolloutParallel]:
    """The model and parallel sizes of ``cfg``, refused early when sglang would refuse them.

    The architecture and shapes come from the checkpoint's config.json when ``cfg.checkpoint`` is
    set (:func:`weightsync.models.resolve.model_spec`), else from the registry at ``cfg.scale``;
    the fp8 block is the checkpoint's, or the profile's where that is cut
    (:func:`weightsync.layout.sglang_fp8.serving_fp8_block`). Every rank's layout is built here.

    Raises:
        ValueError: unknown model or scale, a checkpoint config of another family or with a field
            the engine cannot honour, bad sizes (an fp8 block cut by a shard included), not enough
            CUDA devices, an address beyond loopback without a token.
    """
    check_access(cfg)
    spec = model_spec(cfg.model, cfg.scale, checkpoint=cfg.checkpoint, dtype=cfg.dtype)
    par = RolloutParallel(
        tp=cfg.tp, dp=cfg.dp, ep=cfg.ep, moe_dense_tp=cfg.moe_dense_tp_size, dp_lm_head=cfg.enable_dp_lm_head,
        router_fp32=cfg.router_fp32, dsa_indexer_fusion=cfg.dsa_indexer_fusion,
        shared_experts_fusion=cfg.shared_experts_fusion,
    )
    # every rank's layout, before any rank starts: a block-fp8 checkpoint is served in its own blocks,
    # re-blocked losslessly into the profile's where a shard would cut them, refused in one line otherwise
    spec = serving_fp8_block(spec, par, profile_fp8_block(cfg.model, cfg.scale))
    if cfg.device == "cuda" and torch.cuda.device_count() < par.tp:
        raise ValueError(f"tp={par.tp} needs {par.tp} CUDA devices, found {torch.cuda.device_count()}")
    return spec, par


def transport_config(cfg: ServeConfig) -> TransportConfig | None:
    """The engine's p2p transport as its command line gives it (None: ``--transport none``).

    The kind arrives resolved (a launcher resolved ``auto`` with the run's placement); the
    engine adds what only it knows: its own address, for a backend whose peers connect to its
    ports (``opens_ports``). Each rank binds its CUDA device when it opens the transport.
    """
    if cfg.transport is None or not cfg.transport.backend.opens_ports:
        return cfg.transport
    return cfg.transport.on_host(advertised_host(cfg))


def advertised_host(cfg: ServeConfig) -> str:
    """The address peers reach this engine at: ``--host``, or this host's name's address for a
    wildcard (``0.0.0.0``)."""
    return cfg.host if not is_wildcard(cfg.host) else socket.gethostbyname(socket.gethostname())


def build_rank(cfg: ServeConfig, spec: ModelSpec, par: RolloutParallel, rank: int, port: int, *,
               cancel: Any = None) -> Engine:
    """Join the engine's process group (tp > 1), allocate the rank's parameters and load them.

    Collective over the engine's ranks when ``tp > 1``. ``cancel``: the counter the engine's ranks
    share to end broadcast receives (:attr:`BroadcastReceiver.cancel
    <weightsync.sync.broadcast_receiver.BroadcastReceiver.cancel>`); None: this rank's own.

    Raises:
        The rank's own load error, or RuntimeError naming the ranks that failed to load.
    """
    if cfg.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cfg.cpu_threads)
    if par.tp > 1:
        timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)
        # gloo groups built from here on (the default one, the control group) pair over loopback;
        # weight-update groups name their own device (weightsync.transport.group)
        lo = interface_of(LOOPBACK)
        if lo is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = lo
        store = bound_store(LOOPBACK, port, par.tp, is_master=rank == 0, timeout=timeout)
        dist.init_process_group(
            "nccl" if cfg.device == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=par.tp,
            timeout=timeout,
        )
        groups = EngineGroups.build(par, rank)
    else:
        groups = EngineGroups.single(par)
    dtype = getattr(torch, cfg.compute_dtype) if cfg.compute_dtype else None
    engine = Engine.build(
        spec,
        groups,
        device=device,
        compute_dtype=dtype,
        transport=transport_config(cfg),
        group_timeout_s=cfg.group_timeout_s,
        shadow=cfg.shadow,
    )
    if cancel is not None:
        engine.broadcast.cancel = cancel
    error: BaseException | None = None
    if cfg.join_from:  # the weights come from a peer (weightsync.engine.join): nothing to load
        logger.info("[rank%d] joining from %s: no weights loaded", rank, ", ".join(cfg.join_from))
        _agree(groups, rank, None)
        return engine
    try:
        stats = (engine.load_checkpoint(cfg.checkpoint) if cfg.load_format == "auto" and cfg.checkpoint
                 else engine.load_dummy(cfg.seed))
        logger.info(
            "[rank%d] loaded %d tensors (%.1f MB) in %.2f s", rank, stats.num_tensors, stats.nbytes / 1e6, stats.seconds
        )
    except Exception as exc:  # agreed on below, then re-raised as is
        error = exc
    _agree(groups, rank, error)
    return engine


def _agree(groups: EngineGroups, rank: int, error: BaseException | None) -> None:
    """Every rank learns whether all loaded; a failed rank re-raises its own error."""
    if groups.control is not None:
        flags = [None] * groups.world
        dist.all_gather_object(flags, error is None, group=groups.control)
        failed = [r for r, ok in enumerate(flags) if not ok]
    else:
        failed = [rank] if error is not None else []
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"[rank{rank}] engine ranks {failed} failed to load their weights (see their logs)")


def finish_rank(engine: Engine) -> None:
    """Release the rank's parameters and groups, then the process group."""
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()
