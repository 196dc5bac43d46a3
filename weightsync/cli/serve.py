"""``weightsync serve MODEL``: the built-in rollout engine's command line (see
:mod:`weightsync.engine.serve` and docs/engine.md)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from weightsync.engine.config import COMPUTE_DTYPES, IN_FLIGHT_AT_FLIP, SHADOW_MODES, ServeConfig
from weightsync.launch.config import env_token
from weightsync.transport.config import add_receiver_arguments, receiver_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="registry model name (see `weightsync list`)")
    parser.add_argument("--scale", default="full", help="full | layers=N | tiny (default: full)")
    parser.add_argument("--tp", type=int, default=1, help="ranks (processes) of the engine")
    parser.add_argument("--dp", type=int, default=1, help="DP-attention size (1 = off)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument(
        "--moe-dense-tp-size",
        type=int,
        default=None,
        help="1: replicate dense MLP layers (MLA and GLM-4.5 models); default: split over TP",
    )
    parser.add_argument(
        "--enable-dp-lm-head",
        action="store_true",
        help="split the lm_head vocab over attention-TP instead of full TP (with --dp > 1)",
    )
    parser.add_argument("--router-dtype", choices=("float32", "model"), default=None,
                        help="dtype of the MoE routers' mlp.gate.weight: float32, or the model's (as sglang 0.5.16 "
                        "registers GLM routers); default: sglang 0.5.23's rule (float32 for GLM-4.5 and GLM-4.7-Flash, "
                        "config.json router_fp32 for DeepSeek-V3 models)")
    parser.add_argument("--disable-dsa-indexer-fusion", action="store_true",
                        help="keep the DSA indexer's wk and weights_proj apart (sglang's "
                        "SGLANG_DISABLE_DSA_INDEXER_FUSION); default: one wk_weights_proj with the interleaved indexer "
                        "rope, as sglang 0.5.23 on CUDA")
    fusion = parser.add_mutually_exclusive_group()
    fusion.add_argument("--disable-shared-experts-fusion", action="store_true",
                        help="keep the MoE shared expert apart (mlp.shared_experts.*); default: sglang 0.5.23's "
                        "rule (fused into the last slot of mlp.experts.w13_weight / w2_weight at --ep 1 for GLM-4.5, "
                        "GLM-4.7-Flash and 256-expert DeepSeek-V3 / GLM-5)")
    fusion.add_argument("--enforce-shared-experts-fusion", action="store_true",
                        help="fuse the shared expert whatever the model (at --ep 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the ranks compute")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=30000, help="HTTP port")
    parser.add_argument("--checkpoint", help="HF checkpoint directory (config.json + safetensors): the architecture "
                        "and shapes come from its config.json, the run profile from MODEL")
    parser.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default=None,
        help="dummy: seeded synthetic weights instead of the checkpoint's (of its shapes when --checkpoint is given)",
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                        help="dtype of the unquantized weights (default bfloat16; float32 keeps a float32 checkpoint)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the dummy weights")
    add_receiver_arguments(parser)  # --transport, its backends' options, --transport-config
    parser.add_argument(
        "--transfer-info-format",
        choices=("weightsync", "sglang"),
        default="weightsync",
        help="what /get_remote_instance_transfer_engine_info publishes: weightsync (sglang's pair plus the transport "
        "descriptor) or sglang (exactly what a real sglang server publishes; senders need --transport mooncake)",
    )
    parser.add_argument("--max-batch-size", type=int, default=32, help="sequences decoded together")
    parser.add_argument("--weight-version", default="default", help="the version /get_weight_version answers "
                        "until an update publishes another")
    parser.add_argument("--dist-port", type=int, default=None, help="process-group rendezvous port (default: free)")
    parser.add_argument("--compute-dtype", default=None, choices=COMPUTE_DTYPES,
                        help="activation dtype (default: float32 on cpu, the weights' on cuda)")
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads per rank on cpu (default: 1)")
    parser.add_argument("--token-file", default=None,
                        help="file holding the token every route but /health requires (default: WEIGHTSYNC_TOKEN); "
                        "an engine whose --host is not loopback refuses to start without one")
    parser.add_argument("--api-docs", action="store_true", help="serve /docs and /openapi.json")
    parser.add_argument("--die-with-parent", action="store_true",
                        help="stop (as on SIGTERM) when the process that started this engine dies (a launcher; "
                        "Linux ties it to the starting thread)")
    parser.add_argument("--max-request-mb", type=float, default=64.0,
                        help="larger request bodies get 413; also the bodies parsed at once (more wait, then 503)")
    parser.add_argument("--max-queued-requests", type=int, default=1024,
                        help="generation requests waiting or running at once (429 beyond)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0,
                        help="a /generate not answered within this long is aborted (503)")
    parser.add_argument("--group-timeout-s", type=float, default=600.0,
                        help="deadline of joining a weight-update group and of one broadcast receive")
    parser.add_argument("--collective-timeout-s", type=float, default=300.0,
                        help="deadline of the engine's own collectives between its ranks")
    parser.add_argument("--shadow", choices=SHADOW_MODES, default="auto",
                        help="a shadow copy of the parameters that pause-free updates write while the engine keeps "
                        "generating: auto (on CPU always, on a GPU when it fits) or off (updates pause generation)")
    parser.add_argument("--in-flight-at-flip", choices=IN_FLIGHT_AT_FLIP, default="keep",
                        help="what a pause-free update's flip does to running requests: keep (they go on, their "
                        "KV kept), recompute (re-prefilled under the new weights) or abort")
    parser.add_argument("--max-connections", type=int, default=2048,
                        help="HTTP connections at once (kept below the descriptor limit); beyond, the one stalled "
                        "longest in sending its request is closed")
    parser.add_argument("--header-timeout-s", type=float, default=10.0,
                        help="a request's headers must arrive within this long (else the connection is closed, 408)")
    parser.add_argument("--body-timeout-s", type=float, default=60.0,
                        help="a request's body must arrive within this long of its first byte")
    parser.add_argument("--live-check-interval-s", type=float, default=None,
                        help="seconds between checks of the served weights against their publication (a write "
                        "outside an update session makes them dirty); 0: off; default: 60 where the p2p transport "
                        "opens ports beyond loopback, else off")
    parser.add_argument("--join-from", default="", metavar="URL[,URL...]",
                        help="start joining: copy the fleet's current version from the first healthy of these peer "
                        "engines (one-sided, verified by fingerprint) instead of loading weights; needs --transport")
    parser.add_argument("--join-deadline-s", type=float, default=300.0,
                        help="how long one peer's copy may take before the next peer is tried")
    parser.add_argument("--log-level", default="info", help="debug | info | warning | error")


def _token(args: argparse.Namespace) -> str | None:
    """The token: ``--token-file``'s content, else ``WEIGHTSYNC_TOKEN`` (read by the one reader)."""
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--token-file {args.token_file}: {exc.strerror}") from None
        if not token:
            raise ValueError(f"--token-file {args.token_file} is empty")
        return token
    return env_token()


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    load_format = args.load_format or ("auto" if args.checkpoint else "dummy")
    return ServeConfig(
        model=args.model,
        scale=args.scale,
        tp=args.tp,
        dp=args.dp,
        ep=args.ep,
        moe_dense_tp_size=args.moe_dense_tp_size,
        enable_dp_lm_head=args.enable_dp_lm_head,
        router_fp32=None if args.router_dtype is None else args.router_dtype == "float32",
        dsa_indexer_fusion=False if args.disable_dsa_indexer_fusion else None,
        shared_experts_fusion=(False if args.disable_shared_experts_fusion
                               else True if args.enforce_shared_experts_fusion else None),
        device=args.device,
        host=args.host,
        port=args.port,
        checkpoint=args.checkpoint,
        load_format=load_format,
        dtype=args.dtype,
        seed=args.seed,
        transport=receiver_config_from_args(args),
        max_batch_size=args.max_batch_size,
        weight_version=args.weight_version,
        dist_port=args.dist_port,
        compute_dtype=args.compute_dtype,
        cpu_threads=args.cpu_threads,
        transfer_info_format=args.transfer_info_format,
        token=_token(args),
        api_docs=args.api_docs,
        die_with_parent=args.die_with_parent,
        max_request_bytes=int(args.max_request_mb * (1 << 20)),
        max_queued_requests=args.max_queued_requests,
        request_timeout_s=args.request_timeout_s,
        group_timeout_s=args.group_timeout_s,
        collective_timeout_s=args.collective_timeout_s,
        shadow=args.shadow,
        in_flight_at_flip=args.in_flight_at_flip,
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        live_check_interval_s=args.live_check_interval_s,
        join_from=tuple(u.strip() for u in args.join_from.split(",") if u.strip()),
        join_deadline_s=args.join_deadline_s,
    )


def main(args: argparse.Namespace) -> int:
    from weightsync.engine.serve import run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn re-raises the stop signal once it has shut down: turn SIGTERM into SystemExit (as
    # Ctrl-C is a KeyboardInterrupt) so that the teardown below runs instead of a hard kill.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"weightsync serve: {exc}", file=sys.stderr)
        return 2
    try:
        return run_server(cfg, log_level=args.log_level)
    except KeyboardInterrupt:
        return 0
    except ValueError as exc:  # configuration or checkpoint refused before anything started: one line, no traceback
        print(f"weightsync serve: {exc}", file=sys.stderr)
        return 2


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)
