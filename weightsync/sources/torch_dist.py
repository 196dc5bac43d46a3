"""Megatron ``torch_dist`` checkpoints: write every trainer rank's shards from one process, read
one rank's shards (or whole global tensors) back.

On-disk layout, as ``megatron.training.checkpointing.save_checkpoint`` makes it for a released
checkpoint (miles' ``tools/convert_hf_to_torch_dist.py``)::

    <dir>/latest_checkpointed_iteration.txt      "release"
    <dir>/release/.metadata                      torch.distributed.checkpoint (DCP) metadata
    <dir>/release/__<rank>_0.distcp              the chunks first held by trainer rank <rank>
    <dir>/release/metadata.json                  {"sharded_backend": "torch_dist", ...}
    <dir>/release/common.pt                      the non-sharded part (iteration, version)

The DCP keys, global shapes and chunk offsets are those of megatron-core's
``GPTModel.sharded_state_dict()`` (:mod:`weightsync.sources.dist_layout`), so Megatron's
``dist_checkpointing.load`` reads the result at any parallel configuration; each chunk is one
rank's shard, so a reader at the saving configuration reads exactly its own bytes.

Writing does not need a process group: DCP runs with ``no_dist=True`` and the state dict holds,
for each key, a container of every rank's chunks (implementing DCP's ``_Checkpointable``
protocol, as megatron-core's ``LocalShardsContainer`` does) whose data is produced lazily, one
chunk at a time, from a reader of global (HF) tensors.

Typical usage::

    write_torch_dist(out_dir, spec, par, read_global)            # prepare
    tensors = read_rank_tensors(out_dir, spec, par, rank)        # one trainer rank
    full = read_global_tensors(out_dir, spec, par)               # round-trip checks
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from weightsync.layout.box import Box, LocalTensor, box_intersect, box_shape, box_slices
from weightsync.layout.megatron import trainer_layout
from weightsync.models.dtypes import torch_dtype
from weightsync.models.parallel import TrainParallel
from weightsync.models.spec import ModelSpec
from weightsync.sources.dist_layout import DistChunk, chunks_of, extra_state_objects

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
BACKEND_FILE = "metadata.json"
COMMON_FILE = "common.pt"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}
"""``metadata.json`` of megatron-core's ``CheckpointingConfig`` for a torch_dist checkpoint."""
CHECKPOINT_VERSION = 3.0
"""``checkpoint_version`` of Megatron-LM's ``save_checkpoint``."""

ReadGlobal = Callable[[str, Box], torch.Tensor]
"""``read(global_name, global_box)`` -> the region of an HF global tensor (any float dtype)."""



def assemble_box(tensor: LocalTensor, box: Box, read: ReadGlobal, device: str | torch.device = "cpu") -> torch.Tensor:
    """The region ``box`` of a local tensor, built from the global tensors its pieces name.

    Regions covered by no piece (padded vocab rows) are zero.

    Args:
        tensor: a local tensor (its pieces).
        box: a region of the local tensor.
        read: reader of global tensor regions.
        device: where to build the result.

    Returns:
        A new tensor of ``box``'s shape and the local tensor's dtype.
    """
    out = torch.zeros(box_shape(box), dtype=torch_dtype(tensor.dtype), device=device)
    for piece in tensor.pieces:
        extra = len(piece.local_box) - len(piece.global_box)
        inter = box_intersect(piece.local_box, box)
        if inter is None:
            continue
        gbox = tuple((g0 + a - l0, g0 + b - l0) for (a, b), (g0, _), (l0, _) in
                     zip(inter[extra:], piece.global_box, piece.local_box[extra:], strict=True))
        dst = tuple((a - o, b - o) for (a, b), (o, _) in zip(inter, box, strict=True))
        region = out[box_slices(dst)]
        region.copy_(read(piece.global_name, gbox).reshape(region.shape))
    return out


def scatter_local(tensor: LocalTensor, data: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """Write the pieces of local tensor ``data`` into the global tensors of ``out`` (name -> tensor)."""
    for piece in tensor.pieces:
        region = data[box_slices(piece.local_box)]
        dst = out[piece.global_name][box_slices(piece.global_box)]
        dst.copy_(region.reshape(dst.shape))


# --------------------------------------------------------------------------- DCP containers


class _Chunks(torch.Tensor):
    """The chunks of one checkpoint key held by this process (DCP ``_Checkpointable``).

    Saving: ``chunks[k] = (offset, shape, make)`` with ``make()`` producing the data on demand.
    Loading: ``make()`` returns the destination tensor the reader copies into.
    """

    @staticmethod
    def __new__(cls, global_shape: tuple[int, ...], dtype: torch.dtype,
                chunks: list[tuple[tuple[int, ...], tuple[int, ...], Callable[[], torch.Tensor]]]) -> _Chunks:
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=dtype)

    def __init__(self, global_shape: tuple[int, ...], dtype: torch.dtype,
                 chunks: list[tuple[tuple[int, ...], tuple[int, ...], Callable[[], torch.Tensor]]]) -> None:
        self._global_shape = torch.Size(global_shape)
        self._chunks = chunks
        self._by_offset = {torch.Size(o): k for k, (o, _, _) in enumerate(chunks)}

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"{cls.__name__} is a checkpoint container, not a tensor to compute with")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(index=MetadataIndex(fqn, torch.Size(o), k), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk, properties=props, size=self._global_shape))
            for k, ((o, _, _), chunk) in enumerate(zip(self._chunks, self.__create_chunk_list__(), strict=True))
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        k = index.index if index.index is not None and index.index < len(self._chunks) and \
            torch.Size(self._chunks[index.index][0]) == index.offset else self._by_offset[torch.Size(index.offset)]
        return self._chunks[k][2]()


class _RankFilesWriter(dcp.FileSystemWriter):
    """A DCP writer that puts the chunks first held by trainer rank r into ``__<r>_0.distcp``
    (Megatron's per-rank files), so that one file's data is in memory at a time."""

    def __init__(self, path: Path, owner: dict[tuple[str, tuple[int, ...]], int]) -> None:
        super().__init__(path, single_file_per_rank=True, thread_count=1, sync_files=False)
        self._owner = owner

    def write_data(self, plan: SavePlan, planner: Any) -> Any:
        import queue

        by_rank: dict[int, list[WriteItem]] = {}
        for item in plan.items:
            offset = tuple(item.index.offset) if item.index.offset is not None else ()
            by_rank.setdefault(self._owner.get((item.index.fqn, offset), 0), []).append(item)
        file_queue: queue.Queue = queue.Queue()
        for rank in sorted(by_rank):
            name = f"__{rank}_0.distcp"
            file_queue.put((self.fs.concat_path(self.path, name), name, by_rank[rank]))
        return self._write_data(planner, file_queue)


# --------------------------------------------------------------------------- writing


@dataclass(frozen=True, kw_only=True, slots=True)
class WriteSummary:
    """What :func:`write_torch_dist` stored."""

    keys: int
    chunks: int
    objects: int
    nbytes: int
    ranks: int


@dataclass
class _Plan:
    keys: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # key -> (global shape, dtype)
    chunks: dict[str, list[tuple[DistChunk, LocalTensor]]] = field(default_factory=dict)
    owner: dict[tuple[str, tuple[int, ...]], int] = field(default_factory=dict)
    objects: dict[str, int] = field(default_factory=dict)  # unique key -> owner rank


def _collect(spec: ModelSpec, par: TrainParallel, expert_naming: str) -> _Plan:
    """Every distinct chunk of the job (replicas dropped), with the rank that first holds it."""
    plan = _Plan()
    for rank in range(par.world_size):
        for tensor in trainer_layout(spec, par, rank, expert_naming=expert_naming):
            for chunk in chunks_of(spec, par, rank, tensor):
                where = (chunk.key, chunk.global_offset)
                if where in plan.owner:
                    continue
                known = plan.keys.setdefault(chunk.key, (chunk.global_shape, tensor.dtype))
                if known != (chunk.global_shape, tensor.dtype):
                    raise AssertionError(f"{chunk.key}: ranks disagree on shape/dtype {known} vs "
                                         f"{(chunk.global_shape, tensor.dtype)}")
                plan.owner[where] = rank
                plan.chunks.setdefault(chunk.key, []).append((chunk, tensor))
        for obj in extra_state_objects(spec, par, rank, expert_naming=expert_naming):
            plan.objects.setdefault(obj.unique_key, rank)
    return plan


def write_torch_dist(out_dir: str | Path, spec: ModelSpec, par: TrainParallel, read: ReadGlobal, *,
                     expert_naming: str = "sequential", progress: Callable[[int], None] | None = None) -> WriteSummary:
    """Write the torch_dist checkpoint of every rank of ``par`` into ``out_dir`` (one process).

    Args:
        out_dir: the checkpoint directory (created; existing files of the same names are
            overwritten: write into a temporary directory and rename, see ``prepare``).
        spec: the model.
        par: the parallel configuration whose shards become the stored chunks.
        read: reader of global (HF) tensor regions; called once per stored chunk piece.
        expert_naming: as in :func:`trainer_layout`.
        progress: called with the number of bytes of each chunk as it is produced.

    Returns:
        A :class:`WriteSummary`.

    Raises:
        ValueError: ``par`` does not fit ``spec`` (names the constraint).
    """
    plan = _collect(spec, par, expert_naming)
    state: dict[str, Any] = {}
    nbytes = 0
    for key, entries in plan.chunks.items():
        gshape, dtype = plan.keys[key]
        items = []
        for chunk, tensor in entries:
            nbytes += _numel(chunk.chunk_shape) * torch.empty((), dtype=torch_dtype(dtype)).element_size()
            items.append((chunk.global_offset, chunk.chunk_shape, _maker(chunk, tensor, read, progress)))
        state[key] = _Chunks(gshape, torch_dtype(dtype), items)
    for unique_key, rank in plan.objects.items():
        # DCP torch.save()s the object; Megatron stores each rank's list of its objects' data,
        # and the _extra_state of a local-spec linear is None.
        state[unique_key] = [None]
        plan.owner[(unique_key, ())] = rank
    release = Path(out_dir) / RELEASE
    release.mkdir(parents=True, exist_ok=True)
    with _single_process():
        dcp.save(state, storage_writer=_RankFilesWriter(release, plan.owner),
                 planner=dcp.DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)
    (release / BACKEND_FILE).write_text(json.dumps(BACKEND))
    torch.save({"checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}, release / COMMON_FILE)
    (Path(out_dir) / TRACKER_FILE).write_text(RELEASE)
    return WriteSummary(keys=len(plan.chunks), chunks=sum(len(v) for v in plan.chunks.values()),
                        objects=len(plan.objects), nbytes=nbytes, ranks=par.world_size)


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """DCP without a process group, on purpose: silence its warning that it assumes so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _maker(chunk: DistChunk, tensor: LocalTensor, read: ReadGlobal,
           progress: Callable[[int], None] | None) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        data = assemble_box(tensor, chunk.local_box, read).reshape(chunk.chunk_shape)
        if progress is not None:
            progress(data.numel() * data.element_size())
        return data

    return make


# --------------------------------------------------------------------------- reading


def release_dir(ckpt_dir: str | Path) -> Path:
    """The directory holding the DCP files of a Megatron checkpoint directory.

    Raises:
        ValueError: no tracker file, or a tracker naming an iteration directory that is absent.
    """
    root = Path(ckpt_dir)
    tracker = root / TRACKER_FILE
    if not tracker.is_file():
        raise ValueError(f"{root} is not a Megatron checkpoint: no {TRACKER_FILE}")
    it = tracker.read_text().strip()
    sub = root / (RELEASE if it == RELEASE else f"iter_{int(it):07d}")
    if not (sub / ".metadata").is_file():
        raise ValueError(f"{root}: {TRACKER_FILE} says {it!r} but {sub}/.metadata is missing")
    return sub


def stored_shapes(ckpt_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Key -> global shape of every tensor of a torch_dist checkpoint (metadata only)."""
    md = dcp.FileSystemReader(release_dir(ckpt_dir)).read_metadata()
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _clip(chunk: DistChunk, stored: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The part of a chunk inside the stored tensor: (offset, shape), None when outside.

    Only a vocab tensor may differ in shape (another TP pads the vocab differently).
    """
    want = chunk.global_shape
    if stored == want:
        return chunk.global_offset, chunk.chunk_shape
    if not chunk.allow_shape_mismatch or len(stored) != len(want) or stored[1:] != want[1:]:
        raise ValueError(f"checkpoint tensor {chunk.key} has shape {list(stored)}, the model needs {list(want)}")
    lo = chunk.global_offset[0]
    hi = min(lo + chunk.chunk_shape[0], stored[0])
    if hi <= lo:
        return None
    return chunk.global_offset, (hi - lo, *chunk.chunk_shape[1:])


def read_rank_tensors(ckpt_dir: str | Path, spec: ModelSpec, par: TrainParallel, rank: int, *,
                      expert_naming: str = "sequential", device: str | torch.device = "cpu",
                      out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Read the local tensors of trainer rank ``rank`` (only its chunks' bytes) from a checkpoint.

    Any parallel configuration can read a checkpoint written with another one (DCP reads the
    overlapping stored chunks); vocab rows beyond the stored padded vocab stay zero.

    Args:
        ckpt_dir: the torch_dist checkpoint directory.
        spec: the model.
        par: the reader's parallel configuration.
        rank: the reader's global trainer rank.
        expert_naming: as in :func:`trainer_layout`.
        device: where new tensors are allocated (ignored for tensors given in ``out``).
        out: destination tensors by local name (e.g. a live model's parameters); missing ones
            are allocated.

    Returns:
        Local name -> tensor, in layout order.

    Raises:
        ValueError: not a checkpoint, a key the checkpoint lacks, or a mis-shaped tensor.
    """
    path = release_dir(ckpt_dir)
    reader = dcp.FileSystemReader(path)
    stored = {k: tuple(v.size) for k, v in reader.read_metadata().state_dict_metadata.items()
              if isinstance(v, TensorStorageMetadata)}
    result: dict[str, torch.Tensor] = {}
    requests: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], Callable[[], torch.Tensor]]]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for tensor in trainer_layout(spec, par, rank, expert_naming=expert_naming):
        dst = out.get(tensor.name) if out is not None else None
        if dst is None:
            dst = torch.zeros(tensor.shape, dtype=torch_dtype(tensor.dtype), device=device)
        elif tuple(dst.shape) != tensor.shape:
            raise ValueError(f"{tensor.name}: destination shape {list(dst.shape)} != layout {list(tensor.shape)}")
        result[tensor.name] = dst
        for chunk in chunks_of(spec, par, rank, tensor):
            if chunk.key not in stored:
                raise ValueError(f"{ckpt_dir}: no tensor {chunk.key!r} (needed for {tensor.name}); "
                                 f"was it written for {spec.name} at scale {spec.scale}?")
            clipped = _clip(chunk, stored[chunk.key])
            if clipped is None:
                continue
            offset, shape = clipped
            view = dst[box_slices(chunk.local_box)].view(chunk.chunk_shape)
            view = view[tuple(slice(0, n) for n in shape)]
            requests.setdefault(chunk.key, []).append((offset, shape, _const(view)))
            dtypes[chunk.key] = dst.dtype
    state = {key: _Chunks(stored[key], dtypes[key], reqs) for key, reqs in requests.items()}
    with _single_process():
        dcp.load(state, storage_reader=reader, planner=dcp.DefaultLoadPlanner(flatten_state_dict=False), no_dist=True)
    return result


def _const(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


def read_global_tensors(ckpt_dir: str | Path, spec: ModelSpec, par: TrainParallel, *,
                        expert_naming: str = "sequential") -> dict[str, torch.Tensor]:
    """Gather the HF global tensors back from a checkpoint by reading every rank of ``par``.

    Args:
        ckpt_dir: the torch_dist checkpoint directory.
        spec: the model.
        par: the parallel configuration to read with (any; need not be the saving one).
        expert_naming: as in :func:`trainer_layout`.

    Returns:
        HF name -> tensor of the trainer's dtype, for every global tensor some rank holds (fp8
        ``weight_scale_inv`` tensors are not trainer tensors and are absent).
    """
    from weightsync.models.hf import global_tensors

    table = global_tensors(spec)
    out: dict[str, torch.Tensor] = {}
    for rank in range(par.world_size):
        tensors = read_rank_tensors(ckpt_dir, spec, par, rank, expert_naming=expert_naming)
        for lt in trainer_layout(spec, par, rank, expert_naming=expert_naming):
            for piece in lt.pieces:
                if piece.global_name not in out:
                    gt = table[piece.global_name]
                    out[piece.global_name] = torch.zeros(gt.shape, dtype=torch_dtype(lt.dtype))
            scatter_local(lt, tensors[lt.name], out)
    return {name: out[name] for name in table if name in out}
