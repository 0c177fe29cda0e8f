"""The provider interface every cloud implements, and the values it speaks in."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class BillingTerms:
    """How a cloud bills a VM (what the cloud *is*: data in `providers/<cloud>/facts.py`, read by
    `elastic.record.billing` without importing the provider).

    Args:
        minimum_s: seconds billed at least once the VM is gone.
        increment_s: billed time is rounded up to whole increments of this many seconds.
        interrupted_free_s: a spot VM the cloud itself interrupts within this many seconds of its
            launch is not billed at all, where one the user terminates bills its seconds (AWS: the
            first hour, for Linux). 0: no such rule. `elastic.record.billing` bills such a VM
            nothing (one its `node_preempted` says the cloud reclaimed: after a notice, or by the
            cloud's own word); the driver leaves a noticed VM that young for its cloud to reclaim
            rather than terminating it (`Driver.leaves_to_cloud`). The bounds of
            `elastic.sim.bound` price the bill before such refunds (the simulator's `list_usd`).
    """

    minimum_s: float
    increment_s: float
    interrupted_free_s: float = 0.0


@dataclass(frozen=True)
class Offer:
    """Something a provider would rent now.

    Args:
        cloud: provider name (`local`, `aws`, `gcp`).
        region: region name.
        zone: zone / availability zone.
        instance_type: the provider's instance (machine) type.
        gpu: accelerator model, or "" for CPU-only.
        gpus: accelerators per VM.
        cpus: vCPUs per VM.
        spot: a spot / preemptible offer.
        usd_per_hour: price of this offer now, USD per hour.
        on_demand_usd_per_hour: on-demand price of the same VM, USD per hour.
        read_at: unix time the price was read.
        capacity: VMs of this offer that can be held at once, when the provider knows (a simulated
            market, a trace; 0 in a stock-out); None: unknown (real clouds do not say).
    """

    cloud: str
    region: str
    zone: str
    instance_type: str
    gpu: str
    gpus: int
    cpus: int
    spot: bool
    usd_per_hour: float
    on_demand_usd_per_hour: float
    read_at: float
    capacity: int | None = None

    NOT_KEPT = ("read_at", "capacity")   # what a VM rented from an offer does not keep of it (`node_launched`)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Instance:
    """A VM a run holds.

    Args:
        instance_id: the provider's id.
        offer: the offer it was rented from.
        run: the run that owns it.
        role: what it is for (`replica`, `controller`).
        launched_at: unix time it was launched.
        ray_node_id: the Ray node it runs, once joined.
        labels: provider tags / labels.
        heartbeat_at: unix time of the newest driver heartbeat the cloud holds on the VM (its
            `elastic:heartbeat` tag / `elastic-heartbeat` label), None when it never got one;
            filled in by `find_instances`.
    """

    instance_id: str
    offer: Offer
    run: str
    role: str
    launched_at: float
    ray_node_id: str | None = None
    labels: dict = field(default_factory=dict)
    heartbeat_at: float | None = None


class NodeEventKind(StrEnum):
    """What a provider saw happen to a VM."""

    NOTICE = "notice"          # it will be reclaimed at the event's deadline
    PREEMPTED = "preempted"    # it is gone
    REBALANCE = "rebalance"    # elevated interruption risk, no deadline (AWS's rebalance recommendation)


@dataclass(frozen=True)
class NodeEvent:
    """Something the provider saw happen to a VM.

    Args:
        instance_id: the instance.
        kind: what happened (`NodeEventKind`).
        at: unix time the provider saw it.
        deadline: for a notice, unix time the VM goes.
        with_notice: for a preemption, whether a notice came first.
        reclaimed: for a preemption, the cloud says it took the VM back itself (a spot
            interruption: AWS's `Server.SpotInstanceTermination`), not that something else ended it.
    """

    instance_id: str
    kind: NodeEventKind
    at: float
    deadline: float | None = None
    with_notice: bool = False
    reclaimed: bool = False


class CapacityError(Exception):
    """The offer cannot be had now (stock-out, quota); the caller cools it down and tries later."""


@runtime_checkable
class Provider(Protocol):
    """What elastic needs of a cloud; `providers/<cloud>/provider.py` implements all of it
    (`BaseProvider` gives the few members a cloud may truly have nothing to do for).

    Constructed as `cls(recipe, cluster, run_name)`: the run's recipe (its own section is
    `recipe.<name>`), its Ray cluster (None for commands that do not train: prices, down,
    preflight) and the run's name (tags / labels on every VM).
    """

    name: str
    """The provider's name: its key in `providers.PROVIDERS` and its recipe section's."""
    section: type
    """Its recipe section, a pydantic model (`providers/<cloud>/config.py`)."""
    notice_s: float
    """Seconds between a spot VM's interruption notice and its end (AWS 120, GCP 30)."""
    storage_scheme: str | None
    """URI scheme of its object store (`s3`, `gs`), None without one (`open_storage`)."""
    storage_usd_per_gb_month: float
    """List price of its object store (standard class), USD per GB-month: the report's estimate of
    what checkpoints kept there cost; 0 without one."""

    @classmethod
    def accelerator_models(cls) -> set[str]:
        """GPU model names this cloud offers (what `resources.accelerators` may name before `:`)."""

    @classmethod
    def configured(cls) -> str | None:
        """None when this cloud can be used from here (credentials found); else one line saying
        what is missing (`elastic prices` and `elastic down` without `--cloud` ask every cloud)."""

    @classmethod
    def open_storage(cls, uri: str, bucket: str, prefix: str, create: bool):
        """Its object store at `uri` (`bucket`, `prefix` parsed from it) as an
        `elastic.storage.stores.Storage`; `create`: make the bucket when missing, else a missing one is a
        UserError."""

    @classmethod
    def open_keys(cls, uri: str, bucket: str):
        """The secret store keeping the per-run keys that authenticate the checkpoint manifests at
        `uri` (an `elastic.storage.stores.KeyStore`): readable by drivers, not by nodes."""

    @classmethod
    def start_network(cls, recipe):
        """Before the run's Ray cluster starts: the network the driver's host joins, with `tag`,
        `head_ip` and `down()` (the local provider's `local.network` lab; a cloud's WireGuard overlay
        with this host as its head, `providers.cloud.CloudNetwork`), or None."""

    @classmethod
    def network_problem(cls, recipe) -> str | None:
        """Why this machine cannot make the network `start_network` would make for `recipe`, in
        one line naming the recipe field; None when it can (or there is none). `elastic launch`
        asks before a run directory or Ray exists."""

    @classmethod
    def clean_orphans_here(cls) -> list[str]:
        """Remove what dead runs of this provider left on this machine (`elastic down --orphans`);
        returns what was removed, one name each."""

    def offers(self, resources) -> list[Offer]:
        """Offers matching a recipe's `resources` section, cheapest first."""

    def prices(self, instance_ids: list[str]) -> dict[str, float]:
        """USD per hour in effect now for each held VM among `instance_ids` (spot prices may move
        during a VM's life). The driver polls it and records a `node_price` event on a change."""

    def launch(self, offer: Offer, run: str, role: str) -> Instance:
        """Rent one VM from `offer`; returns once it has joined the Ray cluster. A refusal of
        capacity (stock-out, quota) raises CapacityError."""

    def launch_controller(self, run: str, recipe_text: str) -> Instance:
        """Start the run's controller VM (`resources.head: controller`): on-demand, it runs the Ray
        head and the driver of `recipe_text`. UserError where the provider has none."""

    def terminate(self, instance_id: str) -> None:
        """Release one VM (idempotent)."""

    def list_instances(self, run: str) -> list[Instance]:
        """Every VM this provider holds for `run`."""

    def find_instances(self, run: str | None) -> list[Instance]:
        """Every live VM the cloud says belongs to `run` (any elastic run when None), whoever
        launched it: the run's controller and VMs of another process included."""

    def heartbeat(self, run: str, now_s: float) -> int:
        """Record `now_s` (unix time) as the driver's heartbeat on every VM of `run` this provider
        holds and on the run's controller, in the cloud itself (`elastic down --orphans` reads it
        from `Instance.heartbeat_at`); the number of VMs it was written on."""

    def events(self) -> list[NodeEvent]:
        """Preemption notices and preemptions seen since the last call."""

    def preflight(self, resources) -> list[str]:
        """What would stop a run of `resources` on this cloud before it starts, one line each
        (credentials that do not resolve, an unknown account or project, regions that do not exist
        or are not enabled, an accelerator this cloud does not offer, quota below what the world
        needs where the cloud's API says); [] when nothing is in the way. Read-only calls only:
        it rents nothing and writes nothing."""

    def remove_run_resources(self, run: str, wait_s: float = 0.0) -> list[str]:
        """Delete what `run` owns in this cloud besides its VMs (token secret, its own role or
        network rules), once its VMs are terminated, waiting up to `wait_s` for VMs still shutting
        down to let go of them; returns one line per thing left (`elastic down`)."""

    def stop_launches(self) -> None:
        """Launches still under way give up now (the run is ending)."""

    def close(self) -> None:
        """Stop what the provider runs in the background (idempotent)."""


class BaseProvider:
    """Explicit defaults for the members of `Provider` a provider may have nothing to do for; a
    provider that does override them. Everything else each provider implements itself."""

    storage_scheme: str | None = None
    storage_usd_per_gb_month: float = 0.0

    @classmethod
    def configured(cls) -> str | None:
        """Nothing to configure."""
        return None

    @classmethod
    def open_storage(cls, uri: str, bucket: str, prefix: str, create: bool):
        from elastic.errors import UserError

        raise UserError(f"{uri}: the {cls.name} provider has no object store")

    @classmethod
    def open_keys(cls, uri: str, bucket: str):
        from elastic.errors import UserError

        raise UserError(f"{uri}: the {cls.name} provider has no secret store")

    @classmethod
    def start_network(cls, recipe):
        """No network of its own: the driver's host stays where it is."""
        return None

    @classmethod
    def network_problem(cls, recipe) -> str | None:
        """No network of its own to make here."""
        return None

    @classmethod
    def clean_orphans_here(cls) -> list[str]:
        """Nothing kept on this machine."""
        return []

    def launch_controller(self, run: str, recipe_text: str) -> Instance:
        from elastic.errors import UserError

        raise UserError(f"resources.head: controller is not available on {self.name}; set resources.head: local")

    def remove_run_resources(self, run: str, wait_s: float = 0.0) -> list[str]:
        """A run owns nothing here besides its VMs."""
        return []

    def stop_launches(self) -> None:
        """Launches return on their own."""

    def close(self) -> None:
        """Nothing runs in the background."""


class JoinTimeout(CapacityError):
    """A launched VM did not join the Ray cluster within `resources.join_timeout_s` (or its boot
    script failed first); the provider has terminated it. The caller cools the offer down and bills
    the seconds it ran.

    Args:
        message: what happened, one line.
        instance: the VM (its `launched_at` set; `ray_node_id` None).
        released_at: unix time it was terminated.
        timeout_s: the join timeout it ran into, seconds.
        waited_s: how long it was waited for (less than `timeout_s` when the run stopped first).
        console_tail: the last lines of its serial console (its boot log), "" when none was read.
        boot_failed: its boot script said it failed, which ended the wait before `timeout_s`.
    """

    def __init__(self, message: str, instance: Instance, released_at: float, timeout_s: float,
                 waited_s: float | None = None, console_tail: str = "", boot_failed: bool = False):
        super().__init__(message)
        self.console_tail = console_tail
        self.boot_failed = boot_failed
        self.instance = instance
        self.released_at = released_at
        self.timeout_s = timeout_s
        self.waited_s = timeout_s if waited_s is None else waited_s
