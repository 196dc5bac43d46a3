"""Load weightsync's torch_dist checkpoint into a live megatron-core ``GPTModel``.

Two ways, same bytes (a test checks they agree bit for bit):

* :func:`load_into_model` -- weightsync's reader: each rank reads only its own chunks, no
  collective, any device and dtype of the model (parameters are copied in);
* :func:`load_with_megatron` -- megatron-core's ``dist_checkpointing.load`` of the model's
  ``sharded_state_dict()`` (collective over the job), what Megatron-LM's ``load_checkpoint`` does.

Typical usage::

    model = build_gpt_model(spec, par, rank, device="cuda")
    load_into_model(model, "/root/multinode/Qwen3-4B_torch_dist", spec, par, rank)
"""

from __future__ import annotations

from pathlib import Path

import torch

from weightsync.models.parallel import TrainParallel
from weightsync.models.spec import ModelSpec
from weightsync.sources.megatron_model import check_against_layout, megatron_compat, model_tensors
from weightsync.sources.torch_dist import read_rank_tensors, release_dir


def load_into_model(model: torch.nn.Module, ckpt_dir: str | Path, spec: ModelSpec, par: TrainParallel,
                    rank: int) -> int:
    """Load this rank's shards of a torch_dist checkpoint into a live model (in place).

    Reads only the rank's chunks (:func:`read_rank_tensors`, on the CPU, in the layout's
    dtypes) after checking the model's names and shapes against the trainer layout, then copies
    them into the parameters (whatever their device and dtype).

    Returns:
        Bytes read.

    Raises:
        ValueError: the model differs from the layout, or the checkpoint lacks a tensor.
    """
    check_against_layout(model, spec, par, rank, check_dtype=False)
    loaded = read_rank_tensors(ckpt_dir, spec, par, rank)
    with torch.no_grad():
        for name, t in model_tensors(model).items():
            t.copy_(loaded[name])
    return sum(t.numel() * t.element_size() for t in loaded.values())


def load_with_megatron(model: torch.nn.Module, ckpt_dir: str | Path) -> None:
    """Load a torch_dist checkpoint with megatron-core's own loader (collective: every rank calls it).

    Raises:
        ValueError: ``ckpt_dir`` is not a Megatron checkpoint directory.
    """
    from megatron.core import dist_checkpointing

    with megatron_compat():
        loaded = dist_checkpointing.load(model.sharded_state_dict(), str(release_dir(ckpt_dir)))
        model.load_state_dict(loaded, strict=False)  # strict=False: the local spec's _extra_state entries
