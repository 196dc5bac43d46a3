"""A standalone torch.distributed group between a trainer rank and rollout ranks, built the way
sglang and miles build it, so that either side can be weightsync's or theirs.

sglang's ``/init_weights_update_group`` builds such a group outside the default process group:
the trainer's stage source is rank 0 and hosts the TCP store, engine rank ``r`` joins as
``rank_offset + r``. miles' trainer (``miles/utils/distributed_utils.py`` ``init_process_group``)
and sglang's engine (``srt/utils/common.py`` ``init_custom_process_group``) run the same code:
torch's ``tcp://`` rendezvous, ``PrefixStore(group_name)``, then torch's private
``_new_process_group_helper``. That fixes what every member must do to meet the others:

* the store: ``TCPStore(..., wait_for_workers=True)`` on every rank (torch's
  ``_create_c10d_store``): each store adds itself to the ``init/`` counter, and the master's
  constructor waits until all ``world_size`` members have (a client that is not counted leaves
  the master waiting: "1/2 clients joined");
* the keys: ``PrefixStore(group_name)`` (theirs), then ``PrefixStore(group_name + "/")`` and
  ``PrefixStore("cpu/")`` for gloo or ``"cuda/"`` for NCCL (torch's helper: the group, then the
  first device of the backend's config), i.e. ``"<G>/<G>//cpu//<key>"`` in the store;
* the collective: one ``broadcast`` from rank 0 per tensor.

:func:`new_weight_update_group` builds exactly that with public torch classes (no default group
needed, nothing registered in torch's global group tables), so weightsync meets weightsync,
miles' trainer and sglang's engines alike.

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

BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}
"""The device prefix torch's group helper puts under a group's keys: the first device of the
backend's ``BackendConfig`` (gloo: ``{"cpu": "gloo", "cuda": "gloo"}``; nccl: ``{"cuda": "nccl"}``)."""


def group_store(store: object, group_name: str, backend: str) -> dist.PrefixStore:
    """``store`` seen the way a member of weight-update group ``group_name`` sees it: the three
    prefixes of sglang's / miles' group (module docstring), net key ``"<G>/<G>//<device>//<key>"``.

    Raises:
        ValueError: unknown backend.
    """
    if backend not in BACKEND_DEVICE:
        raise ValueError(f"weight update group backend must be gloo or nccl, got {backend!r}")
    named = dist.PrefixStore(group_name, store)
    return dist.PrefixStore(BACKEND_DEVICE[backend] + "/", dist.PrefixStore(group_name + "/", named))


def new_weight_update_group(*, master_address: str, master_port: int, rank: int, world_size: int,
                            group_name: str, backend: str,
                            timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                            bind_host: str | None = None) -> dist.ProcessGroup:
    """Join (rank 0: host) a standalone process group outside the default one.

    Hangs until all ``world_size`` ranks have joined or ``timeout`` passes (rank 0 waits for every
    member's store to be counted; a member whose master nobody listens on retries the connect until
    then).

    Args:
        master_address: host of rank 0's TCP store (rank 0 binds it).
        master_port: its port.
        rank: this process's rank in the group.
        world_size: ranks in the group.
        group_name: the group's name (the namespace of its keys in the store).
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
    if backend not in BACKEND_DEVICE:
        raise ValueError(f"weight update group backend must be gloo or nccl, got {backend!r}")
    store = bound_store(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                        wait_for_workers=True)
    prefixed = group_store(store, group_name, backend)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        local = bind_host or (master_address if rank == 0 else route_source(master_address))
        options._devices = [gloo_device(local)]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
