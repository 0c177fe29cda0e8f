"""The Ray cluster a run drives: started here (a head on this machine) or joined (`--address`).

Local "VMs" are extra raylets on this machine: each one is a real Ray node with its own
resources and labels, and removing it kills its raylet and every actor on it, as a preemption
would. Ray's own `ray.cluster_utils.Cluster` does the same for Ray's tests; we start nodes the
same way so that an external head (`--address`) can be given nodes too.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"

# No phoning home, no dashboard, quiet workers: set before ray is imported anywhere. Ray starts
# its workers at niceness 15 (`worker_niceness`) to keep the raylet responsive; here the workers
# are the ranks, the node's whole workload: at 15 any process at the default priority (another
# job, a test worker, a busy driver) takes ~30 times their CPU share (on 2 busy cores a replica's
# setup took 105 s instead of 3.8 s). They run at the default priority, as the raylet does.
_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
            "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "RAY_worker_niceness": "0"}


def quiet_ray_env() -> None:
    for k, v in _RAY_ENV.items():
        os.environ.setdefault(k, v)


@contextmanager
def _keep_signal_handlers():
    """ray.init and every raylet Ray starts in this process install SIGTERM/SIGINT handlers (exit,
    or drain-and-hang). The driver's own handlers decide what a signal does: release every node and
    write the report. Restore them after Ray is done installing its own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in saved.items():
            if h is not None:
                signal.signal(s, h)


@contextmanager
def _users_ray_address_kept():
    """Ray's `Cluster` points this machine's "current cluster" file (`<ray temp dir>/ray_current_cluster`,
    what `ray.init()` and `ray status` without an address connect to) at the head it starts, saying
    so on the console when the file named another, and deletes the file when it shuts down: a
    cluster the user started with `ray start` would lose its pointer to a run. The cluster elastic
    starts serves only its run (the driver passes its address everywhere): the file is left alone."""
    try:
        from ray._common import utils as common_utils
        from ray._private import utils as private_utils
        write, reset = private_utils.write_ray_address, common_utils.reset_ray_address
    except (ImportError, AttributeError):   # another Ray: its own behaviour
        yield
        return
    private_utils.write_ray_address = lambda *args, **kwargs: None
    common_utils.reset_ray_address = lambda *args, **kwargs: None
    try:
        yield
    finally:
        private_utils.write_ray_address, common_utils.reset_ray_address = write, reset


@contextmanager
def light_nodes(zygote: str | None = None):
    """Nodes started inside this block run no dashboard and no node agents, and start their Python
    workers through `start_worker.py` (an exec, not Ray's `setup_worker.py`); with `zygote` (the
    socket of a `Zygote` on this machine), forked from it.

    A cluster elastic starts serves only its run: no runtime_env, no dashboard (`elastic status`
    reads the ledger), no metrics. Ray still starts, per node, a dashboard agent and a runtime env
    agent (the raylet waits for their ports before it joins), and on the head an API server it
    waits for: ~1 s of CPU each and most of a node's start on 2 cores. Here each raylet is told to
    run `elastic/run/idle_agent.py` as both agents (it reports their ports as not served and lives as
    long as the raylet), and the head's API server is not started. Ray offers no switch for
    either, so its process launcher is wrapped for the duration (callers hold the start lock).
    Nor does it ask whether the dashboard's dependencies import (`get_dashboard_dependency_error`,
    which imports aiohttp and more, ~0.4 CPU-s per node started, only to add `--minimal` to the
    agent command replaced here). A Ray whose raylets do not take their agents' ports from port
    files gets its full nodes."""
    from ray._private import ray_constants, services
    from ray._private import utils as ray_utils

    try:
        from ray._raylet import (DASHBOARD_AGENT_LISTEN_PORT_NAME, METRICS_AGENT_PORT_NAME,
                                 METRICS_EXPORT_PORT_NAME, RUNTIME_ENV_AGENT_PORT_NAME, persist_port)  # noqa: F401
    except ImportError:   # an older Ray: its agents register over RPC, which the stand-in cannot
        yield
        return

    agents = {"--dashboard_agent_command=": (METRICS_AGENT_PORT_NAME, METRICS_EXPORT_PORT_NAME,
                                             DASHBOARD_AGENT_LISTEN_PORT_NAME),
              "--runtime_env_agent_command=": (RUNTIME_ENV_AGENT_PORT_NAME,)}
    start_process, start_api_server = services.start_ray_process, services.start_api_server
    dashboard_deps = ray_utils.get_dashboard_dependency_error

    def start_ray_process(command, process_type, *args, **kwargs):
        if process_type == ray_constants.PROCESS_TYPE_RAYLET:
            flags = dict(a.split("=", 1) for a in command if a.startswith("--") and "=" in a)
            idle = [sys.executable, "-S", _IDLE_AGENT, f"--session-dir={flags['--session_dir']}",
                    f"--node-id={flags['--node_id']}"]
            command = [next((f"{flag}{subprocess.list2cmdline([*idle, '--ports=' + ','.join(ports)])}"
                             for flag, ports in agents.items() if a.startswith(flag)), a) for a in command]
            command = [_light_worker_command(a, zygote) for a in command]
        return start_process(command, process_type, *args, **kwargs)

    services.start_ray_process = start_ray_process
    services.start_api_server = lambda *args, **kwargs: ("", None)   # what Ray returns for "no dashboard"
    ray_utils.get_dashboard_dependency_error = lambda: None   # no dashboard, nor its agent, to start
    try:
        yield
    finally:
        services.start_ray_process, services.start_api_server = start_process, start_api_server
        ray_utils.get_dashboard_dependency_error = dashboard_deps


_IDLE_AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "idle_agent.py")
_START_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "start_worker.py")
_ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
_WORKER_FLAG = "--python_worker_command="


def _light_worker_command(arg: str, zygote: str | None) -> str:
    """The raylet's `--python_worker_command=` with `start_worker.py` in place of Ray's
    `setup_worker.py` (which it runs where the worker needs more than an exec), told the `zygote`
    socket if any; any other argument, or a command of another shape, as it is."""
    if not arg.startswith(_WORKER_FLAG):
        return arg
    parts = arg[len(_WORKER_FLAG):].split(" ", 2)
    if len(parts) < 3 or parts[0] != sys.executable or not parts[1].endswith(os.sep + "setup_worker.py"):
        return arg
    light = subprocess.list2cmdline([sys.executable, "-S", _START_WORKER, f"--setup-worker={parts[1]}",
                                     *([f"--zygote={zygote}"] if zygote else [])])
    return f"{_WORKER_FLAG}{light} {parts[2]}"


class Zygote:
    """`zygote.py` beside a cluster of nodes on this machine's own network: started before the
    head (its imports overlap the cluster's start), stopped with the cluster."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        self._dir = tempfile.mkdtemp(prefix="elastic-zygote-")
        self.socket = os.path.join(self._dir, "socket")
        self._workers = os.path.join(self._dir, "workers")
        os.mkdir(self._workers)
        self._log = open(os.path.join(self._dir, "zygote.log"), "ab")
        self._proc = subprocess.Popen([sys.executable, _ZYGOTE, f"--dir={self._dir}", f"--parent={os.getpid()}",
                                       *([f"--preload={','.join(preload)}"] if preload else [])],
                                      stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log)

    def workers_of(self, pids: list[int]) -> list[int]:
        """The workers it forked for those of `pids` that are `start_worker.py` stand-ins."""
        from elastic.run.zygote import workers_of

        return workers_of(self._workers, pids)

    def stop(self) -> None:
        """End it (the workers it forked are the raylets' to stop) and remove its directory (it
        removes it itself when it ends on SIGTERM, as when this process dies)."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc.wait()
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; the local provider runs where Ray's raylets run)."""
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_children(node, zygote: Zygote | None) -> list[int]:
    """SIGKILL every process the node's raylet started (its worker processes and agents), and the
    workers `zygote` forked for them; returns pidfds of those it killed (`_wait_gone`)."""
    from ray._private import ray_constants

    below = [child for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])
             for child in _descendants(info.process.pid)]
    return _kill_all((zygote.workers_of(below) if zygote is not None else []) + below)


def _session_processes(session_dir: str) -> list[int]:
    """Every process but this one whose command line names the Ray session directory (its GCS,
    raylets, agents and workers)."""
    marker = session_dir.encode()
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if marker in f.read():
                        out.append(int(entry.name))
            except OSError:
                continue
    return out


def _kill_all(pids: list[int]) -> list[int]:
    """SIGKILL each process; returns pidfds of those it killed (`_wait_gone`)."""
    killed = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:   # gone already
            continue
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)   # this process, even if its pid was reused since
        except ProcessLookupError:   # it exited and was reaped after the open: gone too
            os.close(fd)
            continue
        killed.append(fd)
    return killed


def _wait_gone(pidfds: list[int], timeout_s: float = 10.0) -> None:
    """Wait until every process behind `pidfds` has exited, and close them. A SIGKILLed process
    runs on until the kernel has torn it down, which on a busy machine takes a moment: a node
    removed here is gone when its removal returns."""
    import select

    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)   # readable once the process has exited
    deadline = time.monotonic() + timeout_s
    left = set(pidfds)
    while left and (remaining_s := deadline - time.monotonic()) > 0:
        for fd, _ in poller.poll(remaining_s * 1000):
            poller.unregister(fd)
            left.discard(fd)
    for fd in pidfds:
        os.close(fd)


def ray_messages_log() -> logging.Logger:
    """The logger of Ray's cluster messages: outside `elastic.*` (so not in the run's driver.log),
    written to `driver_messages.log` in the Ray session's log directory once the cluster runs."""
    ray_log = logging.getLogger("ray_driver_messages")
    ray_log.propagate = False
    ray_log.setLevel(logging.INFO)
    return ray_log


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a `ray start` process, everything below it and its process group; reap it."""
    for pid in [*_descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"


def _route_ray_messages() -> None:
    """Ray's driver prints cluster messages (a node marked dead, a raylet's last log lines) straight
    to stdout. For elastic a dead node is the normal path, and the terminal shows our own view: send
    them to Ray's own log directory instead (`ray_messages_log`)."""
    import ray._private.worker as ray_worker

    ray_log = ray_messages_log()

    def to_log(data, ignore_prefix=False):
        for line in data.get("lines", []):
            ray_log.info("%s: %s", data.get("pid", "ray"), str(line).strip())

    ray_worker.print_to_stdstream = to_log


def _joined_node_ip(address: str) -> str | None:
    """The address this driver joins a head at `address` from: the head's own where it is a
    loopback one (a head started with `--node-ip-address=127.0.0.1`: a driver that took this
    machine's outward address would wait forever for a raylet there), else the one Ray picks."""
    import ipaddress

    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return host if ipaddress.ip_address(host).is_loopback else None
    except ValueError:   # a name, or "auto"
        return "127.0.0.1" if host == "localhost" else None


class LocalCluster:
    """A Ray cluster on this machine that local nodes can be added to and removed from.

    Args:
        address: GCS address of an existing cluster to join; None starts a head here.
        head_cpus: CPUs the head offers (0: the head runs only the driver).
        node_ip: the head's address (loopback, or its overlay address in a network lab); with
            `address`, taken from it (`_joined_node_ip`).
        network: the run's network lab (`Provider.start_network`: `local.network`), if any: stopped with the cluster.
        preload: modules the zygote imports besides torch's and elastic's own (`zygote.recipe_modules`).
    """

    def __init__(self, address: str | None = None, head_cpus: int = 0, node_ip: str = LOOPBACK,
                 network=None, preload: tuple[str, ...] = ()):
        # Nodes on this machine's own network fork their workers from one process that imported
        # torch once (`Zygote`); a network lab's hosts are other namespaces, started as VMs are.
        # It starts first: its imports are the longest part of a local launch's way to its first
        # step, and overlap Ray's import and the cluster's start.
        self._zygote = Zygote(preload) if address is None and node_ip == LOOPBACK else None
        try:
            self._init(address, head_cpus, node_ip, network)
        except BaseException:
            if self._zygote is not None:
                self._zygote.stop()
            raise
        atexit.register(self._kill_nodes)

    def _init(self, address: str | None, head_cpus: int, node_ip: str, network) -> None:
        quiet_ray_env()
        self.network = network
        if address is not None:
            # A user's head: joined from its own address where that is a loopback one (`ray start
            # --head --node-ip-address=127.0.0.1`), else from the one Ray picks (None).
            node_ip = _joined_node_ip(address)
        loopback = node_ip == LOOPBACK if address is None else node_ip is not None
        if loopback:
            # Keep a local cluster on loopback: otherwise Ray rewrites 127.0.0.1 to the address
            # this machine would use to reach the internet (and a driver joining a loopback head
            # dials a GCS that is not there). Despite its name, this switch only changes how Ray
            # picks the local IP (multi-node clusters on one machine still work); the constant is
            # set too in case ray was imported before us.
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray
        from ray._private import ray_constants
        from ray.cluster_utils import Cluster

        if loopback:
            ray_constants.ENABLE_RAY_CLUSTER = False

        self._ray = ray
        self._cluster = None
        self.node_ip = node_ip
        self._nodes: dict[str, object] = {}
        # Nodes of a cluster we start serve only this run: they start light (`light_nodes`). A
        # joined cluster (`--address`) is the user's: its nodes get Ray's full set of agents.
        self._light = address is None
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        with _keep_signal_handlers():
            self._start(address, head_cpus, Cluster)

    def _start(self, address, head_cpus, Cluster) -> None:
        ray = self._ray
        _route_ray_messages()
        if address is not None and ":" not in address and address != "auto":
            raise ValueError(f"--address {address!r}: expected HOST:PORT of a Ray head")
        if address is None:
            with light_nodes(), _users_ray_address_kept():
                self._start_head(Cluster, head_cpus)
            self.address = self._cluster.address
        else:
            self.address = address
        ray.init(address=self.address, logging_level=logging.ERROR, log_to_driver=False,
                 _node_ip_address=self.node_ip)
        self.gcs_address = ray.get_runtime_context().gcs_address
        # Every process of this cluster carries this directory on its command line.
        self.session_dir = ray._private.worker._global_node.get_session_dir_path()
        ray_log = ray_messages_log()
        for h in list(ray_log.handlers):   # an earlier cluster of this process: its session is over
            ray_log.removeHandler(h)
            h.close()
        ray_log.addHandler(logging.FileHandler(os.path.join(self.session_dir, "logs", "driver_messages.log")))

    def _start_head(self, Cluster, head_cpus: int) -> None:
        self._cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args={
            "num_cpus": head_cpus, "num_gpus": 0, "include_dashboard": False,
            "node_ip_address": self.node_ip, "object_store_memory": 100 * 1024 * 1024,
            # The driver reads no worker output (log_to_driver=False), nothing autoscales this
            # cluster and nobody scrapes Prometheus here: no log monitor, no autoscaler monitor,
            # and no metrics export from any node's processes (each costs CPU all run long).
            "include_log_monitor": False, "no_monitor": True,
            # Notice a node that died without a word within ~1.5 s, not Ray's default ~15 s.
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                               "enable_metrics_collection": False}})

    def add_node(self, cpus: int, gpus: int, labels: dict[str, str], resources: dict[str, float],
                 object_store_bytes: int, timeout_s: float = 60.0, netns: str | None = None,
                 node_ip: str | None = None) -> str:
        """Start a raylet with these resources and labels; returns its Ray node id once alive.
        With `netns`, the raylet runs inside that network namespace at `node_ip` (a host of a
        network lab, reaching the head over the overlay)."""
        if netns is not None:
            return self._add_node_in(netns, node_ip, cpus, gpus, labels, resources, object_store_bytes,
                                     timeout_s)
        from ray._private.node import Node
        from ray._private.parameter import RayParams

        params = RayParams(num_cpus=cpus, num_gpus=gpus, resources=resources, labels=labels,
                           object_store_memory=object_store_bytes, gcs_address=self.gcs_address,
                           node_ip_address=LOOPBACK, include_log_monitor=False, node_manager_port=0,
                           min_worker_port=0, max_worker_port=0)
        params.dashboard_agent_listen_port = None
        # shutdown_at_exit=False: Ray would install a SIGTERM handler (main thread only, and it
        # exits without our cleanup); this object stops its nodes itself (shutdown, atexit).
        # One raylet starts at a time: Ray's node startup is not thread-safe within a process.
        with (self._start_lock, _keep_signal_handlers(),
              light_nodes(self._zygote and self._zygote.socket) if self._light else nullcontext()):
            node = Node(params, head=False, shutdown_at_exit=False, spawn_reaper=True)
        node_id = node.node_id
        with self._lock:
            self._nodes[node_id] = node
        self._wait_alive(node_id, timeout_s)
        return node_id

    def _add_node_in(self, netns: str, node_ip: str, cpus: int, gpus: int, labels: dict[str, str],
                     resources: dict[str, float], object_store_bytes: int, timeout_s: float) -> str:
        """`ray start --block` inside `netns`, as a VM's bootstrap runs it; the process group is
        this node's handle (removing the node kills it; the lab then clears the namespace)."""
        import json
        import subprocess

        # `ray start`, light where the cluster is ours (`python -m elastic.run.cluster`: the same CLI).
        ray_start = [sys.executable, "-m", "elastic.run.cluster"] if self._light else ["ray"]
        cmd = ["ip", "netns", "exec", netns, *ray_start, "start", "--block", f"--address={self.gcs_address}",
               f"--node-ip-address={node_ip}", f"--num-cpus={cpus}", f"--num-gpus={gpus}",
               f"--resources={json.dumps(resources)}", f"--object-store-memory={object_store_bytes}",
               "--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()),
               "--disable-usage-stats", "--include-log-monitor=false"]
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
        log_path = os.path.join(self.session_dir, "logs", f"ray-start-{netns}.log")
        # One node starts at a time until it has joined: nodes on one machine share the session
        # directory, and two starting at once pick the same socket and log names.
        with self._start_lock, open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True)
            deadline = time.monotonic() + timeout_s
            while True:
                node_id = next((n["NodeID"] for n in self._ray.nodes()
                                if n["Alive"] and n["NodeManagerAddress"] == node_ip), None)
                if node_id is not None:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    _kill_group(proc)
                    raise TimeoutError(f"node in {netns} did not join the cluster within {timeout_s:.0f} s"
                                       + (f" (ray start exited {proc.returncode}: {_last_line(log_path)})"
                                          if proc.returncode else ""))
                time.sleep(0.1)   # polling the GCS for the new node, bounded by timeout_s
        with self._lock:
            self._nodes[node_id] = proc
        return node_id

    def _wait_alive(self, node_id: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_alive(node_id):
            if time.monotonic() > deadline:
                self.remove_node(node_id)
                raise TimeoutError(f"local node did not join the cluster within {timeout_s:.0f} s")
            time.sleep(0.05)

    def is_alive(self, node_id: str) -> bool:
        return any(n["NodeID"] == node_id and n["Alive"] for n in self._ray.nodes())

    def remove_node(self, node_id: str, graceful: bool = True) -> None:
        """Stop the node's raylet and every worker process on it (idempotent). `graceful=False`
        kills them outright, as a hard preemption does."""
        with self._lock:
            node = self._nodes.pop(node_id, None)
        if node is None:
            return
        # Everything the raylet started goes first: a reclaimed VM's workers (actors) die with it
        # rather than answering on, and the node's agents cannot report the raylet's end as a
        # crash into the driver's terminal. Actors on a node being released were killed already.
        if isinstance(node, subprocess.Popen):
            _kill_group(node)   # `ray start` in a namespace: its session holds every process
            return
        children = _kill_children(node, self._zygote)
        node.kill_all_processes(check_alive=False, allow_graceful=graceful, wait=True)
        _wait_gone(children)

    def _kill_nodes(self) -> None:
        for node_id in list(self._nodes):
            self.remove_node(node_id, graceful=False)
        if self._zygote is not None:
            self._zygote.stop()
        if self.network is not None:
            self.network.down()

    def shutdown(self) -> None:
        """Remove every node this object started, disconnect, and stop the head if we started it."""
        for node_id in list(self._nodes):
            self.remove_node(node_id)
        self._ray.shutdown()
        if self._cluster is not None:
            with _users_ray_address_kept():
                self._cluster.shutdown()
            self._cluster = None
            # A process of this session can outlive its raylet for a moment: one the raylet was
            # starting as its node was removed, an agent that dies with it only once the kernel
            # says so. The cluster is ours: none of its processes is left when this returns.
            _wait_gone(_kill_all(_session_processes(self.session_dir)))
        if self._zygote is not None:
            self._zygote.stop()
        if self.network is not None:
            self.network.down()


if __name__ == "__main__":
    # `python -m elastic.run.cluster start ...` is Ray's `ray start` with its node started light
    # (`light_nodes`): how a network lab's hosts join a cluster elastic started.
    from ray.scripts.scripts import main

    with light_nodes():
        main()
