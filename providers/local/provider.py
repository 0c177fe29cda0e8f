"""The `local` provider: "VMs" are Ray nodes on this machine, priced by a simulated spot market.

Renting adds a raylet to the local cluster, labelled with cloud/region/zone/instance id;
terminating removes it. A preemption (drawn by the market, or asked for with `preempt`) kills the
raylet and every process on it at once, as a reclaimed VM would; with a notice, the kill comes
`notice_s` (scaled by the market's time compression) after the notice.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

from providers.base import BaseProvider, CapacityError, Instance, NodeEvent, NodeEventKind, Offer
from providers.local.config import LocalSection, MarketSection
from providers.simmarket import SimMarket

log = logging.getLogger(__name__)

TICK_S = 0.1


def check_accelerator(resources) -> None:
    """The simulated market stands in for the real clouds: `resources.accelerators` must name a GPU
    one of them offers (UserError otherwise), though local nodes carry none."""
    from elastic.errors import UserError
    from providers import PROVIDERS, provider_class

    if not resources.accelerators:
        return
    model = resources.accelerators.partition(":")[0]
    known = sorted({m for name in PROVIDERS if name != "local" for m in provider_class(name).accelerator_models()})
    if model.upper() not in {m.upper() for m in known}:
        raise UserError(f"resources.accelerators: no cloud offers {model!r}; known: {', '.join(known)}")


def gpu_problems(instance_types, regions) -> list[str]:
    """`local.instance_types` (in `regions`, all when empty) that offer more GPUs than torch sees
    on this machine, one line each (torch is imported only when a type offers a GPU)."""
    wanting = [it for it in instance_types if it.gpus and (not regions or it.region in regions)]
    if not wanting:
        return []
    import torch

    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    have = f"torch {torch.__version__} sees {seen or 'no'} CUDA device{'' if seen == 1 else 's'} on this machine"
    return [f"local.instance_types: {it.name} offers {it.gpus} GPU(s) but {have}; set its gpus to 0 "
            "(or run on a machine with the GPUs and a CUDA build of torch)" for it in wanting if it.gpus > seen]


class LocalProvider(BaseProvider):
    """Args:
        recipe: the run's recipe (its `local` section; `world.ranks_per_replica`, the CPUs each
            node needs at least, one per rank).
        cluster: the `elastic.run.cluster.LocalCluster` nodes are added to (None: offers only).
        run_name: the run's name.
    """

    name = "local"
    section = LocalSection
    # The simulated market's default notice, simulated seconds; a run's is its `local.market.notice_s`.
    notice_s = MarketSection.model_fields["notice_s"].default

    @classmethod
    def accelerator_models(cls) -> set[str]:
        """No GPUs: local nodes are CPU processes."""
        return set()

    def __init__(self, recipe, cluster, run_name: str):
        self._section = section = recipe.local
        self._cluster = cluster
        self._ranks = recipe.world.ranks_per_replica
        self.notice_s = section.market.notice_s
        self._instances: dict[str, Instance] = {}
        self._hosts: dict[str, object] = {}   # instance id -> its localnet.Member (local.network)
        self._kill_at: dict[str, float] = {}   # instance id -> unix time of a noticed kill
        self._doom: dict[str, tuple[float, bool]] = {}   # spot instance id -> `SimMarket.preemption`
        self._starting: dict[tuple, int] = {}   # (zone, instance type, spot) -> launches under way
        self._events: list[NodeEvent] = []
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self.market = SimMarket(section.market, section.instance_types, section.capacity)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="local-market", daemon=True)
        self._ticker.start()

    # -- the provider interface ------------------------------------------------------------------

    @classmethod
    def network_problem(cls, recipe) -> str | None:
        """Why this machine cannot build the recipe's `local.network` lab, in one line naming the
        field (needs root, iproute2, nftables, wireguard-tools and wireguard-go); None when it can
        or the recipe asks for no lab."""
        if "local" not in recipe.resources.clouds or recipe.local.network is None:
            return None
        from elastic.net import overlay
        from providers.local import localnet

        missing = overlay.missing_tools()
        reason = localnet.missing_requirements() or (f"missing {', '.join(missing)} (install wireguard-tools and "
                                                     "wireguard-go)" if missing else None)
        return f"local.network: {reason}" if reason else None

    @classmethod
    def start_network(cls, recipe):
        """The run's network lab and overlay when the recipe runs on `local` with `local.network`
        set (None otherwise): each region behind its own NAT router, the driver's host on
        `head_region`'s private network."""
        section = recipe.local
        if "local" not in recipe.resources.clouds or section.network is None:
            return None
        from elastic.errors import UserError
        from providers.local import localnet

        if problem := cls.network_problem(recipe):
            raise UserError(problem)
        regions = dict.fromkeys(it.region for it in section.instance_types)
        links = {r: localnet.Link(**(section.network.links[r].model_dump() if r in section.network.links else {}))
                 for r in regions}
        try:
            return localnet.LocalNetwork(links, section.network.head_region or next(iter(regions)))
        except localnet.LabError as e:
            raise UserError(f"local.network: {e}") from None

    @classmethod
    def clean_orphans_here(cls) -> list[str]:
        """Network namespaces of local runs whose process is gone (`local.network`)."""
        from providers.local import localnet

        return localnet.cleanup_orphans()

    def offers(self, resources) -> list[Offer]:
        check_accelerator(resources)
        now = time.time()
        regions = set(resources.regions)
        out = []
        with self._lock:
            for it in self._section.instance_types:
                if regions and it.region not in regions:
                    continue
                st = self.market.state(it.zone, it.name)
                usd = st.spot_usd_per_hour if resources.spot else st.on_demand_usd_per_hour
                if resources.max_usd_per_hour is not None and usd > resources.max_usd_per_hour:
                    continue
                out.append(Offer(cloud="local", region=it.region, zone=it.zone, instance_type=it.name,
                                 gpu="local" if it.gpus else "", gpus=it.gpus, cpus=max(it.cpus, self._ranks), spot=resources.spot, usd_per_hour=usd,
                                 on_demand_usd_per_hour=st.on_demand_usd_per_hour, read_at=now,
                                 capacity=st.capacity if resources.spot and self._section.market.show_capacity
                                 else None))
        return sorted(out, key=lambda o: o.usd_per_hour)

    def preflight(self, resources) -> list[str]:
        """Nothing to reach on this machine; an accelerator no cloud knows is still an error, and
        so is an instance type with more GPUs than torch sees here (its ranks would fail their
        setup on every node rented)."""
        from elastic.errors import UserError

        try:
            check_accelerator(resources)
        except UserError as exc:
            return exc.lines
        return gpu_problems(self._section.instance_types, resources.regions)

    def launch(self, offer: Offer, run: str, role: str) -> Instance:
        with self._lock:
            cap = self.market.state(offer.zone, offer.instance_type).capacity if offer.spot else None
            # Spot capacity bounds spot VMs only: on-demand ones (a deadline's fallback) take none of it.
            key = (offer.zone, offer.instance_type, offer.spot)
            held = sum(1 for i in self._instances.values()
                       if (i.offer.zone, i.offer.instance_type, i.offer.spot) == key) + self._starting.get(key, 0)
            if cap is not None and held >= cap:
                raise CapacityError(f"{offer.instance_type} in {offer.zone}: no capacity "
                                    f"({'stock-out' if cap == 0 else f'{held}/{cap} held'})")
            self._starting[key] = self._starting.get(key, 0) + 1   # the slot is ours while it starts
            n = next(self._ids)
            instance_id = f"local-{n:04d}"
            # Drawn now, by launch order, as the simulator draws it (`providers.simmarket`).
            doom = self.market.preemption(offer.zone, offer.instance_type, n, self.market.sim_time_s) \
                if offer.spot else None
        labels = {"elastic.cloud": "local", "elastic.region": offer.region, "elastic.zone": offer.zone,
                  "elastic.instance_type": offer.instance_type, "elastic.instance_id": instance_id,
                  "elastic.run": run, "elastic.role": role}
        network, member = self._cluster.network, None
        try:
            if network is not None:
                member = network.add_host(offer.region)
            node_id = self._cluster.add_node(cpus=offer.cpus, gpus=offer.gpus, labels=labels, resources={},
                                             object_store_bytes=self._section.object_store_bytes,
                                             netns=member and member.host.netns,
                                             node_ip=member and member.overlay_ip)
            inst = Instance(instance_id=instance_id, offer=offer, run=run, role=role, launched_at=time.time(),
                            ray_node_id=node_id, labels=labels)
            with self._lock:
                self._instances[instance_id] = inst
                if doom is not None:
                    self._doom[instance_id] = doom
                if member is not None:
                    self._hosts[instance_id] = member
            return inst
        except BaseException:
            if member is not None:
                network.remove_host(member)
            raise
        finally:
            with self._lock:
                self._starting[key] -= 1

    def terminate(self, instance_id: str) -> None:
        with self._lock:
            inst = self._instances.pop(instance_id, None)
            self._kill_at.pop(instance_id, None)
            self._doom.pop(instance_id, None)
        if inst is not None:
            self._cluster.remove_node(inst.ray_node_id)
            self._drop_host(instance_id)

    def overlay_member(self, instance_id: str):
        """The `localnet.Member` a held node sits on in the network lab (None without `local.network`)."""
        with self._lock:
            return self._hosts.get(instance_id)

    def _drop_host(self, instance_id: str) -> None:
        """A released or preempted node's host leaves the network; its key is revoked everywhere."""
        with self._lock:
            member = self._hosts.pop(instance_id, None)
        if member is not None:
            self._cluster.network.remove_host(member)

    def list_instances(self, run: str) -> list[Instance]:
        with self._lock:
            return [i for i in self._instances.values() if i.run == run]

    def find_instances(self, run: str | None) -> list[Instance]:
        """Local "VMs" live in this process only: the ones it holds."""
        with self._lock:
            return [i for i in self._instances.values() if run is None or i.run == run]

    def heartbeat(self, run: str, now_s: float) -> int:
        """Nothing to record: local nodes end with the process that holds them."""
        return 0

    def prices(self, instance_ids) -> dict[str, float]:
        """USD per hour in effect now for each held VM: the market's spot price (on-demand VMs keep theirs)."""
        out = {}
        with self._lock:
            for iid in instance_ids:
                inst = self._instances.get(iid)
                if inst is not None:
                    st = self.market.state(inst.offer.zone, inst.offer.instance_type)
                    out[iid] = st.spot_usd_per_hour if inst.offer.spot else st.on_demand_usd_per_hour
        return out

    def events(self) -> list[NodeEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out

    def close(self) -> None:
        """Stop the market ticker (nodes are released with terminate)."""
        self._stop.set()
        self._ticker.join(timeout=5)

    # -- preemption ------------------------------------------------------------------------------

    def preempt(self, instance_id: str, notice: bool) -> None:
        """Reclaim a node as the cloud would: now (hard), or after the market's notice length."""
        self._reclaim(instance_id, self.market.notice_real_s if notice else None)

    def _reclaim(self, instance_id: str, notice_real_s: float | None) -> None:
        """A notice now and the kill `notice_real_s` real seconds later; None: a hard kill now."""
        now = time.time()
        with self._lock:
            if instance_id not in self._instances or instance_id in self._kill_at:
                return
            self._doom.pop(instance_id, None)
            if notice_real_s is not None:
                deadline = now + notice_real_s
                self._kill_at[instance_id] = deadline
                self._events.append(NodeEvent(instance_id, NodeEventKind.NOTICE, now, deadline=deadline))
                return
        self._kill(instance_id, with_notice=False)

    def _kill(self, instance_id: str, with_notice: bool) -> None:
        with self._lock:
            inst = self._instances.pop(instance_id, None)
            self._kill_at.pop(instance_id, None)
            self._doom.pop(instance_id, None)
        if inst is None:
            return
        self._cluster.remove_node(inst.ray_node_id, graceful=False)
        self._drop_host(instance_id)
        with self._lock:
            self._events.append(NodeEvent(instance_id, NodeEventKind.PREEMPTED, time.time(), with_notice=with_notice,
                                          reclaimed=True))   # the local market took it
        log.info("preempted %s (%s notice)", instance_id, "with" if with_notice else "without")

    def _tick_loop(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(TICK_S):
            now_m = time.monotonic()
            dt, last = now_m - last, now_m
            now = time.time()
            with self._lock:
                self.market.advance(dt)
                due = [i for i, t in self._kill_at.items() if t <= now]
                # A VM ends at its drawn time; a noticed one hears of it notice_s (simulated) ahead.
                sim_t, draws = self.market.sim_time_s, []
                for instance_id, (end_sim_s, notice) in self._doom.items():
                    if sim_t >= end_sim_s - (self.notice_s if notice else 0.0):
                        draws.append((instance_id, self.market.real_s(max(0.0, end_sim_s - sim_t)) if notice else None))
            for instance_id in due:
                self._kill(instance_id, with_notice=True)
            for instance_id, notice_real_s in draws:
                try:
                    self._reclaim(instance_id, notice_real_s)
                except Exception:  # a node that vanished on its own meanwhile
                    log.exception("preempting %s", instance_id)

