"""A stand-in for a real sglang server, for the interop tests: its routes, request bodies, answers
and refusals follow sglang's own handlers, and its weight-update group is joined sglang's way.

Run as a process: ``python -m tests.sglang_fake --flavor 0.5.23 --model Qwen3-4B --port P``.
Three flavors, each what that build serves (the cited files are sglang 0.5.23's unless said):

* ``0.5.23`` -- the current release: update sessions (``/begin_weight_update`` ..
  ``/end_weight_update``, ``managers/scheduler_components/weight_updater.py``
  ``SchedulerWeightUpdaterManager``; ``update_weights_from_distributed`` refused outside one), no
  ``/parallelism_config``, ``attn_dp_size`` in ``/server_info``, the checksum answer's
  ``parallelism_info`` a list of role dicts (``managers/io_struct.py`` ``ChecksumInfo``);
* ``0.5.16`` -- no session routes (404 from the router), updates accepted any time, no
  ``/parallelism_config``, ``parallelism_info`` one object without ``role`` (0.5.16 ``io_struct.py``);
* ``miles`` -- miles' build (``sglang-miles`` branch on 0.5.16, miles' ``docker/Dockerfile``): the
  0.5.23 session rules and answer shapes plus ``/parallelism_config?rank=R`` (the 15-field
  record miles reads, ``RankParallelismConfig.from_dict``).

One process holds every TP rank's parameters (``engine_layout``'s tensors, in its order as
``named_parameters()``), filled with random values at start like ``--load-format dummy``
(padding rows zero, as sglang's vocab loader leaves them after a load). With ``--transport
mooncake`` each rank's parameters are registered with a Mooncake engine and published as sglang's
``[session_id, {name: [ptr, numel, element_size]}]`` (``remote_instance_transfer_engine_info``),
nothing else. The broadcast group needs one process per rank (torch names groups per process),
so ``/init_weights_update_group`` is served at TP 1 only.

Checksums: ``--device cuda`` hashes as a GPU sglang does (``gpu_tensor_hash``, by the numpy
reference of tests/sglang_reference.py), ``cpu`` as a CPU one (sha256 prefix).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tests.sglang_reference import per_gpu_checksum, sglang_checksum
from weightsync.layout.box import box_slices
from weightsync.layout.sglang import engine_layout
from weightsync.layout.sglang_coords import engine_coords
from weightsync.models import get_model
from weightsync.models.dtypes import torch_dtype
from weightsync.models.parallel import RolloutParallel
from weightsync.sync.params import write_global

FLAVORS = ("0.5.23", "0.5.16", "miles")


def join_group_sglang_way(*, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                          backend: str, timeout: datetime.timedelta) -> Any:
    """A weight-update group joined the way sglang's engine (``srt/utils/common.py``
    ``init_custom_process_group``) and miles' trainer (``miles/utils/distributed_utils.py``
    ``init_process_group``) join it -- the two are the same steps -- written with torch's API:
    torch's ``tcp://`` rendezvous (its TCPStore, ``wait_for_workers`` left at its default), the
    timeout set on the store, ``PrefixStore(group_name)``, torch's group helper (which adds its own
    ``group_name + "/"`` and device prefixes), and the identity rank map. Collectives go through
    ``torch.distributed.broadcast(..., group=pg)``."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class FakeSglang:
    """The state behind the routes: parameters per rank, the open session, groups, the version."""

    def __init__(self, *, flavor: str, model: str, tp: int, device: str, transport: str | None, seed: int) -> None:
        if flavor not in FLAVORS:
            raise ValueError(f"flavor {flavor!r}: one of {FLAVORS}")
        self.flavor = flavor
        self.model = model
        self.spec = get_model(model, "tiny")
        self.par = RolloutParallel(tp=tp)
        self.device = device
        self.weight_version = "default"
        self.session: dict[str, Any] | None = None
        self.paused = False
        self.groups: dict[str, Any] = {}
        self.calls: list[str] = []
        """Every route called, in order (what the tests read back)."""
        self.receivers: list[Any] = []
        self.stores: list[Any] = []
        gen = torch.Generator().manual_seed(seed)
        for r in range(tp):
            layout = [t for t in engine_layout(self.spec, self.par, r) if not t.derived]
            receiver, store = self._open(transport, layout, r)
            for t in layout:
                dummy = (torch.rand(t.shape, generator=gen) * 2e-3 - 1e-3).to(torch_dtype(t.dtype))
                written = torch.zeros(t.shape, dtype=torch.bool)
                for p in t.pieces:
                    written[box_slices(p.local_box)] = True
                store[t.name].copy_(torch.where(written, dummy, torch.zeros((), dtype=dummy.dtype)))
            self.receivers.append(receiver)
            self.stores.append(store)
        self.lock = threading.Lock()

    @staticmethod
    def _open(transport: str | None, layout: list, rank: int) -> tuple[Any, Any]:
        from weightsync.sync.p2p_receiver import Receiver
        from weightsync.transport import TransportConfig

        cfg = None if transport is None else TransportConfig(kind=transport)
        receiver, copies = Receiver.open(cfg, layout, device=torch.device("cpu"), rank=rank)
        return receiver, copies.served_store  # one copy: sglang holds no shadow

    # -- /server_info ---------------------------------------------------------------------------

    def server_info(self) -> dict[str, Any]:
        """``ServerArgs`` as 0.5.16 (``dataclasses.asdict``) and 0.5.23 (``resolved_dict``)
        report it -- the fields a layout depends on, at their defaults unless set -- plus the
        scheduler's ``internal_states`` and ``version``; nothing of weightsync's."""
        info: dict[str, Any] = {
            "model_path": f"/models/{self.model}", "tokenizer_path": f"/models/{self.model}",
            "load_format": "dummy", "dtype": "auto", "quantization": None, "kv_cache_dtype": "auto",
            "device": self.device, "nnodes": 1, "node_rank": 0, "base_gpu_id": 0, "dist_init_addr": None,
            "tp_size": self.par.tp, "pp_size": 1, "dp_size": 1, "ep_size": 1, "moe_dp_size": 1, "attn_cp_size": 1,
            "dcp_size": 1, "enable_dp_attention": False, "enable_dp_lm_head": False, "moe_dense_tp_size": None,
            "moe_a2a_backend": "none", "ep_num_redundant_experts": 0, "disable_shared_experts_fusion": False,
            "enforce_shared_experts_fusion": False, "rl_on_policy_target": None, "enable_memory_saver": False,
            "skip_tokenizer_init": True, "engine_info_bootstrap_port": 6789,
            "remote_instance_weight_loader_start_seed_via_transfer_engine": bool(self.receivers[0].descriptor()),
            "internal_states": [{"last_gen_throughput": 0.0}],
            "version": "0.5.16" if self.flavor in ("0.5.16", "miles") else "0.5.23",
        }
        if self.flavor == "0.5.23":
            info |= {"attn_dp_size": 1, "shared_experts_tp_size": None, "enable_shared_experts_attn_tp": False,
                     "enable_dense_mlp_attn_tp": False, "frontend": "python"}
        return info

    def parallelism_config(self, rank: int) -> dict[str, Any]:
        """miles' build: the 15-field ``RankParallelismConfig`` of ``rank``."""
        c = engine_coords(self.par, rank)
        return {"tp_size": c.tp_size, "tp_rank": c.tp_rank, "pp_size": 1, "pp_rank": 0, "ep_size": c.moe_ep_size,
                "ep_rank": c.moe_ep_rank, "moe_tp_size": c.moe_tp_size, "moe_tp_rank": c.moe_tp_rank,
                "attn_tp_size": c.attn_tp_size, "attn_tp_rank": c.attn_tp_rank, "attn_dp_size": c.attn_dp_size,
                "attn_dp_rank": c.attn_dp_rank, "world_size": self.par.tp, "global_rank": rank, "local_rank": rank}

    def transfer_engine_info(self, rank: int) -> dict[str, Any] | None:
        """``entrypoints/engine_info_bootstrap_server.py`` ``get_transfer_engine_info``'s answer, or
        None (the route's 400) for a rank that registered nothing."""
        if not 0 <= rank < self.par.tp or not self.receivers[rank].descriptor():
            return None
        return {"rank": rank, "remote_instance_transfer_engine_info": [self.receivers[rank].session_id,
                                                                       self.stores[rank].transfer_info()]}

    # -- sessions (0.5.23, miles) ---------------------------------------------------------------

    def begin(self) -> tuple[bool, str]:
        """``SchedulerWeightUpdaterManager.begin_weight_update``."""
        if self.session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = {"loaded_weights": False}
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        """``SchedulerWeightUpdaterManager.end_weight_update``: closes whatever happened inside."""
        if self.session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = None
        return True, "Success"

    def needs_session(self, what: str) -> str | None:
        """The refusal of a distributed / tensor update outside a session (0.5.23 and miles)."""
        if self.flavor != "0.5.16" and self.session is None:
            return f"{what} must run between begin_weight_update() and end_weight_update()"
        return None

    # -- the broadcast group --------------------------------------------------------------------

    def init_group(self, body: dict[str, Any]) -> tuple[bool, str]:
        """``WeightUpdater.init_weights_update_group`` (``model_runner_components/weight_updater.py``):
        this rank joins as ``rank_offset + tp_rank``; blocks until the group formed."""
        if self.par.tp != 1:
            return False, "Failed to initialize custom process group: the fake serves groups at TP 1 only."
        try:
            self.groups[body["group_name"]] = join_group_sglang_way(
                master_address=body["master_address"], master_port=int(body["master_port"]),
                rank=int(body["rank_offset"]), world_size=int(body["world_size"]), group_name=body["group_name"],
                backend=body.get("backend", "nccl"), timeout=datetime.timedelta(seconds=60))
        except Exception as e:  # sglang answers the failure in the body
            return False, f"Failed to initialize custom process group: {e}."
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, name: str) -> tuple[bool, str]:
        if name not in self.groups:
            return False, "The group to be destroyed does not exist."
        dist.destroy_process_group(self.groups.pop(name))
        return True, "Succeeded to destroy custom process group."

    def update_from_distributed(self, body: dict[str, Any]) -> tuple[bool, str]:
        """``receive_weights_from_distributed`` (one broadcast per tensor from rank 0, in order)
        then ``load_weights_from_distributed`` (the model's loader: each rank keeps its pieces)."""
        refused = self.needs_session("update_weights_from_distributed")
        if refused:
            return False, refused
        pg = self.groups.get(body["group_name"])
        if pg is None:
            return False, f"Failed to receive weights: Group {body['group_name']} not in {list(self.groups)}."
        weights, handles = [], []
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            w = torch.empty(shape, dtype=getattr(torch, dtype))
            handles.append(dist.broadcast(w, src=0, group=pg, async_op=True))
            weights.append((name, w))
        for h in handles:
            h.wait()
        for name, w in weights:
            for store in self.stores:
                write_global(store, self.spec, name, lambda box, w=w: w[tuple(slice(a, b) for a, b in box)])
        if self.session is not None:
            self.session["loaded_weights"] = True
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return True, "Succeeded to update parameter online."

    # -- the weight checker ---------------------------------------------------------------------

    def checksum(self, skip: list[str] | None) -> dict[str, Any]:
        """``WeightChecker._compute_checksum`` per rank (``named_parameters()`` order, skipped
        names left out), one entry per TP rank in rank order, and ``per_engine_checksum``
        (``tokenizer_control_mixin.py`` ``check_weights``)."""
        ranks = []
        for r, store in enumerate(self.stores):
            sums = {name: sglang_checksum(t, gpu=self.device == "cuda") for name, t in store.items()
                    if not any(s in name for s in skip or ())}
            placement = {"tp_rank": r, "tp_size": self.par.tp, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                         "pp_size": 1, "rank": r, "size": self.par.tp}
            info: Any = placement if self.flavor == "0.5.16" else [{"role": "target", **placement}]
            ranks.append({"checksums": sums, "per_gpu_checksum": per_gpu_checksum(sums), "parallelism_info": info})
        h = hashlib.sha256()
        for entry in ranks:
            h.update(entry["per_gpu_checksum"].encode())
        return {"success": True, "message": "Success.", "ranks": ranks, "per_engine_checksum": h.hexdigest()}


def build_app(fake: FakeSglang) -> Any:
    """The routes (0.5.23 ``entrypoints/http_server.py``; 0.5.16 lacks the session routes)."""
    app = FastAPI()

    def answer(ok: bool, message: str, **extra: Any) -> JSONResponse:
        return JSONResponse({"success": ok, "message": message, **extra}, status_code=200 if ok else 400)

    async def body_of(request: Request) -> dict[str, Any]:
        raw = await request.body()
        return {} if not raw else dict(await request.json())

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Any:
        if request.url.path not in ("/fake_calls", "/health"):
            fake.calls.append(request.url.path)
        return await call_next(request)

    @app.get("/fake_calls")
    def calls() -> list[str]:
        """Not sglang's: the routes called so far (for the tests)."""
        return list(fake.calls)

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    def server_info() -> dict[str, Any]:
        return fake.server_info()

    @app.get("/model_info")
    def model_info() -> dict[str, Any]:
        return {"model_path": f"/models/{fake.model}", "is_generation": True, "weight_version": fake.weight_version}

    @app.get("/remote_instance_transfer_engine_info")
    @app.get("/get_remote_instance_transfer_engine_info")
    def transfer_info(rank: int | None = None) -> Any:
        if rank is None or rank < 0:
            return JSONResponse({"error": {"message": "Missing or invalid rank parameter"}}, status_code=400)
        out = fake.transfer_engine_info(rank)
        if out is None:
            return JSONResponse({"error": {"message": f"Failed to get transfer engine info for rank {rank}"}},
                                status_code=400)
        return out

    if fake.flavor == "miles":
        @app.get("/parallelism_config")
        def parallelism_config(rank: int) -> Any:
            return fake.parallelism_config(rank)

    @app.post("/pause_generation")
    async def pause(request: Request) -> dict[str, str]:
        await body_of(request)
        fake.paused = True
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume(request: Request) -> dict[str, str]:
        await body_of(request)
        fake.paused = False
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache() -> Response:
        return Response("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                        "waiting requests, the operation will not be performed.)\n", status_code=200)

    if fake.flavor != "0.5.16":
        @app.post("/begin_weight_update")
        async def begin(request: Request) -> JSONResponse:
            await body_of(request)
            return answer(*fake.begin())

        @app.post("/end_weight_update")
        async def end(request: Request) -> JSONResponse:
            await body_of(request)
            return answer(*fake.end())

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await body_of(request)
        fake.weight_version = str(body["new_version"])
        return JSONResponse({"success": True, "message": f"Weight version updated to {fake.weight_version}",
                             "new_version": fake.weight_version})

    @app.post("/init_weights_update_group")
    def init_group(body: dict[str, Any]) -> JSONResponse:
        return answer(*fake.init_group(body))

    @app.post("/destroy_weights_update_group")
    def destroy_group(body: dict[str, Any]) -> JSONResponse:
        return answer(*fake.destroy_group(body["group_name"]))

    @app.post("/update_weights_from_distributed")
    def update_from_distributed(body: dict[str, Any]) -> JSONResponse:
        with fake.lock:
            return answer(*fake.update_from_distributed(body))

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(request: Request) -> JSONResponse:
        body = await body_of(request)
        action = body.get("action", "checksum")
        if action != "checksum":
            return answer(False, f"Unsupported action={action}")
        skip = body.get("skip_tensor_list") if fake.flavor == "0.5.23" else None
        return JSONResponse(fake.checksum(skip))

    return app


@contextlib.contextmanager
def serve_fake(log: Path, *, flavor: str, model: str = "Qwen3-4B", tp: int = 1, device: str = "cuda",
               transport: str | None = None, seed: int = 0) -> Iterator[str]:
    """A fake sglang process until the block ends (its output in ``log``); yields its URL once healthy."""
    from tests.e2e_helpers import serve_process
    from weightsync.proc import free_port

    port = free_port()
    argv = [sys.executable, "-m", "tests.sglang_fake", "--flavor", flavor, "--model", model, "--tp", str(tp),
            "--device", device, "--seed", str(seed), "--port", str(port)]
    argv += ["--transport", transport] if transport else []
    with serve_process(argv, log, port, timeout_s=120) as url:
        yield url


def expected_checksums(spec: Any, par: RolloutParallel, rank: int, full: dict[str, torch.Tensor], *,
                       gpu: bool) -> dict[str, str]:
    """What sglang's checker reports for engine rank ``rank`` after a load of the global tensors
    ``full`` (each rank keeps its pieces; padding rows zero)."""
    from weightsync.sync.params import ParamStore

    store = ParamStore([t for t in engine_layout(spec, par, rank) if not t.derived], torch.device("cpu"))
    for name, t in full.items():
        write_global(store, spec, name, lambda box, t=t: t[tuple(slice(a, b) for a, b in box)])
    return {name: sglang_checksum(t, gpu=gpu) for name, t in store.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", choices=FLAVORS, default="0.5.23")
    p.add_argument("--model", default="Qwen3-4B")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--transport", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    import uvicorn

    fake = FakeSglang(flavor=args.flavor, model=args.model, tp=args.tp, device=args.device, transport=args.transport,
                      seed=args.seed)
    uvicorn.run(build_app(fake), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
