"""The benchmark's colocated baseline: the reference system's path, re-implemented on purpose.

Where one GPU holds a trainer rank and an engine rank, broadcast cannot run (NCCL refuses two
ranks of a group on one GPU), and p2p is measured against the path the reference RL framework
takes there instead (miles ``update_weight_from_tensor.py``, ``_send_to_colocated_engine``): the
trainer converts its shards into whole HF tensors in the engine's wire format, packs a bucket of
them into ONE flat buffer with each tensor's name, dtype, shape and offset (sglang's
``FlattenedTensorBucket``), and hands the engine a CUDA IPC handle of that buffer
(``update_weights_from_tensor`` with ``load_format="flattened_bucket"``); the engine opens it,
loads every tensor through its own loading rule
(:func:`~weightsync.sync.params.write_global`: slice each piece it holds, copy) and
acknowledges, and the trainer fills the next bucket.

This module re-implements that path as the benchmark's baseline; it is not the library's
colocated broadcast (:mod:`weightsync.sync.tensor_sender`, what ``run --placement colocated``
uses: named views pickled per tensor through the engine's HTTP endpoint), and it does not build
on the library's senders: the benchmark's engine ranks are processes of the benchmark, not HTTP
servers, and what is measured is the reference's design. To keep the comparison about that
design and not about a slow conversion, the trainer assembles tensors straight into the flat
buffer, quantizes fp8 weights with the same fused kernel p2p packs with
(:class:`~weightsync.quant.fp8_fused.FusedQuant`, which writes a weight and its
``weight_scale_inv`` together, so the two always share a bucket) and reuses two flat buffers
across steps.

Needs one trainer rank holding every tensor whole and one engine rank (the one-GPU colocated
case); :func:`~weightsync.launch.bench.config.tensor_skip_reason` says why not otherwise. The
hand-over is timed on the GPU only (``weightsync bench --placement colocated``, BENCHMARKS.md);
the conversion and loading are tested on CPU (``tests/test_bench_colocated.py``).

Typical usage (inside :mod:`weightsync.launch.bench.worker`)::

    plan = TensorBuckets.build(inputs, bucket_bytes)          # every process, same result
    src = TrainerBuckets(plan, inputs, params, device)        # trainer
    run_update(is_trainer=..., trainer=src, plan=plan, store=store, spec=spec,
               exchange=exchange, engine_rank=1)              # both sides, every step
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from weightsync.layout.box import box_slices, full_box
from weightsync.models.spec import ModelSpec
from weightsync.plan.inputs import PlanInputs
from weightsync.quant.fp8_fused import FusedQuant, QuantTask
from weightsync.sync.params import ParamStore, write_global

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
ALIGN = 256
"""Byte alignment of every tensor in a flat buffer."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WireTensor:
    """One whole HF tensor of a bucket, as the engine receives it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the bucket's flat buffer (256-aligned)."""
    quant_of: str | None = None
    """The source weight when this is an fp8 value or scale tensor computed by the trainer."""

    @property
    def nbytes(self) -> int:
        return _bytes(self.dtype, self.shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorBuckets:
    """The baseline's buckets: the same on every process (a pure function of the inputs)."""

    buckets: tuple[tuple[WireTensor, ...], ...]
    capacity: int
    """Bytes of the largest bucket (each flat buffer's size)."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for b in self.buckets for t in b)

    @property
    def num_tensors(self) -> int:
        return sum(len(b) for b in self.buckets)

    @classmethod
    def build(cls, inputs: PlanInputs, bucket_bytes: int, dst_rank: int = 0) -> TensorBuckets:
        """Every global tensor engine rank ``dst_rank`` holds a piece of, in its wire format.

        A weight the engine stores in fp8 and the trainer holds in another dtype is sent as fp8
        values plus its ``_scale_inv`` tensor, next to each other in one bucket.
        """
        layout = inputs.dest_layout(dst_rank)
        dtype_of: dict[str, torch.dtype] = {}
        for t in layout:
            for p in t.pieces:
                dtype_of.setdefault(p.global_name, getattr(torch, t.dtype))
        entries: list[list[tuple[str, torch.dtype, tuple[int, ...], str | None]]] = []
        for name, dtype in dtype_of.items():
            g = inputs.globals[name]
            if g.quant_of is not None and inputs.globals[g.quant_of].dtype != "float8_e4m3fn":
                continue  # computed with its weight
            if dtype == FP8 and g.dtype != "float8_e4m3fn":
                scale = inputs.globals[name + "_scale_inv"]
                entries.append([(name, FP8, g.shape, name), (scale.name, torch.float32, scale.shape, name)])
            else:
                entries.append([(name, dtype, g.shape, None)])
        buckets: list[tuple[WireTensor, ...]] = []
        cur: list[WireTensor] = []
        used = 0
        for group in entries:
            size = sum(_aligned(_bytes(dt, sh)) for _, dt, sh, _ in group)
            if cur and used + size > bucket_bytes:
                buckets.append(tuple(cur))
                cur, used = [], 0
            for name, dt, sh, q in group:
                cur.append(WireTensor(name=name, dtype=dt, shape=sh, offset=used, quant_of=q))
                used += _aligned(_bytes(dt, sh))
        if cur:
            buckets.append(tuple(cur))
        capacity = max((b[-1].offset + b[-1].nbytes for b in buckets), default=0)
        return cls(buckets=tuple(buckets), capacity=capacity)


def _bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return dtype.itemsize * math.prod(shape)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class TrainerBuckets:
    """The trainer side: conversion steps per bucket, prepared once; :meth:`fill` every step."""

    def __init__(self, plan: TensorBuckets, inputs: PlanInputs, params: Mapping[str, torch.Tensor],
                 device: torch.device, src_rank: int = 0) -> None:
        self.plan = plan
        self.device = device
        pieces: dict[str, list[tuple[str, Any]]] = {}
        for t in inputs.source_layouts[src_rank]:
            for p in t.pieces:
                pieces.setdefault(p.global_name, []).append((t.name, p))
        self.flat = [torch.empty(max(plan.capacity, 1), dtype=torch.uint8, device=device) for _ in range(2)]
        self._steps = [self._compile(b, self.flat[i % 2], inputs, params, pieces) for i, b in enumerate(plan.buckets)]

    def _compile(self, bucket: tuple[WireTensor, ...], flat: torch.Tensor, inputs: PlanInputs,
                 params: Mapping[str, torch.Tensor], pieces: dict[str, list[tuple[str, Any]]]) -> tuple[Any, ...]:
        """``(copies, scratch copies, quantization)`` of one bucket: whole-tensor assembly from the
        trainer's pieces (into the buffer, or into a bf16 scratch that is then quantized)."""
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        tasks: list[QuantTask] = []
        block = None
        views = {w.name: flat[w.offset : w.offset + w.nbytes].view(w.dtype).view(w.shape) for w in bucket}
        for w in bucket:
            if w.quant_of is not None and w.dtype != FP8:
                continue  # the scale, written with its weight
            g = inputs.globals[w.name]
            have = pieces.get(w.name, [])
            if w.quant_of is None:
                for local, p in have:
                    copies.append((views[w.name][box_slices(p.global_box)], params[local][box_slices(p.local_box)]))
                continue
            block = g.block or inputs.globals[w.name + "_scale_inv"].block
            src = None
            if len(have) == 1 and have[0][1].global_box == full_box(g.shape):
                local, p = have[0]
                try:  # quantized straight from the parameter when its box is a view of that shape
                    src = params[local][box_slices(p.local_box)].view(g.shape)
                except RuntimeError:
                    src = None
            if src is None:  # several pieces (a fused or interleaved trainer tensor): assemble first
                src = torch.empty(g.shape, dtype=getattr(torch, g.dtype), device=self.device)
                for local, p in have:
                    copies.append((src[box_slices(p.global_box)], params[local][box_slices(p.local_box)]))
            tasks.append(QuantTask(src=src, q=views[w.name], scale=views[w.name + "_scale_inv"]))
        quant = FusedQuant(tasks, block) if tasks else None
        return copies, quant

    def fill(self, index: int) -> torch.Tensor:
        """Convert bucket ``index`` into its flat buffer (enqueued on the current stream)."""
        copies, quant = self._steps[index]
        for dst, src in copies:  # views of the live parameters: reshaped here, never copied at set-up
            dst.copy_(src.reshape(dst.shape))
        if quant is not None:
            quant.run()
        return self.flat[index % 2]


def share(flat: torch.Tensor) -> tuple[Any, ...]:
    """The picklable CUDA IPC description of ``flat`` (torch's ``reduce_tensor``)."""
    return reduce_tensor(flat)


def open_shared(shared: tuple[Any, ...]) -> torch.Tensor:
    """The engine's view of a :func:`share` d buffer."""
    fn, args = shared
    return fn(*args)


def load_bucket(store: ParamStore, spec: ModelSpec, bucket: tuple[WireTensor, ...], flat: torch.Tensor) -> int:
    """Load every tensor of ``bucket`` from ``flat`` with the engine's loading rule; bytes written."""
    written = 0
    for w in bucket:
        t = flat[w.offset : w.offset + w.nbytes].view(w.dtype).view(w.shape)
        written += write_global(store, spec, w.name, lambda box, t=t: t[box_slices(box)])
    return written


def run_update(*, is_trainer: bool, trainer: TrainerBuckets | None, plan: TensorBuckets, store: ParamStore | None,
               spec: ModelSpec, exchange: Callable[[Any, int], Any], engine_rank: int) -> dict[str, float]:
    """One baseline update, bucket by bucket (trainer fills, hands the handle, engine loads, acks).

    Args:
        is_trainer: which side this process is.
        trainer: the trainer's buckets (trainer only).
        plan: the buckets.
        store: the engine's parameters (engine only).
        spec: the model.
        exchange: ``exchange(obj, src)`` broadcasts ``obj`` from process ``src`` to both and
            returns it (a blocking call, as the reference's per-bucket request).
        engine_rank: the engine's process rank in ``exchange``.

    Returns:
        The side's own seconds: trainer ``fill_s``; engine ``load_s``; both ``bytes``.
    """
    fill_s = load_s = 0.0
    nbytes = 0
    for i, bucket in enumerate(plan.buckets):
        if is_trainer:
            assert trainer is not None
            t0 = time.perf_counter()
            flat = trainer.fill(i)
            torch.cuda.current_stream().synchronize()
            fill_s += time.perf_counter() - t0
            exchange(share(flat), 0)
            exchange(None, engine_rank)  # the engine's acknowledgement
            nbytes += sum(w.nbytes for w in bucket)
        else:
            assert store is not None
            shared = exchange(None, 0)
            t0 = time.perf_counter()
            flat = open_shared(shared)
            nbytes += load_bucket(store, spec, bucket, flat)
            torch.cuda.current_stream().synchronize()
            del flat
            load_s += time.perf_counter() - t0
            exchange(True, engine_rank)
    return {"fill_s": fill_s, "load_s": load_s, "bytes": float(nbytes)}
