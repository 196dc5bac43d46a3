"""Contract: the launcher and its trainer ranks speak typed messages, and each rank's transport
publishes its own node's address.

* The protocol is explicit: one command record per ``Cmd`` member, each naming its member; every
  command and reply survives pickling (pipes, Ray and queues carry them) equal to itself.
* The launcher collects one reply per rank, in rank order; a rank's error reply fails the command
  with that rank's own error first and its peers' broken collectives after it.
* A placement starts each trainer rank bound to the address of that rank's host
  (``WorkerConfig.host``), and the rank opens the run's transport bound to it: a Mooncake session
  over rdma announces the node's address, not loopback.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from weightsync.launch import messages as m
from weightsync.launch.messages import Command, Reply
from weightsync.launch.placement import EngineEndpoint, Placement, RankChannel, TrainerError
from weightsync.launch.trainer_worker import WorkerConfig, updater_config
from weightsync.models.fit import plan_nodes
from weightsync.models.parallel import RolloutParallel, TrainParallel
from weightsync.plan.records import Mode
from weightsync.sync.updater import UpdaterConfig
from weightsync.transport import TransportConfig, TransportKind

MOONCAKE_RDMA = TransportConfig(kind=TransportKind.MOONCAKE, mooncake_protocol="rdma", mooncake_device="mlx5_0")


def test_one_record_per_command_of_the_protocol():
    assert [c.cmd for c in m.COMMANDS] == list(m.Cmd)
    assert all(issubclass(c, Command) for c in m.COMMANDS)


MESSAGES = [
    m.SetupUpdater(engine_urls=("http://10.0.0.2:30000",), config=UpdaterConfig(mode="both", transport=MOONCAKE_RDMA)),
    m.TrainStep(samples=({"prompt_ids": [1, 2], "output_ids": [3], "rollout_logprobs": [-0.5], "text": "x"},)),
    m.Update(version=3, mode=Mode.BROADCAST),
    m.Refresh(),
    m.Export(directory="/tmp/x"),
    m.Memory(),
    m.Stop(),
    Reply.success(1, m.Started(rank=1)),
    Reply.success(0, m.UpdaterReady(ops=85, plan_s=0.01, bytes=1 << 20, memory={"updater_staging": 0})),
    Reply.success(0, m.TrainStats(trainer="synthetic", stats={"step": 1.0})),
    Reply.success(0, m.Exported(tensors=12)),
    Reply.failure(2, "trainer rank 2: update: Traceback ..."),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda x: type(x.value if isinstance(x, Reply) else x).__name__)
def test_messages_survive_pickling(msg: Any):
    assert pickle.loads(pickle.dumps(msg)) == msg


class _Channel(RankChannel):
    """A rank that answers every command with a fixed reply (and records what it got)."""

    def __init__(self, reply: Reply[Any]) -> None:
        self.reply = reply
        self.sent: list[Command[Any]] = []

    def send(self, msg: Command[Any]) -> None:
        self.sent.append(msg)

    def poll(self, timeout_s: float) -> bool:
        return bool(self.sent)

    def recv(self) -> Reply[Any]:
        return self.reply

    def dead(self) -> str:
        return ""

    def stop(self) -> None:
        pass

    def join(self, timeout_s: float) -> None:
        pass


class _Placement(Placement):
    """Trainer ranks on two hosts (ranks 0-1 on the first, 2-3 on the second); no process starts."""

    kind = "fake"
    HOSTS = ("10.0.0.1", "10.0.0.2")

    def __init__(self, tmp: Path, replies: list[Reply[Any]] | None = None) -> None:
        super().__init__(tmp, plan_nodes(TrainParallel(world_size=4, tp=2), RolloutParallel(tp=2)))
        self.replies = replies or []
        self.started: list[WorkerConfig] = []

    def trainer_host(self, rank: int) -> str:
        return self.HOSTS[rank // 2]

    def trainer_port(self, rank: int) -> int:
        return 29500

    def engine_endpoints(self) -> list[EngineEndpoint]:
        return []

    def _start_engine(self, ep: EngineEndpoint, argv: list[str]) -> Any:
        raise AssertionError("no engine here")

    def _spawn_trainer(self, rank: int, cfg: WorkerConfig) -> RankChannel:
        self.started.append(cfg)
        return _Channel(self.replies[rank] if self.replies else Reply.success(rank, m.Started(rank=rank)))


def _worker_config() -> WorkerConfig:
    return WorkerConfig(model="Qwen3-4B", scale="tiny", train=TrainParallel(world_size=4, tp=2),
                        rollout=RolloutParallel(tp=2), ckpt_dir="/nonexistent", master_addr="10.0.0.1",
                        master_port=29500, device="cpu")


def test_replies_come_back_typed_in_rank_order(tmp_path: Path):
    replies = [Reply.success(r, m.Exported(tensors=10 * r)) for r in range(4)]
    procs = _Placement(tmp_path, replies)
    try:
        procs.spawn_trainers(_worker_config())
        assert procs.command(m.Export(directory="d")) == [m.Exported(tensors=t) for t in (0, 10, 20, 30)]
    finally:
        procs.close()


def test_an_error_reply_fails_the_command_cause_first(tmp_path: Path):
    replies = [Reply.success(0, m.Exported(tensors=1)),
               Reply.failure(1, "trainer rank 1: export: Connection closed by peer"),
               Reply.failure(2, "trainer rank 2: export: OSError: disk full"),
               Reply.success(3, m.Exported(tensors=0))]
    procs = _Placement(tmp_path, replies)
    try:
        procs.spawn_trainers(_worker_config())
        with pytest.raises(TrainerError) as err:
            procs.command(m.Export(directory="d"))
        first, second = str(err.value).splitlines()
        assert first == "trainer rank 2: export: OSError: disk full"  # the cause before its peer's collateral
        assert second == "trainer rank 1: export: Connection closed by peer"
    finally:
        procs.close()


def test_each_trainer_rank_is_started_with_its_hosts_address(tmp_path: Path):
    procs = _Placement(tmp_path)
    try:
        procs.spawn_trainers(_worker_config())
        assert [c.host for c in procs.started] == ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
    finally:
        procs.close()


def test_the_rank_opens_the_runs_transport_on_its_own_host():
    config = UpdaterConfig(mode="p2p", transport=MOONCAKE_RDMA)
    bound = updater_config(config, "10.0.0.2")
    assert isinstance(bound.transport, TransportConfig)
    assert bound.transport.options() == {"protocol": "rdma", "device": "mlx5_0", "hostname": "10.0.0.2"}
    assert bound.transport.mooncake_protocol == "rdma"
    assert bound == UpdaterConfig(mode="p2p", transport=MOONCAKE_RDMA.on_host("10.0.0.2"))
    # a transport named by kind only is discovered from the engines by the updater: left as it is
    assert updater_config(UpdaterConfig(transport="auto"), "10.0.0.2") == UpdaterConfig(transport="auto")
