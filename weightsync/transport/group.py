"""A standalone torch.distributed group between a trainer rank and rollout ranks.

sglang's ``/init_weights_update_group`` builds such a group outside the default process group:
the trainer's stage source is rank 0 and hosts the TCP store, engine rank ``r`` joins as
``rank_offset + r``. Both sides must build it the same way, so both call
:func:`new_weight_update_group`.

Listeners bind one address (:mod:`weightsync.transport.net`): rank 0's store binds
``master_address``, and each rank's gloo pairs bind the local address on the route to
``master_address`` (``127.0.0.1`` when the master is local), never every interface. NCCL's
bootstrap sockets follow ``NCCL_SOCKET_IFNAME`` (NCCL's own rule).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from weightsync.transport.net import bound_store, gloo_device, route_source

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def new_weight_update_group(*, master_address: str, master_port: int, rank: int, world_size: int,
                            group_name: str, backend: str,
                            timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                            bind_host: str | None = None) -> dist.ProcessGroup:
    """Join (rank 0: host) a standalone process group outside the default one.

    Hangs until all ``world_size`` ranks have joined or ``timeout`` passes (a master that
    nobody listens on: the connect is retried until then).

    Args:
        master_address: host of rank 0's TCP store (rank 0 binds it).
        master_port: its port.
        rank: this process's rank in the group.
        world_size: ranks in the group.
        group_name: namespace of the group's keys in the store.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout: rendezvous and per-collective timeout.
        bind_host: the local address gloo pairs listen on (default: ``master_address`` on rank 0,
            else this host's address on the route to it).

    Returns:
        The process group (use its ``broadcast(tensor, root)`` method).

    Raises:
        ValueError: unknown backend or rank out of range.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"weight update group rank {rank} is outside [0, {world_size})")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight update group backend must be gloo or nccl, got {backend!r}")
    store = bound_store(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(group_name + "/", store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        local = bind_host or (master_address if rank == 0 else route_source(master_address))
        options._devices = [gloo_device(local)]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
