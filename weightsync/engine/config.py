"""The engine's configuration record: everything one ``weightsync serve`` engine needs.

Filled by the command line (:mod:`weightsync.cli.serve`) or by a launcher; read by
:mod:`weightsync.engine.bootstrap` and :mod:`weightsync.engine.serve`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from weightsync.models.parallel import RolloutParallel
from weightsync.transport import TransportConfig
from weightsync.transport.net import is_loopback

TRANSFER_INFO_FORMATS = ("weightsync", "sglang")
SHADOW_MODES = ("auto", "off")
"""``--shadow``: auto holds a shadow copy on CPU always and on a GPU when it fits
(:func:`weightsync.sync.weight_copies.shadow_fits`); off never."""
IN_FLIGHT_AT_FLIP = ("keep", "recompute", "abort")
"""``--in-flight-at-flip``: what a flip does to the running requests
(:meth:`weightsync.engine.scheduler.Scheduler.flip`)."""
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
"""Activation dtypes the engine computes in."""

DEFAULT_LIVE_CHECK_S = 60.0
"""The live check's interval where peers can write without a token (:attr:`ServeConfig.live_check_s`)."""
GRACEFUL_SHUTDOWN_S = 5
"""On stop, requests still waiting after this long (e.g. queued behind a pause) are cancelled."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeConfig:
    """Everything one engine needs; the CLI only fills it."""

    model: str
    """Registry name (``weightsync list``)."""
    scale: str = "full"
    """``full``, ``layers=N`` or ``tiny``."""
    tp: int = 1
    dp: int = 1
    """DP-attention size (1 = off)."""
    ep: int = 1
    moe_dense_tp_size: int | None = None
    """sglang ``--moe-dense-tp-size`` (only 1: dense MLP layers replicated; None: split over TP)."""
    enable_dp_lm_head: bool = False
    """sglang ``--enable-dp-lm-head``: lm_head vocab split over attention-TP instead of full TP."""
    router_fp32: bool | None = None
    """Layout option ``router_fp32`` (:mod:`weightsync.layout.sglang_options`): the MoE routers in
    float32 (True) or the model dtype (False, as sglang 0.5.16 registers GLM routers); None: sglang
    0.5.23's rule for the model."""
    dsa_indexer_fusion: bool | None = None
    """Layout option ``dsa_indexer_fusion``: False keeps the DSA indexer's ``wk`` and ``weights_proj``
    apart (sglang's ``SGLANG_DISABLE_DSA_INDEXER_FUSION``); None: sglang 0.5.23's rule."""
    shared_experts_fusion: bool | None = None
    """Layout option ``shared_experts_fusion``: True fuses the shared expert into the routed experts'
    weights (sglang's ``--enforce-shared-experts-fusion``, at ep 1 only), False keeps it apart
    (``--disable-shared-experts-fusion``); None: sglang 0.5.23's rule."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` (rank r uses ``cuda:r``)."""
    host: str = "127.0.0.1"
    port: int = 30000
    checkpoint: str | None = None
    """HF checkpoint directory: the model's architecture and shapes come from its config.json (the
    registry's shapes at ``scale`` when None, with ``load_format="dummy"``)."""
    load_format: str = "auto"
    """``auto`` (the checkpoint's weights) or ``dummy`` (seeded synthetic weights, of the checkpoint's
    shapes when one is given, as sglang's ``--load-format dummy --model-path``)."""
    dtype: str = "bfloat16"
    """Dtype of the weights the engine stores unquantized (``bfloat16``, ``float32``, ``float16``);
    a float32 checkpoint stays float32 with ``float32``."""
    seed: int = 0
    """Seed of the dummy weights."""
    transport: TransportConfig | None = None
    """The p2p transport the parameters are registered with, the whole record (its kind one an
    engine receives through; the engine binds its own device and address); None leaves the
    broadcast path only."""
    max_batch_size: int = 32
    weight_version: str = "default"
    dist_port: int | None = None
    """Rendezvous port of the engine's process group (None: a free one)."""
    compute_dtype: str | None = None
    """Activation dtype (None: float32 on CPU, the model's dtype on CUDA)."""
    cpu_threads: int = 1
    """torch intra-op threads per rank on CPU (tiny models are fastest on one; more oversubscribes
    a small machine running several ranks)."""
    transfer_info_format: str = "weightsync"
    """What ``/get_remote_instance_transfer_engine_info`` publishes: ``weightsync`` (sglang's
    ``[session_id, weights_info]`` plus this project's transport descriptor) or ``sglang`` (exactly
    sglang's pair, as a real sglang server publishes it; senders then need Mooncake)."""
    token: str | None = field(default=None, repr=False)
    """Required on every route but ``/health`` (``Authorization: Bearer``); an engine whose host is
    not a loopback address refuses to start without one (``WEIGHTSYNC_TOKEN`` or ``--token-file``)."""
    api_docs: bool = False
    """Serve ``/docs`` and ``/openapi.json`` (off by default)."""
    die_with_parent: bool = False
    """End the engine (SIGTERM: a clean stop, shm unlinked) when the process that started it dies."""
    max_request_bytes: int = 64 << 20
    """Larger request bodies are refused (413); also the budget of bodies parsed at once (a parse
    costs several times the body)."""
    max_queued_requests: int = 1024
    """Generation requests waiting or running at once (429 beyond; a single request of more prompts: 413)."""
    request_timeout_s: float = 600.0
    """A ``/generate`` not answered within this long is aborted (503)."""
    group_timeout_s: float = 600.0
    """Joining a weight-update group and one broadcast receive must complete within this long."""
    collective_timeout_s: float = 300.0
    """The engine's own collectives between its ranks (a rank waiting on a failed peer gives up after it)."""
    shadow: str = "auto"
    """A shadow copy of the parameters for pause-free updates: ``auto`` (on CPU always, on a GPU when
    it fits beside the served copy) or ``off`` (every update pauses generation)."""
    in_flight_at_flip: str = "keep"
    """What a pause-free update's flip does to the running requests: ``keep`` (they go on under the
    new version, their KV kept), ``recompute`` (re-prefilled under the new version) or ``abort``."""
    max_connections: int = 2048
    """HTTP connections at once (lowered to stay below the descriptor limit); beyond, the connection
    stalled longest in sending its request is closed (:mod:`weightsync.engine.http_guard`)."""
    header_timeout_s: float = 10.0
    """A request's headers must arrive within this long of the connection's start (or of the request's
    first byte); else the connection is closed (408)."""
    body_timeout_s: float = 60.0
    """A request's body must arrive within this long of its first byte; else the connection is closed."""
    live_check_interval_s: float | None = None
    """Seconds between checks of the served weights against their publication (a write outside a
    session makes them dirty; :mod:`weightsync.engine.live_check`); 0: off; None: every 60 s when the
    p2p transport opens ports beyond loopback (peers write without a token there), else off."""

    @property
    def live_check_s(self) -> float:
        """:attr:`live_check_interval_s` resolved (0: off)."""
        if self.live_check_interval_s is not None:
            return self.live_check_interval_s
        exposed = self.transport is not None and self.transport.backend.opens_ports and not is_loopback(self.host)
        return DEFAULT_LIVE_CHECK_S if exposed else 0.0
    join_from: tuple[str, ...] = ()
    """Peer engines (``http://host:port``) to copy the fleet's current version from at start-up,
    tried in order: the engine starts ``joining``, loads nothing itself and serves once the copy
    is verified (:mod:`weightsync.engine.join`). Needs a p2p transport."""
    join_deadline_s: float = 300.0
    """How long one peer's copy may take before the next peer is tried."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"dtype must be bfloat16, float32 or float16, got {self.dtype!r}")
        if self.load_format == "auto" and self.checkpoint is None:
            raise ValueError("no --checkpoint: pass one, or --load-format dummy for synthetic weights")
        if self.compute_dtype not in (None, *COMPUTE_DTYPES):
            raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.dist_port is not None and not 1 <= self.dist_port <= 65535:
            raise ValueError(f"dist_port must be in 1..65535, got {self.dist_port}")
        if self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.transfer_info_format not in TRANSFER_INFO_FORMATS:
            choices = ", ".join(TRANSFER_INFO_FORMATS)
            raise ValueError(f"transfer_info_format must be one of {choices}, got {self.transfer_info_format!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        for name in ("max_request_bytes", "max_queued_requests", "request_timeout_s", "group_timeout_s",
                     "collective_timeout_s", "max_connections", "header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number, got {value}")
        if self.shadow not in SHADOW_MODES:
            raise ValueError(f"shadow must be one of {', '.join(SHADOW_MODES)}, got {self.shadow!r}")
        if self.in_flight_at_flip not in IN_FLIGHT_AT_FLIP:
            raise ValueError(f"in_flight_at_flip must be one of {', '.join(IN_FLIGHT_AT_FLIP)}, got "
                             f"{self.in_flight_at_flip!r}")
        if self.shared_experts_fusion and self.ep > 1:
            raise ValueError(f"--enforce-shared-experts-fusion with --ep {self.ep}: shared-expert fusion under "
                             "expert parallelism is not supported (sglang scales the shared slots by 1/ep)")
        if self.live_check_interval_s is not None and not (self.live_check_interval_s >= 0
                                                           and math.isfinite(self.live_check_interval_s)):
            raise ValueError(f"live_check_interval_s must be >= 0 (0: off), got {self.live_check_interval_s}")
        if self.join_from and self.transport is None:
            raise ValueError("--join-from needs a p2p transport (--transport): the peer writes into this engine")
        if not self.join_deadline_s > 0:
            raise ValueError(f"join_deadline_s must be positive, got {self.join_deadline_s}")
        if self.token is not None and len(self.token) < 16:
            raise ValueError("the engine token must be at least 16 characters (e.g. python -c 'import secrets; "
                             "print(secrets.token_urlsafe(32))')")


def option_flags(par: RolloutParallel) -> list[str]:
    """The ``weightsync serve`` flags that give an engine ``par``'s layout options (none for an
    option left to sglang's rule)."""
    flags: list[str] = []
    if par.router_fp32 is not None:
        flags += ["--router-dtype", "float32" if par.router_fp32 else "model"]
    if par.dsa_indexer_fusion is False:
        flags.append("--disable-dsa-indexer-fusion")
    if par.shared_experts_fusion is not None:
        flags.append("--enforce-shared-experts-fusion" if par.shared_experts_fusion else
                     "--disable-shared-experts-fusion")
    return flags
