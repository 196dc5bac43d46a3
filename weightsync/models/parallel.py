"""Parallel configurations of the two sides and the devices they run on.

Trainer (Megatron-core): ``world = tp * cp * dp * pp``; experts: ``world = etp * ep * edp * pp``.
Engine (sglang): an engine of ``tp`` GPUs; DP-attention splits it into ``dp`` attention groups of
``tp // dp`` GPUs (attention-TP); experts are split over ``ep`` ranks and ``tp // ep`` moe-TP.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GPUS_PER_NODE = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainParallel:
    """Megatron parallel sizes of the training job."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    """Expert tensor-parallel size; None (not given) becomes ``tp`` on construction, megatron-core's and
    Megatron-LM's default (``ModelParallelConfig.expert_tensor_parallel_size``). The reference
    profiles give ETP 1."""
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
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
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
    router_fp32: bool | None = None
    """Layout option: the MoE routers' ``mlp.gate.weight`` in float32 (True) or in the model dtype
    (False, as sglang 0.5.16 keeps GLM routers); None: sglang 0.5.23's rule for the model
    (:func:`weightsync.layout.sglang_options.layout_options`)."""
    dsa_indexer_fusion: bool | None = None
    """Layout option: the DSA indexer's ``wk`` and ``weights_proj`` as one bfloat16
    ``wk_weights_proj`` (True), or apart (False, sglang's ``SGLANG_DISABLE_DSA_INDEXER_FUSION``);
    None: sglang 0.5.23's rule (fused with the interleaved indexer rope, on CUDA)."""
    shared_experts_fusion: bool | None = None
    """Layout option: each MoE layer's shared expert as one more slot of ``mlp.experts.w13_weight`` /
    ``w2_weight`` (True; no ``mlp.shared_experts.*``), or apart (False, sglang's
    ``--disable-shared-experts-fusion``); None: sglang 0.5.23's rule (fused at expert-parallel 1 for
    GLM-4.5, GLM-4.7-Flash and 256-expert DeepSeek-V3 / GLM-5 checkpoints, on CUDA)."""

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


TRAIN_KEYS = ("tp", "pp", "cp", "ep", "etp", "world", "dp", "last", "mla_rep")
"""Keys of ``--train``: the sizes of :class:`TrainParallel` (``world`` = ``world_size``, ``last`` =
``pp_last_stage_layers``, ``mla_rep`` = ``mla_down_proj_replicated`` as 0 or 1) and ``dp``."""
ROLLOUT_KEYS = ("tp", "ep", "dp", "engines")
"""Keys of ``--rollout``: the sizes of :class:`RolloutParallel` (``engines`` = ``num_engines``)."""


def parse_kv(text: str, allowed: tuple[str, ...], what: str) -> dict[str, int]:
    """``"tp=2,ep=2"`` -> ``{"tp": 2, "ep": 2}``.

    Raises:
        ValueError: an item that is not ``key=N`` with a key of ``allowed``, a value that is not
            an integer, or a key given twice (the message names ``--what`` and the item).
    """
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, val = (x.strip() for x in item.partition("="))
        if not eq or key not in allowed:
            raise ValueError(f"--{what}: {item!r} is not one of {', '.join(k + '=N' for k in allowed)}")
        if key in out:
            raise ValueError(f"--{what}: {key} is given twice")
        try:
            out[key] = int(val)
        except ValueError:
            raise ValueError(f"--{what}: {key} must be an integer, got {val!r}") from None
    return out


def override_train(base: TrainParallel, text: str | None, *, base_name: str = "the base",
                   etp_follows_tp: bool = False) -> TrainParallel:
    """``--train``: ``base`` with the sizes ``text`` names replaced, field by field.

    The one meaning of ``--train`` in every command (``base`` is the model's run profile there):

    * ``tp``, ``pp``, ``cp``, ``ep``, ``etp``: given, or the base's value. With
      ``etp_follows_tp``, an ``etp`` not given is the resolved ``tp`` instead (Megatron's own
      default for ``--expert-tensor-parallel-size``).
    * ``world_size``: ``world=N``; else ``dp=N`` gives ``tp * pp * cp * N`` (with the resolved
      ``tp``/``pp``/``cp``); both given must agree; neither: the base's world size. So the GPU
      count stays the base's and ``dp = world_size / (tp * pp * cp)`` (and
      ``edp = world_size / (etp * ep * pp)``) follow from it.
    * ``pp_last_stage_layers``: ``last=N``; else the base's when the resolved ``pp`` is the
      base's, and an even split (None) when ``pp`` changed (the base's uneven split belongs to
      its own ``pp``).
    * ``mla_down_proj_replicated``: ``mla_rep=0|1``; else the base's. Every other field
      (``sequence_parallel``) is the base's.

    An empty or None ``text`` returns ``base``; ``base_name`` names the base in error messages.

    Raises:
        ValueError: a bad item (see :func:`parse_kv`), ``mla_rep`` not 0 or 1, ``world`` and
            ``dp`` that disagree, or sizes that do not divide; the message quotes ``text``, the
            sizes it makes (the layout that would run) and the base's.
    """
    if not text or not text.strip():
        return base
    kv = parse_kv(text, TRAIN_KEYS, "train")
    if kv.get("mla_rep", 0) not in (0, 1):
        raise ValueError(f"--train: mla_rep must be 0 or 1, got {kv['mla_rep']}")
    tp, pp, cp = (kv.get(k, getattr(base, k)) for k in ("tp", "pp", "cp"))
    world = kv.get("world", base.world_size)
    if "dp" in kv:
        if kv["dp"] < 1:
            raise ValueError(f"--train: dp must be >= 1, got {kv['dp']}")
        from_dp = tp * pp * cp * kv["dp"]
        if "world" in kv and kv["world"] != from_dp:
            raise ValueError(f"--train: world={kv['world']} disagrees with dp={kv['dp']} "
                             f"(tp*pp*cp*dp = {from_dp}); give one of them")
        world = from_dp
    default_etp = tp if etp_follows_tp else base.etp
    sizes = {"world_size": world, "tp": tp, "pp": pp, "cp": cp, "ep": kv.get("ep", base.ep),
             "etp": kv.get("etp", default_etp),
             "pp_last_stage_layers": kv.get("last", base.pp_last_stage_layers if pp == base.pp else None),
             "mla_down_proj_replicated": bool(kv["mla_rep"]) if "mla_rep" in kv else base.mla_down_proj_replicated}
    try:
        return replace(base, **sizes)
    except ValueError as exc:
        # the layout that would run, then where the keys not given came from
        raise ValueError(f"--train {text!r} makes the trainer {_train_sizes_text(**sizes)} ({base_name} "
                         f"{train_text(base)} with the keys given replaced): {exc}") from None


def override_rollout(base: RolloutParallel, text: str | None, *, base_name: str = "the base") -> RolloutParallel:
    """``--rollout``: ``base`` with the sizes ``text`` names replaced, field by field.

    ``tp``, ``ep``, ``dp`` and ``engines`` (``num_engines``) are given or the base's; so are
    ``moe_dense_tp`` and ``dp_lm_head``, which have no key. An empty or None ``text`` returns
    ``base``; ``base_name`` names the base in error messages.

    Raises:
        ValueError: a bad item (see :func:`parse_kv`) or sizes that do not divide; the message
            quotes ``text``, the sizes it makes and the base's.
    """
    if not text or not text.strip():
        return base
    kv = parse_kv(text, ROLLOUT_KEYS, "rollout")
    fields = {"num_engines" if k == "engines" else k: v for k, v in kv.items()}
    try:
        return replace(base, **fields)
    except ValueError as exc:
        asked = {"tp": base.tp, "ep": base.ep, "dp": base.dp, "engines": base.num_engines, **kv}
        raise ValueError(f"--rollout {text!r} makes the engines {','.join(f'{k}={v}' for k, v in asked.items())} "
                         f"({base_name} {rollout_text(base)} with the keys given replaced): {exc}") from None


def train_text(p: TrainParallel) -> str:
    """``p`` in the ``--train`` grammar, every key given (``override_train(b, train_text(p))`` is
    ``p`` for any base ``b`` with ``p``'s ``sequence_parallel``)."""
    return _train_sizes_text(world_size=p.world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp,
                             pp_last_stage_layers=p.pp_last_stage_layers,
                             mla_down_proj_replicated=p.mla_down_proj_replicated)


def _train_sizes_text(*, world_size: int, tp: int, pp: int, cp: int, ep: int, etp: int,
                      pp_last_stage_layers: int | None, mla_down_proj_replicated: bool) -> str:
    """Sizes in the ``--train`` grammar, also those no :class:`TrainParallel` can hold."""
    last = f",last={pp_last_stage_layers}" if pp_last_stage_layers is not None else ""
    return (f"tp={tp},pp={pp},cp={cp},ep={ep},etp={etp},world={world_size}{last},"
            f"mla_rep={int(mla_down_proj_replicated)}")


def rollout_text(p: RolloutParallel) -> str:
    """``p`` in the ``--rollout`` grammar, every key given."""
    return f"tp={p.tp},ep={p.ep},dp={p.dp},engines={p.num_engines}"
