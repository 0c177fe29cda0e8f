"""The driver of the two-region test, in its own process (the test process may hold another Ray
cluster): recipes/local-two-regions.yaml run by the real driver over its network lab, with one
hard preemption of the region-b node at outer step 2. Prints one JSON line.

    python -m tests.servers.two_regions_driver RUN_DIR OVERRIDES_JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main(run_dir: str, overrides: dict) -> dict:
    from elastic.net import linkprobe
    from elastic.recipe.model import load_recipe
    from elastic.run.cluster import LocalCluster
    from elastic.run.driver import run_attached
    from providers.local.provider import LocalProvider

    linkprobe.DURATION_S = 0.5   # a short link measurement: the machine is shared
    recipe = load_recipe(REPO / "recipes" / "local-two-regions.yaml", [f"{k}={v}" for k, v in overrides.items()])
    network = LocalProvider.start_network(recipe)
    cluster = LocalCluster(node_ip=network.head_ip, network=network)
    out = {"tag": network.tag}
    try:
        before = network.lab.internet_counters()
        preempted = {}

        def faults(driver, phase, members):
            if preempted or phase != "inner" or driver.world.outer_step < 2:
                return
            for rid in members:
                inst = driver.world.replicas[rid].instance_id
                member = driver.provider.overlay_member(inst)
                if member is not None and member.host.region == "region-b":
                    preempted.update(instance=inst, key=member.iface.public_key)
                    driver.provider.preempt(inst, notice=False)
                    return

        status, events = run_attached(recipe, cluster, Path(run_dir), on_phase=faults, run_name="two-regions")
        after = network.lab.internet_counters()
        out.update(status=status, preempted=preempted.get("instance"),
                   counters={k: {m: after[k][m] - before[k][m] for m in after[k]} for k in after},
                   key_still_known=[m.overlay_ip for m in network.members()
                                    if preempted.get("key") in m.iface.peers()],
                   members=len(network.members()))
    finally:
        cluster.shutdown()
    out["left"] = network.lab.namespaces()
    return out


if __name__ == "__main__":
    try:
        result = main(sys.argv[1], json.loads(sys.argv[2]))
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    print(json.dumps(result), flush=True)
