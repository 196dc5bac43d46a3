"""Layouts: for a (model spec, parallel config, rank), the rank's local tensors as pieces of
global tensors, on the trainer side (Megatron-core) and the engine side (sglang).

Public entry points (implemented in :mod:`weightsync.layout.megatron` and
:mod:`weightsync.layout.sglang`):

* ``trainer_layout(spec, par: TrainParallel, rank) -> list[LocalTensor]`` -- ``rank`` is the
  global trainer rank in ``[0, par.world_size)``; names are those of
  ``GPTModel.named_parameters()`` on that rank (layer numbers local to the PP stage), plus the
  router ``expert_bias`` buffer.
* ``engine_layout(spec, par: RolloutParallel, rank) -> list[LocalTensor]`` -- ``rank`` is the
  rank inside one engine, in ``[0, par.tp)``; every engine of a fleet has the same layout.
"""

from weightsync.layout.box import Box, LocalTensor, Piece
from weightsync.models.parallel import Device, RolloutParallel, TrainParallel, default_placement

__all__ = ["Box", "Device", "LocalTensor", "Piece", "RolloutParallel", "TrainParallel", "default_placement"]
