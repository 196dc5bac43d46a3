"""Where each trainer parameter lives in a Megatron ``torch_dist`` checkpoint (pure shape math).

Megatron-core saves a model as the *sharded state dict* of ``GPTModel.sharded_state_dict()``:
every rank contributes, for each of its parameters, one or more ``ShardedTensor`` records
``(key, global_shape, global_offset)`` and torch.distributed.checkpoint (DCP) stores them as
chunks of one global tensor per key. This module reproduces those records for the local tensors
of :func:`weightsync.layout.megatron.trainer_layout`, so that weightsync can write a checkpoint
for every rank from one process and Megatron (or weightsync) can read it back with any
parallel configuration. The rules, from megatron-core 0.16.1 with the local layer spec
(``transformer_block.py``, ``transformer_layer.py``, ``mlp.py``, ``moe/experts.py``,
``tensor_parallel/layers.py``, ``language_module.py``):

* **Layers.** ``decoder.layers.{i}.X`` of a PP stage is stored under ``decoder.layers.X`` with a
  leading *layer axis* (size ``num_layers``, offset the global layer) when all layers have the
  same structure; when dense and MoE layers mix (``--moe-layer-freq`` a list or > 1) each layer
  has keys of its own, ``decoder.layers.{global}.X``, and no layer axis.
* **Norm renames** (``sharded_state_dict_keys_map`` of the local GQA spec, so that the keys are
  those of the TE spec): ``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``,
  ``pre_mlp_layernorm.`` -> ``mlp.linear_fc1.layer_norm_``. The MLA spec has no such map.
* **Experts.** ``mlp.experts.local_experts.{k}.X`` (``SequentialMLP``) and
  ``mlp.experts.X{k}`` (``TEGroupedMLP``) are both stored as ``mlp.experts.experts.X`` with an
  *expert axis* (size ``num_experts``, offset the global expert) after the layer axis.
* **Tensor parallelism.** Column-parallel weights are split on dim 0, row-parallel ones on
  dim 1, over TP (dense) or ETP (experts); the global tensor is the concatenation of the TP
  shards. With ``TrainParallel.mla_down_proj_replicated`` the MLA down projections are the TE
  spec's duplicated ``TELinear``: one chunk of the whole tensor, the same on every TP (and DP)
  rank, stored once (Megatron's ``replica_id`` ``(0, tp_rank, dp_rank)``: only the main
  replica writes). The stored tensor is the same either way, so a checkpoint written with one
  setting reads back with the other. A gated ``linear_fc1`` (``[gate_shard; up_shard]`` on each rank) is stored as *two*
  chunks, ``gate_shard`` at ``tp_rank`` and ``up_shard`` at ``tp + tp_rank`` (in units of the
  shard), so the stored tensor is ``[gate; up]`` whatever the TP size.
* **Vocab.** ``embedding.word_embeddings.weight`` and ``output_layer.weight`` are stored with the
  padded vocab of the saving job (``allow_shape_mismatch``: a job with another TP pads
  differently and reads the rows it has). A tied output layer on the last PP stage is a replica
  of ``embedding.word_embeddings.weight``.
* **Extra state.** Each linear module (not ``output_layer``) also stores an ``_extra_state``
  object (``None`` for the local spec) under ``<key>/shard_<offset>_<shape>``, whose offset and
  shape are those of the layer / expert axes (``(0,)`` and ``(1,)`` when there are none).

Legend: ``L`` = number of layers, ``E`` = number of routed experts.

Typical usage::

    chunks = dist_chunks(spec, par, rank)          # the ShardedTensors of one rank
    objects = extra_state_objects(spec, par, rank) # its _extra_state ShardedObjects
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from weightsync.layout.box import Box, LocalTensor, box_shape, full_box
from weightsync.layout.megatron import MLA_DOWN_PROJ, stage_layers, train_coords, trainer_layout
from weightsync.models.parallel import TrainParallel
from weightsync.models.spec import ModelSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_SEQ_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")

_COLUMN = ("linear_qkv", "linear_fc1", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
           "linear_kv_down_proj", "linear_kv_up_proj")
"""Megatron modules built as ``ColumnParallelLinear`` (split output rows) with the local spec."""
_ROW = ("linear_proj", "linear_fc2")
"""Megatron modules built as ``RowParallelLinear`` (split input columns)."""
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True, kw_only=True, slots=True)
class DistChunk:
    """One ``ShardedTensor`` of a rank: a box of a local tensor stored in a checkpoint tensor.

    The stored data is ``local[local_box]`` viewed with a leading extent-1 dim per prepended
    (layer / expert) axis; it occupies ``[global_offset, global_offset + that shape)`` of the
    checkpoint tensor ``key`` of shape ``global_shape``.
    """

    local_name: str
    local_box: Box
    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    allow_shape_mismatch: bool = False
    """Padded vocab: the saved global shape depends on the saving job's TP."""

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        lead = len(self.global_shape) - len(self.local_box)
        return (1,) * lead + box_shape(self.local_box)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExtraStateObject:
    """One ``ShardedObject`` (a linear module's ``_extra_state``) of a rank."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]

    @property
    def unique_key(self) -> str:
        """The DCP key Megatron stores the object under."""
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"


@dataclass(frozen=True, kw_only=True, slots=True)
class TPSplit:
    """How Megatron splits one parameter over tensor parallelism."""

    tensor_model_parallel: bool
    """The ``tensor_model_parallel`` attribute Megatron sets on the parameter."""
    partition_dim: int | None
    """The ``partition_dim`` attribute (None for a replicated parameter)."""
    axis: str | None
    """``"tp"`` (dense and vocab), ``"etp"`` (routed experts) or None."""
    gated: bool = False
    """A gated ``linear_fc1``: stored as two chunks (gate half, up half)."""


@dataclass(frozen=True, slots=True)
class _Where:
    """The checkpoint key of a local parameter and its prepended axes ``(offset, size)``."""

    key: str
    prepend: tuple[tuple[int, int], ...]
    module: str
    """The module path of the key (for ``_extra_state``)."""


def homogeneous_layers(spec: ModelSpec) -> bool:
    """Whether Megatron stacks the layers on a layer axis (every layer the same kind).

    megatron-core sets ``non_homogeneous_layers`` when ``moe_layer_freq`` is a list or > 1,
    which is how a model with leading dense layers is configured (``[0]*k + [1]*n``).
    """
    kinds = {spec.is_moe_layer(layer) for layer in range(spec.num_layers)}
    return len(kinds) == 1


def tp_split(spec: ModelSpec, local_name: str, *, mla_down_proj_replicated: bool = False) -> TPSplit:
    """The tensor-parallel split of a trainer parameter, as megatron-core marks it.

    Args:
        spec: the model.
        local_name: a name of :func:`trainer_layout`.
        mla_down_proj_replicated: ``TrainParallel.mla_down_proj_replicated`` (the MLA down
            projections are duplicated, not column-parallel).

    Returns:
        The :class:`TPSplit`; replicated parameters (norms, router, DSA indexer, duplicated MLA
        down projections) have ``tensor_model_parallel=False``.
    """
    if local_name in _VOCAB:
        return TPSplit(tensor_model_parallel=True, partition_dim=0, axis="tp")
    m = _LAYER.match(local_name)
    rest = m.group(2) if m else local_name
    expert = _SEQ_EXPERT.match(rest) or _GROUPED_EXPERT.match(rest)
    module = rest.rsplit(".", 1)[0].rsplit(".", 1)[-1] if not expert else (
        expert.group(2) if expert.re is _SEQ_EXPERT else expert.group(1))
    if ".indexer." in rest or not rest.split(".")[-1].startswith(("weight", "bias")) or (
            mla_down_proj_replicated and _is_mla_down_proj(rest)):
        return TPSplit(tensor_model_parallel=False, partition_dim=None, axis=None)
    axis = "etp" if expert else "tp"
    if module in _COLUMN:
        gated = module == "linear_fc1"
        return TPSplit(tensor_model_parallel=True, partition_dim=0, axis=axis, gated=gated)
    if module in _ROW:
        return TPSplit(tensor_model_parallel=True, partition_dim=1, axis=axis)
    return TPSplit(tensor_model_parallel=False, partition_dim=None, axis=None)


def _is_mla_down_proj(rest: str) -> bool:
    """``rest`` (a name within its layer) is an MLA down projection's weight."""
    return rest.startswith("self_attention.") and rest.removeprefix("self_attention.") in MLA_DOWN_PROJ


def _where(spec: ModelSpec, par: TrainParallel, pp_rank: int, ep_rank: int, local_name: str) -> _Where:
    """Checkpoint key and prepended axes of one local parameter."""
    if local_name == "output_layer.weight" and spec.tie_word_embeddings:
        local_name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
    m = _LAYER.match(local_name)
    if m is None:
        return _Where(local_name, (), local_name.rsplit(".", 1)[0])
    layer = stage_layers(spec, par)[pp_rank][int(m.group(1))]
    rest = m.group(2)
    if not spec.is_mla:
        for old, new in (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                         ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")):
            if rest.startswith(old):
                rest = new + rest[len(old):]
    prepend: list[tuple[int, int]] = []
    if homogeneous_layers(spec):
        prefix = "decoder.layers."
        prepend.append((layer, spec.num_layers))
    else:
        prefix = f"decoder.layers.{layer}."
    seq, grouped = _SEQ_EXPERT.match(rest), _GROUPED_EXPERT.match(rest)
    if seq or grouped:
        linear, k = (seq.group(2), int(seq.group(1))) if seq else (grouped.group(1), int(grouped.group(2)))
        per_rank = spec.num_experts // par.ep
        prepend.append((ep_rank * per_rank + k, spec.num_experts))
        rest = f"mlp.experts.experts.{linear}.weight"
    key = prefix + rest
    return _Where(key, tuple(prepend), key.rsplit(".", 1)[0])


def chunks_of(spec: ModelSpec, par: TrainParallel, rank: int, tensor: LocalTensor) -> list[DistChunk]:
    """The ``ShardedTensor`` records of one local tensor of trainer rank ``rank``.

    Args:
        spec: the model.
        par: the training job's parallel sizes.
        rank: global trainer rank.
        tensor: one of ``trainer_layout(spec, par, rank)``.

    Returns:
        One chunk, or two for a gated ``linear_fc1`` (gate half, then up half).
    """
    c = train_coords(par, rank)
    where = _where(spec, par, c.pp, c.ep, tensor.name)
    split = tp_split(spec, tensor.name, mla_down_proj_replicated=par.mla_down_proj_replicated)
    shape = tensor.shape
    lead = tuple(size for _, size in where.prepend)
    lead_off = tuple(offset for offset, _ in where.prepend)
    vocab = tensor.name in _VOCAB
    if not split.tensor_model_parallel:
        return [DistChunk(local_name=tensor.name, local_box=full_box(shape), key=where.key,
                          global_shape=lead + shape, global_offset=lead_off + (0,) * len(shape))]
    size, index = (par.tp, c.tp) if split.axis == "tp" else (par.etp, c.etp)
    dim = split.partition_dim
    assert dim is not None
    gshape = list(shape)
    gshape[dim] *= size
    if not split.gated:
        offset = [0] * len(shape)
        offset[dim] = index * shape[dim]
        return [DistChunk(local_name=tensor.name, local_box=full_box(shape), key=where.key,
                          global_shape=lead + tuple(gshape), global_offset=lead_off + tuple(offset),
                          allow_shape_mismatch=vocab)]
    half = shape[0] // 2
    out = []
    for k, fragment in enumerate((index, size + index)):
        box = ((k * half, (k + 1) * half), *full_box(shape[1:]))
        offset = (fragment * half,) + (0,) * (len(shape) - 1)
        out.append(DistChunk(local_name=tensor.name, local_box=box, key=where.key,
                             global_shape=lead + tuple(gshape), global_offset=lead_off + offset))
    return out


def dist_chunks(spec: ModelSpec, par: TrainParallel, rank: int, *,
                expert_naming: str = "sequential") -> list[DistChunk]:
    """Every ``ShardedTensor`` record of trainer rank ``rank``, in parameter order.

    Args:
        spec: the model.
        par: the training job's parallel sizes.
        rank: global trainer rank.
        expert_naming: as in :func:`trainer_layout`.

    Returns:
        The chunks; replicas (other DP / TP ranks holding the same data) are included: they
        have the same ``(key, global_offset)`` as the copy on the main replica.

    Raises:
        ValueError: as :func:`trainer_layout`.
    """
    out: list[DistChunk] = []
    for tensor in trainer_layout(spec, par, rank, expert_naming=expert_naming):
        out += chunks_of(spec, par, rank, tensor)
    return out


def extra_state_objects(spec: ModelSpec, par: TrainParallel, rank: int, *,
                        expert_naming: str = "sequential") -> list[ExtraStateObject]:
    """The ``_extra_state`` objects of trainer rank ``rank`` (one per linear module).

    Args:
        spec: the model.
        par: the training job's parallel sizes.
        rank: global trainer rank.
        expert_naming: as in :func:`trainer_layout`.

    Returns:
        One :class:`ExtraStateObject` per linear module other than ``output_layer``, in order
        (a duplicated MLA down projection is still a linear module with an ``_extra_state``).
    """
    c = train_coords(par, rank)
    out: list[ExtraStateObject] = []
    seen: set[str] = set()
    for tensor in trainer_layout(spec, par, rank, expert_naming=expert_naming):
        # tp_split without the duplicated MLA down projections: it marks the linear modules
        if tensor.name in _VOCAB or not tp_split(spec, tensor.name).tensor_model_parallel:
            continue
        where = _where(spec, par, c.pp, c.ep, tensor.name)
        if where.prepend:
            shape = tuple(size for _, size in where.prepend)
            offset = tuple(o for o, _ in where.prepend)
        else:
            shape, offset = (1,), (0,)
        obj = ExtraStateObject(key=where.module + "._extra_state", global_shape=shape, global_offset=offset)
        if obj.unique_key not in seen:  # linear_qkv weight and bias share one module
            seen.add(obj.unique_key)
            out.append(obj)
    return out
