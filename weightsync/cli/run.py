"""``weightsync run MODEL``: train and update rollout engines every step (the reference system's ``run``).

The command line maps onto a :class:`~weightsync.launch.resolve.RunRequest`;
:func:`~weightsync.launch.resolve.resolve_run` makes it this machine's run (the profile as is
where the GPUs fit it, else the embedded default: the same family at tiny scale on CPU; the
placement; the nodes of a multi-node run), and the run loop runs it
(:class:`~weightsync.launch.session.RunSession`, or on several nodes through Ray:
:mod:`~weightsync.launch.multinode`). With ``--head-ip`` (or a ``--node-rank`` above 0) a
profile of several nodes runs on that many nodes: node rank 0 runs the job, every other node
joins, hosts what is placed on it and leaves when the job ends. Without ``--head-ip`` on node
rank 0 everything runs on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from dataclasses import fields
from pathlib import Path

from weightsync.launch.cluster import ClusterError
from weightsync.launch.config import Deadlines, EnvSettings, RunConfig, env_settings
from weightsync.launch.resolve import RunRequest, resolve_run
from weightsync.models.resolve import describe_model, model_spec
from weightsync.plan.records import Mode
from weightsync.proc import stop_on_signals
from weightsync.sync.update_options import FLIPS, PAUSE_FREE
from weightsync.transport import AUTO, run_choices


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="registry model name (weightsync list)")
    p.add_argument("--mode", default=Mode.P2P.value, metavar="{" + ",".join(Mode) + "}",
                   help="p2p (default), broadcast, or both (alternating, one run)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's rank in a multi-node run (0 = the head, which runs the job; 1.. join it)")
    p.add_argument("--head-ip", default="",
                   help="the head node's address as the other nodes reach it: run a multi-node profile on its nodes "
                        "through Ray (port WEIGHTSYNC_RAY_PORT, default 6379; the head waits "
                        "WEIGHTSYNC_NODE_TIMEOUT_S, default 300, for the nodes); without it node 0 runs alone")
    p.add_argument("--num-rollout", type=int, default=3, help="training steps, each followed by an update")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when the profile fits")
    p.add_argument("--scale", default=None, help="full | layers=N | tiny (default: the profile's or tiny)")
    p.add_argument("--train", default=None,
                   help="tp=..,pp=..,cp=..,ep=..,etp=..,world=..,dp=..,last=..,mla_rep=0|1: the run profile's sizes "
                        "with these replaced, keys not given keep the profile's (world: the profile's unless "
                        "world= or dp=; see `weightsync list`). mla_rep=1: MLA down projections whole on every TP "
                        "rank, as Megatron's TE spec; 0: split over TP, as its local spec")
    p.add_argument("--rollout", default=None,
                   help="tp=..,ep=..,dp=..,engines=..: the run profile's engine sizes with these replaced")
    p.add_argument("--transport", default=AUTO, choices=run_choices(), metavar="KIND",
                   help="p2p transport: %(choices)s (auto: the written policy over the placement; a kind: forced for "
                   "every pair)")
    p.add_argument("--prompts-per-step", type=int, default=4, help="prompts each engine generates for per step")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per sample")
    p.add_argument("--hf-checkpoint", type=Path, default=None,
                   help="HF checkpoint directory to run (its config.json gives the architecture and shapes; prepared "
                        "like `weightsync prepare --hf-checkpoint`); default: the one prepare recorded, else "
                        "synthetic weights at tiny scale")
    p.add_argument("--synthetic", action="store_true",
                   help="synthetic weights where no checkpoint is prepared, also beyond the tiny scale")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                   help="weight dtype of the trainer and the engines (default bfloat16; float32 keeps float32)")
    p.add_argument("--engine-urls", default="",
                   help="comma-separated URLs of engines already serving this run's model and layout (started "
                        "with `weightsync serve`): update them instead of starting engines; one URL per engine")
    p.add_argument("--placement", choices=("split", "colocated"), default=None,
                   help="split: trainer and engine ranks on GPUs of their own; colocated: trainer rank i and engine "
                        "rank i share GPU i (p2p over CUDA IPC within the GPU, broadcast through "
                        "/update_weights_from_tensor); default: colocated where the GPUs do not fit both, else split")
    p.add_argument("--trainer", choices=("synthetic", "megatron"), default=None,
                   help="megatron: megatron-core GRPO on the engines' rollouts (default on cuda); synthetic: a "
                        "deterministic update of every weight that learns nothing (default on cpu)")
    p.add_argument("--group-size", type=int, default=4, help="GRPO samples per prompt (megatron trainer)")
    p.add_argument("--lr", type=float, default=1e-5, help="Adam learning rate (megatron trainer)")
    p.add_argument("--update-retries", type=int, default=0,
                   help="try a failed update (a rank's or engine's error, a fingerprint mismatch) again from scratch "
                        "up to N times before stopping; the engines stay paused and dirty at the old version until "
                        "an attempt verifies (default 0: stop at the first failure)")
    p.add_argument("--pause-free", choices=PAUSE_FREE, default="auto",
                   help="auto: the engines keep generating while an update lands (the flip is the only pause) "
                        "wherever every engine holds a shadow copy, else pause them; on: pause-free or refuse; off: "
                        "pause generation around every update (default: auto)")
    p.add_argument("--flip", choices=FLIPS, default="swap",
                   help="how a pause-free update is published: swap (the shadow becomes the served copy) or copy "
                        "(shadow copied into the served copy, whose addresses never change) (default: swap)")
    p.add_argument("--replace-dead-engines", action="store_true",
                   help="an engine this run started that dies (its process exited, or /health fails) is started "
                        "again on its host, port and GPU before the step's next generation, update or validation, "
                        "joins the current version from a healthy engine (serve --join-from; the run waits until it "
                        "serves it) and takes part in the updates again; an engine that fails during an update is "
                        "dropped from it and the others publish. Engines of --engine-urls are never restarted "
                        "(default: off, a dead engine stops the run, named)")
    p.add_argument("--deadlines", default="",
                   help="KEY=SECONDS,... replacing the default deadline of each wait: "
                        + ", ".join(f"{f.name.removesuffix('_s')} ({f.default:g})" for f in fields(Deadlines)))


def request_of(args: argparse.Namespace) -> RunRequest:
    """The command line as a :class:`~weightsync.launch.resolve.RunRequest`.

    Raises:
        ValueError: an unknown mode, a bad ``--deadlines`` (the message says which).
    """
    return RunRequest(model=args.model, mode=Mode.parse(args.mode), node_rank=args.node_rank, head_ip=args.head_ip,
                      num_steps=args.num_rollout, device=args.device, scale=args.scale, train=args.train,
                      rollout=args.rollout, placement=args.placement,
                      engine_urls=tuple(u.strip().rstrip("/") for u in args.engine_urls.split(",") if u.strip()),
                      trainer=args.trainer, transport=args.transport, prompts_per_step=args.prompts_per_step,
                      max_new_tokens=args.max_new_tokens, hf_checkpoint=args.hf_checkpoint, synthetic=args.synthetic,
                      dtype=args.dtype, group_size=args.group_size, lr=args.lr, update_retries=args.update_retries,
                      pause_free=args.pause_free, flip=args.flip, replace_dead_engines=args.replace_dead_engines,
                      deadlines=Deadlines.parse(args.deadlines))


def resolve(args: argparse.Namespace, env: EnvSettings) -> RunConfig:
    """The run this invocation stands for (:func:`~weightsync.launch.resolve.resolve_run`).

    Raises:
        ValueError: as :func:`request_of` and :func:`~weightsync.launch.resolve.resolve_run`.
    """
    return resolve_run(request_of(args), env)


def main(args: argparse.Namespace) -> int:
    """Run ``weightsync run``: 0 when every update passed validation, 1 when the run failed or a
    gate did, 2 on bad input, 130 when interrupted. A run that fails leaves no empty directory
    behind (its log directory, where nothing was written into it, and the parents it created)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        env = env_settings()
        cfg = resolve(args, env)
    except ValueError as exc:
        print(f"weightsync run: {exc}", file=sys.stderr)
        return 2
    if cfg.cluster is not None and cfg.cluster.node_rank > 0:
        from weightsync.launch.multinode import run_node

        try:
            return run_node(cfg)
        except ClusterError as exc:
            print(f"weightsync run: {exc}", file=sys.stderr)
            return 1
    created = missing_dirs(cfg.log_dir)
    code = 1  # an exception on the way out is a failure too
    try:
        code = _run(cfg, env)
    finally:
        if code != 0:
            drop_empty_dirs(cfg.log_dir, created)
    return code


def _run(cfg: RunConfig, env: EnvSettings) -> int:
    """Node rank 0's part of ``main``: prepare (never a download), then the run; the exit status."""
    # the run loop imports torch (and the cluster Ray): imported here, as every command builds its
    # parser from this module
    from weightsync.launch.procs import TrainerError
    from weightsync.launch.session import RunError, RunSession
    from weightsync.launch.trainer_worker import SYNTHETIC_LABEL
    from weightsync.sources.prepare import ensure_prepared, weights_label
    from weightsync.sync.engine_client import EngineError

    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        hf_dir, torch_dist_dir = ensure_prepared(cfg.model, scale=cfg.scale, ckpt_dir=env.ckpt_dir, train=cfg.train,
                                                 hf_checkpoint=cfg.hf_checkpoint, dtype=cfg.dtype,
                                                 synthetic=cfg.synthetic)
    except (ValueError, FileExistsError) as exc:  # prepare's errors name the checkpoint and what is wrong
        print(f"weightsync run: prepare: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # CKPT_SAVE_DIR not writable (a read-only mount, a file in the path, a full disk)
        print(f"weightsync run: prepare: CKPT_SAVE_DIR {env.ckpt_dir}: cannot write "
              f"{exc.filename or env.ckpt_dir} ({exc.strerror or exc}); point CKPT_SAVE_DIR at a writable directory",
              file=sys.stderr)
        return 2
    weights = weights_label(hf_dir)
    print(f"trainer: {SYNTHETIC_LABEL if cfg.trainer == 'synthetic' else 'megatron-core GRPO'}; placement "
          f"{cfg.placement}", flush=True)
    try:
        # the checkpoint's own shapes against the layouts, before any process starts
        session = RunSession(cfg, hf_dir=hf_dir, torch_dist_dir=torch_dist_dir) if cfg.cluster is None else None
        spec = session.spec if session is not None else model_spec(cfg.model, cfg.scale, checkpoint=hf_dir,
                                                                   dtype=cfg.dtype)
    except ValueError as exc:
        print(f"weightsync run: {exc}", file=sys.stderr)
        return 2
    print(f"model: {describe_model(spec, None if weights == 'synthetic' else hf_dir)}; mode {cfg.mode}, "
          f"{cfg.device}; checkpoint {hf_dir}; weights "
          f"{'SYNTHETIC (seeded random-init, not a trained model)' if weights == 'synthetic' else weights}; "
          f"logs {cfg.log_dir}", flush=True)
    stop_on_signals()
    try:
        if session is not None:
            summary = session.run()
        else:
            from weightsync.launch.multinode import run_head

            summary = run_head(cfg, hf_dir=hf_dir.absolute(), torch_dist_dir=torch_dist_dir.absolute())
    except (RunError, EngineError, TrainerError, ClusterError) as exc:
        # What failed, without stack frames (the launcher's own adds nothing; the ranks' are kept in
        # error.log of the run's log directory)
        print(f"weightsync run: {_error_text(exc, cfg.log_dir)}", file=sys.stderr)
        return 1
    except OSError as exc:  # its log directory filled up (results, plot, logs): one line naming the file
        print(f"weightsync run: cannot write {exc.filename or cfg.log_dir} ({exc.strerror or exc}); free space in "
              f"or point MILES_LOG_DIR away from {cfg.log_dir}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM: everything this run started was stopped on the way out
        print("weightsync run: interrupted; every process this run started is stopped", file=sys.stderr)
        return 130
    return 0 if summary["validation_passed"] else 1


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first."""
    out: list[Path] = []
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        out.append(path)
        path = path.parent
    return out


def drop_empty_dirs(log_dir: Path, created: list[Path]) -> None:
    """Remove the empty directories a failed run leaves: those under ``log_dir``, then each of
    ``created`` (deepest first) that is empty; a directory holding anything stays."""
    log_dir = Path(log_dir)
    if log_dir.is_dir():
        for sub in sorted((d for d in log_dir.rglob("*") if d.is_dir()), key=lambda d: len(d.parts), reverse=True):
            with contextlib.suppress(OSError):  # not empty
                sub.rmdir()
    for d in created:
        with contextlib.suppress(OSError):  # not empty, or already gone
            d.rmdir()
def _error_text(exc: BaseException, log_dir: Path) -> str:
    """``exc``'s message without stack frames; the whole of it (and of what caused it) goes to
    ``error.log`` in ``log_dir`` when that drops anything."""
    from weightsync.launch.report import error_summary

    full = "\n\n".join(str(e) for e in (exc, exc.__cause__) if e is not None)
    short = error_summary(str(exc))
    if short == full:
        return short
    path = log_dir / "error.log"
    try:
        path.write_text(full + "\n")
    except OSError:
        return short
    return f"{short}\n(the whole error, tracebacks included: {path})"
