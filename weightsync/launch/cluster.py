"""The Ray cluster of a multi-node run, from the wrapper's ``NODE_RANK`` and ``HEAD_IP``.

Node rank 0 (the head) starts a Ray head on ``--head-ip`` (:class:`HeadCluster`), waits until every
node the run spans has joined (deadline ``WEIGHTSYNC_NODE_TIMEOUT_S``; on expiry the error says how
many joined, which ranks are missing and what to check), runs the job, tells the other nodes that it
ended, waits for them to leave and stops its Ray head. Every other rank (:func:`run_worker`) waits
for the head, joins it as a Ray node, stays until the job ends and exits 0; it exits 1 with a
message when the head goes away mid-job.

Each node's Ray processes are one ``ray start --block`` process this run starts, in a session of its
own, with a fresh temporary directory: nothing is shared with another run, and stopping it (SIGTERM,
which Ray's own ``--block`` shutdown turns into stopping every process it started, then SIGKILL to
that process group for stragglers) stops exactly what this run started. If the launcher itself is
killed, the kernel sends that process SIGTERM (``PR_SET_PDEATHSIG``). Ray's logs of the node are
copied into the run's log directory (``ray_node<k>/``) before the temporary directory is removed.

Nodes are told apart by a custom Ray resource, ``weightsync_node_<rank>``, which every node
announces when it starts; placement groups pin bundles to a node rank with it
(:mod:`~weightsync.launch.placement_ray`). Ray is imported here only inside functions: single-node
runs never import it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from weightsync.launch.config import ClusterSpec
from weightsync.proc import die_with_parent, free_port, log_tail

log = logging.getLogger(__name__)

NAMESPACE = "weightsync"
"""The Ray namespace of a run's named actors."""
JOB_ACTOR = "weightsync-job"
"""The head's named actor every worker polls to learn that the job ended."""
NODE_RESOURCE_UNITS = 10_000
"""How much of its ``weightsync_node_<rank>`` resource a node announces (one unit per bundle)."""
HEAD_LOST_AFTER_S = 5.0
"""A worker decides the head went away after its Ray port refused connections this long."""
FINISHED = "finished"
"""The job's outcome when it ran to its end on the head (whatever its validation says there)."""
LEAVE_TIMEOUT_S = 30.0
"""How long the head waits for the workers to leave after the job ended."""
RAY_START_TIMEOUT_S = 120.0
"""How long a node's ``ray start`` may take to bring its Ray processes up."""
OBJECT_STORE_BYTES = 512 * 2**20
"""Ray's object store per node: it carries the run's control messages only (commands, parameter
tables), never weights; Ray's default (30 % of RAM in /dev/shm per node) would be wasted."""


class ClusterError(RuntimeError):
    """The cluster could not be formed or was lost; the message says what to check."""


def node_resource(rank: int) -> str:
    """The custom Ray resource node rank ``rank`` announces (and bundles pinned to it ask for)."""
    return f"weightsync_node_{rank}"


# -- addresses ------------------------------------------------------------------------------------


def local_addresses() -> dict[str, str]:
    """This host's IPv4 addresses and the interface of each (``{"10.0.0.5": "eth0"}``; Linux)."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
            out[socket.inet_ntoa(raw[20:24])] = name
    return out


def interface_of(ip: str) -> str:
    """The network interface that holds ``ip`` here ("" when none does)."""
    return local_addresses().get(ip, "")


def resolve_ip(host: str) -> str:
    """``host`` as an IPv4 address.

    Raises:
        ClusterError: it does not resolve.
    """
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ClusterError(f"--head-ip {host!r} does not resolve to an address: {exc}") from None


def address_toward(ip: str, port: int) -> str:
    """The address this host uses to reach ``ip:port`` (its source address on that route).

    Raises:
        ClusterError: no route to ``ip``.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, port))  # UDP: picks the route and source address, sends nothing
        except OSError as exc:
            raise ClusterError(f"no route from this node to the head {ip}: {exc}; check --head-ip") from None
        return str(s.getsockname()[0])


def reachable(ip: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to ``ip:port`` is accepted."""
    try:
        with socket.create_connection((ip, port), timeout=timeout_s):
            return True
    except OSError:
        return False


# -- one node's Ray processes ---------------------------------------------------------------------


class RayNode:
    """This node's Ray processes: one ``ray start --block`` this run started (module docstring)."""

    def __init__(self, argv: list[str], temp_dir: Path, what: str) -> None:
        self.temp_dir = temp_dir
        self.what = what
        self.out_path = temp_dir / "ray-start.out"
        self._out = open(self.out_path, "w")  # noqa: SIM115 -- closed in stop()
        # Its own session (a process group this run can stop as a whole); SIGTERM when the
        # launcher dies, which ray start --block turns into stopping what it started.
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        log.info("%s: started ray (pid %d): %s", what, self.proc.pid, " ".join(argv))

    @classmethod
    def start(cls, *, rank: int, ip: str, head: ClusterSpec | None = None, port: int = 0) -> RayNode:
        """Start the Ray processes of node ``rank`` on address ``ip``: a head on ``port`` when
        ``head`` is None, else a node joining ``head``."""
        temp_dir = Path(tempfile.mkdtemp(prefix=f"wsray{rank}-"))
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
                "--node-ip-address", ip, "--temp-dir", str(temp_dir),
                "--resources", json.dumps({node_resource(rank): NODE_RESOURCE_UNITS}),
                "--dashboard-agent-listen-port", str(free_port(ip)), "--object-store-memory", str(OBJECT_STORE_BYTES)]
        if head is None:
            argv += ["--head", "--port", str(port), "--include-dashboard", "false",
                     "--dashboard-port", str(free_port(ip))]
        else:
            argv += ["--address", head.address]
        return cls(argv, temp_dir, f"node {rank}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 20) -> str:
        return log_tail(self.out_path, n)

    def wait_up(self, ready: Callable[[], bool], *, timeout_s: float = RAY_START_TIMEOUT_S) -> None:
        """Wait until ``ready()``; ray start exiting or the deadline is an error with its output.

        Raises:
            ClusterError: naming the cause and the end of ``ray start``'s output.
        """
        end = time.monotonic() + timeout_s
        while not ready():
            if not self.alive():
                raise ClusterError(f"{self.what}: ray start exited (code {self.proc.returncode}):\n{self.tail()}")
            if time.monotonic() > end:
                raise ClusterError(f"{self.what}: Ray did not come up within {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(0.2)

    def logs_dir(self) -> Path | None:
        """Ray's log directory of this node's session (None before Ray made one)."""
        sessions = sorted(self.temp_dir.glob("session_2*"))
        return sessions[-1] / "logs" if sessions else None

    def stop(self, *, graceful: bool = True, copy_logs_to: Path | None = None) -> None:
        """Stop everything this node's ``ray start`` started; copy Ray's logs to ``copy_logs_to``
        and remove the temporary directory.

        Args:
            graceful: SIGTERM first (ray start stops its processes, a worker drains through the
                head first); False when the head is gone and draining would only wait.
            copy_logs_to: where Ray's logs of this node go (None: dropped with the directory).
        """
        if self.alive() and graceful:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=45)
            except subprocess.TimeoutExpired:
                log.warning("%s: ray start did not stop within 45 s after SIGTERM; killing its processes", self.what)
        # Stragglers of its process group (Ray's agents outlive a killed ray start): this run's own.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._out.close()
        src = self.logs_dir()
        if copy_logs_to is not None and src is not None:
            try:
                shutil.copytree(src, copy_logs_to, dirs_exist_ok=True, ignore_dangling_symlinks=True,
                                ignore=shutil.ignore_patterns("*.sock", "sockets"))
                shutil.copy2(self.out_path, copy_logs_to / "ray-start.out")
            except OSError as exc:
                log.warning("%s: could not copy Ray's logs to %s: %s", self.what, copy_logs_to, exc)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _connect(spec: ClusterSpec, ip: str, temp_dir: Path) -> None:
    """This process joins the cluster as a driver, through its own node's Ray processes."""
    import ray

    ray.init(address=spec.address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False,
             _node_ip_address=ip, _temp_dir=str(temp_dir))


def _shutdown_ray(timeout_s: float = 10.0) -> None:
    """Disconnect this driver (in a thread: with the head gone, Ray's shutdown can wait long)."""
    import threading

    import ray

    t = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
    t.start()
    t.join(timeout_s)


def joined_nodes() -> dict[int, list[str]]:
    """Node rank -> addresses of the live Ray nodes announcing it."""
    import ray

    out: dict[int, list[str]] = {}
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        for key in n.get("Resources", {}):
            if key.startswith("weightsync_node_"):
                out.setdefault(int(key.rsplit("_", 1)[1]), []).append(str(n["NodeManagerAddress"]))
    return out


# -- the head ---------------------------------------------------------------------------------------


class JobState:
    """The head's record of the job, which every worker polls (a named actor on node 0; a plain
    class until ``ray.remote`` makes it one)."""

    def __init__(self, log_dir: str, run: dict[str, str]) -> None:
        self._state: dict[str, Any] = {"state": "running", "log_dir": log_dir, "outcome": "", "run": dict(run)}

    def get(self) -> dict[str, Any]:
        return dict(self._state)

    def finish(self, outcome: str) -> None:
        self._state.update(state="done", outcome=outcome)


class HeadCluster:
    """Node rank 0's cluster for one run (a context manager; see the module docstring).

    ``with HeadCluster(spec, log_dir=...) as cluster:`` starts the head, waits for the nodes and
    yields; ``cluster.nodes`` maps node rank to address. Leaving the block ends the job for every
    node and stops this node's Ray processes, also on errors.
    """

    def __init__(self, spec: ClusterSpec, *, log_dir: Path, run: dict[str, str] | None = None,
                 say: Callable[[str], None] = print) -> None:
        """``run``: what the job is (``{"model": ...}``); a worker started for another refuses to stay."""
        if spec.node_rank != 0:
            raise ValueError(f"HeadCluster runs on node rank 0, not {spec.node_rank}")
        self.spec = spec
        self.log_dir = log_dir
        self.say = say
        self.run = dict(run or {})
        self.ip = resolve_ip(spec.head_ip)
        self.nodes: dict[int, str] = {}
        self._node: RayNode | None = None
        self._job: Any = None
        self._connected = False

    def __enter__(self) -> HeadCluster:
        try:
            self._start()
        except BaseException:
            self.close("failed before the job started")
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(FINISHED if exc_type is None else f"failed: {exc_type.__name__}: {exc}"[:300])

    def _start(self) -> None:
        spec, ip = self.spec, self.ip
        mine = local_addresses()
        if ip not in mine:
            raise ClusterError(f"--head-ip {spec.head_ip} ({ip}) is not an address of this node (its addresses: "
                               f"{', '.join(sorted(mine))}): on node rank 0 give the address the other nodes reach "
                               "it at")
        if reachable(ip, spec.port, 1.0):
            raise ClusterError(f"{ip}:{spec.port} is in use (a Ray cluster of another run, or another program): stop "
                               "it, or pick another port with WEIGHTSYNC_RAY_PORT (the same on every node)")
        self.say(f"node 0 of {spec.num_nodes}: starting the Ray head on {ip}:{spec.port}")
        self._node = RayNode.start(rank=0, ip=ip, port=spec.port)
        self._node.wait_up(lambda: reachable(ip, spec.port, 1.0))
        _connect(spec, ip, self._node.temp_dir)
        self._connected = True
        import ray

        self._job = ray.remote(JobState).options(name=JOB_ACTOR, num_cpus=0,
                                                 resources={node_resource(0): 1}).remote(str(self.log_dir), self.run)
        ray.get(self._job.get.remote(), timeout=60)
        self.wait_for_nodes()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Ray's errors inside the block (a node or an agent lost mid-run) as a :class:`ClusterError`
        saying where to look."""
        from ray.exceptions import RayError

        try:
            yield
        except RayError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ClusterError(f"the run lost part of its cluster ({type(exc).__name__}: {first[:300]}); each "
                               f"node's console and {self.log_dir}/ray_node<k>/ on that node say why") from None

    def wait_for_nodes(self) -> None:
        """Wait until every node rank has joined (once each), up to the spec's deadline.

        Raises:
            ClusterError: the deadline passed (naming how many joined and the missing ranks), or
                a node rank joined twice.
        """
        spec = self.spec
        want = set(range(spec.num_nodes))
        end = time.monotonic() + spec.timeout_s
        said = -1
        while True:
            joined = joined_nodes()
            twice = {r: a for r, a in joined.items() if len(a) > 1}
            if twice:
                raise ClusterError("node rank(s) joined more than once: " + "; ".join(
                    f"rank {r} from {', '.join(a)}" for r, a in sorted(twice.items())) + ": give each node its own "
                    "NODE_RANK")
            missing = sorted(want - set(joined))
            if not missing:
                self.nodes = {r: a[0] for r, a in sorted(joined.items())}
                self.say(f"all {spec.num_nodes} nodes joined: " + ", ".join(
                    f"node {r} {a}" for r, a in self.nodes.items()))
                return
            if len(joined) != said:
                said = len(joined)
                self.say(f"waiting for node rank(s) {', '.join(map(str, missing))} ({len(joined)} of {spec.num_nodes} "
                         f"joined; up to {spec.timeout_s:.0f} s)")
            if time.monotonic() > end:
                raise ClusterError(
                    f"{len(joined)} of {spec.num_nodes} nodes joined the Ray head at {self.ip}:{spec.port} within "
                    f"{spec.timeout_s:.0f} s; missing node rank(s) {', '.join(map(str, missing))}. Start the same "
                    f"command with NODE_RANK {', '.join(map(str, missing))} and HEAD_IP {spec.head_ip} on them, and "
                    f"check that they reach {self.ip}:{spec.port} over TCP (firewall; HEAD_IP is this node's address "
                    "as they see it) and run the same model; WEIGHTSYNC_NODE_TIMEOUT_S sets this deadline")
            time.sleep(0.5)

    def close(self, outcome: str) -> None:
        """End the job for every node, wait for the workers to leave, stop this node's Ray."""
        if self._connected:
            import ray

            try:
                if self._job is not None:
                    ray.get(self._job.finish.remote(outcome), timeout=10)
                    self._wait_workers_left()
            except Exception as exc:  # the cluster is being torn down anyway; say why it was not clean
                log.warning("the workers were not told that the job ended: %s", exc)
            _shutdown_ray()
            self._connected = False
        if self._node is not None:
            self._node.stop(copy_logs_to=self.log_dir / "ray_node0")
            self._node = None

    def _wait_workers_left(self) -> None:
        end = time.monotonic() + LEAVE_TIMEOUT_S
        while time.monotonic() < end:
            left = sorted(r for r in joined_nodes() if r != 0)
            if not left:
                return
            time.sleep(0.5)
        log.warning("node rank(s) %s did not leave within %.0f s of the job's end", left, LEAVE_TIMEOUT_S)


# -- a worker ---------------------------------------------------------------------------------------


def run_worker(spec: ClusterSpec, *, run: dict[str, str] | None = None, runs_here: str = "",
               say: Callable[[str], None] = print) -> int:
    """Node rank >= 1: join the head, stay until the job ends, leave.

    Args:
        spec: this node's part.
        run: what this node was started for (``{"model": ...}``): the head's job must be the same.
        runs_here: what the run places on this node (for the first message).
        say: where progress lines go.

    Returns:
        0 when the job ran to its end on the head (its validation is the head's to report), 1 when
        it failed there or the head went away first.

    Raises:
        ClusterError: no head within the deadline, this node's Ray failed to start, or the head
            runs another job than ``run``.
    """
    head = resolve_ip(spec.head_ip)
    ip = address_toward(head, spec.port)
    say(f"node {spec.node_rank} of {spec.num_nodes} ({ip}): joining the Ray head at {head}:{spec.port}"
        + (f"; it runs {runs_here} here" if runs_here else "") + "; staying until the job ends")
    end = time.monotonic() + spec.timeout_s
    while not reachable(head, spec.port, 1.0):
        if time.monotonic() > end:
            raise ClusterError(f"no Ray head at {head}:{spec.port} within {spec.timeout_s:.0f} s: start node rank 0 "
                               f"(HEAD_IP {spec.head_ip}), check that this node reaches it over TCP port {spec.port} "
                               "(firewall) and that WEIGHTSYNC_RAY_PORT is the same on every node")
        time.sleep(0.5)
    node = RayNode.start(rank=spec.node_rank, ip=ip, head=spec)
    log_dir: Path | None = None
    try:
        node.wait_up(lambda: node.logs_dir() is not None and (node.logs_dir() / "raylet.out").exists())
        _connect(spec, ip, node.temp_dir)
        state = _wait_for_job_end(spec, head, node, dict(run or {}))
    except _HeadLost as exc:
        say(f"node {spec.node_rank}: {exc}; stopping this node's Ray processes")
        node.stop(graceful=False)
        return 1
    except BaseException:
        _shutdown_ray(5.0)
        node.stop(graceful=False)
        raise
    log_dir = Path(state["log_dir"]) if state.get("log_dir") else None
    _shutdown_ray()
    node.stop(copy_logs_to=log_dir / f"ray_node{spec.node_rank}" if log_dir is not None else None)
    outcome = state.get("outcome", "")
    say(f"node {spec.node_rank}: the job ended on the head ({outcome or 'no outcome given'}); "
        + (f"logs of this node under {log_dir}; " if log_dir is not None else "") + "left the cluster")
    return 0 if outcome == FINISHED else 1


class _HeadLost(Exception):
    """The head went away before the job ended."""


def _wait_for_job_end(spec: ClusterSpec, head: str, node: RayNode, run: dict[str, str]) -> dict[str, Any]:
    """Poll the head's job actor until the job ends; raise :class:`_HeadLost` when the head goes,
    :class:`ClusterError` when it runs another job than ``run``."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    job = None
    refused_since: float | None = None
    while True:
        if not node.alive():
            raise ClusterError(f"node {spec.node_rank}: this node's Ray processes exited:\n{node.tail()}")
        if reachable(head, spec.port, 1.0):
            refused_since = None
        else:
            refused_since = refused_since or time.monotonic()
            if time.monotonic() - refused_since > HEAD_LOST_AFTER_S:
                raise _HeadLost(f"the head {head}:{spec.port} went away mid-job (its Ray port refuses connections)")
            time.sleep(0.5)
            continue
        if job is None:
            with contextlib.suppress(ValueError):  # not created yet
                job = ray.get_actor(JOB_ACTOR, namespace=NAMESPACE)
        if job is not None:
            try:
                state = ray.get(job.get.remote(), timeout=10)
            except GetTimeoutError:
                continue
            except RayActorError:
                raise _HeadLost("the head's run exited without ending the job (its driver is gone)") from None
            theirs = state.get("run", {})
            differ = {k: (theirs.get(k), v) for k, v in run.items() if theirs.get(k) != v}
            if differ:
                raise ClusterError(f"node {spec.node_rank}: the head runs " + ", ".join(
                    f"{k} {a!r}" for k, (a, _) in differ.items()) + "; this node was started for " + ", ".join(
                    f"{k} {b!r}" for k, (_, b) in differ.items()) + ": start every node with the same command")
            if state.get("state") == "done":
                return state
        time.sleep(1.0)


__all__ = ["ClusterError", "HeadCluster", "RayNode", "interface_of", "local_addresses", "node_resource", "run_worker"]
