"""A multi-node ``run``: what node rank 0 (the head) and every other node do.

The head (:func:`run_head`) starts the Ray cluster (:class:`~weightsync.launch.cluster.HeadCluster`),
waits for the other nodes, places the trainer ranks and engines on them by the run's
:class:`~weightsync.models.fit.NodePlan` (:class:`~weightsync.launch.placement_ray.RayPlacement`)
and runs the job (:class:`~weightsync.launch.session.RunSession`). Every other node
(:func:`run_node`) joins, hosts what is placed on it and leaves when the job ends. Both check
that they were started for the same job (:func:`job_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightsync.launch.cluster import HeadCluster, run_worker
from weightsync.launch.config import RunConfig
from weightsync.launch.placement_ray import RayPlacement
from weightsync.launch.session import RunSession


def job_of(cfg: RunConfig) -> dict[str, str]:
    """What every node of a multi-node run must agree on."""
    return {"model": cfg.model, "scale": cfg.scale, "device": cfg.device}


def run_head(cfg: RunConfig, *, hf_dir: Path, torch_dist_dir: Path, say: Callable[[str], None] = print
             ) -> dict[str, Any]:
    """Node rank 0: the cluster, the placement on it, the run; its summary.

    Raises:
        ValueError: ``cfg`` is no multi-node run.
        ClusterError: the cluster could not be formed, or was lost mid-run (what to check).
        RunError, EngineError, TrainerError: as :meth:`RunSession.run`.
    """
    if cfg.cluster is None or cfg.nodes is None:
        raise ValueError("run_head runs a multi-node run (RunConfig.cluster and .nodes set)")
    plan = cfg.nodes.nodes_of()
    say("placement: " + "; ".join(f"node {n}: {', '.join(what) or 'nothing'}" for n, what in plan.items()))
    with HeadCluster(cfg.cluster, log_dir=cfg.log_dir, run=job_of(cfg)) as cluster, cluster.guard():
        placement = RayPlacement(cluster, cfg.nodes, cfg.log_dir, gpus=cfg.device == "cuda", token=cfg.env.token)
        return RunSession(cfg, hf_dir=hf_dir, torch_dist_dir=torch_dist_dir, placement=placement).run()


def run_node(cfg: RunConfig) -> int:
    """Node rank >= 1: join the head, host what it places here, leave at the end.

    Returns:
        As :func:`~weightsync.launch.cluster.run_worker`: 0 when the job ran to its end on the head.

    Raises:
        ValueError: ``cfg`` is no multi-node run.
        ClusterError: no head within the deadline, or the head runs another job.
    """
    if cfg.cluster is None or cfg.nodes is None:
        raise ValueError("run_node runs a multi-node run (RunConfig.cluster and .nodes set)")
    here = cfg.nodes.nodes_of()[cfg.cluster.node_rank]
    return run_worker(cfg.cluster, run=job_of(cfg), runs_here=", ".join(here) or "nothing (the profile places no "
                      "rank here)")


__all__ = ["job_of", "run_head", "run_node"]
