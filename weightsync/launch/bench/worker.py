"""One process of the transfer benchmark: a trainer rank or an engine rank, run as one SPMD script.

Every process of a benchmark runs :func:`rank_main`; they meet in one gloo process group
(trainer ranks ``0 .. T-1``, engine ranks ``T .. T+R-1``: the trainer ranks keep their Megatron
rank numbers, which the broadcast sender's gather relies on) and go through the same steps::

    set_up       trainer: its Megatron-layout shards, filled with the global values
                 engine:  its sglang-layout parameters in one transport arena, registered once,
                          and the values a complete update must leave in them
    exchange     engines publish (descriptor, parameter addresses); trainers plan their ops
    local_copy   trainer 0 only: a plain copy of the update's bytes inside one process
    flips        engine ranks: a shadow of their parameters flipped in by swap and by copy, what
                 a pause-free update stops the engine for (where the shadow fits)
    p2p          trainers build their WeightUpdater (the library's facade, from the published
                 tables: no engine to drive); then warm-up + ``repeats`` pairs of runs:
                 memcpy  the link's own rate: each trainer writes the bytes it sends in p2p as
                         one run per destination, on the sender's transport, into the same arenas
                 p2p     WeightUpdater.write("p2p")
                 and the bit-exact check of the last p2p run
    broadcast    warm-up + ``repeats`` runs (WeightUpdater.write("broadcast"), bucket by bucket:
                 stage sources gather and broadcast, engine ranks keep their pieces); the
                 bit-exact check
    tensor       the colocated baseline (:mod:`~weightsync.launch.bench.colocated`): warm-up +
                 ``repeats`` runs, each followed by the post-load phase; the bit-exact check

Before every run the engines zero their parameters and poison every byte a run must write.
Each timed window runs from a barrier of every process to the next one (GPU work synchronized
before it). The result (:data:`RankResult`) goes back to the launcher through a queue, as one
:class:`~weightsync.launch.messages.Reply` (or the traceback that stopped the process).

Nothing here imports megatron, mooncake, fastapi, pydantic, httpx or xxhash (the GPU machines
lack some of them).
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from weightsync.engine.loader import run_post_load
from weightsync.launch.bench.colocated import TensorBuckets, TrainerBuckets, run_update
from weightsync.launch.bench.config import GPU_ENV, BenchConfig
from weightsync.launch.bench.data import (
    GlobalData,
    compare,
    compare_derived,
    expected_store,
    fill_params,
    poison,
    reference_derived,
)
from weightsync.launch.messages import Reply
from weightsync.layout.box import box_volume
from weightsync.layout.megatron import trainer_layout
from weightsync.layout.sglang import engine_layout
from weightsync.models import get_model
from weightsync.models.hf import DTYPE_BYTES
from weightsync.plan.broadcast import plan_broadcast
from weightsync.plan.inputs import PlanInputs, build_inputs
from weightsync.plan.ops import CopyOp
from weightsync.plan.p2p import plan_p2p_for_rank
from weightsync.proc import die_with_parent
from weightsync.sync.broadcast_receiver import BroadcastReceiver
from weightsync.sync.broadcast_sender import announcement
from weightsync.sync.p2p_receiver import PARAMS_REGION, Receiver
from weightsync.sync.params import ParamStore
from weightsync.sync.updater import WeightUpdater
from weightsync.sync.updater_config import UpdaterConfig
from weightsync.sync.weight_copies import WeightCopies, shadow_fits
from weightsync.transport import PeerDescriptor, deadline_after

log = logging.getLogger(__name__)

RankResult = dict[str, Any]
"""One process's result: ``rank``, ``role`` (``trainer`` / ``engine``), ``local_rank``, ``device``,
``set_up_s``, and per mode measured its runs (``memcpy``, ``p2p``, ``broadcast``, ``tensor``: the
timed windows, the bit-exact check), read by :mod:`~weightsync.launch.bench.summary`."""


class _Block:
    """An ``ArenaLike`` that hands one preallocated buffer to :class:`ParamStore`."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert dtype == torch.uint8
        assert tuple(shape) == (self.buf.numel(),)
        return self.buf


def _copy_into(src: torch.Tensor, device: torch.device, sync: Callable[[], None], repeats: int = 5) -> float:
    """Best time of a plain copy of ``src`` into a new buffer on ``device``, after one warm-up.

    Host memory is copied with one ``memmove`` (the shm transport's primitive), device memory
    with ``copy_`` (``cudaMemcpyAsync``; a peer copy when the devices differ).
    """
    dst = torch.ones(src.numel(), dtype=torch.uint8, device=device)
    if device.type == "cpu":

        def copy() -> None:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())

    else:

        def copy() -> None:
            dst.copy_(src, non_blocking=True)

    copy()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


class BenchRank:
    """The state of one benchmark process (see the module docstring)."""

    def __init__(self, cfg: BenchConfig, rank: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.is_trainer = rank < cfg.train.world_size
        self.local = rank if self.is_trainer else rank - cfg.train.world_size
        """Trainer rank, or global rollout rank (engine ``e`` rank ``r`` is ``e * tp + r``)."""
        if cfg.device == "cuda":
            gpu = cfg.train_gpus[self.local] if self.is_trainer else cfg.rollout_gpus[self.local]
            torch.cuda.set_device(gpu)
            self.device = torch.device(f"cuda:{gpu}")
        else:
            self.device = torch.device("cpu")
        self.spec = get_model(cfg.model, cfg.scale)
        self.inputs: PlanInputs = build_inputs(
            self.spec,
            cfg.train,
            cfg.rollout,
            trainer_layout=trainer_layout,
            engine_layout=engine_layout,
            placement=cfg.placement(),
        )
        self.data = GlobalData(self.inputs.globals, seed=cfg.seed, device=self.device)
        self.store: ParamStore | None = None
        self.source = torch.empty(0, dtype=torch.uint8)
        """Trainer: the one buffer every parameter is a view of (registered as the write source)."""
        self.expected: ParamStore | None = None
        self.receiver: Receiver | None = None
        self.sender: Any = None
        """Trainer: its updater's p2p sender (whose transport the memcpy reference writes with)."""
        self.updater: WeightUpdater | None = None
        self.ops: list[CopyOp] = []
        # the trainer ranks' process group of their updaters (created by every process)
        self.trainer_group = dist.new_group(ranks=list(range(cfg.train.world_size)), backend="gloo")
        self.out: dict[str, Any] = {
            "rank": rank,
            "role": "trainer" if self.is_trainer else "engine",
            "local_rank": self.local,
            "device": str(self.device),
        }

    # -- helpers ------------------------------------------------------------------------------
    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.sync()
        dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.cfg.world_size
        dist.all_gather_object(out, obj)
        return out

    def params(self) -> dict[str, torch.Tensor]:
        assert self.store is not None
        return dict(self.store.items())

    # -- set-up -------------------------------------------------------------------------------
    def set_up(self) -> None:
        """Trainer: allocate and fill the shards. Engine: arena, registration, expected values."""
        t0 = time.perf_counter()
        if self.is_trainer:
            layout = list(self.inputs.source_layouts[self.local])
            self.source = torch.empty(ParamStore.required_bytes(layout), dtype=torch.uint8, device=self.device)
            self.store = ParamStore(layout, self.device, arena=_Block(self.source))
            self.out["param_bytes"] = fill_params(self.data, layout, self.params())
        else:
            layout = list(self.inputs.dest_layout(self.local))
            self.receiver, copies = Receiver.open(
                self.cfg.transport, layout, device=self.device, rank=self.local % self.cfg.rollout.tp
            )
            # the benchmark measures writes into the registered memory (copy 0: a staged transport's inbox)
            self.store = copies.stores[0]
            self.expected = expected_store(self.data, self.store, self.spec)
            if self.store.derived_names():
                reference_derived(self.expected, self.spec)
            self.out["shard_bytes"] = sum(
                box_volume(p.local_box) * DTYPE_BYTES[t.dtype] for t in layout if not t.derived for p in t.pieces
            )
        self.sync()
        self.out["set_up_s"] = time.perf_counter() - t0

    def exchange(self) -> dict[int, dict[str, Any]]:
        """All-gather what every engine rank publishes, by rollout rank; trainers plan their ops."""
        mine = None
        if not self.is_trainer:
            assert self.store is not None
            assert self.receiver is not None
            mine = {"descriptor": self.receiver.descriptor(), "weights": self.store.transfer_info()}
        infos = {r - self.cfg.train.world_size: g for r, g in enumerate(self.gather(mine)) if g is not None}
        if self.is_trainer and "p2p" in self.cfg.modes:
            t0 = time.perf_counter()
            self.ops = list(plan_p2p_for_rank(self.inputs, src_rank=self.local).ops)
            self.out.update(
                plan_s=time.perf_counter() - t0,
                ops=len(self.ops),
                staged_ops=sum(1 for op in self.ops if op.transform is not None),
            )
        return infos

    def bytes_by_dest(self) -> dict[int, int]:
        """Bytes this trainer's ops write into each rollout rank."""
        itemsize: dict[tuple[int, str], int] = {}
        for r in range(self.cfg.rollout.tp):
            for t in self.inputs.engine_layouts[r]:
                itemsize[(r, t.name)] = DTYPE_BYTES[t.dtype]
        out: dict[int, int] = defaultdict(int)
        for op in self.ops:
            out[op.dst_rank] += box_volume(op.dst_box) * itemsize[(op.dst_rank % self.cfg.rollout.tp, op.dst_param)]
        return dict(out)

    def build_sender(self, infos: dict[int, dict[str, Any]]) -> None:
        """The trainer's :class:`~weightsync.sync.updater.WeightUpdater` over the published tables."""
        self.updater = self._updater("p2p", published=infos)
        self.sender = self.updater.p2p_sender

    def _updater(self, mode: str, *, published: dict[int, dict[str, Any]] | None = None,
                 broadcast_group: dict[str, Any] | None = None) -> WeightUpdater:
        """A trainer's updater for ``mode`` (collective over the trainer ranks); its set-up time
        goes into ``sender_s`` / ``broadcast_setup_s``."""
        t0 = time.perf_counter()
        config = UpdaterConfig(mode=mode, bucket_bytes=self.cfg.bucket_bytes, transport=self.cfg.transport,
                               verify_every=0, deadline_s=self.cfg.timeout_s)
        updater = WeightUpdater(self.params(), spec=self.spec, train=self.cfg.train, engine_urls=None,
                                group=self.trainer_group, config=config, rollout=self.cfg.rollout,
                                published=published or {}, broadcast_group=broadcast_group,
                                source_regions=[("params", self.source)], placement=self.cfg.placement())
        self.out["sender_s" if mode == "p2p" else "broadcast_setup_s"] = time.perf_counter() - t0
        return updater

    # -- references ---------------------------------------------------------------------------
    def local_copy(self, nbytes: int) -> dict[str, Any] | None:
        """Trainer 0: best plain copy of ``nbytes`` (capped) in this process (others: None).

        CPU: one ``memmove`` (the shm transport's primitive). CUDA: this GPU to the first rollout
        rank's GPU (peer copy over NVLink when they differ) and within this GPU.
        """
        if self.rank != 0 or nbytes <= 0:
            return None
        n = min(nbytes, self.cfg.local_copy_bytes)
        src = torch.empty(n, dtype=torch.uint8, device=self.device)
        for off in range(0, n, max(1, self.source.numel())):  # random bytes: never time zeros
            k = min(self.source.numel(), n - off)
            src[off : off + k].copy_(self.source[:k])
        out: dict[str, Any] = {"bytes": n}
        if self.device.type == "cpu":
            out["memmove_s"] = _copy_into(src, self.device, lambda: None)
            return out
        peer = torch.device(f"cuda:{self.cfg.rollout_gpus[0]}")
        out["same_gpu_s"] = _copy_into(src, self.device, lambda: torch.cuda.synchronize(self.device))
        if peer != self.device:

            def sync() -> None:
                torch.cuda.synchronize(self.device)
                torch.cuda.synchronize(peer)

            out["peer_gpu_s"] = _copy_into(src, peer, sync)
            out["peer_gpu"] = str(peer)
        torch.cuda.empty_cache()
        return out

    def flips(self, repeats: int = 5) -> dict[str, Any] | None:
        """Engine ranks: what a pause-free update would stop this rank for -- the best of
        ``repeats`` flips of a shadow into the served parameters, by swap and by copy
        (:class:`~weightsync.sync.weight_copies.WeightCopies`, as the engine flips; the shadow is
        allocated for it and freed after). None on trainers; ``{"skipped": why}`` where the shadow
        does not fit (``serve --shadow auto``'s rule)."""
        if self.is_trainer:
            return None
        assert self.store is not None
        if not shadow_fits(self.store.nbytes, self.device):
            return {"skipped": f"no room for a second copy of {self.store.nbytes / 1e9:.2f} GB on {self.device}"}
        copies = WeightCopies([self.store, ParamStore(self.store.layout, self.device)], published=2)
        out: dict[str, Any] = {"bytes": self.store.nbytes}
        for kind in ("swap", "copy"):
            best = float("inf")
            for _ in range(repeats):
                copies.begin(pause_free=True, flip=kind)
                best = min(best, copies.flip()["seconds"])
            out[f"{kind}_s"] = best
        copies.served = 0  # the registered copy stays the served one for the steps after this
        copies.stores[1].close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return out

    def memcpy_batches(self, infos: dict[int, dict[str, Any]]) -> list[Any]:
        """The link's reference, prepared on the p2p sender's own transport (same copy engine, same
        opened destination memory): every trainer writes the bytes it sends each rollout rank in p2p
        as ONE contiguous run from its parameter buffer, into disjoint ranges of that rank's arena.

        Collective (every process calls it); engines get [].
        """
        mine = self.bytes_by_dest() if self.is_trainer else {}
        everyone = self.gather(mine)
        if not self.is_trainer:
            return []
        transport = self.sender.transport
        batches = []
        for d, n in sorted(mine.items()):
            desc = PeerDescriptor.from_json(infos[d]["descriptor"])
            region = desc.region(PARAMS_REGION)
            off = sum(everyone[t].get(d, 0) for t in range(self.local))
            n = min(n, self.source.numel(), region.nbytes - off)
            if n > 0:  # connect() again: cuda_ipc reuses the handles it opened, shm maps once more
                peer = transport.connect(desc)
                batches.append(transport.prepare(peer, [(self.source.data_ptr(), region.addr + off, n)]))
        return batches

    def _memcpy_body(self, batches: list[Any]) -> dict[str, Any]:
        if not self.is_trainer:
            return {}
        transport = self.sender.transport
        t0 = time.perf_counter()
        deadline = deadline_after(self.cfg.timeout_s)
        for h in [transport.write(b.peer, b) for b in batches]:
            transport.wait(h, deadline)
        return {"own_s": time.perf_counter() - t0, "bytes": sum(b.nbytes for b in batches)}

    def _p2p_body(self) -> dict[str, Any]:
        if not self.is_trainer:
            return {}
        assert self.updater is not None
        s = self.updater.write("p2p")
        return {
            "send_s": s["total_s"],
            "pack_s": s["pack_s"],
            "wire_s": s["wire_s"],
            "bytes": s["bytes"],
            "bytes_by_dest": s["bytes_by_dest"],
        }

    # -- the two modes ------------------------------------------------------------------------
    def _window(self, body: Callable[[], dict[str, Any]], *, warmup: bool, reset: bool = True) -> dict[str, Any]:
        """Reset the engines' parameters (outside the window; unless ``reset`` is False), then time
        ``body`` between two barriers of every process."""
        if reset:
            self._reset()
        self.barrier()
        t0 = time.perf_counter()
        row = body()
        self.barrier()
        row["window_s"] = time.perf_counter() - t0
        row["warmup"] = warmup
        return row

    def _reset(self) -> None:
        """Engine: padding zero (a memcpy reference run writes over it), every piece poisoned."""
        if not self.is_trainer:
            assert self.store is not None
            for _, t in self.store.items():
                t.zero_()
            poison(self.store)

    def p2p(self, infos: dict[int, dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Alternate memcpy-reference runs and p2p runs (one warm-up pair, then ``repeats`` pairs),
        so that both see the same machine; then check the last p2p run bit for bit.

        Returns:
            ``(memcpy runs, {"runs": p2p runs, "check": ...})``.
        """
        if self.is_trainer:
            self.build_sender(infos)
        batches = self.memcpy_batches(infos)
        memcpy, p2p, post = [], [], []
        for i in range(self.cfg.repeats + 1):
            memcpy.append(self._window(lambda: self._memcpy_body(batches), warmup=i == 0))
            p2p.append(self._window(self._p2p_body, warmup=i == 0))
            if self.has_post_load:
                post.append(self._window(self._post_load_body, warmup=i == 0, reset=False))
        return memcpy, {"runs": p2p, "check": self.check(derived=bool(post)), "post_load": post}

    @property
    def has_post_load(self) -> bool:
        """Whether the engines derive tensors after an update (the same on every process)."""
        return any(t.derived for ts in self.inputs.engine_layouts for t in ts)

    def _post_load_body(self) -> dict[str, Any]:
        """Engine: the post-load derivations (every engine process runs them on its parameters)."""
        if self.is_trainer:
            return {}
        assert self.store is not None
        return {"own_s": run_post_load(self.store, self.spec)}

    def tensor(self) -> dict[str, Any]:
        """The colocated baseline (:mod:`weightsync.launch.bench.colocated`): warm-up +
        ``repeats`` updates, each followed by the post-load phase; then the bit-exact check."""
        plan = TensorBuckets.build(self.inputs, self.cfg.bucket_bytes)
        trainer = TrainerBuckets(plan, self.inputs, self.params(), self.device) if self.is_trainer else None
        engine_rank = self.cfg.train.world_size

        def exchange(obj: Any, src: int) -> Any:
            box = [obj]
            dist.broadcast_object_list(box, src=src)
            return box[0]

        def body() -> dict[str, Any]:
            return run_update(is_trainer=self.is_trainer, trainer=trainer, plan=plan, store=self.store,
                                 spec=self.spec, exchange=exchange, engine_rank=engine_rank)

        runs, post = [], []
        for i in range(self.cfg.repeats + 1):
            runs.append(self._window(body, warmup=i == 0))
            if self.has_post_load:
                post.append(self._window(self._post_load_body, warmup=i == 0, reset=False))
        check = self.check(derived=bool(post))
        if trainer is not None:
            trainer.flat.clear()
        return {"runs": runs, "check": check, "post_load": post, "buckets": len(plan.buckets),
                "tensors": plan.num_tensors, "bytes": plan.nbytes}

    def check(self, *, derived: bool = False) -> dict[str, Any] | None:
        """Engine: compare every parameter with the expected bytes (trainer: None); with
        ``derived``, the derived tensors too (after a post-load phase)."""
        if self.is_trainer:
            return None
        assert self.store is not None
        assert self.expected is not None
        bad = compare(self.store, self.expected)
        if derived:
            bad += compare_derived(self.store, self.expected)
        return {"params": len(self.store.names()), "mismatched": len(bad), "names": bad[:10]}

    def broadcast(self) -> dict[str, Any]:
        buckets = plan_broadcast(self.inputs, bucket_bytes=self.cfg.bucket_bytes, dst_rank=0).buckets
        names = {s: f"weightsync_bench_src{s}" for s in self.cfg.group_ports}
        endpoint = self._join_broadcast(names)
        anns = [announcement(self.inputs, b.names) for b in buckets]

        def body() -> dict[str, Any]:
            if isinstance(endpoint, WeightUpdater):  # a trainer: every bucket, in the engines' order
                r = endpoint.write("broadcast")
                return {"pack_s": r["pack_s"], "wire_s": r["wire_s"], "bytes": r["bytes"]}
            acc: dict[str, Any] = defaultdict(float)
            for b, (n, d, s) in zip(buckets, anns, strict=True):
                r = endpoint.receive(names=n, dtypes=d, shapes=s, group_name=names[b.src_rank])
                acc["bytes"] += r["nbytes"]
            return dict(acc)

        try:
            runs = [self._window(body, warmup=i == 0) for i in range(self.cfg.repeats + 1)]
            return {"runs": runs, "check": self.check(), "buckets": len(buckets)}
        finally:
            endpoint.close()  # a trainer's updater shuts its weight-update groups down (NCCL wants it)

    def _join_broadcast(self, names: dict[int, str]) -> WeightUpdater | BroadcastReceiver:
        """Trainer: its WeightUpdater for broadcast (sources host the groups). Engine: a
        BroadcastReceiver that joined every source's group."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        world = 1 + self.cfg.rollout.world_size
        if self.is_trainer:
            group = {
                "master_address": "127.0.0.1",
                "world_size": world,
                "backend": backend,
                "ports": {str(s): p for s, p in self.cfg.group_ports.items()},
                "group_names": {str(s): n for s, n in names.items()},
            }
            return self._updater("broadcast", broadcast_group=group)
        assert self.store is not None
        tp = self.cfg.rollout.tp
        receiver = BroadcastReceiver(self.store, self.spec, self.local % tp)
        for s in sorted(self.cfg.group_ports):
            receiver.init_group(
                master_address="127.0.0.1",
                master_port=self.cfg.group_ports[s],
                rank_offset=1 + (self.local // tp) * tp,
                world_size=world,
                group_name=names[s],
                backend=backend,
            )
        return receiver

    def close(self) -> None:
        for obj in (self.updater, self.receiver):
            if obj is not None:
                obj.close()
        self.updater = self.sender = self.receiver = None


def run_rank(bench: BenchRank) -> RankResult:
    """The benchmark steps of one process (module docstring); collective over all processes."""
    cfg = bench.cfg
    bench.set_up()
    infos = bench.exchange()
    out = bench.out
    total = sum(sum(x.values()) for x in bench.gather(bench.bytes_by_dest() if bench.is_trainer else {}))
    out["local_copy"] = bench.local_copy(total or int(out.get("param_bytes", 0)))
    out["flips"] = bench.flips()
    bench.barrier()
    if "p2p" in cfg.modes:
        out["memcpy"], out["p2p"] = bench.p2p(infos)
    if "broadcast" in cfg.modes:
        out["broadcast"] = bench.broadcast()
    if "tensor" in cfg.modes:
        out["tensor"] = bench.tensor()
    bench.barrier()
    return out


def rank_main(rank: int, cfg: BenchConfig, results: Any) -> None:
    """Entry point of a spawned benchmark process; puts one result on ``results``."""
    die_with_parent()
    os.environ.update(GPU_ENV)
    logging.basicConfig(level=logging.INFO, format=f"[bench rank{rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(cfg.threads)
    bench: BenchRank | None = None
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{cfg.master_port}",
            rank=rank,
            world_size=cfg.world_size,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
        )
        bench = BenchRank(cfg, rank)
        results.put(Reply.success(rank, run_rank(bench)))
    except Exception:  # shipped to the launcher with the traceback, which re-raises
        results.put(Reply.failure(rank, traceback.format_exc()))
    finally:
        if bench is not None:
            bench.close()
        if dist.is_initialized():
            dist.destroy_process_group()
