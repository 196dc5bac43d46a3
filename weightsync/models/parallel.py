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


def parse_kv(text: str, allowed: tuple[str, ...], what: str) -> dict[str, int]:
    """``"tp=2,ep=2"`` -> ``{"tp": 2, "ep": 2}``; unknown keys and non-integers are errors."""
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, val = item.partition("=")
        if not eq or key not in allowed:
            raise ValueError(f"--{what}: {item!r} is not one of {', '.join(k + '=N' for k in allowed)}")
        try:
            out[key] = int(val)
        except ValueError:
            raise ValueError(f"--{what}: {key} must be an integer, got {val!r}") from None
    return out


def train_from_args(text: str, *, mla_down_proj_replicated: bool = False) -> TrainParallel:
    """``--train``; ``mla_rep`` (0 or 1) sets ``mla_down_proj_replicated``, else the keyword's value."""
    kv = parse_kv(text, ("tp", "pp", "cp", "ep", "etp", "world", "last", "mla_rep"), "train")
    world = kv.pop("world", kv.get("tp", 1) * kv.get("pp", 1) * kv.get("cp", 1))
    last = kv.pop("last", None)
    rep = kv.pop("mla_rep", int(mla_down_proj_replicated))
    if rep not in (0, 1):
        raise ValueError(f"--train: mla_rep must be 0 or 1, got {rep}")
    return TrainParallel(world_size=world, pp_last_stage_layers=last, mla_down_proj_replicated=bool(rep), **kv)


def rollout_from_args(text: str) -> RolloutParallel:
    kv = parse_kv(text, ("tp", "ep", "dp", "engines"), "rollout")
    engines = kv.pop("engines", 1)
    return RolloutParallel(num_engines=engines, **kv)
