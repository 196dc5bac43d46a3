#!/usr/bin/env python3
"""Update running engines from your own trainer with weightsync's facade (CPU, one trainer rank).

Start an engine first (a second terminal), then run this script::

    weightsync serve Qwen3-4B --scale tiny --tp 2 --transport shm --load-format dummy --port 30000
    python examples/api/update_engines.py --engine-url http://127.0.0.1:30000

The "trainer" here is a plain mapping of Megatron-layout names to tensors (what a megatron-core
model's ``named_parameters()`` gives on one rank); each step changes every weight, then one
``update()`` moves them into the engine: p2p and broadcast alternate (``mode="both"``), and
every update is verified (every engine parameter's checksum against the trainer's weights laid
out by the engine's loading rule: bit-exact or the update fails).

An engine started with a token (``weightsync serve ... --token-file FILE``, or ``WEIGHTSYNC_TOKEN``)
answers 401 / 403 to a caller without it; give the same file here (``--token-file FILE``): the
token goes to the updater as ``UpdaterConfig(token=...)``, which sends it on every engine call.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from weightsync import UpdaterConfig, WeightUpdater
from weightsync.layout.megatron import trainer_layout
from weightsync.models import get_model
from weightsync.models.parallel import TrainParallel
from weightsync.proc import free_port


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-url", action="append", required=True, help="an engine's URL (repeat for several)")
    p.add_argument("--model", default="Qwen3-4B")
    p.add_argument("--scale", default="tiny")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--token-file", type=Path, default=None, help="file holding the engines' access token, if any")
    args = p.parse_args()
    token = args.token_file.read_text().strip() if args.token_file else None

    # One trainer rank in its own gloo group (a real job passes the group of its trainer ranks).
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    group = dist.new_group(backend="gloo")
    spec = get_model(args.model, args.scale)
    train = TrainParallel(world_size=1)
    gen = torch.Generator().manual_seed(0)
    params = {t.name: torch.randn(t.shape, generator=gen).to(getattr(torch, t.dtype))
              for t in trainer_layout(spec, train, rank=0)}

    config = UpdaterConfig(mode="both", bucket_bytes=1 << 20, verify_every=1, token=token)
    with WeightUpdater(params, spec=spec, train=train, engine_urls=args.engine_url, group=group,
                       config=config) as updater:
        for step in range(1, args.steps + 1):
            with torch.no_grad():  # the "optimizer step"
                for t in params.values():
                    t.add_(torch.randn(t.shape, generator=gen).to(t.dtype), alpha=1e-2)
            stats = updater.update(step)
            how = f"pause-free, {stats.flip}" if stats.pause_free else f"paused: {stats.pause_reason}"
            print(f"step {step}: {stats.mode} ({how}) engines idle {stats.engine_idle_s * 1e3:.2f} ms, "
                  f"{stats.bytes / 1e6:.2f} MB in {stats.update_s * 1e3:.1f} ms, {stats.gb_per_s:.2f} GB/s, "
                  f"verified={stats.verified}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
