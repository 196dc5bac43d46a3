"""Contract of the one transport configuration of a run (:class:`TransportConfig`).

* ``auto`` is resolved by the written policy (:func:`choose_transport`) over every writing pair of
  the placement: the placements of ``run`` and ``bench`` (every rank its own process on one host)
  give ``shm`` on CPU and ``cuda_ipc`` on GPU, another host gives ``mooncake``, and a placement no
  single kind serves is refused with the pairs named;
* a forced kind is taken as it is; an unknown one is refused with the choices;
* the backend's constructor options come from the record alone (the backend class builds them),
  and a process binds its own CUDA device and, for a backend whose peers connect to its ports,
  its address;
* the record survives every way it crosses a process: JSON, pickle, and the engine's command line
  as one argument (:func:`serve_argv` -> ``weightsync serve`` parser -> :func:`transport_config`);
  serve's own flags (``--transport KIND --mooncake-protocol ...``) give the same record, and the
  environment's options are the variables the fields name.
"""

from __future__ import annotations

import argparse
import pickle

import pytest

from weightsync.cli import serve as serve_cli
from weightsync.engine.bootstrap import transport_config
from weightsync.launch.bench.config import bench_placement
from weightsync.launch.procs import serve_argv
from weightsync.models.parallel import Device, RolloutParallel, TrainParallel
from weightsync.transport import HOST, TransportConfig, TransportKind, resolve_kind
from weightsync.transport.config import receiver_argv


def _pairs(trainers, engines):
    return [(a, b) for a in trainers for b in engines]


@pytest.mark.parametrize(
    ("device", "train_gpus", "rollout_gpus", "expected"),
    [
        pytest.param("cpu", (), (), TransportKind.SHM, id="cpu"),
        pytest.param("cuda", (0, 1), (2, 3), TransportKind.CUDA_IPC, id="cuda-split"),
        pytest.param("cuda", (0, 1), (0, 1), TransportKind.CUDA_IPC, id="cuda-colocated-processes"),
    ],
)
def test_auto_on_the_bench_placement(device, train_gpus, rollout_gpus, expected) -> None:
    """The policy gives what the launchers hard-coded before (shm on CPU, cuda_ipc on CUDA)."""
    trainers, engines = bench_placement(device, TrainParallel(world_size=2, tp=2), RolloutParallel(tp=2),
                                        train_gpus, rollout_gpus)
    cfg = TransportConfig.resolve("auto", _pairs(trainers, engines), on_gpu=device == "cuda")
    assert cfg.kind is expected


def test_auto_across_hosts_is_mooncake_and_carries_its_options() -> None:
    trainers = [Device(0, 0), Device(0, 1)]
    engines = [Device(0, 2), Device(1, 0)]  # one engine rank on another host
    cfg = TransportConfig.resolve("auto", _pairs(trainers, engines), on_gpu=True, mooncake_protocol="rdma",
                                  mooncake_device="mlx5_0")
    assert cfg.kind is TransportKind.MOONCAKE
    assert cfg.options() == {"protocol": "rdma", "device": "mlx5_0", "hostname": "127.0.0.1"}


def test_auto_refuses_a_placement_no_kind_serves() -> None:
    colocated, other = (Device(0, 0), Device(0, 0)), (Device(0, 0), Device(0, 1))
    with pytest.raises(ValueError, match=r"needs local.*needs cuda_ipc.*--transport"):
        resolve_kind("auto", [colocated, other], on_gpu=True, same_process=True)
    with pytest.raises(ValueError, match="at least one"):
        resolve_kind("auto", [], on_gpu=False)


def test_forced_and_unknown_kinds() -> None:
    across = [(Device(0, 0), Device(1, 0))]
    assert TransportConfig.resolve("shm", across, on_gpu=False).kind is TransportKind.SHM
    with pytest.raises(ValueError, match=r"unknown transport 'rdma'; choose auto or one of"):
        TransportConfig.resolve("rdma", across, on_gpu=False)
    with pytest.raises(ValueError, match="unknown transport 'nvlink'"):
        TransportConfig(kind="nvlink")


@pytest.mark.parametrize(
    ("cfg", "options"),
    [
        pytest.param(TransportConfig(kind="shm", shm_threads=2), {"num_threads": 2}, id="shm"),
        pytest.param(TransportConfig(kind="cuda_ipc").on_device(3), {"device": 3}, id="cuda_ipc"),
        pytest.param(TransportConfig(kind="local"), {"device": HOST, "num_threads": 1}, id="local-host"),
        pytest.param(TransportConfig(kind="local", cuda_device=1), {"device": 1, "num_threads": 1}, id="local-gpu"),
        pytest.param(TransportConfig(kind="mooncake", mooncake_hostname="10.0.0.2"),
                     {"protocol": "auto", "device": "", "hostname": "10.0.0.2"}, id="mooncake"),
    ],
)
def test_backend_options_per_kind(cfg, options) -> None:
    assert cfg.options() == options


def test_options_that_cannot_be_written_down_are_refused() -> None:
    with pytest.raises(ValueError, match="bind it with on_device"):
        TransportConfig(kind="cuda_ipc").options()
    with pytest.raises(ValueError, match=r"make_transport\('dist'"):
        TransportConfig(kind="dist").options()
    with pytest.raises(ValueError, match="shm_threads"):
        TransportConfig(kind="shm", shm_threads=0)


def test_make_opens_the_backend() -> None:
    with TransportConfig(kind="shm").make() as t:
        assert t.kind == "shm"
    with TransportConfig(kind="local").make() as t:
        assert t.kind == "local"


def test_json_and_pickle_round_trip() -> None:
    cfg = TransportConfig(kind="mooncake", mooncake_protocol="rdma", mooncake_device="mlx5_0", cuda_device=2)
    data = cfg.to_json()
    assert data["kind"] == "mooncake"
    assert type(data["kind"]) is str  # plain JSON, not the enum
    assert TransportConfig.from_json(data) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert TransportConfig.from_json({"kind": "shm"}) == TransportConfig(kind=TransportKind.SHM)
    with pytest.raises(ValueError, match=r"unknown transport config keys \['threads'\]"):
        TransportConfig.from_json({"kind": "shm", "threads": 2})


def _engine_side(argv: list[str]):
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    i = argv.index("serve") if "serve" in argv else -1
    return transport_config(serve_cli.config_from_args(parser.parse_args(argv[i + 1:])))


@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(None, id="none"),
        pytest.param(TransportConfig(kind="shm"), id="shm"),
        pytest.param(TransportConfig(kind="shm", shm_threads=3), id="shm-threads"),
        pytest.param(TransportConfig(kind="cuda_ipc"), id="cuda_ipc"),
        pytest.param(TransportConfig(kind="mooncake"), id="mooncake-tcp"),
        pytest.param(TransportConfig(kind="mooncake", mooncake_protocol="rdma", mooncake_device="mlx5_0"),
                     id="mooncake-rdma"),
    ],
)
def test_the_engine_command_line_carries_the_config(cfg) -> None:
    """The launcher passes the whole record as one argument; the engine rebuilds it unchanged (its own
    address, 127.0.0.1 by default, is the launcher's default; it binds its GPUs itself)."""
    argv = serve_argv(model="Qwen3-4B", scale="tiny", tp=1, ep=1, dp=1, device="cpu", port=30000, checkpoint=None,
                      transport=cfg)
    carried = receiver_argv(cfg)
    assert len(carried) == 2
    assert argv[argv.index(carried[0]):argv.index(carried[0]) + 2] == carried
    assert _engine_side(argv) == cfg


@pytest.mark.parametrize(
    ("flags", "cfg"),
    [
        pytest.param([], None, id="default-none"),
        pytest.param(["--transport", "none"], None, id="none"),
        pytest.param(["--transport", "shm"], TransportConfig(kind="shm"), id="shm"),
        pytest.param(["--transport", "mooncake", "--mooncake-protocol", "rdma", "--mooncake-device", "mlx5_0"],
                     TransportConfig(kind="mooncake", mooncake_protocol="rdma", mooncake_device="mlx5_0"),
                     id="mooncake-flags"),
    ],
)
def test_serve_flags_give_the_same_record(flags, cfg) -> None:
    """What a person types (``--transport KIND`` and a backend's own flags) is mapped at the command
    line's edge into the record a launcher passes whole."""
    assert _engine_side(["Qwen3-4B", "--load-format", "dummy", *flags]) == cfg


def test_the_engine_binds_its_own_address_where_peers_connect_to_it() -> None:
    """A backend that opens ports (mooncake) is told the engine's address; another is left as given."""
    base = ["Qwen3-4B", "--load-format", "dummy", "--host", "10.0.0.5", "--transport-config"]
    for cfg, host in ((TransportConfig(kind="mooncake"), "10.0.0.5"), (TransportConfig(kind="shm"), "127.0.0.1")):
        assert _engine_side([*base, receiver_argv(cfg)[1]]).mooncake_hostname == host


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        pytest.param(["--transport-config", '{"kind": "shm"}', "--transport", "shm"], "drop --transport",
                     id="config-and-kind"),
        pytest.param(["--transport-config", '{"kind": "mooncake"}', "--mooncake-protocol", "rdma"],
                     "drop --mooncake-protocol", id="config-and-option"),
        pytest.param(["--transport-config", "{kind: shm}"], "--transport-config is not JSON", id="not-json"),
        pytest.param(["--transport-config", '"shm"'], "must be a JSON object", id="not-an-object"),
        pytest.param(["--transport-config", '{"protocol": "tcp"}'], "unknown transport config keys", id="bad-key"),
        pytest.param(["--transport-config", '{"shm_threads": 2}'], "needs its kind", id="no-kind"),
    ],
)
def test_bad_engine_transport_options_are_refused(flags, named) -> None:
    with pytest.raises(ValueError, match=named):
        _engine_side(["Qwen3-4B", "--load-format", "dummy", *flags])


def test_the_environment_options_are_the_variables_the_fields_name() -> None:
    env = {"MOONCAKE_PROTOCOL": " rdma ", "MOONCAKE_DEVICE": "", "PATH": "/bin"}
    assert TransportConfig.env_options(env) == {"mooncake_protocol": "rdma"}
    assert TransportConfig.env_options({}) == {}
