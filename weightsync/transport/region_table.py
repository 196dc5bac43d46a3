"""The sorted table of one side's registered regions, with vectorized lookup of each run's region.

Every write is checked against two tables: the writer's own registered regions (sources) and the
peer's published regions (destinations); a run outside them is refused with the region it missed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from weightsync.transport.records import Region


class RegionTable:
    """Sorted, non-overlapping regions with vectorized lookup of the region holding each run."""

    def __init__(self, regions: Sequence[Region]) -> None:
        self.regions = tuple(sorted(regions, key=lambda r: r.addr))
        self.starts = np.array([r.addr for r in self.regions], dtype=np.int64)
        self._ends = np.array([r.end for r in self.regions], dtype=np.int64)
        overlap = np.flatnonzero(self.starts[1:] < self._ends[:-1])
        if overlap.size:
            a, b = self.regions[int(overlap[0])], self.regions[int(overlap[0]) + 1]
            raise ValueError(
                f"regions {a.name!r} [{a.addr:#x}, {a.end:#x}) and {b.name!r} [{b.addr:#x}, {b.end:#x}) overlap"
            )

    def __len__(self) -> int:
        return len(self.regions)

    def locate(self, addrs: np.ndarray, nbytes: np.ndarray, *, what: str) -> np.ndarray:
        """Index (into ``self.regions``) of the region holding each ``[addr, addr + nbytes)``.

        Raises:
            ValueError: a run lies outside every region or crosses a region's end; the message
                names the run, the nearest region and ``what`` (e.g. "destination of peer X").
        """
        if not len(self.regions):
            if len(addrs):
                raise ValueError(f"{what}: no memory is registered; register it before writing")
            return np.zeros(0, dtype=np.int64)
        idx = np.searchsorted(self.starts, addrs, side="right") - 1
        safe = np.maximum(idx, 0)
        ok = (idx >= 0) & (addrs + nbytes <= self._ends[safe])
        bad = np.flatnonzero(~ok)
        if bad.size:
            i = int(bad[0])
            a, n = int(addrs[i]), int(nbytes[i])
            r = self.regions[int(safe[i])]
            if idx[i] >= 0 and a < r.end:
                where = f"crosses the end of region {r.name!r} [{r.addr:#x}, {r.end:#x}) by {a + n - r.end} bytes"
            else:
                where = f"lies outside every registered region (nearest: {r.name!r} [{r.addr:#x}, {r.end:#x}))"
            raise ValueError(
                f"{what}: run {i} [{a:#x}, {a + n:#x}) ({n} bytes) {where}; "
                f"{bad.size} of {len(addrs)} runs are out of bounds. Check the plan against the published regions."
            )
        return idx
