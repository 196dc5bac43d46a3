"""The updater's megatron-core entry: a live job's parallel sizes, read from its ``parallel_state``.

:meth:`WeightUpdater.from_megatron <weightsync.sync.updater.WeightUpdater.from_megatron>` builds
an updater for one rank of a megatron-core ``GPTModel``: its parameters are the model's own (either
layer spec, :func:`~weightsync.sync.names.module_tensors`), its :class:`TrainParallel` is
:func:`megatron_train_parallel`'s. megatron-core is imported only when that is called.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from weightsync.layout.megatron import MLA_DOWN_PROJ, train_coords
from weightsync.models.parallel import TrainParallel
from weightsync.models.spec import ModelSpec


def megatron_train_parallel(model: torch.nn.Module, spec: ModelSpec, group: Any) -> TrainParallel:
    """The :class:`TrainParallel` of a live megatron-core job, from its ``parallel_state``.

    Args:
        model: this rank's megatron-core model (its config gives the last stage's layers and
            sequence parallelism; its MLA down projections say whether they are replicated).
        spec: the model.
        group: the trainer ranks' process group, in megatron's rank order.

    Raises:
        ValueError: the parallel state is not initialized, or this rank's megatron coordinates
            are not those of its rank in ``group`` (naming the coordinate).
    """
    from megatron.core import parallel_state as ps  # optional: only megatron jobs have it

    if not ps.model_parallel_is_initialized():
        raise ValueError("megatron-core's parallel state is not initialized (initialize_model_parallel first)")
    config = getattr(model, "config", None)
    replicated = False
    if spec.is_mla and ps.get_tensor_model_parallel_world_size() > 1:
        whole = spec.kv_lora_rank + spec.qk_rope_head_dim
        replicated = any(n.endswith(MLA_DOWN_PROJ[1]) and p.shape[0] == whole for n, p in model.named_parameters())
    train = TrainParallel(
        world_size=dist.get_world_size(group), tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(), cp=ps.get_context_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size(),
        pp_last_stage_layers=getattr(config, "num_layers_in_last_pipeline_stage", None),
        sequence_parallel=bool(getattr(config, "sequence_parallel", False)), mla_down_proj_replicated=replicated)
    c = train_coords(train, dist.get_rank(group))
    have = {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "ep": ps.get_expert_model_parallel_rank(), "etp": ps.get_expert_tensor_parallel_rank()}
    bad = [f"{k}: megatron {v}, group rank {dist.get_rank(group)} -> {getattr(c, k)}" for k, v in have.items()
           if getattr(c, k) != v]
    if bad:
        raise ValueError("megatron-core's rank order is not the group's (Megatron's default order tp-cp-ep-dp-pp is "
                         "expected): " + "; ".join(bad))
    return train
