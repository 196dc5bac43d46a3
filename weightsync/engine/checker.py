"""The weight checker of one engine rank: snapshot, reset, bitwise compare, per-tensor checksums.

The correctness gate of a weight update (``--check-weight-update-equal``): snapshot the weights
loaded from the checkpoint, reset them to random values, run the update, compare bit for bit.

``reset_tensors`` poisons exactly what an update writes: the regions covered by pieces of
global tensors, and derived tensors (recomputed by ``end_weight_update``). Padding (vocab rows
beyond the vocab) is left alone: it is zero from allocation and no update writes it, so a
compare after an update must find it unchanged too.

Compare is bitwise (raw bytes, NaN-safe); every mismatching tensor is reported with its max
absolute difference (as float32) and the count of differing elements.
"""

from __future__ import annotations

import hashlib

import torch
import xxhash

from weightsync.sync.params import ParamStore

FP8 = torch.float8_e4m3fn


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _random_fill(region: torch.Tensor, gen: torch.Generator) -> None:
    values = torch.rand(region.shape, generator=gen, dtype=torch.float32) * 2 - 1
    if region.dtype == FP8 or region.dtype.is_floating_point:
        region.copy_(values.to(region.device))
    else:
        region.copy_((values * 100).to(region.dtype).to(region.device))


class WeightChecker:
    """Checker state of one rank (the snapshot lives in host memory)."""

    def __init__(self, store: ParamStore) -> None:
        self.store = store
        self._snapshot: dict[str, torch.Tensor] | None = None

    def snapshot(self) -> dict[str, int]:
        """Copy every parameter to host memory (replacing an older snapshot)."""
        self._snapshot = {n: t.detach().to("cpu", copy=True) for n, t in self.store.items()}
        return {
            "num_tensors": len(self._snapshot),
            "nbytes": sum(t.numel() * t.element_size() for t in self._snapshot.values()),
        }

    def reset_tensors(self, seed: int = 0) -> dict[str, int]:
        """Overwrite every written region and every derived tensor with random values."""
        gen = torch.Generator().manual_seed(seed)
        count = 0
        for name, t in self.store.items():
            meta = self.store.meta[name]
            if meta.derived:
                _random_fill(t, gen)
            for piece in meta.pieces:
                _random_fill(t[tuple(slice(a, b) for a, b in piece.local_box)], gen)
            count += 1
        return {"num_tensors": count}

    def compare(self) -> dict[str, object]:
        """Compare every parameter with the snapshot, bit for bit.

        Returns:
            ``{"equal": bool, "num_tensors": n, "mismatches": [{"name", "max_abs_diff",
            "num_diff"}...]}``.

        Raises:
            ValueError: no snapshot was taken.
        """
        if self._snapshot is None:
            raise ValueError("weights_checker compare: no snapshot (call the 'snapshot' action first)")
        mismatches = []
        for name, t in self.store.items():
            expect = self._snapshot[name]
            actual = t.detach().to("cpu")
            if torch.equal(_bytes(expect), _bytes(actual)):
                continue
            diff = (expect.float() - actual.float()).abs()
            differs = (
                _bytes(expect)
                .view(-1, expect.element_size())
                .ne(_bytes(actual).view(-1, actual.element_size()))
                .any(dim=1)
            )
            mismatches.append(
                {
                    "name": name,
                    "max_abs_diff": float(diff.nan_to_num(float("inf")).max()),
                    "num_diff": int(differs.sum()),
                }
            )
        return {"equal": not mismatches, "num_tensors": len(self._snapshot), "mismatches": mismatches}

    def checksum(self) -> dict[str, object]:
        """xxh64 of each parameter's bytes, and one digest over all (name-sorted)."""
        sums = {name: xxhash.xxh64(_bytes(t.detach().to("cpu")).numpy()).hexdigest() for name, t in self.store.items()}
        overall = hashlib.sha256()
        for name in sorted(sums):
            overall.update(name.encode())
            overall.update(sums[name].encode())
        return {"checksums": sums, "per_rank_checksum": overall.hexdigest()}
