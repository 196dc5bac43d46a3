"""Validation of a run: what the engines must hold after an update, and logprob parity.

Both checks compare the engines against the *trainer's* weights, computed independently of the
transfer: the global tensors at a step (from the trainer backend's reference copy) are laid
out into each engine rank's parameters by the engine's own loading code and hashed the way the
engine's ``/weights_checker checksum`` hashes (sglang's checksum: derived tensors, which are not
sglang parameters, are not listed; they are checked by the logprobs); logprobs of fixed
prompts come from a single-process reference forward of the same global tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from weightsync.layout.box import Box
from weightsync.layout.sglang import engine_layout
from weightsync.models.hf import global_tensors
from weightsync.models.parallel import RolloutParallel
from weightsync.models.spec import ModelSpec
from weightsync.sync.engine_client import EngineClient, EngineError

ReadGlobal = Callable[[str], torch.Tensor]
"""Global tensor name -> the full tensor (trainer's weights at some step)."""

PARITY_PROMPTS: tuple[str, ...] = (
    "What is 12 + 30? Answer:",
    "Compute 7 * 6.",
    "The square root of 1764 is",
)
"""Fixed prompts of the logprob parity check."""


def expected_checksums(spec: ModelSpec, rollout: RolloutParallel, rank: int, read: ReadGlobal, *,
                       gpu: bool) -> dict[str, str]:
    """The checksums rank ``rank`` of every engine must report after an update (sglang's, as the
    engine's ``/weights_checker`` computes them).

    Args:
        spec: the model.
        rollout: the engine's parallel layout.
        rank: rank inside the engine.
        read: the trainer's global tensors (fp8 weights in the trainer's dtype; no scale tensors).
        gpu: the engines hold their parameters on GPUs (sglang hashes those another way).

    Returns:
        ``{param name: hex digest}`` for every parameter the engine lists.
    """
    from weightsync.engine.checker import WeightChecker
    from weightsync.sync.params import ParamStore, write_global

    store = ParamStore(engine_layout(spec, rollout, rank), device=torch.device("cpu"))
    try:
        cache: dict[str, torch.Tensor] = {}

        def reader(name: str) -> Callable[[Box], torch.Tensor]:
            def read_box(box: Box) -> torch.Tensor:
                if name not in cache:
                    cache.clear()
                    cache[name] = read(name)
                return cache[name][tuple(slice(a, b) for a, b in box)]

            return read_box

        table = global_tensors(spec)
        for name in _stored_globals(store):
            if table[name].quant_of is not None:
                continue  # an fp8 scale: written with its weight, which write_global quantizes
            write_global(store, spec, name, reader(name))
        return dict(WeightChecker(store).checksum(gpu=gpu)["checksums"])
    finally:
        store.close()


def as_engine_holds(spec: ModelSpec, read: ReadGlobal, rollout: RolloutParallel | None = None) -> ReadGlobal:
    """The trainer's tensors as the engine computes with them: weights it stores in fp8 come back
    block-quantized and dequantized, weights it stores in a narrower float dtype than the
    trainer's (the DSA indexer's bfloat16 ``weights_proj`` in a float32 run) rounded through it,
    the others unchanged.

    The reference forward of the logprob check reads these. A synthetic checkpoint is fp8-exact,
    so before the first train step this changes nothing; after one, it is the difference between
    an fp8 engine and a bf16 reference (and expert routing turns that into logprob differences
    far above the tolerance). Dequantized to float32 (the engine's CPU compute dtype), except MLA
    ``kv_b_proj``: the engine computes only with ``w_kc``/``w_vc`` derived from it, which it
    stores in the model's dtype.

    Args:
        spec: the model.
        read: the trainer's global tensors.
        rollout: the engines' layout (its options decide the stored dtypes; default: sglang's rules).
    """
    from weightsync.quant.fp8 import dequantize_block_fp8, quantize_block_fp8

    block = spec.fp8_block
    quantized = {g.quant_of for g in global_tensors(spec).values() if g.quant_of is not None}
    narrower = _narrower_storage(spec, rollout or RolloutParallel())
    if (block is None or not quantized) and not narrower:
        return read

    def view(name: str) -> torch.Tensor:
        t = read(name)
        if name in narrower:
            return t.to(narrower[name]).to(t.dtype)
        if name not in quantized or block is None:
            return t
        q, scale_inv = quantize_block_fp8(t, block)
        dtype = getattr(torch, spec.dtype) if name.endswith(".kv_b_proj.weight") else torch.float32
        return dequantize_block_fp8(q, scale_inv, block, dtype)

    return view


def _narrower_storage(spec: ModelSpec, rollout: RolloutParallel) -> dict[str, torch.dtype]:
    """Global tensors (of the trainer's float dtype) that the engine stores in a float dtype of fewer bits."""
    bits = {"float32": 32, "bfloat16": 16, "float16": 16}
    out: dict[str, torch.dtype] = {}
    for t in engine_layout(spec, rollout, 0):
        if bits.get(t.dtype, 32) < bits.get(spec.dtype, 0):
            out.update({p.global_name: getattr(torch, t.dtype) for p in t.pieces})
    return out


def _stored_globals(store: Any) -> list[str]:
    names: list[str] = []
    seen: set[str] = set()
    for t in store.layout:
        for p in t.pieces:
            if p.global_name not in seen:
                seen.add(p.global_name)
                names.append(p.global_name)
    return names


def compare_checksums(got: Mapping[str, str], want: Mapping[str, str]) -> list[str]:
    """Names whose digests differ, are missing, or are unexpected (empty: all equal)."""
    bad = [n for n in want if got.get(n) != want[n]]
    bad += [n for n in got if n not in want]
    return sorted(bad)


def engine_checksum_mismatches(answer: Mapping[str, Any], want: Sequence[Mapping[str, str]]) -> list[str]:
    """One line per rank of an engine whose checksums differ from ``want[rank]`` (empty: all equal).

    Args:
        answer: the engine's ``/weights_checker`` ``checksum`` answer, as sglang gives it (``ranks``,
            each with its ``parallelism_info``; either release's shape) -- this project's engine
            answers the same.
        want: per rank, :func:`expected_checksums`.
    """
    from weightsync.sync.sglang_checksum import checksums_by_rank

    got = checksums_by_rank(answer)
    bad = []
    for rank, expected in enumerate(want):
        if rank not in got:
            bad.append(f"rank {rank}: not in the answer (ranks {sorted(got)})")
            continue
        diff = compare_checksums(got[rank], expected)
        if diff:
            bad.append(f"rank {rank}: {len(diff)} tensors differ, e.g. {diff[:3]}")
    return bad


def max_abs_diff(a: Sequence[float | None], b: Sequence[float | None]) -> float:
    """Largest |a_i - b_i| over positions where both are numbers."""
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    return max(diffs, default=0.0)


# -- step 0: the engines' weights against their snapshot (check-weight-update-equal) ------------------


DERIVED_MLA = (".w_kc", ".w_vc")
"""Name suffixes of the engine tensors derived from MLA ``kv_b_proj`` after every load or update."""


def holds_fp8_weights(hf_dir: Path) -> bool:
    """Whether the checkpoint stores float8 weights (a real block-fp8 checkpoint)."""
    from weightsync.models.checkpoint import HFCheckpoint

    with HFCheckpoint(hf_dir) as ckpt:
        return any(ckpt.meta(n)[1] == "float8_e4m3fn" for n in ckpt.names())


def compare_snapshot(client: EngineClient, *, allow_quant_error: bool = False) -> Any:
    """``/weights_checker compare``; a mismatch answers HTTP 400 with the report, kept as the result."""
    try:
        if allow_quant_error:
            return client.weights_checker("compare", allow_quant_error=True, skip_tensor_list=list(DERIVED_MLA))
        return client.weights_checker("compare")
    except EngineError as exc:
        return {"equal": False, "error": str(exc)[:1000]}


def compare_ok(result: Any) -> bool:
    """Whether a :func:`compare_snapshot` answer says the weights equal the snapshot."""
    if isinstance(result, dict):
        if "mismatches" in result:
            return not result["mismatches"]
        if "equal" in result:
            return bool(result["equal"])
    return False
