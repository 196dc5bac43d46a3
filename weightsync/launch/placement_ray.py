"""The multi-node placement: trainer ranks and engines in a Ray placement group, each bundle pinned
to the node rank the run's :class:`~weightsync.models.fit.NodePlan` gives it.

One bundle per trainer rank (one GPU on CUDA) and one per engine (its TP GPUs: an engine's ranks are
one process tree on one host), each asking for one unit of its node's ``weightsync_node_<rank>``
resource (:func:`~weightsync.launch.cluster.node_resource`), so a bundle can only land on the node
the plan names. A :class:`~weightsync.launch.ray_agent.NodeAgent` actor in each bundle starts the
rank's process there; the run loop reaches engines over HTTP at their node's address and trainer
ranks through their agents, exactly as it does on one host (:class:`~weightsync.launch.placement.Placement`).

Ray is imported only here and in :mod:`~weightsync.launch.cluster`, both only for multi-node runs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from weightsync.launch.cluster import ClusterError, HeadCluster, node_resource
from weightsync.launch.messages import Command, Reply
from weightsync.launch.placement import LOOPBACK, EngineEndpoint, Placement, RankChannel
from weightsync.launch.procs import health_cause
from weightsync.launch.trainer_worker import WorkerConfig
from weightsync.models.fit import NodePlan
from weightsync.sync.engine_client import EngineClient

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
"""How long the placement group may take to be placed once every node has joined."""
AGENT_CALL_TIMEOUT_S = 60.0


class _RayEngine:
    """One engine started by its agent on its node, reached over HTTP from here."""

    def __init__(self, index: int, url: str, agent: Any, node: int, token: str | None, *, timeout_s: float = 600.0
                 ) -> None:
        self.index = index
        self.url = url
        self.node = node
        self.agent = agent
        self.client = EngineClient(url, token=token, timeout_s=timeout_s)  # per control call

    def _call(self, method: str, *args: Any, default: Any = None) -> Any:
        import ray
        from ray.exceptions import RayError

        try:
            return ray.get(getattr(self.agent, method).remote(*args), timeout=AGENT_CALL_TIMEOUT_S)
        except RayError as exc:  # the agent or its node is gone, or it does not answer
            log.warning("engine %d: its agent on node %d did not answer %s: %s", self.index, self.node, method, exc)
            return default

    def alive(self) -> bool:
        return bool(self._call("engine_alive", default=False))

    def tail(self, n: int = 30) -> str:
        return str(self._call("engine_tail", n, default=""))

    def request_stop(self) -> None:
        self.agent.request_stop_engine.remote()

    def diagnose(self) -> str:
        """Its agent's diagnosis on the node (its exit code, the cause its log names); when the
        agent does not answer, what can be seen from here."""
        why = self._call("engine_diagnose")
        if why is not None:
            return str(why)
        what = f"engine {self.index} ({self.url}, node {self.node})"
        return health_cause(self.client, what) or f"{what}: its agent on node {self.node} does not answer"

    def stop(self) -> None:
        self.client.close()
        self._call("stop_engine")


class _RayChannel(RankChannel):
    """A trainer rank started by its agent; each command is one call of the agent."""

    def __init__(self, rank: int, agent: Any, node: int, cfg: WorkerConfig) -> None:
        self.rank = rank
        self.agent = agent
        self.node = node
        self._ref = agent.start_trainer.remote(rank, cfg)
        self._stop_ref: Any = None

    def send(self, msg: Command[Any]) -> None:
        self._ref = self.agent.request.remote(msg)

    def poll(self, timeout_s: float) -> bool:
        import ray

        ready, _ = ray.wait([self._ref], timeout=timeout_s)
        return bool(ready)

    def recv(self) -> Reply[Any]:
        import ray
        from ray.exceptions import RayError

        try:
            return ray.get(self._ref)
        except RayError as exc:  # the agent or its node is gone
            return Reply.failure(self.rank, f"trainer rank {self.rank} on node {self.node}: its agent is gone: {exc}")

    def dead(self) -> str:
        return ""  # a dead agent or rank answers its pending call with an error (recv)

    def stop(self) -> None:
        self._stop_ref = self.agent.stop_trainer.remote(10.0)

    def join(self, timeout_s: float) -> None:
        import ray

        if self._stop_ref is not None:
            ready, _ = ray.wait([self._stop_ref], timeout=timeout_s + 5)
            if not ready:
                log.warning("trainer rank %d on node %d did not stop within %.0f s; its agent is killed",
                            self.rank, self.node, timeout_s + 5)


class RayPlacement(Placement):
    """Trainer ranks and engines on the nodes of a :class:`~weightsync.launch.cluster.HeadCluster`."""

    kind = "ray"

    def __init__(self, cluster: HeadCluster, nodes: NodePlan, log_dir: Path, *, gpus: bool,
                 token: str | None = None) -> None:
        """Reserve one bundle per trainer rank and per engine and start an agent in each.

        Raises:
            ClusterError: the bundles could not be placed (the message says what each node
                lacks) or the cluster spans other nodes than the plan.
        """
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from weightsync.launch.ray_agent import NodeAgent

        super().__init__(log_dir, nodes, token=token)
        if nodes.num_nodes != len(cluster.nodes):
            raise ClusterError(f"the run's plan spans {nodes.num_nodes} nodes, the cluster has {len(cluster.nodes)}")
        self.cluster = cluster
        self.gpus = gpus
        bundles = [self._bundle(d.node, 1) for d in nodes.trainer]
        bundles += [self._bundle(devs[0].node, len(devs)) for devs in nodes.engines]
        self._pg = placement_group(bundles, strategy="PACK", name="weightsync-run")
        try:
            ray.get(self._pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self._remove_group()
            raise ClusterError(self._unplaced(bundles)) from None
        agent_cls = ray.remote(NodeAgent)

        def agent(i: int, num_gpus: int) -> Any:
            return agent_cls.options(num_cpus=0, num_gpus=num_gpus if gpus else 0,
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, i)
                                     ).remote(str(log_dir))

        t = len(nodes.trainer)
        self._trainer_agents = [agent(i, 1) for i in range(t)]
        self._engine_agents = [agent(t + e, len(devs)) for e, devs in enumerate(nodes.engines)]
        self._hosts = ray.get([a.address.remote() for a in self._trainer_agents + self._engine_agents],
                              timeout=PLACEMENT_TIMEOUT_S)
        for what, host, node in [*((f"trainer rank {r}", h, d.node) for r, (h, d) in
                                   enumerate(zip(self._hosts[:t], nodes.trainer))),
                                 *((f"engine {e}", h, devs[0].node) for e, (h, devs) in
                                   enumerate(zip(self._hosts[t:], nodes.engines)))]:
            if host != cluster.nodes[node]:
                raise ClusterError(f"{what} landed on {host}, but node {node} is {cluster.nodes[node]}")

    def _bundle(self, node: int, num_gpus: int) -> dict[str, float]:
        return {node_resource(node): 1, **({"GPU": num_gpus} if self.gpus else {})}

    def _unplaced(self, bundles: list[dict[str, float]]) -> str:
        import ray

        need: dict[int, float] = {}
        for b in bundles:
            node = next(int(k.rsplit("_", 1)[1]) for k in b if k.startswith("weightsync_node_"))
            need[node] = need.get(node, 0) + b.get("GPU", 0)
        have = {}
        for n in ray.nodes():
            for k in n.get("Resources", {}):
                if k.startswith("weightsync_node_") and n.get("Alive"):
                    have[int(k.rsplit("_", 1)[1])] = n["Resources"].get("GPU", 0)
        short = [f"node {r} needs {g:.0f} GPUs and has {have.get(r, 0):.0f}" for r, g in sorted(need.items())
                 if g > have.get(r, 0)]
        return (f"the run's {len(bundles)} placement bundles were not placed within {PLACEMENT_TIMEOUT_S:.0f} s"
                + (": " + "; ".join(short) if short else "") + " (check each node's GPUs with nvidia-smi and Ray's "
                "view of them, `ray status`, and the profile: `weightsync list`)")

    # -- addresses ------------------------------------------------------------------------------
    def trainer_host(self, rank: int) -> str:
        return str(self._hosts[rank])

    def trainer_port(self, rank: int) -> int:
        import ray

        return int(ray.get(self._trainer_agents[rank].free_port.remote(), timeout=AGENT_CALL_TIMEOUT_S))

    def engine_endpoints(self) -> list[EngineEndpoint]:
        """An engine binds its node's address when the launcher (node 0) or a trainer rank is on
        another node, else loopback; its port is picked on its node."""
        import ray

        t = len(self.nodes.trainer)
        out = []
        for e, (agent, devs) in enumerate(zip(self._engine_agents, self.nodes.engines, strict=True)):
            node = devs[0].node
            remote = node != 0 or any(d.node != node for d in self.nodes.trainer)
            host = str(self._hosts[t + e]) if remote else LOOPBACK
            port = int(ray.get(agent.free_port.remote(), timeout=AGENT_CALL_TIMEOUT_S))
            out.append(EngineEndpoint(index=e, node=node, host=host, port=port, remote=remote))
        return out

    def engine_log(self, index: int, replacement: int = 0) -> str:
        node = self.nodes.engine_node(index)
        return f"{super().engine_log(index, replacement)} on node {node} ({self.cluster.nodes[node]})"

    # -- processes ------------------------------------------------------------------------------
    def _start_engine(self, ep: EngineEndpoint, argv: list[str], *, replacement: int = 0) -> _RayEngine:
        """The engine's agent starts it on its node (a replacement too: the node, the environment
        and the endpoint of the engine it replaces), its log the file :meth:`engine_log` names there."""
        import ray

        agent = self._engine_agents[ep.index]
        name = Path(super().engine_log(ep.index, replacement)).name
        ray.get(agent.start_engine.remote(ep.index, argv, ep.url, self.token, ep.node, name),
                timeout=AGENT_CALL_TIMEOUT_S)
        return _RayEngine(ep.index, ep.url, agent, ep.node, self.token, timeout_s=self.deadlines.engine_call_s)

    def _spawn_trainer(self, rank: int, cfg: WorkerConfig) -> RankChannel:
        return _RayChannel(rank, self._trainer_agents[rank], self.nodes.trainer[rank].node, cfg)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "nodes": {str(r): a for r, a in self.cluster.nodes.items()}}

    def close(self) -> None:
        """Stop every rank's process, then the agents and the placement group."""
        import ray

        try:
            super().close()
        finally:
            for a in self._trainer_agents + self._engine_agents:
                ray.kill(a)
            self._remove_group()

    def _remove_group(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self._pg)


__all__ = ["RayPlacement"]
