"""The recipe's `local:` section: local instance types, the simulated spot market, the network lab."""

from __future__ import annotations

from pydantic import Field, model_validator

from elastic.recipe.section import Section


class LocalInstanceType(Section):
    """One kind of local 'VM': a Ray node on this machine, priced by the simulated market."""

    name: str = "local-cpu"
    """Instance type name shown in reports."""
    region: str = "local-1"
    """Simulated region."""
    zone: str = "local-1a"
    """Simulated zone."""
    cpus: int = Field(1, ge=1)
    """Logical CPUs the node offers to Ray (one per rank)."""
    gpus: int = Field(0, ge=0, le=64)
    """GPUs the node offers to Ray: this machine's own (a rank takes one each; 0: CPU ranks)."""
    spot_usd_per_hour: float = Field(0.5, ge=0)
    """Simulated spot price, USD per hour."""
    on_demand_usd_per_hour: float = Field(1.5, ge=0)
    """Simulated on-demand price, USD per hour."""


class MarketSection(Section):
    """The local provider's simulated spot market: prices that move, capacity that runs out, and
    preemptions with or without notice. Generated from a seed, or replayed from `trace`."""

    seed: int = Field(0, ge=0)
    """Seed of the price walk, stock-outs and preemptions."""
    time_compression: float = Field(60.0, gt=0)
    """Simulated seconds per real second (60: a simulated hour passes in a real minute). Rates,
    notice lengths and price changes are in simulated time."""
    preempt_per_hour: float = Field(0.0, ge=0)
    """Preemptions per node-hour of simulated time (generated market; a trace gives its own)."""
    notice_fraction: float = Field(0.5, ge=0, le=1)
    """Share of preemptions that come with a notice ahead; the rest are hard kills."""
    notice_s: float = Field(120.0, ge=0)
    """Notice length in simulated seconds (AWS gives 120, GCP 30)."""
    volatility: float = Field(0.0, ge=0, le=5)
    """Spot price volatility per sqrt(simulated hour) of a mean-reverting walk around the base price."""
    stockout_per_hour: float = Field(0.0, ge=0)
    """Stock-outs (capacity drops to 0) per simulated hour, per instance type."""
    stockout_s: float = Field(600.0, ge=0)
    """Length of a stock-out, simulated seconds."""
    first_preemption_after_s: float = Field(0.0, ge=0)
    """No preemption in a node's first this-many simulated seconds (lets a node start and join)."""
    show_capacity: bool = True
    """Spot offers carry the market's capacity (a simulated market can show it). false: they carry
    none, as AWS's and GCP's do, and a run learns a full zone only from its refused launches (the
    same as `elastic simulate --hide-capacity`; the simulator honours it too)."""
    trace: str | None = None
    """CSV to replay instead of generating: columns timestamp_s,cloud,region,zone,instance_type,gpu,
    gpus,spot_usd_per_hour,on_demand_usd_per_hour,preempt_per_hour,capacity (timestamp_s in
    simulated seconds from the run's start; each row holds until the next row of the same zone and
    instance type; capacity 0 = stock-out)."""


class LinkSection(Section):
    """A local region's uplink to the simulated internet, shaping what leaves the region."""

    rate_mbit: float | None = Field(None, gt=0, le=100_000)
    """Bandwidth, Mbit/s (empty: unlimited)."""
    delay_ms: float = Field(0.0, ge=0, le=10_000)
    """One-way delay added, milliseconds: the kernel's `netem` qdisc where it has one (all traffic
    leaving the region), else a userspace relay that holds the overlay's WireGuard datagrams
    between regions (the only traffic that crosses them)."""
    loss_pct: float = Field(0.0, ge=0, le=100)
    """Packets dropped, percent (needs the kernel's `netem` qdisc)."""


class LocalNetworkSection(Section):
    """Separate networks for the local regions: each region a private subnet in a Linux network
    namespace behind its own NAT router, the routers joined by one simulated internet, and the
    run's WireGuard overlay the only way between regions, as on clouds. The driver's host (the
    Ray head) sits on the private network of `head_region`. Needs root, iproute2, nftables,
    wireguard-tools and wireguard-go."""

    head_region: str | None = None
    """Region whose private network the driver's host joins. Empty: the first instance type's."""
    links: dict[str, LinkSection] = Field(default_factory=dict)
    """Uplink of each region, by region name (a region not named: unlimited)."""


class LocalSection(Section):
    """The `local` provider: Ray nodes on this machine and a simulated spot market."""

    instance_types: list[LocalInstanceType] = Field(default_factory=lambda: [LocalInstanceType()], min_length=1)
    """Instance types on offer. A replica's node gets `world.ranks_per_replica` CPUs whatever `cpus` says
    when that is smaller."""
    object_store_bytes: int = Field(100 * 1024 * 1024, ge=78643200)
    """Ray object store size per local node, in bytes."""
    capacity: int | None = Field(None, ge=0)
    """Most local nodes of one instance type that can be held at once (empty: no limit)."""
    market: MarketSection = Field(default_factory=MarketSection)
    """The simulated spot market."""
    network: LocalNetworkSection | None = None
    """Separate networks per region joined only by the overlay (empty: every node on this
    machine's loopback)."""

    @model_validator(mode="after")
    def _check_network(self) -> "LocalSection":
        if self.network is not None:
            regions = [it.region for it in self.instance_types]
            for name in [self.network.head_region, *self.network.links]:
                if name is not None and name not in regions:
                    raise ValueError(f"@network: region {name!r} has no instance type "
                                     f"(regions: {', '.join(dict.fromkeys(regions))})")
        return self
