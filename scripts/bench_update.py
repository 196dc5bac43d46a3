"""The update benchmark of issue 5 on CPU, with its two pass criteria.

Runs ``weightsync bench`` on Qwen3-4B at ``layers=2`` (real per-layer shapes, ~1.2 GB with the
embeddings), trainer TP 2 -> engine TP 2, both modes in one run, then checks:

* p2p's wire rate is at least 50 % of a plain copy of the same bytes measured in the same run
  (the copy between the benchmark's own processes, through the same transport into the same
  engine memory; the copy inside one process is printed beside it);
* p2p's whole update is faster than broadcast's;
* both modes landed every byte (bit-exact check).

Exit status 0 when all hold. Extra arguments go to ``weightsync bench`` (later ones win), e.g.::

    .venv/bin/python scripts/bench_update.py --out logs/bench_update.json
    .venv/bin/python scripts/bench_update.py --repeats 5
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT = [
    "Qwen3-4B",
    "--scale",
    "layers=2",
    "--train",
    "tp=2,cp=1,world=2",
    "--rollout",
    "tp=2,engines=1",
    "--device",
    "cpu",
    "--mode",
    "both",
    "--repeats",
    "3",
]
MIN_WIRE_RATIO = 0.5


def main(argv: list[str]) -> int:
    out = None
    if "--out" in argv:
        out = Path(argv[argv.index("--out") + 1])
    else:
        out = Path(tempfile.mkdtemp(prefix="bench_update_")) / "bench.json"
        argv = [*argv, "--out", str(out)]
    rc = subprocess.call([sys.executable, "-m", "weightsync.cli", "bench", *DEFAULT, *argv])
    if rc != 0 or not out.exists():
        print(f"bench_update: weightsync bench failed (exit {rc})", file=sys.stderr)
        return rc or 1
    s = json.loads(out.read_text())
    checks = {
        f"p2p wire >= {MIN_WIRE_RATIO:.0%} of the copy between processes ({s['ratio_wire_to_memcpy']:.2f})": s[
            "ratio_wire_to_memcpy"
        ]
        >= MIN_WIRE_RATIO,
        f"p2p update faster than broadcast ({s['speedup_p2p_vs_broadcast']:.1f}x)": s["speedup_p2p_vs_broadcast"] > 1,
        "both modes bit-exact": s["verified"],
    }
    for what, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    print(
        f"(p2p wire / copy between processes from the medians of the alternating runs: "
        f"{s['ratio_wire_to_memcpy_median']:.2f}; "
        f"p2p wire / copy inside one process: {s.get('ratio_wire_to_local_copy', float('nan')):.2f}; "
        f"load average {s['load_avg_1m']:.1f} on {s['cpus']} CPUs; JSON in {out})"
    )
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
