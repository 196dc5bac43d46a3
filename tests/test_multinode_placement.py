"""Placement by profile and the multi-node decisions, without starting anything.

Contracts:

* :func:`plan_nodes`: one node keeps every rank on this host; a multi-node profile on GPUs is the
  reference's disaggregated placement (GLM-4.7-Flash 8 + 8: trainer on node 0, both engines on
  node 1); the embedded default spans the nodes (trainer on node 0, one engine on each other node);
  an engine that would span two nodes is refused naming it.
* The transport resolved over a placement: same-host pairs stay on shm, cross-host pairs go over
  Mooncake.
* ``run``'s resolution: ``--head-ip`` (or a worker's ``--node-rank``) makes a multi-node profile
  span its nodes; without them node 0 runs alone, as before; bad ranks and combinations are
  refused naming the flag; the deadline and port come from their environment variables.
* A single-node run imports no Ray.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from weightsync.cli import build_parser
from weightsync.cli.run import resolve
from weightsync.launch.config import ClusterSpec, env_settings
from weightsync.models.fit import embedded_layout, fit_profile, plan_nodes
from weightsync.models.parallel import Device
from weightsync.models.profiles import get_profile
from weightsync.transport import TransportConfig, TransportKind


def _resolve(argv: list[str], env: dict[str, str] | None = None):
    args = build_parser().parse_args(["run", *argv])
    return resolve(args, env_settings({"CKPT_SAVE_DIR": "/nonexistent", **(env or {})}))


def test_one_node_keeps_every_rank_here():
    train, rollout = embedded_layout("Qwen3-4B")
    plan = plan_nodes(train, rollout)
    assert plan.num_nodes == 1
    assert plan.trainer == (Device(0, 0), Device(0, 1))
    assert plan.rollout == (Device(0, 2), Device(0, 3))
    cfg = TransportConfig.resolve("auto", plan.pairs(), on_gpu=False)
    assert cfg.kind is TransportKind.SHM


def test_a_gpu_profile_is_the_reference_disaggregated_placement():
    profile = get_profile("GLM-4.7-Flash")
    fit = fit_profile("GLM-4.7-Flash", 8, multi_node=True)
    assert not fit.embedded
    assert fit.num_nodes == 2
    plan = plan_nodes(fit.train, fit.rollout, num_nodes=2, gpus_per_node=profile.gpus_per_node)
    assert plan.trainer == tuple(Device(0, g) for g in range(8))
    assert plan.engines == (tuple(Device(1, g) for g in range(4)), tuple(Device(1, g) for g in range(4, 8)))
    assert plan.nodes_of() == {0: [f"trainer rank {r}" for r in range(8)], 1: ["engine 0", "engine 1"]}
    assert TransportConfig.resolve("auto", plan.pairs(), on_gpu=True).kind is TransportKind.MOONCAKE


def test_the_embedded_default_spans_the_profiles_nodes():
    fit = fit_profile("Qwen3-30B-A3B", 0, multi_node=True)  # 4 nodes
    assert fit.embedded
    assert fit.num_nodes == 4
    assert fit.rollout.num_engines == 3
    assert "over 4 nodes" in fit.note
    plan = plan_nodes(fit.train, fit.rollout, num_nodes=4, by_role=True)
    assert {d.node for d in plan.trainer} == {0}
    assert [plan.engine_node(e) for e in range(3)] == [1, 2, 3]
    assert TransportConfig.resolve("auto", plan.pairs(), on_gpu=False).kind is TransportKind.MOONCAKE


def test_without_head_ip_a_multi_node_profile_runs_here_alone():
    fit = fit_profile("GLM-4.7-Flash", 0)
    assert (fit.embedded, fit.num_nodes, fit.rollout.num_engines) == (True, 1, 1)
    assert _resolve(["GLM-4.7-Flash"]).cluster is None


def test_an_engine_across_two_nodes_is_refused_naming_it():
    fit = fit_profile("Qwen3-235B-A22B", 8, multi_node=True)  # engines of TP 32
    with pytest.raises(ValueError, match=r"engine 0 \(TP 32\) would span nodes \[8, 9, 10, 11\]"):
        plan_nodes(fit.train, fit.rollout, num_nodes=16)


def test_head_and_worker_resolve_the_same_run():
    head = _resolve(["GLM-4.7-Flash", "--node-rank", "0", "--head-ip", "198.18.0.1"],
                    {"WEIGHTSYNC_NODE_TIMEOUT_S": "42", "WEIGHTSYNC_RAY_PORT": "7000"})
    worker = _resolve(["GLM-4.7-Flash", "--node-rank", "1", "--head-ip", "198.18.0.1"])
    assert head.cluster == ClusterSpec(num_nodes=2, node_rank=0, head_ip="198.18.0.1", port=7000, timeout_s=42.0)
    assert worker.cluster is not None
    assert (worker.cluster.node_rank, worker.cluster.port, worker.cluster.timeout_s) == (1, 6379, 300.0)
    assert head.nodes == worker.nodes
    assert worker.nodes is not None
    assert worker.nodes.nodes_of()[1] == ["engine 0"]
    assert head.log_dir.is_absolute()  # the other nodes write under it


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        pytest.param(["GLM-4.7-Flash", "--node-rank", "2", "--head-ip", "198.18.0.1"], {},
                     "--node-rank 2: this run spans 2 nodes", id="rank-too-high"),
        pytest.param(["GLM-4.7-Flash", "--node-rank", "1"], {}, "node rank 1 needs --head-ip", id="no-head"),
        pytest.param(["Qwen3-4B", "--node-rank", "1", "--head-ip", "198.18.0.1"], {},
                     "Qwen3-4B's profile runs on one node", id="one-node-profile"),
        pytest.param(["GLM-4.7-Flash", "--head-ip", "198.18.0.1", "--engine-urls", "http://198.18.0.2:1"], {},
                     "--engine-urls", id="engine-urls"),
        pytest.param(["GLM-4.7-Flash", "--head-ip", "198.18.0.1"], {"WEIGHTSYNC_NODE_TIMEOUT_S": "soon"},
                     "WEIGHTSYNC_NODE_TIMEOUT_S must be a positive number, got 'soon'", id="timeout"),
    ],
)
def test_bad_multi_node_input_is_refused_naming_it(argv: list[str], env: dict[str, str], named: str):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        _resolve(argv, env)


def test_this_hosts_addresses_are_found():
    from weightsync.launch.cluster import interface_of, local_addresses

    assert local_addresses().get("127.0.0.1") == "lo"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("198.19.255.254") == ""


def test_a_single_node_run_imports_no_ray():
    code = ("import sys; import weightsync.cli.run, weightsync.launch.session, weightsync.launch.placement, "
            "weightsync.launch.cluster, weightsync.launch.placement_ray, weightsync.launch.ray_agent; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
