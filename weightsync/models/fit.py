"""Does a run profile fit this machine, and if not, what the embedded default runs instead; and
the profile's parallel sizes with the command line's ``--train`` / ``--rollout`` applied.

Pure decisions over a :class:`RunProfile` and a GPU count (the caller counts the GPUs), shared
by ``prepare``, ``run``, ``plan`` and ``bench`` so that they pick the same scale and layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.models.parallel import RolloutParallel, TrainParallel, override_rollout, override_train
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


def embedded_layout(model: str) -> tuple[TrainParallel, RolloutParallel]:
    """The tiny CPU layout of a profile's family: TP 2 on both sides, EP 2 for MoE families,
    DP-attention where the profile uses it (with the profile's ``dp_lm_head``), the profile's
    ``moe_dense_tp``, and the trainer's MLA down projections whole on every TP rank
    (``mla_down_proj_replicated``, as in the MLA profiles: the reference trains with Megatron's TE
    spec; split over TP 2, Kimi-K2's tiny ``kv_a_proj_with_mqa`` would cut its fp8 blocks, which a
    p2p sender quantizes whole within one shard).
    """
    profile = get_profile(model)
    spec = get_model(model, "tiny")
    ep = 2 if spec.is_moe else 1
    dp = 2 if profile.rollout.dp > 1 else 1
    train = TrainParallel(world_size=2, tp=2, ep=ep, etp=profile.train.etp,
                          mla_down_proj_replicated=profile.train.mla_down_proj_replicated)
    rollout = RolloutParallel(tp=2, ep=ep, dp=dp, moe_dense_tp=profile.rollout.moe_dense_tp,
                              dp_lm_head=profile.rollout.dp_lm_head and dp > 1)
    return train, rollout


def fit_profile(model: str, num_gpus: int) -> Fit:
    """The profile as is when this node has its GPUs, else the embedded default.

    Args:
        model: registry model name.
        num_gpus: CUDA devices on this machine.
    """
    profile = get_profile(model)
    needed = profile.num_train_gpus + profile.num_rollout_gpus
    if num_gpus >= needed and profile.num_nodes == 1:
        return Fit(scale="full", device="cuda", train=profile.train, rollout=profile.rollout, embedded=False, note="")
    train, rollout = embedded_layout(model)
    note = (f"{model}: the profile needs {needed} GPUs on {profile.num_nodes} node(s), this machine has {num_gpus}: "
            f"running the embedded default ({get_model(model).family} family, tiny scale, CPU, "
            f"train TP {train.tp}/EP {train.ep}/DP {train.dp} -> "
            f"engine TP {rollout.tp}/EP {rollout.ep}/DP {rollout.dp}).")
    return Fit(scale="tiny", device="cpu", train=train, rollout=rollout, embedded=True, note=note)


def cuda_device_count() -> int:
    """CUDA devices visible here (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
