"""Parallel configurations of the two sides and the devices they run on.

Trainer (Megatron-core): ``world = tp * cp * dp * pp``; experts: ``world = etp * ep * edp * pp``.
Engine (sglang): an engine of ``tp`` GPUs; DP-attention splits it into ``dp`` attention groups of
``tp // dp`` GPUs (attention-TP); experts are split over ``ep`` ranks and ``tp // ep`` moe-TP.
"""

from __future__ import annotations

from dataclasses import dataclass

GPUS_PER_NODE = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainParallel:
    """Megatron parallel sizes of the training job."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    pp_last_stage_layers: int | None = None
    """Layers on the last PP stage when the split is uneven (Megatron
    ``--decoder-last-pipeline-num-layers``); the other stages share the rest evenly."""
    sequence_parallel: bool = True
    mla_down_proj_replicated: bool = False
    """MLA ``linear_q_down_proj`` / ``linear_kv_down_proj`` whole on every TP rank (True), as
    megatron-core's Transformer Engine spec builds them (``TELinear(parallel_mode="duplicated")``,
    checkpointed as one replicated tensor), or split by rows over TP (False), as its local spec
    builds them (``ColumnParallelLinear``). The reference system trains with the TE spec. No
    effect on models without MLA."""

    def __post_init__(self) -> None:
        for k in ("world_size", "tp", "pp", "cp", "ep", "etp"):
            if getattr(self, k) < 1:
                raise ValueError(f"train {k} must be >= 1, got {getattr(self, k)}")
        if self.world_size % (self.tp * self.pp * self.cp):
            raise ValueError(
                f"train world size {self.world_size} is not divisible by tp*pp*cp = {self.tp * self.pp * self.cp}"
            )
        if self.world_size % (self.etp * self.ep * self.pp):
            raise ValueError(
                f"train world size {self.world_size} is not divisible by etp*ep*pp = {self.etp * self.ep * self.pp}"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutParallel:
    """sglang parallel sizes of each rollout engine, and how many engines there are."""

    tp: int = 1
    """GPUs per engine (sglang ``--tp-size``)."""
    dp: int = 1
    """DP-attention size (``--dp-size`` with ``--enable-dp-attention``); 1 = off."""
    ep: int = 1
    """Expert-parallel size (``--ep-size``)."""
    num_engines: int = 1
    moe_dense_tp: int | None = None
    """``--moe-dense-tp-size`` (1: dense MLP layers replicated instead of TP-split)."""
    dp_lm_head: bool = False
    """``--enable-dp-lm-head``: vocab split over attention-TP instead of full TP."""

    def __post_init__(self) -> None:
        for k in ("tp", "dp", "ep", "num_engines"):
            if getattr(self, k) < 1:
                raise ValueError(f"rollout {k} must be >= 1, got {getattr(self, k)}")
        if self.tp % self.dp:
            raise ValueError(f"rollout tp={self.tp} is not divisible by dp={self.dp}")
        if self.tp % self.ep:
            raise ValueError(f"rollout tp={self.tp} is not divisible by ep={self.ep}")
        if self.moe_dense_tp not in (None, 1):
            raise ValueError(f"rollout moe_dense_tp must be 1 or unset, got {self.moe_dense_tp}")

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def world_size(self) -> int:
        return self.tp * self.num_engines


@dataclass(frozen=True, slots=True)
class Device:
    """Where a rank runs: node index and GPU (or CPU slot) index within the node."""

    node: int
    gpu: int


def default_placement(num_train: int, num_rollout: int, gpus_per_node: int = GPUS_PER_NODE) -> tuple[
    list[Device], list[Device]
]:
    """Trainer ranks on the first GPUs, rollout ranks on the GPUs after them, filling nodes in order.

    This is the reference system's disaggregated placement: 4+4 shares one node, 8+8 uses two.
    """
    devs = [Device(i // gpus_per_node, i % gpus_per_node) for i in range(num_train + num_rollout)]
    return devs[:num_train], devs[num_train:]
