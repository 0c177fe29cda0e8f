"""Stand-in for a Ray node's agents (dashboard agent, runtime env agent) on a cluster elastic starts.

Every raylet starts both agents and waits for the ports they report before it joins the cluster;
each agent imports aiohttp, grpc and the dashboard modules: ~1 s of CPU and ~1 s of waiting per
node on a 2-core machine, for services a run does not use (no runtime_env, no dashboard: `elastic
status` reads the run's ledger). `elastic.run.cluster` has the raylets it starts run this file instead:

    python -S idle_agent.py --session-dir=DIR --node-id=HEX --ports=NAME[,NAME...]

It reports every named port as -1 ("not served", what Ray's own minimal agent reports for the
services it leaves out), then lives exactly as long as its raylet (the raylet fate-shares with its
agents: an agent that exits takes the node down). A run file, not a module: stdlib only, started
with -S so it costs a few milliseconds.
"""

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _report(session_dir: str, node_id: str, name: str) -> None:
    """Write the port file the raylet waits for (Ray's `persist_port` layout: `NAME_NODEID`)."""
    path = os.path.join(session_dir, f"{name}_{node_id}")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write("-1")
    os.replace(tmp, path)   # the raylet never reads a half-written file


def main(argv: list[str]) -> None:
    args = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    # Die with the raylet, whatever kills it (SIGKILL of a preempted node included).
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    raylet_pid = int(os.environ.get("RAY_RAYLET_PID", "0") or 0)
    if raylet_pid and os.getppid() != raylet_pid:
        return   # the raylet died before we could follow it
    for name in args["ports"].split(","):
        _report(args["session-dir"], args["node-id"], name)
    while True:
        signal.pause()


if __name__ == "__main__":
    main(sys.argv[1:])
