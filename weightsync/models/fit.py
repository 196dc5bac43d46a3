"""Does a run profile fit this machine, and if not, what the embedded default runs instead; the
profile's parallel sizes with the command line's ``--train`` / ``--rollout`` applied; and which
node (and GPU or CPU slot on it) runs each trainer rank and each engine rank (:func:`plan_nodes`).

Pure decisions over a :class:`RunProfile` and a GPU count (the caller counts the GPUs), shared
by ``prepare``, ``run``, ``plan`` and ``bench`` so that they pick the same scale and layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.models.parallel import (
    GPUS_PER_NODE,
    Device,
    RolloutParallel,
    TrainParallel,
    default_placement,
    override_rollout,
    override_train,
)
from weightsync.models.profiles import get_profile
from weightsync.models.registry import get_model


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    """What runs on this machine for a profile."""

    scale: str
    device: str
    train: TrainParallel
    rollout: RolloutParallel
    embedded: bool
    """True: the profile does not fit and the tiny CPU default runs instead."""
    note: str
    """One line saying so (empty when the profile fits)."""
    num_nodes: int = 1
    """Nodes the run spans: the profile's for a multi-node run, else 1."""


def profile_sizes(model: str, train: str | None = None, rollout: str | None = None
                  ) -> tuple[TrainParallel, RolloutParallel]:
    """The run profile's parallel sizes (``weightsync list``) with ``--train`` / ``--rollout``
    applied field by field (:func:`~weightsync.models.parallel.override_train`,
    :func:`~weightsync.models.parallel.override_rollout`); None or empty: the profile's.

    The profile is the base of ``--train`` / ``--rollout`` in every command, whatever the
    command runs when the flag is absent (the embedded default, a small shard layout).

    Raises:
        ValueError: unknown model, or a bad ``--train`` / ``--rollout`` (the message says which).
    """
    profile = get_profile(model)
    name = f"{model}'s run profile"
    return (override_train(profile.train, train, base_name=name),
            override_rollout(profile.rollout, rollout, base_name=name))


def embedded_layout(model: str, num_nodes: int = 1) -> tuple[TrainParallel, RolloutParallel]:
    """The tiny CPU layout of a profile's family: TP 2 on both sides, EP 2 for MoE families,
    DP-attention where the profile uses it (with the profile's ``dp_lm_head``), the profile's
    ``moe_dense_tp``, and the trainer's MLA down projections whole on every TP rank
    (``mla_down_proj_replicated``, as in the MLA profiles: the reference trains with Megatron's TE
    spec; split over TP 2, Kimi-K2's tiny ``kv_a_proj_with_mqa`` would cut its fp8 blocks, which a
    p2p sender quantizes whole within one shard).

    Args:
        model: registry model name.
        num_nodes: nodes the run spans; over several, the trainer keeps node 0 and every other
            node runs one engine (:func:`plan_nodes`), so the cross-host path is exercised there.
    """
    profile = get_profile(model)
    spec = get_model(model, "tiny")
    ep = 2 if spec.is_moe else 1
    dp = 2 if profile.rollout.dp > 1 else 1
    train = TrainParallel(world_size=2, tp=2, ep=ep, etp=profile.train.etp,
                          mla_down_proj_replicated=profile.train.mla_down_proj_replicated)
    rollout = RolloutParallel(tp=2, ep=ep, dp=dp, moe_dense_tp=profile.rollout.moe_dense_tp,
                              dp_lm_head=profile.rollout.dp_lm_head and dp > 1, num_engines=max(1, num_nodes - 1))
    return train, rollout


def fit_profile(model: str, num_gpus: int, *, multi_node: bool = False, checkpoint: bool = False) -> Fit:
    """The profile as is when this node has its GPUs, else the embedded default.

    Args:
        model: registry model name.
        num_gpus: CUDA devices on this machine.
        multi_node: the run spans the profile's nodes (``--head-ip`` given, or a worker's
            ``--node-rank``): the profile fits when this node has a node's worth of GPUs (the
            other nodes' are checked when the run places its ranks); the embedded default then
            spans the profile's nodes too. Otherwise everything must fit on this machine and a
            multi-node profile runs the embedded default here alone.
        checkpoint: the command was given a checkpoint of the user's (``--hf-checkpoint``): the
            model is that checkpoint, so the note speaks of the embedded default's layout only,
            not of its tiny registry shapes.
    """
    profile = get_profile(model)
    needed = profile.num_train_gpus + profile.num_rollout_gpus
    nodes = profile.num_nodes if multi_node else 1
    if profile.num_nodes == 1 and num_gpus >= needed:
        return Fit(scale="full", device="cuda", train=profile.train, rollout=profile.rollout, embedded=False, note="")
    if multi_node and profile.num_nodes > 1 and num_gpus >= profile.gpus_per_node:
        return Fit(scale="full", device="cuda", train=profile.train, rollout=profile.rollout, embedded=False, note="",
                   num_nodes=profile.num_nodes)
    train, rollout = embedded_layout(model, nodes)
    where = (f"this node has {num_gpus}" if multi_node and profile.num_nodes > 1 else f"this machine has {num_gpus}")
    span = (f" over {nodes} nodes: trainer on node 0, one engine on each other node" if nodes > 1 else "")
    layout = (f"train TP {train.tp}/EP {train.ep}/DP {train.dp} -> engine TP {rollout.tp}/EP {rollout.ep}/"
              f"DP {rollout.dp}")
    what = (f"the embedded default's layout on CPU{span} ({layout}) with the given checkpoint" if checkpoint else
            f"the embedded default ({get_model(model).family} family, tiny scale, CPU{span}, {layout})")
    note = f"{model}: the profile needs {needed} GPUs on {profile.num_nodes} node(s), {where}: running {what}."
    return Fit(scale="tiny", device="cpu", train=train, rollout=rollout, embedded=True, note=note, num_nodes=nodes)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodePlan:
    """Which node, and which GPU (or CPU slot) on it, runs each trainer rank and each engine rank."""

    num_nodes: int
    trainer: tuple[Device, ...]
    """Per trainer rank."""
    engines: tuple[tuple[Device, ...], ...]
    """Per engine, its ranks' devices (all on one node: an engine's ranks share a host)."""

    @property
    def rollout(self) -> tuple[Device, ...]:
        """Every engine rank's device, in global rollout-rank order."""
        return tuple(d for engine in self.engines for d in engine)

    def engine_node(self, engine: int) -> int:
        return self.engines[engine][0].node

    def pairs(self) -> list[tuple[Device, Device]]:
        """``(trainer device, engine-rank device)`` of every pair that may write (the transport
        policy's input)."""
        return [(a, b) for a in self.trainer for b in self.rollout]

    def nodes_of(self) -> dict[int, list[str]]:
        """What each node runs (``trainer rank 0``, ``engine 1``), for messages and results.json."""
        out: dict[int, list[str]] = {n: [] for n in range(self.num_nodes)}
        for r, d in enumerate(self.trainer):
            out[d.node].append(f"trainer rank {r}")
        for e, devs in enumerate(self.engines):
            out[devs[0].node].append(f"engine {e}")
        return out


def plan_nodes(train: TrainParallel, rollout: RolloutParallel, *, num_nodes: int = 1, by_role: bool = False,
               gpus_per_node: int = GPUS_PER_NODE) -> NodePlan:
    """Where each rank of a run runs.

    * One node: trainer ranks on slots ``0 .. T-1``, engine ranks after them (every pair on one host).
    * Several nodes, a profile: the reference system's disaggregated placement
      (:func:`~weightsync.models.parallel.default_placement`: trainer ranks on the first GPUs,
      engine ranks on the GPUs after them, filling nodes in order: GLM-4.7-Flash's 8 + 8 puts the
      trainer on node 0 and both engines on node 1).
    * Several nodes, ``by_role`` (the embedded default and other CPU runs): trainer ranks on
      node 0, engine ``e`` on node ``1 + e % (num_nodes - 1)``, so every write crosses hosts.

    Raises:
        ValueError: the ranks do not fit the nodes, or an engine would span two nodes (the
            message says which and what to change).
    """
    t, tp = train.world_size, rollout.tp
    if num_nodes < 1:
        raise ValueError(f"a run needs at least one node, got {num_nodes}")
    if num_nodes == 1:
        return NodePlan(num_nodes=1, trainer=tuple(Device(0, i) for i in range(t)),
                        engines=tuple(tuple(Device(0, t + e * tp + r) for r in range(tp))
                                      for e in range(rollout.num_engines)))
    if by_role:
        return NodePlan(num_nodes=num_nodes, trainer=tuple(Device(0, i) for i in range(t)),
                        engines=tuple(tuple(Device(1 + e % (num_nodes - 1), (e // (num_nodes - 1)) * tp + r)
                                            for r in range(tp)) for e in range(rollout.num_engines)))
    trainer, ranks = default_placement(t, rollout.world_size, gpus_per_node)
    used = max(d.node for d in (*trainer, *ranks)) + 1
    if used > num_nodes:
        raise ValueError(f"{t} trainer + {rollout.world_size} engine ranks at {gpus_per_node} GPUs per node need "
                         f"{used} nodes; the run has {num_nodes}")
    engines = tuple(tuple(ranks[e * tp:(e + 1) * tp]) for e in range(rollout.num_engines))
    for e, devs in enumerate(engines):
        if len({d.node for d in devs}) > 1:
            raise ValueError(f"engine {e} (TP {tp}) would span nodes {sorted({d.node for d in devs})}: the built-in "
                             f"engine runs all ranks of an engine on one host; use --rollout tp=N with N <= "
                             f"{gpus_per_node} and engines=... so that each engine fits one node")
    return NodePlan(num_nodes=num_nodes, trainer=tuple(trainer), engines=engines)


def cuda_device_count() -> int:
    """CUDA devices visible here (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
