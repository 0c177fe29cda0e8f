"""The `local` provider: "VMs" are Ray nodes on this machine, priced by a simulated market.

Renting adds a raylet to the local cluster, labelled with cloud/region/zone/instance id;
terminating removes it (its raylet and actors die for real). Prices are the recipe's
`local.instance_types` figures.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

from providers.base import Instance, Notice, Offer

log = logging.getLogger(__name__)


class LocalProvider:
    """Args:
        section: the recipe's `local` section.
        cluster: the `elastic.cluster.LocalCluster` nodes are added to.
        ranks_per_replica: CPUs each node needs at least (one per rank).
    """

    name = "local"

    def __init__(self, section, cluster, ranks_per_replica: int = 1):
        self._section = section
        self._cluster = cluster
        self._ranks = ranks_per_replica
        self._instances: dict[str, Instance] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def offers(self, resources) -> list[Offer]:
        now = time.time()
        regions = set(resources.regions)
        out = []
        for it in self._section.instance_types:
            if regions and it.region not in regions:
                continue
            usd = it.spot_usd_per_hour if resources.spot else it.on_demand_usd_per_hour
            if resources.max_usd_per_hour is not None and usd > resources.max_usd_per_hour:
                continue
            out.append(Offer(cloud="local", region=it.region, zone=it.zone, instance_type=it.name, gpu="", gpus=0,
                             cpus=max(it.cpus, self._ranks), spot=resources.spot, usd_per_hour=usd,
                             on_demand_usd_per_hour=it.on_demand_usd_per_hour, read_at=now))
        return sorted(out, key=lambda o: o.usd_per_hour)

    def launch(self, offer: Offer, run: str, role: str) -> Instance:
        with self._lock:
            instance_id = f"local-{next(self._ids):04d}"
        labels = {"elastic.cloud": "local", "elastic.region": offer.region, "elastic.zone": offer.zone,
                  "elastic.instance_type": offer.instance_type, "elastic.instance_id": instance_id,
                  "elastic.run": run, "elastic.role": role}
        node_id = self._cluster.add_node(cpus=offer.cpus, gpus=0, labels=labels, resources={},
                                         object_store_bytes=self._section.object_store_bytes)
        inst = Instance(instance_id=instance_id, offer=offer, run=run, role=role, launched_at=time.time(),
                        ray_node_id=node_id, labels=labels)
        with self._lock:
            self._instances[instance_id] = inst
        return inst

    def terminate(self, instance_id: str) -> None:
        with self._lock:
            inst = self._instances.pop(instance_id, None)
        if inst is not None:
            self._cluster.remove_node(inst.ray_node_id)

    def list_instances(self, run: str) -> list[Instance]:
        with self._lock:
            return [i for i in self._instances.values() if i.run == run]

    def notices(self) -> list[Notice]:
        return []
