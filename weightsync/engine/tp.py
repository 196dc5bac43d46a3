"""The tensor-parallel pass of the engine: process groups and the collectives the model calls.

One engine of ``tp`` ranks uses three kinds of groups (sglang's names):

* ``tp``      all ranks of the engine: dense-MLP (unless ``--moe-dense-tp-size 1`` replicates
  it), MoE (EP x moe-TP) and vocab all-reduces;
* ``attn_tp`` the ranks of one DP-attention group (``tp // dp`` consecutive ranks): the
  attention output all-reduce and, with ``--enable-dp-lm-head``, the lm_head logits gather
  (equal to ``tp`` when DP-attention is off);
* ``control`` a gloo group over all ranks for commands (pickled objects) from rank 0, also on
  CUDA engines.

DP-attention here: every attention-DP group computes the *same* batch (rank 0 drives all of
them), so the hidden states are identical on all ranks after attention and the MoE / dense /
vocab reductions over the full ``tp`` group are exact. sglang instead gives each DP group its own
requests and all-gathers tokens around the MoE; the parameters (what weight updates write) are
the same in both schemes, only throughput differs.

Every rank of the world must build the same :class:`EngineGroups` (``new_group`` is collective).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weightsync.layout.sglang import EngineCoords, engine_coords
from weightsync.models.parallel import RolloutParallel

CONTROL_TIMEOUT = datetime.timedelta(days=365)
"""Workers block on the control group between commands for as long as the engine lives."""


@dataclass(frozen=True, slots=True)
class Group:
    """A process group with its size and this rank's rank in it (None group = single rank)."""

    pg: dist.ProcessGroup | None
    size: int
    rank: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place (no-op for a group of one)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.pg)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim, in group-rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.pg)
        return torch.cat(parts, dim=-1)


SINGLE = Group(None, 1, 0)


@dataclass(frozen=True, slots=True)
class EngineGroups:
    """The groups of one engine rank (see the module docstring)."""

    par: RolloutParallel
    rank: int
    coords: EngineCoords
    tp: Group
    attn_tp: Group
    control: dist.ProcessGroup | None
    """gloo group over all ranks; None for a single-rank engine without a process group."""

    @property
    def world(self) -> int:
        return self.par.tp

    @classmethod
    def single(cls, par: RolloutParallel | None = None) -> EngineGroups:
        """The groups of a one-rank engine that runs without torch.distributed."""
        par = par if par is not None else RolloutParallel()
        if par.tp != 1:
            raise ValueError(f"a single-process engine needs tp=1, got tp={par.tp}")
        return cls(par=par, rank=0, coords=engine_coords(par, 0), tp=SINGLE, attn_tp=SINGLE, control=None)

    @classmethod
    def build(cls, par: RolloutParallel, rank: int, world: dist.ProcessGroup | None = None) -> EngineGroups:
        """Build the groups on an initialized default process group (collective: all ranks call it).

        Args:
            par: the engine's sizes; ``par.tp`` must equal the world size of ``world``.
            rank: this process's rank in ``world``.
            world: the engine's group (default: the default process group).

        Returns:
            :class:`EngineGroups`.

        Raises:
            ValueError: the world size differs from ``par.tp``.
        """
        size = dist.get_world_size(world)
        if size != par.tp:
            raise ValueError(f"engine tp={par.tp} needs a world of {par.tp} processes, got {size}")
        coords = engine_coords(par, rank)
        a = par.attn_tp
        attn_pg = None
        for g in range(par.dp):
            pg = dist.new_group(list(range(g * a, (g + 1) * a)))
            if g == coords.attn_dp_rank:
                attn_pg = pg
        # Its own group even on gloo engines: the long timeout must not apply to model collectives.
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        return cls(
            par=par,
            rank=rank,
            coords=coords,
            tp=Group(world, par.tp, rank),
            attn_tp=Group(attn_pg, a, coords.attn_tp_rank),
            control=control,
        )

    def broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Make rank 0's sampled ``tokens`` everyone's (in place)."""
        if self.tp.size > 1:
            dist.broadcast(tokens, src=0, group=self.tp.pg)
        return tokens
