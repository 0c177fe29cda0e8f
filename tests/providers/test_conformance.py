"""Every provider passes the same tests: `local` (Ray nodes on this machine), `aws` (boto3 against
moto on 127.0.0.1) and `gcp` (google-cloud-compute against providers/lab/gcefake.py).

A harness per cloud says only what differs at the network boundary: the recipe, how a rented
VM's boot is stood in for (a raylet labelled with its instance id joins the real local Ray
cluster, as the VM's bootstrap script would), how the cloud is made to refuse capacity, and how a
notice reaches the provider (the local market's, or the node watcher's forward through Ray's KV).
The test bodies are the same for all three.
"""

from __future__ import annotations

import math
import threading
import time

import pytest

from providers import PROVIDERS, billing_terms, build, provider_class
from providers.base import CapacityError, JoinTimeout, Provider
from tests.conftest import events_within, join_as_vm, tiny_recipe


def _members() -> set[str]:
    """Every name the protocol declares: its attributes and its methods."""
    return {n for n in vars(Provider) if not n.startswith("_")} | set(Provider.__annotations__)


class Harness:
    """What a cloud's test double needs from the test; the base serves clouds whose VMs boot
    elsewhere (aws, gcp): a raylet stands in for each new VM."""

    name = ""

    def __init__(self, cluster):
        self.cluster = cluster
        self._nodes: list[str] = []

    def recipe(self, **overrides):
        raise NotImplementedError

    def booting(self, run: str) -> list[str]:
        """Instance ids of the run's VMs the cloud holds (running or starting)."""
        raise NotImplementedError

    def refusing_recipe(self):
        """A recipe the cloud will refuse capacity for (once `refuse_capacity` is called)."""
        return self.recipe()

    def refuse_capacity(self, offer) -> None:
        """From now on the cloud answers a launch from `offer` with its stock-out error."""
        raise NotImplementedError

    def boot(self, instance_id: str) -> None:
        """The VM's bootstrap script: a Ray node labelled with its instance id joins the cluster."""
        self._nodes.append(join_as_vm(self.cluster, instance_id))

    def launch(self, p, offer, run: str):
        """`p.launch` as the driver calls it, with the VM's boot stood in for once the cloud has it."""
        result: dict = {}

        def go():
            try:
                result["inst"] = p.launch(offer, run, "replica")
            except BaseException as exc:   # re-raised in the test's thread
                result["error"] = exc

        t = threading.Thread(target=go)
        t.start()
        deadline = time.monotonic() + 30
        while not self.booting(run) and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        for iid in self.booting(run):
            self.boot(iid)
        t.join(timeout=60)
        if "error" in result:
            raise result["error"]
        return result["inst"]

    def notice(self, p, instance_id: str, deadline: float) -> None:
        """The node's watcher forwards an interruption notice to the driver through Ray's KV."""
        from providers import watcher

        watcher.forward(instance_id, {"kind": "notice", "deadline": deadline, "action": "terminate"})

    def close(self) -> None:
        for node_id in self._nodes:
            self.cluster.remove_node(node_id)


class LocalHarness(Harness):
    name = "local"

    def recipe(self, **overrides):
        return tiny_recipe(**{"resources.clouds": "[local]", **overrides})

    def booting(self, run):
        return []   # the local provider adds the node itself

    def launch(self, p, offer, run):
        return p.launch(offer, run, "replica")

    def refusing_recipe(self):
        return self.recipe(**{"local.capacity": 0})   # the simulated market: a stock-out

    def refuse_capacity(self, offer):
        """The recipe already says so."""

    def notice(self, p, instance_id, deadline):
        p.preempt(instance_id, notice=True)   # the simulated market's notice


class AWSHarness(Harness):
    name = "aws"

    def __init__(self, cluster, proxy):
        super().__init__(cluster)
        from tests.providers.test_aws import price_rule

        self.proxy = proxy
        proxy.rules.append(price_rule)

    def recipe(self, **overrides):
        from tests.providers.test_aws import aws_recipe

        return aws_recipe(**{"resources.regions": "[us-west-2]", "resources.join_timeout_s": 60,
                             "world.capacity_timeout_s": 600, **overrides})

    def booting(self, run):
        from tests.providers.test_aws import instances

        return [vm["InstanceId"] for vm in instances("us-west-2", run)
                if vm["State"]["Name"] in ("pending", "running")]

    def refuse_capacity(self, offer):
        from tests.conftest import aws_error

        self.proxy.rules.insert(0, lambda a, r, p: aws_error("InsufficientInstanceCapacity")
                                if a == "RunInstances" else None)


class GCPHarness(Harness):
    name = "gcp"

    def __init__(self, cluster, fake):
        super().__init__(cluster)
        self.fake = fake

    def recipe(self, **overrides):
        return tiny_recipe(**{"resources.clouds": "[gcp]", "resources.head": "local",
                              "resources.accelerators": "L4:1",
                              "resources.join_timeout_s": 60, "world.capacity_timeout_s": 600, **overrides})

    def booting(self, run):
        return [name for name, vm in self.fake.instances.items() if (vm.get("labels") or {}).get("elastic-run") == run]

    def refuse_capacity(self, offer):
        self.fake.insert_errors[offer.zone] = ("operation", "ZONE_RESOURCE_POOL_EXHAUSTED")


@pytest.fixture(params=list(PROVIDERS))
def cloud(request, local_cluster):
    """The harness of each registered provider, over the real local Ray cluster."""
    name = request.param
    # Its object store's server first: that session fixture sets the environment for good, and a
    # test's own settings (aws_env, gcp_fake) are undone over it afterwards.
    store = {"s3": "s3_server", "gs": "gcs_server"}.get(provider_class(name).storage_scheme)
    if store is not None:
        request.getfixturevalue(store)
    if name == "local":
        harness = LocalHarness(local_cluster)
    elif name == "aws":
        harness = AWSHarness(local_cluster, request.getfixturevalue("aws_env"))
    elif name == "gcp":
        harness = GCPHarness(local_cluster, request.getfixturevalue("gcp_fake"))
    else:
        pytest.fail(f"provider {name} has no conformance harness: add one here")
    try:
        yield harness
    finally:
        harness.close()


@pytest.fixture
def provider(cloud, local_cluster):
    p = build(cloud.name, cloud.recipe(), local_cluster, f"conf-{cloud.name}")
    try:
        yield p
    finally:
        for inst in p.list_instances(f"conf-{cloud.name}"):
            p.terminate(inst.instance_id)
        p.close()


# -- the class: every member of the protocol, its figures ---------------------------------------------

@pytest.mark.parametrize("name", list(PROVIDERS))
def test_implements_the_whole_protocol_and_its_figures(name):
    cls = provider_class(name)
    missing = sorted(m for m in _members() if not hasattr(cls, m))
    assert not missing, f"{name} lacks {missing}"
    assert cls.name == name and PROVIDERS[name].endswith(":" + cls.__name__)
    assert cls.section.__module__.startswith(f"providers.{name}.")     # its recipe section is its own
    terms = billing_terms(name)                                          # what the cloud is: its facts.py
    for figure, value in (("notice_s", cls.notice_s), ("storage_usd_per_gb_month", cls.storage_usd_per_gb_month),
                          ("billing minimum_s", terms.minimum_s), ("billing increment_s", terms.increment_s)):
        assert isinstance(value, float) and math.isfinite(value) and value >= 0, (figure, value)
    assert cls.notice_s > 0 and terms.increment_s > 0
    # An object store has a price (the report's storage estimate); none, none.
    assert (cls.storage_usd_per_gb_month > 0) == (cls.storage_scheme is not None)
    assert cls.configured() is None or isinstance(cls.configured(), str)


# -- one instance: offers, launch, list, prices, notices, release, close --------------------------------

def test_offers_have_prices(cloud, provider):
    offers = provider.offers(cloud.recipe().resources)
    assert offers, "the cloud offers something"
    assert isinstance(provider, Provider)
    for o in offers:
        assert o.cloud == cloud.name and o.usd_per_hour > 0 and o.on_demand_usd_per_hour > 0
        assert math.isfinite(o.usd_per_hour) and o.read_at > 0
    assert [o.usd_per_hour / max(1, o.gpus) for o in offers] == sorted(o.usd_per_hour / max(1, o.gpus) for o in offers)


def test_launch_list_notice_release_leaves_nothing(cloud, provider):
    run = f"conf-{cloud.name}"
    resources = cloud.recipe().resources
    offer = provider.offers(resources)[0]
    inst = cloud.launch(provider, offer, run)
    assert inst.ray_node_id is not None and inst.offer == offer and inst.run == run
    assert [i.instance_id for i in provider.list_instances(run)] == [inst.instance_id]
    assert provider.prices([inst.instance_id, "no-such-vm"]).keys() == {inst.instance_id}
    assert provider.prices([inst.instance_id])[inst.instance_id] > 0
    # The driver's heartbeat is written on the held VM in a cloud; local nodes end with their process.
    assert provider.heartbeat(run, time.time()) == (0 if cloud.name == "local" else 1)

    deadline = time.time() + provider.notice_s
    cloud.notice(provider, inst.instance_id, deadline)
    notices = [ev for ev in events_within(provider) if ev.kind == "notice"]
    assert [ev.instance_id for ev in notices] == [inst.instance_id]
    assert notices[0].deadline > notices[0].at

    provider.terminate(inst.instance_id)
    provider.terminate(inst.instance_id)   # idempotent
    assert provider.list_instances(run) == []
    assert cloud.booting(run) == []
    # What the run owned besides the VM (token, its own network rules) goes too, and twice is fine.
    assert provider.remove_run_resources(run) == []
    assert provider.remove_run_resources(run) == []


def test_capacity_refusal_is_a_capacity_error(cloud, local_cluster):
    run = f"conf-{cloud.name}"
    recipe = cloud.refusing_recipe()
    p = build(cloud.name, recipe, local_cluster, run)
    try:
        offer = p.offers(recipe.resources)[0]
        cloud.refuse_capacity(offer)
        with pytest.raises(CapacityError) as info:
            p.launch(offer, run, "replica")
        assert not isinstance(info.value, JoinTimeout)
        assert p.list_instances(run) == [] and cloud.booting(run) == []
    finally:
        p.close()


def test_close_is_idempotent_and_stops_launches(cloud, local_cluster):
    p = build(cloud.name, cloud.recipe(), local_cluster, f"conf-{cloud.name}")
    p.stop_launches()
    p.close()
    p.close()


# -- storage: the object store a URI scheme names --------------------------------------------------------

def test_storage_backend_round_trips_an_object(cloud):
    from elastic.errors import UserError
    from elastic.storage.stores import open_storage

    cls = provider_class(cloud.name)
    if cls.storage_scheme is None:
        with pytest.raises(UserError, match="no object store"):
            cls.open_storage(f"x://bucket/{cloud.name}", "bucket", cloud.name, True)
        return
    storage = open_storage(f"{cls.storage_scheme}://conformance-{cloud.name}/run", create=True)
    try:
        storage.write_bytes("a/manifest.json", b'{"step": 1}')
        assert storage.read_bytes("a/manifest.json") == b'{"step": 1}'
        assert storage.list("a") == {"a/manifest.json": 11}
        assert storage.read_bytes("a/missing") is None
        storage.delete(["a/manifest.json"])
        assert storage.list("a") == {}
    finally:
        storage.close()
