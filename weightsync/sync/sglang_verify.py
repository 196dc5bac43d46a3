"""Checking an update into engines that hash on GPUs the way sglang does, without gathering weights.

A real sglang reports, per rank and parameter, ``gpu_tensor_hash`` of what it holds (block-fp8
weights dequantized to bfloat16; :mod:`weightsync.sync.sglang_checksum`). That hash sums per-word
keys within tiles of 8192 words, so the trainer ranks compute the expected values from exactly
what each of them writes, with no gather:

* every trainer rank walks its share of the static p2p plan for engine 0 (every engine receives
  the same bytes; broadcast writes the same bytes too, so one walk serves both modes) and puts
  each op's destination values -- its own parameter's box, cast where the op casts, quantized and
  dequantized to bfloat16 where it writes a block-fp8 weight (scales are not listed) -- into a
  scratch copy of the destination parameter, one parameter at a time;
* whole 4-byte words it covered are hashed at their word index into per-(parameter, tile) sums;
  words it covered only in part (a boundary between two writers' elements) travel to rank 0 as
  ``(word, bytes, byte mask)``;
* the sums are added over the trainer ranks (one all-reduce of an int64 vector, a few MB even at
  full size), rank 0 joins the split words, adds the padding it alone covers (vocab padding rows,
  zero after sglang's loader and in this project's engine; the bytes past a tensor's end), and
  finishes each parameter's hash.

The comparison reads each engine's ``/weights_checker`` ``checksum`` answer (either release's
shape) and names every tensor that differs, per engine and rank.

What it proves: what the checker reports equals what the plan's writes put there. It assumes, as
sglang's own hash does, that the engine's padding rows are zero (true after a checkpoint load;
``--load-format dummy`` fills them with random values, which then differ in ``embed_tokens``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from weightsync.layout.box import LocalTensor, box_shape, box_slices
from weightsync.models.dtypes import torch_dtype
from weightsync.plan.inputs import PlanInputs
from weightsync.plan.ops import CopyOp
from weightsync.quant.fp8 import quantize_block_fp8
from weightsync.sync.sglang_checksum import (
    MASK32,
    add_words,
    as_words,
    checksums_by_rank,
    dequant_bf16,
    finalize,
    never_checked,
    num_tiles,
    quantized_pairs,
)
from weightsync.sync.verify import Verifier

if TYPE_CHECKING:
    from weightsync.sync.engines import Engines

log = logging.getLogger(__name__)

MAX_NAMED = 8
"""Differing tensors named per engine rank in a mismatch message."""


class _Slot:
    """One listed parameter of one rank of engine 0, as its checksum hashes it."""

    def __init__(self, rank: int, t: LocalTensor, hashed: torch.dtype, base: int) -> None:
        self.rank = rank
        self.tensor = t
        self.hashed = hashed
        self.nbytes = t.numel * hashed.itemsize
        self.base = base
        """Its first tile in the sums vector."""


def _slots(inputs: PlanInputs) -> list[_Slot]:
    """Every parameter sglang lists, per rank of engine 0, with where its tiles sit.

    Raises:
        ValueError: an fp8 weight whose block sglang would infer otherwise (its checksum would not
            be of the dequantized weight; the name and both blocks are given).
    """
    out: list[_Slot] = []
    base = 0
    for r in range(inputs.rollout.tp):
        layout = [t for t in inputs.dest_layout(r) if not t.derived]
        dtypes = {t.name: torch_dtype(t.dtype) for t in layout}
        pairs = quantized_pairs(dtypes, dtypes)
        scales = set(pairs.values())
        shapes = {t.name: t.shape for t in layout}
        for t in layout:
            if t.name in scales or (t.name not in pairs and never_checked(t.name)):
                continue
            if t.name in pairs:
                block = {inputs.globals[p.global_name].block for p in t.pieces} - {None}
                inferred = shapes[t.name][-1] // shapes[pairs[t.name]][-1]
                if block != {(inferred, inferred)}:
                    raise ValueError(f"{t.name}: fp8 block {sorted(block)} but sglang's checker infers "
                                     f"{inferred}x{inferred} from its scale; its checksum cannot be expected")
            slot = _Slot(r, t, torch.bfloat16 if t.name in pairs else dtypes[t.name], base)
            base += num_tiles(slot.nbytes)
            out.append(slot)
    return out


class ShareChecksum:
    """This trainer rank's part of sglang's checksums of engine 0, and the comparison (module docstring)."""

    def __init__(self, inputs: PlanInputs, ops: Sequence[CopyOp], params: Mapping[str, torch.Tensor], *, rank: int,
                 pg: Any) -> None:
        """Args:
            inputs: both layouts.
            ops: this rank's share of the p2p plan (``plan_p2p_for_rank``).
            params: this rank's parameters by name (the ops' sources).
            rank: this trainer rank in ``pg``.
            pg: the trainer ranks' process group.

        Raises:
            ValueError: see :func:`_slots`.
        """
        self.inputs = inputs
        self.params = params
        self.rank = rank
        self.pg = pg
        self.slots = _slots(inputs)
        self.num_tiles = sum(num_tiles(s.nbytes) for s in self.slots)
        listed = {(s.rank, s.tensor.name) for s in self.slots}
        self._ops: dict[tuple[int, str], list[CopyOp]] = defaultdict(list)
        for op in ops:
            if (op.dst_rank, op.dst_param) in listed:
                self._ops[(op.dst_rank, op.dst_param)].append(op)
        self.device = next(iter(params.values())).device if params else torch.device("cpu")

    def _values(self, op: CopyOp, slot: _Slot) -> torch.Tensor:
        """What ``op`` puts into the hashed tensor, shaped as its destination box."""
        src = self.params[op.src_param][box_slices(op.src_box)]
        if op.transform == "fp8_quant":
            block = self.inputs.globals[op.global_name].block
            assert block is not None, op.global_name
            q, s = quantize_block_fp8(src.reshape(box_shape(op.src_box)[-2:]), block)
            return dequant_bf16(q, s).reshape(box_shape(op.dst_box))
        return src.to(slot.hashed).reshape(box_shape(op.dst_box))

    def _hash_slot(self, slot: _Slot, sums: torch.Tensor, split: list[np.ndarray]) -> None:
        """Hash what this rank covers of ``slot`` (rank 0 also its padding and tail bytes)."""
        t = slot.tensor
        ops = self._ops.get((slot.rank, t.name), [])
        if not ops and self.rank != 0:
            return
        values = torch.zeros(t.shape, dtype=slot.hashed, device=self.device)
        covered = torch.zeros(t.shape, dtype=torch.bool, device=self.device)
        for op in ops:
            values[box_slices(op.dst_box)] = self._values(op, slot)
            covered[box_slices(op.dst_box)] = True
        if self.rank == 0:  # the padding: rows no piece holds (zero in the engine)
            piece = torch.zeros(t.shape, dtype=torch.bool, device=self.device)
            for p in t.pieces:
                piece[box_slices(p.local_box)] = True
            covered |= ~piece
        raw = values.reshape(-1).view(torch.uint8)
        mask = covered.reshape(-1).repeat_interleave(slot.hashed.itemsize)
        tail = -raw.numel() % 4
        mask = torch.cat([mask, mask.new_full((tail,), self.rank == 0)])
        words = as_words(raw)
        index = torch.arange(words.numel(), dtype=torch.int64, device=self.device)
        byte_mask = mask.view(-1, 4)
        full = byte_mask.all(dim=1)
        add_words(sums, words[full], index[full], base=slot.base)
        part = byte_mask.any(dim=1) & ~full
        if bool(part.any()):  # bytes it did not cover are zero in the scratch: the word ORs with the others'
            bits = (byte_mask[part].to(torch.int64) << torch.arange(4, device=self.device)).sum(dim=1)
            n = int(part.sum())
            split.append(np.stack([np.full(n, slot.base), index[part].cpu().numpy(), words[part].cpu().numpy(),
                                   bits.cpu().numpy()], axis=1))

    # The updater drives a verifier through the calls of the fingerprint's
    # (:class:`~weightsync.sync.verify.Verifier`): here nothing is hashed while sending and no
    # seed is used -- sglang's checksum is fixed.

    def new_partials(self) -> torch.Tensor:
        """(The fingerprint's slot vector: none here.)"""
        return torch.zeros(0, dtype=torch.int64)

    def hash_share(self, partials: torch.Tensor, seed: int) -> None:
        """(The fingerprint's hash-only pass: :meth:`expected` walks the share itself.)"""

    scratch_bytes = 0
    hashes_while_writing = False
    """sglang's checksum is computed after the write (the fingerprint hashes while it sends)."""
    what = "checksums"

    def expected(self, partials: torch.Tensor | None = None, seed: int = 0, *,
                 same_for_every_engine: bool = True) -> dict[int, dict[str, str]] | None:
        """Every rank of engine 0's expected checksums, on rank 0 of ``pg`` (None elsewhere); collective.
        (``partials``, ``seed``: the fingerprint's; every engine expects what engine 0 does.)

        Returns:
            ``{rank inside an engine: {parameter: 16 hex digits}}``.

        Raises:
            RuntimeError: (rank 0) bytes of a listed parameter that no one wrote (an incomplete plan).
        """
        sums = torch.zeros(2, self.num_tiles, dtype=torch.int64, device=self.device)
        split: list[np.ndarray] = []
        for slot in self.slots:
            self._hash_slot(slot, sums, split)
        v = sums.to("cuda" if dist.get_backend(self.pg) == "nccl" else "cpu")
        dist.all_reduce(v, group=self.pg)
        everyone: list[Any] = [None] * dist.get_world_size(self.pg)
        mine = np.concatenate(split) if split else np.zeros((0, 4), dtype=np.int64)
        dist.all_gather_object(everyone, mine, group=self.pg)
        if self.rank != 0:
            return None
        total = v.cpu()
        self._join_split(total, np.concatenate(everyone))
        out: dict[int, dict[str, str]] = {r: {} for r in range(self.inputs.rollout.tp)}
        for s in self.slots:
            sl = total[:, s.base:s.base + num_tiles(s.nbytes)]
            out[s.rank][s.tensor.name] = f"{finalize(sl, s.nbytes):016x}"
        return out

    def _join_split(self, total: torch.Tensor, split: np.ndarray) -> None:
        """Join the words several writers covered in part, and hash each once into ``total``."""
        if not len(split):
            return
        words: dict[tuple[int, int], list[int]] = {}
        for base, index, word, bits in split.tolist():
            w = words.setdefault((base, index), [0, 0])
            w[0] |= word
            w[1] |= bits
        bad = [(b, i) for (b, i), (_, bits) in words.items() if bits != 0xF]
        if bad:
            owner = {s.base: f"rank {s.rank} {s.tensor.name}" for s in self.slots}
            raise RuntimeError(f"{len(bad)} words of listed parameters were not fully written by the plan, e.g. "
                               f"word {bad[0][1]} of {owner.get(bad[0][0], '?')}")
        keys = np.array(list(words), dtype=np.int64)
        values = torch.tensor([w[0] & MASK32 for w in words.values()], dtype=torch.int64)
        add_words(total, values, torch.from_numpy(keys[:, 1]), base=torch.from_numpy(keys[:, 0]))

    def compare(self, engines: Engines, expected: Mapping[int, Mapping[str, str]], seed: int = 0,
                answers: Mapping[int, Any] | None = None, only: Sequence[int] | None = None) -> dict[int, str]:
        """The checksums of the engines ``only`` (default every one; one call each, all at once)
        against ``expected``: each engine that differs or did not answer, with why (per rank,
        naming the tensors). (``seed``, ``answers``: the fingerprint's; sglang's checksum is asked
        for after ``end_weight_update``, never inside it.)"""
        tp = self.inputs.rollout.tp
        which = range(len(engines.clients)) if only is None else only
        got, bad = engines.each_of(which, lambda c: c.weights_checker("checksum"), what="weights_checker checksum")
        for e, lines in compare_answers(engines, got, [expected[r] for r in range(tp)]).items():
            bad[e] = "checksums differ: " + "; ".join(lines)
        return dict(sorted(bad.items()))

    def close(self) -> None:
        self._ops.clear()


def compare_answers(engines: Engines, answers: Mapping[int, Mapping[str, Any]],
                    expected: Sequence[Mapping[str, str]]) -> dict[int, list[str]]:
    """Engines' checksum answers (engine index -> answer) against the expected checksums of each
    rank inside an engine: each engine that differs, one line per rank."""
    bad: dict[int, list[str]] = {}
    for e, answer in answers.items():
        try:
            got_by_rank = checksums_by_rank(answer)
        except ValueError as exc:
            bad[e] = [f"{engines.where(e)}: {exc}"]
            continue
        for r, want in enumerate(expected):
            got = got_by_rank.get(r)
            if got is None:
                bad.setdefault(e, []).append(f"{engines.where(e)}: no checksums of rank {r}")
                continue
            diff = sorted([n for n, v in want.items() if got.get(n) != v] + [n for n in got if n not in want])
            if diff:
                more = f" and {len(diff) - MAX_NAMED} more" if len(diff) > MAX_NAMED else ""
                bad.setdefault(e, []).append(f"{engines.where(e)}, rank {r}: {len(diff)} of {len(want)} tensors "
                                             f"differ: {', '.join(diff[:MAX_NAMED])}{more}")
    return bad


def new_verifier(engines: Sequence[tuple[bool, bool]], inputs: PlanInputs, ops: Sequence[CopyOp],
                 params: Mapping[str, torch.Tensor], *, rank: int, pg: Any,
                 bucket_bytes: int) -> Verifier | ShareChecksum:
    """The verification that fits the engines (per engine: this project's engine, on GPUs): this
    project's engines by fingerprint (:class:`~weightsync.sync.verify.Verifier`); with a real
    sglang among them, by sglang's own checksum (:class:`ShareChecksum`: this project's engine
    reports the same values).

    Raises:
        ValueError: a real sglang on the CPU (its sha256 checksum does not compose over the
            writers: not built), or engines on GPUs and on CPUs together.
    """
    if all(builtin for builtin, _ in engines):
        return Verifier(inputs, ops, params, rank=rank, pg=pg, bucket_bytes=bucket_bytes)
    if not all(gpu for _, gpu in engines):
        raise ValueError("a real sglang on the CPU reports sha256 checksums, which do not add up over the trainer "
                         "ranks' writes: verifying it is not built; pass UpdaterConfig(verify_every=0)")
    return ShareChecksum(inputs, ops, params, rank=rank, pg=pg)
