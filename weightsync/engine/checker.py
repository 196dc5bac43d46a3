"""The weight checker of one engine rank: snapshot, reset, compare, per-tensor checksums
(sglang's ``/weights_checker``, ``utils/weight_checker.py``), and fingerprints (an extension).

The correctness gate of a weight update (``--check-weight-update-equal``): snapshot the weights
loaded from the checkpoint, reset them to random values, run the update, compare.

``reset_tensors`` poisons exactly what an update writes: the regions covered by pieces of
global tensors, and derived tensors (recomputed by ``end_weight_update``). Padding (vocab rows
beyond the vocab) is left alone: it is zero from allocation and no update writes it, so a
compare after an update must find it unchanged too. Tensors whose name contains a
``skip_tensor_list`` substring are left alone by reset and not compared (sglang's skip rule).

Compare is bitwise (raw bytes, NaN-safe); every mismatching tensor is reported with its max
absolute difference (as float32) and the count of differing elements. With
``allow_quant_error`` a block-fp8 weight and its ``weight_scale_inv`` are compared as one
dequantized tensor instead, and pass when every element is within one fp8 ULP of each side
(scaled by its block scale), sglang's ``Fp8BlockComparable`` rule.

Checksums are sglang's own (:mod:`weightsync.sync.sglang_checksum`): ``gpu_tensor_hash`` of a
parameter on a GPU, the sha256 prefix of one on the CPU, block-fp8 weights hashed dequantized to
bfloat16 with their scale, scales not listed -- so miles' checksum consumer sees the same values
on this engine as on a real sglang holding the same weights.

Fingerprints (the ``fingerprint`` action, :mod:`weightsync.fingerprint`) are what an updater
verifies an update with: a seeded, position-dependent hash of every element of every non-derived
parameter, computed where the parameter lives (one Triton launch over the whole store on a GPU),
answered as 16 hex digits per parameter. They equal the sum of the partials the trainer ranks
compute over exactly the bytes they wrote.

The live check (:mod:`weightsync.engine.live_check`) digests the served copy with
:meth:`WeightChecker.live_digest`: derived tensors included (a foreign write can reach them too),
by fingerprint where the parameters are on a GPU (one launch, no host copy) and by xxh64 on the
CPU, where numpy's fingerprint runs 60-130 MB/s against xxh64's ~4.6 GB/s (BENCHMARKS.md,
"Verification by fingerprint").
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from weightsync.fingerprint import FingerprintBatch, to_hex, whole_tensors
from weightsync.fingerprint.hash import check_seed
from weightsync.sync.params import ParamStore
from weightsync.sync.sglang_checksum import checksums, per_gpu_checksum

FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _random_fill(region: torch.Tensor, gen: torch.Generator) -> None:
    values = torch.rand(region.shape, generator=gen, dtype=torch.float32) * 2 - 1
    if region.dtype == FP8 or region.dtype.is_floating_point:
        region.copy_(values.to(region.device))
    else:
        region.copy_((values * 100).to(region.dtype).to(region.device))


def _skipped(name: str, skip: Sequence[str]) -> bool:
    return any(s in name for s in skip)


def quant_ulp(q: torch.Tensor) -> torch.Tensor:
    """Per-element ULP of ``q`` in its own (float8) dtype, as float32; zeros and subnormals get
    the spacing of the smallest normal binade (sglang ``ComparableWeight._quant_ulp``)."""
    finfo = torch.finfo(q.dtype)
    x = q.float().abs()
    _, exponent = torch.frexp(x)
    binade = torch.exp2((exponent - 1).float()).masked_fill(x < finfo.smallest_normal, finfo.smallest_normal)
    return binade * finfo.eps


def block_dequant(values: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``values * scale_inv`` per block (blocks of ``k // scale_k`` square, the last two dims)."""
    n, k = values.shape[-2:]
    block = -(-k // scale_inv.shape[-1])
    s = scale_inv.float().repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]
    return values.float() * s


def _diff(expect: torch.Tensor, actual: torch.Tensor) -> dict[str, Any]:
    diff = (expect.float() - actual.float()).abs()
    differs = _bytes(expect).view(-1, expect.element_size()).ne(_bytes(actual).view(-1, actual.element_size())).any(1)
    return {"max_abs_diff": float(diff.nan_to_num(float("inf")).max()), "num_diff": int(differs.sum())}


class WeightChecker:
    """Checker state of one rank (the snapshot lives in host memory)."""

    def __init__(self, store: ParamStore, parallelism_info: dict[str, Any] | None = None) -> None:
        """Args:
        store: the rank's parameters.
        parallelism_info: sglang's ``ParallelismInfo`` of this rank (reported with checksums).
        """
        self.store = store
        self.parallelism_info = dict(parallelism_info or {})
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._batches: weakref.WeakKeyDictionary[ParamStore, dict[bool, tuple[tuple[str, ...], FingerprintBatch]]] = (
            weakref.WeakKeyDictionary())
        """Per store hashed and per ``derived``, the names and the batch of :meth:`fingerprint`
        (built on first use)."""

    def snapshot(self) -> dict[str, int]:
        """Copy every parameter to host memory (replacing an older snapshot; kept until then)."""
        self._snapshot = {n: t.detach().to("cpu", copy=True) for n, t in self.store.items()}
        return {
            "num_tensors": len(self._snapshot),
            "nbytes": sum(t.numel() * t.element_size() for t in self._snapshot.values()),
        }

    def reset_tensors(self, seed: int = 0, skip: Sequence[str] = ()) -> dict[str, int]:
        """Overwrite every written region and every derived tensor with random values (except
        tensors named by a ``skip`` substring)."""
        gen = torch.Generator().manual_seed(seed)
        count = 0
        for name, t in self.store.items():
            if _skipped(name, skip):
                continue
            meta = self.store.meta[name]
            if meta.derived:
                _random_fill(t, gen)
            for piece in meta.pieces:
                _random_fill(t[tuple(slice(a, b) for a, b in piece.local_box)], gen)
            count += 1
        return {"num_tensors": count}

    def _fp8_pairs(self) -> dict[str, str]:
        """fp8 weight name -> its scale's name, for the weights that have one here."""
        return {
            n: n + SCALE_SUFFIX
            for n, t in self.store.items()
            if t.dtype == FP8 and n + SCALE_SUFFIX in self.store and t.dim() >= 2
        }

    def compare(self, allow_quant_error: bool = False, skip: Sequence[str] = ()) -> dict[str, Any]:
        """Compare every parameter with the snapshot.

        Args:
            allow_quant_error: compare block-fp8 weights dequantized, within one ULP per side.
            skip: name substrings of tensors not to compare.

        Returns:
            ``{"equal": bool, "num_tensors": n, "mismatches": [{"name", "max_abs_diff",
            "num_diff"}...]}``; with ``allow_quant_error`` also ``"within_quant_error"``: the
            fp8 weights that differ bitwise but within the tolerance.

        Raises:
            ValueError: no snapshot was taken.
        """
        if self._snapshot is None:
            raise ValueError("weights_checker compare: no snapshot (call the 'snapshot' action first)")
        pairs = self._fp8_pairs() if allow_quant_error else {}
        scales = set(pairs.values())
        mismatches: list[dict[str, Any]] = []
        tolerated: list[str] = []
        for name, t in self.store.items():
            if _skipped(name, skip) or name in scales:
                continue
            expect, actual = self._snapshot[name], t.detach().to("cpu")
            if name in pairs:
                s_name = pairs[name]
                s_expect, s_actual = self._snapshot[s_name], self.store[s_name].detach().to("cpu")
                if torch.equal(_bytes(expect), _bytes(actual)) and torch.equal(_bytes(s_expect), _bytes(s_actual)):
                    continue
                a, b = block_dequant(expect, s_expect), block_dequant(actual, s_actual)
                tol = block_dequant(quant_ulp(expect), s_expect) + block_dequant(quant_ulp(actual), s_actual)
                exceed = int((~((a - b).abs() <= tol)).sum())  # NaN counts as exceeding
                if exceed == 0:
                    tolerated.append(name)
                    continue
                diff = (a - b).abs()
                mismatches.append(
                    {"name": name, "max_abs_diff": float(diff.nan_to_num(float("inf")).max()), "num_diff": exceed}
                )
                continue
            if not torch.equal(_bytes(expect), _bytes(actual)):
                mismatches.append({"name": name, **_diff(expect, actual)})
        out: dict[str, Any] = {"equal": not mismatches, "num_tensors": len(self._snapshot), "mismatches": mismatches}
        if allow_quant_error:
            out["within_quant_error"] = tolerated
        return out

    def checksum(self, skip: Sequence[str] = (), *, gpu: bool | None = None) -> dict[str, Any]:
        """sglang's checksum of each listed parameter (module docstring; derived tensors are not
        parameters in sglang and constant ones are skipped by its checker, so neither is listed),
        one digest over all
        (name-sorted), and this rank's ``parallelism_info`` (sglang's ``ChecksumInfo`` shape: a
        list, one entry per role).

        Args:
            skip: name substrings of (unquantized) tensors to leave out (sglang's skip list).
            gpu: hash as sglang does on a GPU (True) or on the CPU (False); default: where the
                parameters are.
        """
        # derived tensors are not sglang's parameters; constant ones (fp8 attention k_scale / v_scale)
        # sglang marks _skip_weight_check (layers/quantization/kv_cache.py)
        params = [(n, t) for n, t in self.store.items()
                  if not self.store.meta[n].derived and self.store.meta[n].constant is None]
        sums = checksums(params, skip=skip, gpu=gpu)
        return {
            "checksums": sums,
            "per_gpu_checksum": per_gpu_checksum(sums),
            "parallelism_info": [{"role": "target", **self.parallelism_info}] if self.parallelism_info else [],
        }

    def fingerprint(self, seed: int, skip: Sequence[str] = (), *, store: ParamStore | None = None,
                    derived: bool = False) -> dict[str, Any]:
        """The fingerprint of every non-derived parameter of ``store`` (default: the checker's own),
        hashed on the parameters' device in one batch; constant ones (fp8 k/v scales) are left out,
        as from checksums.

        Args:
            seed: the fingerprint's seed (in ``[0, 2^63)``), the one the trainer hashed with.
            skip: name substrings of parameters left out.
            store: the copy to hash (the one the update session wrote).
            derived: hash the derived tensors too (no trainer writes them: the live check's digest).

        Returns:
            ``{"fingerprints": {name: 16 hex digits}, "seed", "nbytes", "seconds"}``.

        Raises:
            ValueError: a seed outside ``[0, 2^63)``.
        """
        check_seed(seed)
        store = self.store if store is None else store
        names = tuple(n for n, _ in store.items() if (derived or not store.meta[n].derived)
                      and store.meta[n].constant is None and not _skipped(n, skip))
        batches = self._batches.setdefault(store, {})
        cached = batches.get(derived)
        if cached is None or cached[0] != names:
            cached = batches[derived] = (names, whole_tensors([store[n] for n in names]))
        batch = cached[1]
        t0 = time.perf_counter()
        out = torch.zeros(len(names), dtype=torch.int64, device=store.device)
        batch.run(out, seed)
        values = out.tolist()  # waits for the device
        return {"fingerprints": {n: to_hex(v) for n, v in zip(names, values, strict=True)}, "seed": seed,
                "nbytes": batch.nbytes, "seconds": time.perf_counter() - t0}

    def live_digest(self, store: ParamStore, seed: int, *, fingerprint: bool | None = None) -> dict[str, str]:
        """A digest of every non-constant tensor of ``store`` (derived ones included), for the live
        check to compare with the one taken at the publication (module docstring).

        Args:
            store: the served copy.
            seed: the live check's fingerprint seed (the same for the reference and every check).
            fingerprint: fingerprints (True) or xxh64 of the raw bytes (False, CPU parameters only);
                default: fingerprints on a GPU.

        Returns:
            ``{name: hex digest}``.
        """
        if fingerprint is None:
            fingerprint = store.device.type == "cuda"
        if fingerprint:
            return self.fingerprint(seed, store=store, derived=True)["fingerprints"]
        return {name: xxhash.xxh64(_bytes(t).numpy()).hexdigest() for name, t in store.items()
                if store.meta[name].constant is None}
