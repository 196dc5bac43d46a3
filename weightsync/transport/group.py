"""A standalone torch.distributed group between a trainer rank and rollout ranks.

sglang's ``/init_weights_update_group`` builds such a group outside the default process group:
the trainer's stage source is rank 0 and hosts the TCP store, engine rank ``r`` joins as
``rank_offset + r``. Both sides must build it the same way, so both call
:func:`new_weight_update_group`.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def new_weight_update_group(*, master_address: str, master_port: int, rank: int, world_size: int,
                            group_name: str, backend: str,
                            timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> dist.ProcessGroup:
    """Join (rank 0: host) a standalone process group outside the default one.

    Hangs until all ``world_size`` ranks have joined or ``timeout`` passes.

    Args:
        master_address: host of rank 0's TCP store.
        master_port: its port.
        rank: this process's rank in the group.
        world_size: ranks in the group.
        group_name: namespace of the group's keys in the store.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout: rendezvous and per-collective timeout.

    Returns:
        The process group (use its ``broadcast(tensor, root)`` method).

    Raises:
        ValueError: unknown backend or rank out of range.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"weight update group rank {rank} is outside [0, {world_size})")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight update group backend must be gloo or nccl, got {backend!r}")
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    prefixed = dist.PrefixStore(group_name + "/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
