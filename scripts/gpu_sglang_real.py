"""A real sglang server on this GPU, updated by weightsync's ``WeightUpdater``: the proof that the
drop-in claim holds, and the same updates into weightsync's own engine beside it.

In one call, every step under a deadline and every server killed at the end:

1. a model directory with a Qwen3-4B-architecture ``config.json`` alone (``--scale``, default
   ``layers=2``; sglang needs no weights or tokenizer with ``--load-format dummy
   --skip-tokenizer-init``);
2. ``python -m sglang.launch_server`` on it, run by ``--sglang-python`` with ``--site`` first on
   its ``PYTHONPATH`` (where sglang's wheels are installed), its transfer engine on so that it
   publishes its parameters for p2p; waited for until ``/health`` answers;
3. this process, the trainer on the same GPU, updates it ``--updates`` times per path: **p2p**
   over Mooncake into the parameters sglang publishes, inside its begin/end session (sglang
   0.5.16 has none: the updater says so once, recorded under ``log``), then the **colocated
   tensor path** (``/update_weights_from_tensor`` with CUDA IPC handles, miles' colocated mode).
   Every update is verified before it is published: against a real sglang, its own
   ``/weights_checker`` checksums equal the values the trainer computes from what it wrote;
   after each path a greedy ``/generate`` must answer with the new weight version;
4. the same updates into ``weightsync serve`` (paused, and pause-free on its shadow copy);
5. per update the engines' idle time (``UpdateStats.engine_idle_s``: paused, from
   ``pause_generation`` to the return of ``continue_generation``; pause-free, the flip).
   Broadcast over NCCL is not run: it needs a GPU per group member (NCCL puts no two ranks of a
   group on one GPU).

Writes ``results.json`` (and the servers' logs, the model directory) under ``--out`` and prints
a table last. A step that fails is recorded with its error and the next one runs; past
``--total-timeout-s`` a watchdog writes what there is, kills the servers and exits 3. Exit
status 0 only when every path of every engine updated, verified and generated the new version.

    python scripts/gpu_sglang_real.py --site /tmp/site --out /tmp/real            # GPU machine
    python scripts/gpu_sglang_real.py --skip-sglang --device cpu --scale tiny --out /tmp/dry
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "Qwen3-4B"
PROMPT = [151644, 872, 198, 3838, 374, 220, 16, 10, 16, 30]
"""Token ids of the prompt (taken modulo the vocabulary: the servers have no tokenizer)."""
NOT_RUN = ["broadcast over NCCL: not run (one GPU; NCCL puts no two ranks of a group on one GPU)"]


class Run:
    """The results so far, the live servers, and the watchdog that ends a call that overruns."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: dict[str, Any] = {"meta": {}, "engines": {}, "runs": [], "errors": [], "log": [],
                                        "not_run": list(NOT_RUN)}
        self.procs: list[subprocess.Popen[Any]] = []
        self.lock = threading.Lock()
        self.timer = threading.Timer(args.total_timeout_s, self._overrun)
        self.timer.daemon = True
        self.over = False
        """The watchdog fired: start nothing more."""
        self.current = "set-up"
        """The step under way (named if the watchdog fires)."""

    def _overrun(self) -> None:
        self.over = True
        limit = self.args.total_timeout_s
        self.results["errors"].append(f"watchdog: the call ran past --total-timeout-s {limit:.0f} s during "
                                      f"{self.current}; servers killed, results as far as they got")
        print(f"[watchdog] past {self.args.total_timeout_s:.0f} s: killing the servers", flush=True)
        self.finish()
        os._exit(3)

    def finish(self) -> None:
        """Kill every server still running, write ``results.json``, print the table (once)."""
        with self.lock:
            for proc in self.procs:
                stop(proc)
            self.procs.clear()
            (self.args.out / "results.json").write_text(json.dumps(self.results, indent=2, default=str) + "\n")
            print(table(self.results["runs"]))
            for e in self.results["errors"]:
                print("error:", e.splitlines()[0][:300])
            print(f"results: {self.args.out / 'results.json'}", flush=True)


class LogTap(logging.Handler):
    """weightsync's warnings (said once: no sessions, TCP for want of RDMA, ...) into the results."""

    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.INFO)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(f"{record.levelname} {record.name}: {record.getMessage()}"[:1000])


def write_model_dir(path: Path, spec: Any) -> Path:
    """The model directory sglang is pointed at: ``config.json`` alone (dummy weights)."""
    from weightsync.models.checkpoint import hf_config_dict

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config_dict(spec), indent=2) + "\n")
    return path


def sglang_argv(args: argparse.Namespace, model_dir: Path) -> list[str]:
    """sglang 0.5.16's launch command (its flag names): dummy weights, no tokenizer, Triton
    attention and torch sampling (no FlashInfer, no FA3), its transfer engine on."""
    return [args.sglang_python, "-m", "sglang.launch_server", "--model-path", str(model_dir),
            "--load-format", "dummy", "--skip-tokenizer-init", "--tp-size", "1",
            "--mem-fraction-static", str(args.mem_fraction), "--attention-backend", "triton",
            "--sampling-backend", "pytorch", "--grammar-backend", "none", "--disable-cuda-graph",
            "--remote-instance-weight-loader-start-seed-via-transfer-engine",
            "--engine-info-bootstrap-port", str(args.bootstrap_port),
            "--host", "127.0.0.1", "--port", str(args.sglang_port)]


def weightsync_argv(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "weightsync.cli", "serve", MODEL, "--scale", args.scale, "--tp", "1",
            "--device", args.device, "--transport", "mooncake", "--load-format", "dummy",
            "--host", "127.0.0.1", "--port", str(args.ws_port)]


def child_env(args: argparse.Namespace) -> dict[str, str]:
    """The servers' environment: ``--site`` (sglang's wheels) and this checkout first on the path;
    Hugging Face offline (the model directory is local; the GPU machine reaches no network)."""
    path = [p for p in (args.site, str(ROOT), os.environ.get("PYTHONPATH")) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}


def log_tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextmanager
def server(run: Run, name: str, argv: list[str], port: int) -> Iterator[str]:
    """A server process until the block ends (killed by its process group, never waited on forever)."""
    from weightsync.sync.engine_client import EngineClient

    log = run.args.out / f"{name}.log"
    with open(log, "w") as out:
        print(f"[{name}] starting: {' '.join(argv)}", flush=True)
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=child_env(run.args))
        run.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        client = EngineClient(url, timeout_s=60)
        try:
            t0 = time.monotonic()
            try:
                client.wait_healthy(timeout_s=run.args.startup_timeout_s, proc_alive=lambda: proc.poll() is None)
            except Exception as exc:
                raise RuntimeError(f"{exc}; the last lines of {log.name}:\n{log_tail(log)}") from None
            print(f"[{name}] healthy after {time.monotonic() - t0:.0f} s", flush=True)
            yield url
        finally:
            client.close()
            stop(proc)
            if proc in run.procs:
                run.procs.remove(proc)


def stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM to the server's process group, SIGKILL after 20 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
    except ProcessLookupError:
        pass


def trainer_params(spec: Any, train: Any, device: str, seed: int) -> dict[str, Any]:
    import torch

    from weightsync.layout.megatron import trainer_layout

    gen = torch.Generator().manual_seed(seed)
    return {t.name: (torch.randn(t.shape, generator=gen) * 0.02).to(getattr(torch, t.dtype)).to(device)
            for t in trainer_layout(spec, train, 0)}


def step(params: dict[str, Any], seed: int) -> None:
    """An optimizer step's worth of change, in place."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for t in params.values():
        t.add_((torch.randn(t.shape, generator=gen) * 1e-3).to(t.dtype).to(t.device))


def generate(url: str, vocab: int, timeout_s: float) -> dict[str, Any]:
    """One greedy ``/generate`` by token ids (no tokenizer on the servers)."""
    import httpx

    try:
        r = httpx.post(f"{url}/generate", json={"input_ids": [t % vocab for t in PROMPT],
                                                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}},
                       timeout=timeout_s)
    except httpx.HTTPError as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}"}
    try:
        body = r.json()
    except ValueError:
        body = None
    if r.status_code != 200 or not isinstance(body, dict):
        return {"status": r.status_code, "error": r.text[:500]}
    meta = body.get("meta_info") or {}
    return {"status": 200, "output_ids": body.get("output_ids"), "weight_version": meta.get("weight_version")}


def checksum(url: str, timeout_s: float) -> dict[str, Any]:
    """The engine's own ``/weights_checker`` checksum after a path (both engines answer sglang's shape)."""
    from weightsync.sync.engine_client import EngineClient

    client = EngineClient(url, timeout_s=timeout_s)
    try:
        out = client.weights_checker("checksum")
        ranks = out.get("ranks") or [{}]
        return {"per_engine_checksum": out.get("per_engine_checksum"), "tensors": len(ranks[0].get("checksums", {}))}
    except Exception as exc:  # recorded, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        client.close()


def run_path(run: Run, engine: dict[str, Any], url: str, path: str, pause_free: str,
             ctx: dict[str, Any]) -> dict[str, Any]:
    """``--updates`` updates of one engine along one path; everything recorded, nothing raised."""
    from weightsync import UpdaterConfig, WeightUpdater

    args, name = run.args, engine["name"]
    out: dict[str, Any] = {"engine": name, "path": path, "pause_free": pause_free, "updates": [], "error": None}
    config = UpdaterConfig(mode="p2p" if path == "p2p" else "broadcast", colocated=path == "tensor",
                           verify_every=1, pause_free=pause_free, http_timeout_s=args.timeout_s,
                           group_timeout_s=args.timeout_s, deadline_s=args.timeout_s)
    before = generate(url, ctx["spec"].vocab_size, args.timeout_s) if engine["generates"] else {}
    version = None
    try:  # a separate updater per path and pause setting: what a job configured so would build
        with WeightUpdater(ctx["params"], spec=ctx["spec"], train=ctx["train"], engine_urls=[url],
                           group=ctx["group"], config=config) as updater:
            for k in range(args.updates):
                version = f"{name}-{path}-{'pf' if pause_free != 'off' else 'paused'}-{k + 1}"
                step(ctx["params"], seed=zlib.crc32(version.encode()))
                stats = updater.update(version)
                out["updates"].append({k2: v for k2, v in stats.to_json().items() if k2 != "per_rank"})
                print(f"[{name} {path}] update {k + 1}: idle {stats.engine_idle_s * 1e3:.1f} ms, whole "
                      f"{stats.update_s * 1e3:.1f} ms, verified {stats.verified}, paused: {stats.pause_reason}",
                      flush=True)
    except Exception as exc:  # recorded; the next path runs
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc(limit=12)
        print(f"[{name} {path}] FAILED: {out['error'][:400]}", flush=True)
    out["generate"] = served_version(url, engine["generates"], before, version, ctx["spec"].vocab_size, args.timeout_s)
    out["checksum_after"] = checksum(url, args.timeout_s)
    return out


def served_version(url: str, generates: bool, before: dict[str, Any], version: str | None, vocab: int,
                   timeout_s: float) -> dict[str, Any]:
    """Whether the engine serves ``version`` now: a ``/generate`` answers with it (and, beside it,
    whether the greedy tokens changed); an engine that does not generate (the stand-in) is asked
    ``/model_info``."""
    from weightsync.sync.engine_client import EngineClient

    out: dict[str, Any] = {"expected_version": version}
    if generates:
        after = generate(url, vocab, timeout_s)
        out.update(before=before, after=after, served=after.get("weight_version"),
                   output_changed=before.get("output_ids") != after.get("output_ids"))
    else:
        client = EngineClient(url, timeout_s=timeout_s)
        try:
            out["served"] = client.get_weight_version()
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            client.close()
    out["version_ok"] = version is not None and out.get("served") == version
    return out


def engine_facts(url: str, timeout_s: float) -> dict[str, Any]:
    """What the engine says of itself: its version, whether it publishes its parameter table."""
    from weightsync.sync.engine_client import EngineClient

    client = EngineClient(url, timeout_s=timeout_s)
    try:
        info = client.server_info()
        table_ = client.transfer_engine_info(0)
        return {"version": info.get("version"), "builtin": "weightsync" in info,
                "publishes_table": table_ is not None,
                "tensors_published": len((table_ or {}).get("remote_instance_transfer_engine_info", [None, {}])[1]),
                "load_format": info.get("load_format"), "attention_backend": info.get("attention_backend")}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        client.close()


def set_up_trainer(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from weightsync.models import get_model
    from weightsync.models.parallel import TrainParallel
    from weightsync.proc import free_port

    if args.device == "cuda":
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    spec = get_model(MODEL, args.scale)
    train = TrainParallel(world_size=1)
    return {"spec": spec, "train": train, "group": dist.new_group(ranks=[0], backend="gloo"),
            "params": trainer_params(spec, train, args.device, seed=1)}


def meta(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from weightsync.transport.mooncake import choose_protocol, mooncake_build

    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "python": platform.python_version(),
           "torch": torch.__version__, "mooncake": mooncake_build(),
           "mooncake_protocol": list(choose_protocol(os.environ.get("MOONCAKE_PROTOCOL", "auto"))), "model": MODEL,
           "scale": args.scale, "device": args.device, "updates_per_path": args.updates,
           "skip_sglang": args.skip_sglang, "site": args.site, "sglang_python": args.sglang_python}
    if args.device == "cuda" and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def _median_ms(ups: list[dict[str, Any]], key: str) -> str:
    return f"{statistics.median(u[key] for u in ups) * 1e3:.1f}" if ups else "-"


def table(runs: list[dict[str, Any]]) -> str:
    rows = [f"{'engine':<11} {'path':<7} {'pause':<6} {'updates':>7} {'idle ms':>9} {'update ms':>10} "
            f"{'verified':>8} {'new version':>11}  error"]
    for r in runs:
        ups = r["updates"]
        pause = "-" if not ups else "free" if ups[-1]["pause_reason"] is None else "paused"
        ver = str(all(u["verified"] for u in ups)) if ups else "-"
        rows.append(f"{r['engine']:<11} {r['path']:<7} {pause:<6} {len(ups):>7} {_median_ms(ups, 'engine_idle_s'):>9} "
                    f"{_median_ms(ups, 'update_s'):>10} {ver:>8} {r['generate']['version_ok']!s:>11}  "
                    f"{(r['error'] or '')[:90]}")
    return "idle ms, update ms: medians per update\n" + "\n".join(rows)


def passed(results: dict[str, Any], want: int) -> bool:
    runs = results["runs"]
    return bool(runs) and not results["errors"] and all(
        not r["error"] and len(r["updates"]) == want and all(u["verified"] for u in r["updates"])
        and r["generate"]["version_ok"] for r in runs)


def engines_to_run(args: argparse.Namespace, spec: Any) -> list[dict[str, Any]]:
    """Per server: its name, command, port, the paths and pause-free settings run against it, and
    whether it generates. sglang takes paused updates only; weightsync's engine both ways
    (``auto``: pause-free on its shadow copy). ``--fake-sglang`` puts the project's test stand-in
    (sglang's routes and checksums, no ``/generate``, no ``/update_weights_from_tensor``, tiny
    scale) where the real sglang would be: the sglang-side code of this script, debugged on CPU."""
    out = []
    if args.fake_sglang:
        argv = [sys.executable, "-m", "tests.sglang_fake", "--flavor", args.fake_sglang, "--model", MODEL,
                "--device", "cuda", "--transport", "mooncake", "--port", str(args.sglang_port)]
        out.append({"name": f"fake-{args.fake_sglang}", "argv": argv, "port": args.sglang_port, "paths": ("p2p",),
                    "pause": ("off",), "generates": False})
    elif not args.skip_sglang:
        out.append({"name": "sglang", "argv": sglang_argv(args, write_model_dir(args.out / "model", spec)),
                    "port": args.sglang_port, "paths": ("p2p", "tensor"), "pause": ("off",), "generates": True})
    if not args.skip_weightsync:
        out.append({"name": "weightsync", "argv": weightsync_argv(args), "port": args.ws_port,
                    "paths": ("p2p", "tensor"), "pause": ("off", "auto"), "generates": True})
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for results.json, the servers' logs, the model dir")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--scale", default="layers=2", help="tiny | full | layers=N (Qwen3-4B architecture)")
    p.add_argument("--updates", type=int, default=3, help="updates per engine, path and pause setting")
    p.add_argument("--site", default=None, help="folder sglang's wheels are installed in (--target), put first on "
                   "the servers' PYTHONPATH (and this process's, for Mooncake's CUDA build)")
    p.add_argument("--sglang-python", default=sys.executable, help="the interpreter that runs sglang")
    p.add_argument("--skip-sglang", action="store_true", help="weightsync's own engine only (the CPU dry run)")
    p.add_argument("--skip-weightsync", action="store_true", help="the real sglang only")
    p.add_argument("--fake-sglang", choices=("0.5.16", "0.5.23"), default=None,
                   help="the test stand-in instead of the real sglang (CPU dry run of the sglang side; --scale tiny)")
    p.add_argument("--sglang-port", type=int, default=30000)
    p.add_argument("--bootstrap-port", type=int, default=6789, help="sglang's --engine-info-bootstrap-port")
    p.add_argument("--ws-port", type=int, default=30100)
    p.add_argument("--mem-fraction", type=float, default=0.35, help="sglang's --mem-fraction-static")
    p.add_argument("--startup-timeout-s", type=float, default=300.0, help="a server not healthy by then fails")
    p.add_argument("--timeout-s", type=float, default=120.0, help="each engine call, write and generate")
    p.add_argument("--total-timeout-s", type=float, default=540.0, help="the watchdog: the whole call")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.site:
        sys.path.insert(0, args.site)
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args)
    run.timer.start()
    logging.getLogger("weightsync").addHandler(LogTap(run.results["log"]))
    logging.getLogger("weightsync").setLevel(logging.INFO)
    try:
        run.results["meta"] = meta(args)
        ctx = set_up_trainer(args)
        for e in engines_to_run(args, ctx["spec"]):
            run.current = f"{e['name']} start-up"
            try:
                with server(run, e["name"], e["argv"], e["port"]) as url:
                    run.results["engines"][e["name"]] = engine_facts(url, args.timeout_s)
                    for path, pause_free in [(p, f) for p in e["paths"] for f in e["pause"]]:
                        if run.over:
                            break
                        run.current = f"{e['name']} {path} pause_free={pause_free}"
                        run.results["runs"].append(run_path(run, e, url, path, pause_free, ctx))
            except Exception as exc:  # the server did not come up: recorded, the next one runs
                run.results["errors"].append(f"{e['name']}: {type(exc).__name__}: {exc}")
                print(f"[{e['name']}] FAILED: {str(exc)[:2000]}", flush=True)
    except Exception as exc:
        run.results["errors"].append(f"set-up: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=12)}")
    run.timer.cancel()
    ok = passed(run.results, args.updates)
    run.results["ok"] = ok
    run.finish()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
