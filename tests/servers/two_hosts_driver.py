"""The driver of the two-host test, in its own process (the test process may hold another Ray
cluster): a Ray head on HOST_IP with one CPU, a raylet started inside namespace NS at PEER_IP,
and a world of one replica on each, built as elastic/run/driver.py builds it. Prints one JSON line.

    python -m tests.servers.two_hosts_driver NS HOST_IP PEER_IP OVERRIDES_JSON
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(ns: str, host_ip: str, peer_ip: str, overrides: dict) -> dict:
    from elastic.run.cluster import light_nodes, quiet_ray_env

    quiet_ray_env()
    import ray
    from ray.cluster_utils import Cluster

    from elastic.train.world import Loss, World
    from tests.conftest import tiny_recipe

    t0 = time.monotonic()
    with light_nodes():   # as elastic starts a cluster of its own: no dashboard, no node agents
        cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args={
            "num_cpus": 1, "num_gpus": 0, "include_dashboard": False, "node_ip_address": host_ip,
            "object_store_memory": 80 * 1024 * 1024,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}})
    peer = None
    world = None
    try:
        ray.init(address=cluster.address, _node_ip_address=host_ip, logging_level="ERROR", log_to_driver=False)
        # The second host: a raylet in the namespace, dialling the head over the veth link (`ray
        # start`, light, as elastic.run.cluster starts a network lab's hosts).
        peer = __import__("subprocess").Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "elastic.run.cluster", "start", "--block",
             "--address", cluster.address, "--node-ip-address", peer_ip, "--num-cpus", "1", "--num-gpus", "0",
             "--object-store-memory", str(80 * 1024 * 1024), "--disable-usage-stats"],
            stdout=sys.stderr, stderr=sys.stderr, env=os.environ)
        deadline = time.monotonic() + 60
        while len(alive := {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the namespace's raylet did not join: {alive}")
            time.sleep(0.1)   # polling the cluster's membership with a deadline
        formed_s = time.monotonic() - t0
        world = World(tiny_recipe(**{"world.replicas": 2, **overrides}))
        t1 = time.monotonic()
        world.add_replicas([("host", alive[host_ip]), ("peer", alive[peer_ip])])
        happened, steps = world.take_events(), []
        while not world.done():
            res, in_step = world.run_step()
            happened += in_step
            steps.append(None if res is None else sorted(res.replicas))
            if res is None or not res.replicas:
                break
        states = {rid: world.call_replica(rep, "full_state")[0] for rid, rep in world.replicas.items()}
        same = len(states) == 2 and all(
            (a == b).all().item() for a, b in zip(*(list(s.values()) for s in states.values())))
        return {"steps": steps, "lost": [(x.replica_id, x.reason, x.phase) for x in happened if isinstance(x, Loss)],
                "replicas_on": {rid: rep.instance_id for rid, rep in world.replicas.items()},
                "identical_theta": same, "cluster_s": round(formed_s, 2),
                "train_s": round(time.monotonic() - t1, 2)}
    finally:
        if world is not None:
            world.shutdown()
        ray.shutdown()
        if peer is not None:
            peer.kill()
            peer.wait()
        cluster.shutdown()


if __name__ == "__main__":
    try:
        out = main(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    print(json.dumps(out), flush=True)
