"""The gcp provider against the local fake of Compute Engine, the Billing Catalog and the metadata
server (providers/lab/gcefake.py): the real google-cloud clients, our code path, HTTP on 127.0.0.1."""

from __future__ import annotations

import base64
import json
import re
import threading
import time

import pytest

from providers.base import Offer
from tests.conftest import REPO, cli_env, join_as_vm, polled_events, run_cli, tiny_recipe
from providers.lab.gcefake import MACHINE_TYPES, PRICES, ZONE_ACCELERATORS, ZONE_MACHINE_TYPES, ZONES


def _provider(run="run-1", cluster=None, **dotted):
    from providers import build

    recipe = tiny_recipe(**{"resources.clouds": "[gcp]", "resources.head": "local",
                            "world.capacity_timeout_s": 600, **dotted})
    return build("gcp", recipe, cluster, run), recipe


def _expected_usd(machine_type: str, region: str, spot: bool) -> float:
    """The price of one VM from the fake's price table: vCPUs, GiB and GPUs at their SKU rates."""
    cpus, mem, accel, gpus = MACHINE_TYPES[machine_type]
    fam = machine_type.split("-")[0]
    gpu = {"nvidia-tesla-a100": "A100", "nvidia-a100-80gb": "A100-80GB", "nvidia-l4": "L4"}[accel]
    i = 1 if spot else 0
    t = PRICES[region]
    return cpus * t[f"{fam}-core"][i] + mem * t[f"{fam}-ram"][i] + gpus * t[gpu][i]


# -- prices and the catalog ------------------------------------------------------------------------

def test_offers_priced_per_vm_across_regions_and_zones(gcp_fake):
    p, recipe = _provider(**{"resources.accelerators": "A100"})
    offers = p.offers(recipe.resources)
    got = {(o.zone, o.instance_type): o for o in offers}
    # Every UP zone whose machine types carry an A100 (40 or 80 GB) and whose region has prices.
    want = {(z, mt) for z, mts in ZONE_MACHINE_TYPES.items() if ZONES[z] == "UP" for mt in mts
            if mt.startswith("a2-") and z.rsplit("-", 1)[0] in PRICES
            and ("A100-80GB" if "ultra" in mt else "A100") in PRICES[z.rsplit("-", 1)[0]]}
    assert set(got) == want
    assert not any(z == "europe-west4-b" for z, _ in got)              # a DOWN zone offers nothing
    for (zone, mt), o in got.items():
        region = zone.rsplit("-", 1)[0]
        assert o.cloud == "gcp" and o.region == region and o.spot
        assert o.usd_per_hour == pytest.approx(_expected_usd(mt, region, True), rel=1e-6)
        # On-demand from the OnDemand SKUs, not the 1-year commitment SKU also in the catalog.
        assert o.on_demand_usd_per_hour == pytest.approx(_expected_usd(mt, region, False), rel=1e-6)
        assert o.gpus == MACHINE_TYPES[mt][3] and o.cpus == MACHINE_TYPES[mt][0]
    per_gpu = [o.usd_per_hour / o.gpus for o in offers]
    assert per_gpu == sorted(per_gpu)
    assert {o.gpu for o in offers} == {"A100", "A100-80GB"}
    assert offers[0].zone == "us-east1-b"   # the cheapest A100 spot region in the test catalog


def test_offers_filter_by_count_region_model_and_price(gcp_fake):
    p, recipe = _provider(**{"resources.accelerators": "A100-80GB:8", "resources.regions": "[europe-west4]"})
    assert [(o.zone, o.instance_type) for o in p.offers(recipe.resources)] == [("europe-west4-a", "a2-ultragpu-8g")]
    p, recipe = _provider(**{"resources.accelerators": "A100:1", "resources.max_usd_per_hour": 1.45})
    offers = p.offers(recipe.resources)
    assert offers and all(o.usd_per_hour <= 1.45 and o.gpus == 1 for o in offers)
    p, recipe = _provider(**{"resources.accelerators": "L4:1", "resources.spot": "false"})
    offers = p.offers(recipe.resources)
    assert offers and all(not o.spot and o.usd_per_hour == o.on_demand_usd_per_hour for o in offers)
    p, recipe = _provider(**{"resources.accelerators": "H100:8"})
    assert p.offers(recipe.resources) == []


def test_n1_offers_attach_gpus(gcp_fake):
    p, recipe = _provider(**{"resources.accelerators": "T4:2"})
    offers = p.offers(recipe.resources)
    assert offers and {o.instance_type for o in offers} == {"n1-standard-16"}
    # Wherever acceleratorTypes lists T4 (up to at least 2 cards) in an UP zone of a priced region:
    # europe-west4-b lists it too, but is DOWN.
    assert {o.zone for o in offers} == {z for z, acc in ZONE_ACCELERATORS.items() if acc.get("nvidia-tesla-t4", 0) >= 2
                                        and ZONES[z] == "UP" and "T4" in PRICES[z.rsplit("-", 1)[0]]}
    assert "europe-west4-b" not in {o.zone for o in offers}
    t = PRICES["us-east1"]
    east = next(o for o in offers if o.zone == "us-east1-c")
    assert east.usd_per_hour == pytest.approx(16 * t["n1-core"][1] + 60 * t["n1-ram"][1] + 2 * t["T4"][1])


def test_prices_cached_on_disk_and_refresh(gcp_fake, monkeypatch):
    from providers import cloud

    p, recipe = _provider(**{"resources.accelerators": "L4"})
    first = p.offers(recipe.resources)
    pages = len(gcp_fake.calls("GET", "/skus$"))
    assert pages > 1                                    # the catalog came in several pages
    again, _ = _provider(**{"resources.accelerators": "L4"})   # a new process-like provider: disk cache
    assert again.offers(recipe.resources) == first
    assert len(gcp_fake.calls("GET", "/skus$")) == pages
    monkeypatch.setattr(cloud, "_refresh", True)
    fresh, _ = _provider(**{"resources.accelerators": "L4"})
    assert [o.usd_per_hour for o in fresh.offers(recipe.resources)] == [o.usd_per_hour for o in first]
    assert len(gcp_fake.calls("GET", "/skus$")) == 2 * pages


def test_catalog_falls_back_to_shipped_table_when_lists_are_refused(gcp_fake):
    gcp_fake.deny(r"/aggregated/machineTypes")
    p, recipe = _provider(**{"resources.accelerators": "A100:8"})
    offers = p.offers(recipe.resources)
    # The shipped table's A100 zones in regions the catalog prices: us-central1, us-east1, europe-west4.
    assert {o.instance_type for o in offers} == {"a2-highgpu-8g", "a2-ultragpu-8g"}
    assert {"us-central1-a", "us-east1-b", "europe-west4-a"} <= {o.zone for o in offers}


# -- launch, errors, teardown ----------------------------------------------------------------------

def _offer(p, recipe, zone=None):
    offers = p.offers(recipe.resources)
    return next(o for o in offers if zone is None or o.zone == zone)


def test_launch_request_spot_delete_labels_accelerators_no_secrets(gcp_fake, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "tok-secret-123")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-456")
    p, recipe = _provider(run="My.Run_1", **{"resources.accelerators": "T4:2"})
    offer = _offer(p, recipe, "us-east1-c")
    inst = p._create(offer, "My.Run_1", "replica")
    (body,) = gcp_fake.inserted()
    assert body["name"] == inst.instance_id
    assert body["machineType"].endswith("zones/us-east1-c/machineTypes/n1-standard-16")
    assert body["scheduling"] == {"provisioningModel": "SPOT", "instanceTerminationAction": "DELETE",
                                  "onHostMaintenance": "TERMINATE", "automaticRestart": False,
                                  "maxRunDuration": {"seconds": "259200"}}   # resources.max_vm_hours: 72
    assert body["labels"] == {"elastic-run": "my-run_1", "elastic-role": "replica", "elastic-managed": "true"}
    assert body["guestAccelerators"] == [{"acceleratorType": "zones/us-east1-c/acceleratorTypes/nvidia-tesla-t4",
                                          "acceleratorCount": 2}]
    meta = {i["key"]: i["value"] for i in body["metadata"]["items"]}
    assert meta["elastic-run"] == "My.Run_1"
    assert json.loads(meta["elastic-offer"])["usd_per_hour"] == offer.usd_per_hour
    script = meta["startup-script"]
    assert "python3 -m elastic.run.cluster start --address=" in script and "--cloud gcp" in script and "--num-gpus=2" in script
    assert "elastic.run=My.Run_1" in script
    blob = json.dumps(body)
    assert "tok-secret-123" not in blob and "aws-secret-456" not in blob and "private_key" not in blob
    # A bundled-GPU machine type carries no guest accelerators.
    p2, recipe2 = _provider(**{"resources.accelerators": "A100:1"})
    p2._create(_offer(p2, recipe2), "run-1", "replica")
    assert "guestAccelerators" not in gcp_fake.inserted()[-1]


@pytest.mark.parametrize("mode,code", [("operation", "ZONE_RESOURCE_POOL_EXHAUSTED"),
                                       ("operation", "QUOTA_EXCEEDED"), ("http", "quotaExceeded")])
def test_stockout_and_quota_are_capacity_errors(gcp_fake, mode, code):
    from providers.base import CapacityError

    p, recipe = _provider(**{"resources.accelerators": "A100:1"})
    offer = _offer(p, recipe, "us-east1-b")
    gcp_fake.insert_errors["us-east1-b"] = (mode, code)
    with pytest.raises(CapacityError, match=code):
        p.launch(offer, "run-1", "replica")
    assert gcp_fake.instances == {}
    # The next zone is tried by the driver after the cool-down; here: it works.
    inst = p._create(_offer(p, recipe, "us-central1-a"), "run-1", "replica")
    assert set(gcp_fake.instances) == {inst.instance_id}


def test_rate_limits_retried_by_api_core_one_vm(gcp_fake):
    p, recipe = _provider(**{"resources.accelerators": "L4:1"})
    offer = _offer(p, recipe)
    p._ensure_firewall("run-1")   # the run's firewall rule and service account exist: the 429s
    p._scope("run-1").service_account()   # below meet the insert
    gcp_fake.rate_limit(3)
    t0 = time.monotonic()
    inst = p._create(offer, "run-1", "replica")
    assert time.monotonic() - t0 < 30
    inserts = gcp_fake.calls("POST", r"/instances$")
    assert len(inserts) == 4                                     # 3 answered 429, then accepted
    assert len({r["query"]["requestId"] for r in inserts}) == 1   # one request id: idempotent retries
    assert list(gcp_fake.instances) == [inst.instance_id]


def test_join_timeout_terminates_and_reports_the_vm(gcp_fake):
    from providers.base import JoinTimeout

    p, recipe = _provider(**{"resources.accelerators": "L4:1", "resources.join_timeout_s": 0.5})
    t0 = time.time()
    with pytest.raises(JoinTimeout) as info:
        p.launch(_offer(p, recipe), "run-1", "replica")
    exc = info.value
    assert exc.instance.instance_id.startswith("elastic-run-1-repl-")
    assert t0 <= exc.instance.launched_at <= exc.released_at and exc.timeout_s == 0.5
    assert gcp_fake.instances == {}
    assert gcp_fake.calls("DELETE", exc.instance.instance_id)


def test_list_by_label_terminate_and_down_leave_nothing(gcp_fake):
    p, recipe = _provider(run="run-a", **{"resources.accelerators": "L4:1"})
    offer = _offer(p, recipe)
    a = [p._create(offer, "run-a", "replica") for _ in range(2)]
    b = p._create(offer, "run-b", "replica")
    # A fresh provider (as `elastic down` builds) finds them by label, prices restored from metadata.
    down, _ = _provider(run="run-a", **{"resources.accelerators": "L4:1"})
    listed = down.list_instances("run-a")
    assert sorted(i.instance_id for i in listed) == sorted(i.instance_id for i in a)
    assert all(i.offer.usd_per_hour == offer.usd_per_hour and i.role == "replica" for i in listed)
    assert {i.run for i in down.find_instances(None)} == {"run-a", "run-b"}
    for i in listed:
        down.terminate(i.instance_id)
        down.terminate(i.instance_id)    # idempotent: already gone is fine
    assert down.list_instances("run-a") == []
    assert list(gcp_fake.instances) == [b.instance_id]


def test_status_poll_reports_a_preempted_vm(gcp_fake, monkeypatch):
    from providers import cloud

    monkeypatch.setattr(cloud, "STATE_POLL_S", 0.0)
    p, recipe = _provider(**{"resources.accelerators": "L4:1"})
    keep, lost = (p._create(_offer(p, recipe), "run-1", "replica") for _ in range(2))
    for inst in (keep, lost):   # as launch() holds them once their Ray node joined
        inst.ray_node_id = f"node-{inst.instance_id}"
        p._held[inst.instance_id] = inst
    assert polled_events(p) == []
    gcp_fake.preempt(lost.instance_id)
    (ev,) = polled_events(p)
    assert (ev.instance_id, ev.kind, ev.with_notice) == (lost.instance_id, "preempted", False)
    assert [i.instance_id for i in p._held.values()] == [keep.instance_id]


# -- notices on the VM -----------------------------------------------------------------------------

def test_metadata_watch_preempted_and_maintenance(gcp_fake):
    from providers.gcp.provider import MAINTENANCE_NOTICE_S, PREEMPT_NOTICE_S
    from providers.gcp.watcher import MetadataWatch

    w = MetadataWatch(gcp_fake.metadata_url, wait_s=30)
    try:
        assert w.wait(0.3) is None                       # long polls waiting, nothing yet
        t0 = time.time()
        gcp_fake.set_metadata("preempted", "TRUE")
        notice = w.wait(5)
        assert notice["kind"] == "notice" and notice["action"] == "preempted"
        assert t0 + PREEMPT_NOTICE_S - 1 <= notice["deadline"] <= time.time() + PREEMPT_NOTICE_S
    finally:
        w.stop()
    gcp_fake.set_metadata("preempted", "FALSE")
    w = MetadataWatch(gcp_fake.metadata_url, wait_s=30)
    try:
        gcp_fake.set_metadata("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
        notice = w.wait(5)
        assert notice["action"] == "maintenance"
        assert notice["deadline"] == pytest.approx(time.time() + MAINTENANCE_NOTICE_S, abs=5)
    finally:
        w.stop()


def test_watcher_forwards_one_gcp_notice(gcp_fake):
    from providers import watcher

    sent, stop = [], threading.Event()
    t = threading.Thread(target=watcher.watch, args=("gcp", "vm-1"),
                         kwargs={"send": lambda i, n: sent.append((i, n)), "poll_s": 0.0, "stop": stop})
    t.start()
    try:
        gcp_fake.set_metadata("preempted", "TRUE")
        t.join(timeout=10)
        assert not t.is_alive()                  # returns after forwarding the interruption
        assert [(i, n["kind"], n["action"]) for i, n in sent] == [("vm-1", "notice", "preempted")]
    finally:
        stop.set()
        from providers.gcp import watcher as gcp_watcher
        for w in gcp_watcher._watches.values():
            w.stop()
        gcp_watcher._watches.clear()


# -- the CLI ---------------------------------------------------------------------------------------

_cli = run_cli


def test_cli_prices_gcp_table_and_json(gcp_fake):
    r = _cli("prices", "--cloud", "gcp", "--accelerator", "A100", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {row["cloud"] for row in rows} == {"gcp"}
    assert len({row["region"] for row in rows}) >= 3 and len({row["zone"] for row in rows}) >= 4
    per_gpu = [row["usd_per_gpu_hour"] for row in rows]
    assert per_gpu == sorted(per_gpu)
    r = _cli("prices", "--cloud", "gcp", "--accelerator", "A100:8")
    assert r.returncode == 0, r.stderr
    assert "a2-highgpu-8g" in r.stdout and "us-east1-b" in r.stdout and "a2-highgpu-1g" not in r.stdout


def test_cli_prices_without_credentials_is_one_line(tmp_path):
    env = cli_env(GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / "missing.json"), NO_GCE_CHECK="True",
                  ELASTIC_CACHE=str(tmp_path / "cache"))
    for k in ("ELASTIC_GCP_COMPUTE_ENDPOINT", "ELASTIC_GCP_BILLING_ENDPOINT"):
        env.pop(k, None)
    r = _cli("prices", "--cloud", "gcp", "--accelerator", "A100", env=env)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "gcp:" in lines[0] and "credentials" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_cli_launch_gcp_smoke_no_node_joins(gcp_fake, tmp_path):
    """recipes/gcp-smoke.yaml against the fake: VMs are created but never join (nothing boots), so
    the run ends insufficient_capacity with one line, nothing of it is left, and the report bills
    the seconds each VM was held."""
    run_dir = tmp_path / "run"
    r = _cli("launch", "recipes/gcp-smoke.yaml", "--run-dir", str(run_dir), "--set", "resources.join_timeout_s=3",
             "--set", "world.capacity_timeout_s=6", timeout=240)
    assert r.returncode == 4, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "no node joined within 3 s" in out and "Traceback" not in r.stdout + r.stderr
    assert gcp_fake.instances == {}                                    # nothing of the run is left
    inserted = {b["name"] for b in gcp_fake.inserted()}
    deleted = {c["path"].rsplit("/", 1)[-1] for c in gcp_fake.calls("DELETE", "/instances/")}
    assert inserted and inserted == deleted
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "insufficient_capacity"
    billed = {i["instance_id"]: i for i in report["instances"]}
    assert set(billed) == inserted
    for i in billed.values():
        assert i["cloud"] == "gcp" and 0 < i["seconds"] < 60 and i["cost_usd"] > 0
    # The total is the unrounded costs' sum, rounded once; each instance's is rounded on its own.
    assert report["cost_usd"] == pytest.approx(sum(i["cost_usd"] for i in billed.values()),
                                               abs=0.5e-6 * (len(billed) + 1))


def test_cli_prices_without_cloud_ranks_aws_and_gcp_together(gcp_fake, aws_env):
    """No --cloud: every configured cloud (moto for AWS, the fake for GCP) in one ranking."""
    from tests.providers.test_aws import spot_history

    aws_rows = {"us-east-1": [("us-east-1a", "p4d.24xlarge", 12.0, "2026-01-01T10:00:00Z")],
                "us-west-2": [("us-west-2b", "p4de.24xlarge", 9.0, "2026-01-01T10:00:00Z")]}
    aws_env.rules.append(lambda action, region, params: spot_history(aws_rows[region])
                         if action == "DescribeSpotPriceHistory" and region in aws_rows else None)
    regions = ["us-east-1", "us-west-2", "us-central1", "us-east1", "europe-west4"]
    r = _cli("prices", "--accelerator", "A100", "--json", *[a for g in regions for a in ("--region", g)],
             env=cli_env(**aws_env.env, **gcp_fake.env()))
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {row["cloud"] for row in rows} == {"aws", "gcp"}
    per_gpu = [row["usd_per_gpu_hour"] for row in rows]
    assert per_gpu == sorted(per_gpu)
    where = [(row["cloud"], row["zone"], row["instance_type"]) for row in rows]
    # AWS p4de at 1.125 per GPU-hour beats every GCP A100; p4d at 1.5 ranks after GCP's us-east1
    # (1.3957) and before its europe-west4 (1.6158).
    assert where[0] == ("aws", "us-west-2b", "p4de.24xlarge")
    p4d = where.index(("aws", "us-east-1a", "p4d.24xlarge"))
    assert where.index(("gcp", "us-east1-b", "a2-highgpu-8g")) < p4d < where.index(("gcp", "europe-west4-a",
                                                                                      "a2-highgpu-8g"))


def test_cli_plan_places_the_world_over_aws_and_gcp(gcp_fake, aws_env):
    """`elastic plan` on live offers of both clouds (moto for AWS, the fake for GCP)."""
    from tests.providers.test_aws import spot_history

    aws_rows = {"us-east-1": [("us-east-1a", "p4d.24xlarge", 12.0, "2026-01-01T10:00:00Z")],
                "us-west-2": [("us-west-2b", "p4de.24xlarge", 9.0, "2026-01-01T10:00:00Z")]}
    aws_env.rules.append(lambda action, region, params: spot_history(aws_rows[region])
                         if action == "DescribeSpotPriceHistory" and region in aws_rows else None)
    sets = ["resources.clouds=[aws, gcp]", "resources.accelerators=A100:8",
            "resources.regions=[us-east-1, us-west-2, us-central1, us-east1, europe-west4]",
            "planner.tokens_per_s={A100: 3000}", "planner.spread_min=2"]
    r = _cli("plan", "recipes/multi-cloud.yaml", "--json", *[a for x in sets for a in ("--set", x)],
             env=cli_env(**aws_env.env, **gcp_fake.env()))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["feasible"] and doc["replicas"] == 4 and len(doc["regions"]) >= 2
    where = {(s["cloud"], s["zone"], s["instance_type"]): s["replicas"] for s in doc["placement"]}
    # The cheapest per token (AWS p4de at $9/h) takes three; the spread puts one in another region,
    # GCP's cheapest A100 VM (us-east1-b, $11.17/h) before AWS's p4d at $12/h.
    assert where == {("aws", "us-west-2b", "p4de.24xlarge"): 3, ("gcp", "us-east1-b", "a2-highgpu-8g"): 1}
    assert doc["sync_penalty_s"] == 2 * 20.0      # across clouds: twice planner.cross_region_sync_s


def test_cluster_token_goes_to_secret_manager_not_metadata(gcp_fake, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "tok-secret-789")
    p, recipe = _provider(run="run-t", **{"resources.accelerators": "L4:1"})
    offer = _offer(p, recipe)
    for _ in range(2):
        p._create(offer, "run-t", "replica")
    name = p.token_secret("run-t")
    assert gcp_fake.secrets[name]["versions"] == ["tok-secret-789"]    # stored once per run
    assert gcp_fake.secrets[name]["labels"]["elastic-run"] == "run-t"
    for body in gcp_fake.inserted():
        script = {i["key"]: i["value"] for i in body["metadata"]["items"]}["startup-script"]
        assert f"gcloud secrets versions access latest --secret={name} --project=elastic-test" in script
        assert "tok-secret-789" not in json.dumps(body)
    p.close()                                                          # the run's end deletes it
    assert name not in gcp_fake.secrets


def _node_call(gcp_fake, token: str, method: str, path: str) -> int:
    """A call from a VM with its service account's token (what gcloud on the node sends): the status."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(gcp_fake.url + path, method=method, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.skipif(not __import__("shutil").which("wg"), reason="needs wireguard-tools (wg) for key pairs")
def test_startup_script_joins_the_overlay_with_its_key_from_secret_manager_never_in_metadata(gcp_fake):
    """The startup script brings up the overlay (head as first peer) before it joins Ray
    (`elastic.run.cluster start`) at the node's overlay address; the private key is a Secret Manager secret of the run, never in the
    instance's metadata, and goes at release."""
    from tests.providers.test_aws import _join

    p, recipe = _provider(run="run-wg", **{"resources.accelerators": "L4:1"})
    offer = _offer(p, recipe)
    private, join = _join(p, offer, "run-wg")
    inst = p._create(offer, "run-wg", "replica", join=join)
    body = gcp_fake.instances[inst.instance_id]
    script = {i["key"]: i["value"] for i in body["metadata"]["items"]}["startup-script"]
    assert private not in json.dumps(body)
    secret = p.node_key_secret("run-wg", join.key_name)
    assert gcp_fake.secrets[secret]["versions"] == [private]
    assert gcp_fake.secrets[secret]["labels"]["elastic-run"] == "run-wg"
    # The VM reads it as the run's own service account; another run's account cannot.
    from providers.gcp.scope import account_id
    access = f"/v1/projects/elastic-test/secrets/{secret}/versions/latest:access"
    own = gcp_fake.token_of(f"{account_id('run-wg')}@elastic-test.iam.gserviceaccount.com")
    assert _node_call(gcp_fake, own, "GET", access) == 200
    other, _ = _provider(run="run-other", **{"resources.accelerators": "L4:1"})
    vm_other = other._create(_offer(other, recipe), "run-other", "replica")
    stranger = gcp_fake.token_of(f"{account_id('run-other')}@elastic-test.iam.gserviceaccount.com")
    assert _node_call(gcp_fake, stranger, "GET", access) == 403
    up = script.index(f"gcloud secrets versions access latest --secret={secret} --project=elastic-test | "
                      "python3 -m elastic.net.overlay up")
    assert script.index("OVERLAY_IP=100.80.0.2") < up < script.index("python3 -m elastic.run.cluster start --address=")
    assert f"--peer {join.head.public_key},100.80.0.1,198.51.100.7:51820 " in script
    assert '--node-ip-address="$OVERLAY_IP"' in script and '--overlay-ip "$OVERLAY_IP"' in script
    nic = body["networkInterfaces"][0]
    assert p._addresses(inst) == (nic["accessConfigs"][0]["natIP"], nic["networkIP"])
    p._drop_node_key(offer, "run-wg", join.key_name)
    assert secret not in gcp_fake.secrets
    p.terminate(inst.instance_id)
    p.close()
    other.terminate(vm_other.instance_id)
    other.close()


def test_each_run_gets_a_firewall_rule_and_a_service_account_of_its_own(gcp_fake, monkeypatch):
    """Two runs in one project: each VM carries its run's own network tag, and the run's firewall
    rule admits only the overlay's UDP port to that tag (Ray and torch ports are reachable only
    inside the overlay, whose keys are the run's own). Each run's VMs run as its own service
    account: its token secret only (run A's node is denied run B's token), its checkpoint prefix
    (read, write) and data prefix (read) only, its own VMs to delete. The run's end deletes its
    rule, token and account (and the account's grants); `elastic down RUN` does for a run whose
    driver died."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", "tok")
    from providers.gcp.provider import run_network_tag
    from providers.gcp.scope import account_id

    a, recipe = _provider(run="run-a", **{"resources.accelerators": "L4:1", "checkpoint.uri": "gs://ckpt/runs/a"})
    recipe.data.uri = "gs://shards/tok"   # set past validation, which would read the shards
    b, _ = _provider(run="run-b", **{"resources.accelerators": "L4:1", "checkpoint.uri": "gs://ckpt/runs/b"})
    offer = _offer(a, recipe)
    vms = {run: [p._create(offer, run, "replica") for _ in range(2)] for run, p in (("run-a", a), ("run-b", b))}
    email = {run: f"{account_id(run)}@elastic-test.iam.gserviceaccount.com" for run in vms}
    assert set(gcp_fake.service_accounts) == set(email.values())
    for run, insts in vms.items():
        for inst in insts:
            assert [sa["email"] for sa in gcp_fake.instances[inst.instance_id]["serviceAccounts"]] == [email[run]]
    node_a = gcp_fake.token_of(email["run-a"])
    secret = "/v1/projects/elastic-test/secrets/{}/versions/latest:access"
    assert _node_call(gcp_fake, node_a, "GET", secret.format(a.token_secret("run-a"))) == 200
    assert _node_call(gcp_fake, node_a, "GET", secret.format(b.token_secret("run-b"))) == 403
    vm = "/compute/v1/projects/elastic-test/zones/us-central1-a/instances/{}"
    assert _node_call(gcp_fake, node_a, "DELETE", vm.format(vms["run-b"][0].instance_id)) == 403
    assert gcp_fake.bucket_allows(email["run-a"], "storage.objects.create", "ckpt", "runs/a/step-00000002/x")
    assert gcp_fake.bucket_allows(email["run-a"], "storage.objects.list", "ckpt", list_prefix="runs/a/")
    assert gcp_fake.bucket_allows(email["run-a"], "storage.objects.get", "shards", "tok/shard-0.bin")
    for permission, bucket, name in (("storage.objects.create", "ckpt", "runs/b/step-00000002/x"),
                                     ("storage.objects.get", "ckpt", "runs/b/step-00000002/x"),
                                     ("storage.objects.create", "ckpt", "runs/a2/x"),   # a prefix, not a folder
                                     ("storage.objects.create", "shards", "tok/shard-0.bin")):
        assert not gcp_fake.bucket_allows(email["run-a"], permission, bucket, name), (permission, name)
    assert not gcp_fake.bucket_allows(email["run-a"], "storage.objects.list", "ckpt", list_prefix="runs/b/")
    assert gcp_fake.bucket_allows(email["run-b"], "storage.objects.create", "ckpt", "runs/b/step-00000002/x")
    # The records beside the checkpoints (elastic/record/remote.py): the driver's account writes
    # them; no node writes or reads one, its own run's or an earlier run's at the same prefix.
    for run in ("run-a", "earlier-run"):
        for part in ("events/000001.jsonl", "driver/000002.log", "report.json", "recipe.yaml"):
            name = f"runs/a/record/{run}/{part}"
            for permission in ("storage.objects.create", "storage.objects.delete", "storage.objects.get"):
                assert not gcp_fake.bucket_allows(email["run-a"], permission, "ckpt", name), (permission, name)
            assert not gcp_fake.bucket_allows(email["run-b"], "storage.objects.get", "ckpt", name)
    assert gcp_fake.bucket_allows(email["run-a"], "storage.objects.get", "ckpt", "runs/a/recorded/x")   # a prefix, not a folder
    # A node deletes itself (autodown), through its own VM's policy.
    doomed = vms["run-a"].pop()
    assert _node_call(gcp_fake, node_a, "DELETE", vm.format(doomed.instance_id)) == 200
    assert set(gcp_fake.firewalls) == {run_network_tag("run-a"), run_network_tag("run-b")}
    for run in ("run-a", "run-b"):
        tag = run_network_tag(run)
        rule = gcp_fake.firewalls[tag]
        assert (rule["targetTags"], rule["direction"], rule["sourceRanges"]) == ([tag], "INGRESS", ["0.0.0.0/0"])
        assert rule["allowed"] == [{"IPProtocol": "udp", "ports": ["51820"]}]   # no TCP, no other port
        for inst in vms[run]:
            tags = gcp_fake.instances[inst.instance_id]["tags"]["items"]
            other = run_network_tag("run-b" if run == "run-a" else "run-a")
            assert tag in tags and other not in tags
    assert sum(1 for r in gcp_fake.requests if r["path"].endswith("/global/firewalls")
               and r["method"] == "POST") == 2                 # one rule per run, not per VM
    for inst in vms["run-a"]:
        a.terminate(inst.instance_id)
    a.close()
    assert set(gcp_fake.firewalls) == {run_network_tag("run-b")} and a.token_secret("run-a") not in gcp_fake.secrets
    assert set(gcp_fake.service_accounts) == {email["run-b"]}

    def granted(run):
        return [b for policy in gcp_fake.bucket_policies.values() for b in policy["bindings"]
                if f"serviceAccount:{email[run]}" in b["members"]]
    assert not granted("run-a") and granted("run-b")
    # run-b's driver dies while a node boots: `elastic down run-b --yes` removes VMs, then its rule,
    # token, the booting node's overlay key and its account; its checkpoint key stays.
    from providers.gcp.storage import KEY_SECRET_PREFIX
    b._put_node_key(offer, "run-b", "wg-100-80-0-9", "a-node-key")
    b._put_secret(KEY_SECRET_PREFIX + "run-b", "its-checkpoint-key", "run-b")
    proc = run_cli("down", "run-b", "--yes", env=cli_env(**gcp_fake.env()))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not gcp_fake.instances and not gcp_fake.firewalls
    assert set(gcp_fake.secrets) == {KEY_SECRET_PREFIX + "run-b"}
    assert not gcp_fake.service_accounts and not granted("run-b")


def test_head_controller_starts_an_on_demand_controller_vm_that_down_stops(gcp_fake, gcs_server, tmp_path):
    run_dir = tmp_path / "ctl-run"
    sa = "elastic-driver@elastic-test.iam.gserviceaccount.com"
    r = _cli("launch", "recipes/gcp-smoke.yaml", "--set", "resources.head=controller", "--set",
             f"gcp.controller_service_account={sa}", "--run-dir", str(run_dir), "--detach",
             "--set", "checkpoint.uri=gs://ckpt-ctl/run",   # a controller run checkpoints to a bucket
             env=cli_env(**gcp_fake.env(), RAY_AUTH_TOKEN="dont-leak-this-token"))
    assert r.returncode == 0, r.stdout + r.stderr
    [(name, vm)] = gcp_fake.instances.items()
    assert name in r.stdout
    assert vm["labels"]["elastic-role"] == "controller" and vm["machineType"].endswith("/e2-standard-2")
    assert vm["scheduling"]["provisioningModel"] == "STANDARD" and vm["scheduling"]["onHostMaintenance"] == "MIGRATE"
    assert "guestAccelerators" not in vm and vm["serviceAccounts"][0]["email"] == sa
    script = {i["key"]: i["value"] for i in vm["metadata"]["items"]}["startup-script"]
    assert "ray start --head" in script and "elastic launch recipe.yaml --set resources.head=local" in script
    # Autodown on the controller too: its watcher deletes it when its driver stops beating.
    assert "python3 -m providers.watcher --cloud gcp" in script and "--autodown-after-s 600 " in script
    [recipe_b64] = re.findall(r"echo (\S+) \| base64 -d", script)
    assert "name: gcp-smoke" in base64.b64decode(recipe_b64).decode()
    assert "dont-leak-this-token" not in json.dumps(vm)
    events = [json.loads(ln) for ln in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["type"] for e in events] == ["run_started", "node_launched", "controller_started"]
    t = PRICES["us-central1"]   # priced from the catalog's E2 SKUs: 2 vCPUs, 8 GiB
    assert events[1]["usd_per_hour"] == pytest.approx(2 * t["e2-core"][0] + 8 * t["e2-ram"][0])
    down = _cli("down", str(run_dir), "--yes", env=cli_env(**gcp_fake.env()))
    assert down.returncode == 0, down.stderr
    assert gcp_fake.instances == {}


def test_down_orphans_judges_runs_by_their_heartbeat_label(gcp_fake, tmp_path):
    """No run directory anywhere: a run whose driver labelled its VMs (controller included) a
    minute ago survives `down --orphans`; a run whose newest heartbeat is stale is deleted."""
    p, recipe = _provider(**{"resources.accelerators": "L4:1"})
    offer = _offer(p, recipe)
    cpu = Offer(**{**offer.to_dict(), "gpus": 0, "gpu": "", "spot": False})
    orphan = [p._create(offer, "gone-run", "replica"), p._create(cpu, "gone-run", "controller")]
    p._tag_heartbeat(orphan, time.time() - 3600)
    ctl = p._create(cpu, "live-run", "controller")
    worker = p._create(offer, "live-run", "replica")
    p._held[worker.instance_id] = worker
    p.heartbeat("live-run", time.time() - 60)   # as the run's driver does: held VMs and its controller
    assert sorted(gcp_fake.label_sets[-2:]) == sorted([ctl.instance_id, worker.instance_id])
    labels = gcp_fake.instances[worker.instance_id]["labels"]
    assert labels["elastic-run"] == "live-run" and labels["elastic-role"] == "replica"   # the others kept
    r = _cli("down", "--orphans", "--yes", env=cli_env(**gcp_fake.env()))
    assert r.returncode == 0, r.stderr
    assert "terminated 2 instance(s)" in r.stdout
    assert set(gcp_fake.instances) == {ctl.instance_id, worker.instance_id}


@pytest.mark.slow
def test_driver_trains_on_gcp_vms_and_drains_one_on_its_notice(gcp_fake, local_cluster, tmp_path, monkeypatch):
    """The real driver and world on GCP "VMs": the fake boots each inserted VM as a local raylet
    labelled with its instance name (as the startup script's `ray start` would), a notice is
    forwarded for one of them as its watcher would, and the run drains it, rents a replacement,
    completes, and deletes every VM."""
    from elastic.run.driver import run_attached
    from providers import cloud, watcher

    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(cloud, "STATE_POLL_S", 1.0)
    nodes: dict[str, str] = {}
    lock = threading.Lock()
    # Raylets die with the thread that started them (Linux parent-death signal): start them all
    # from one thread that lives as long as the test.
    starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vm-boot")

    def _start(name):
        node = join_as_vm(local_cluster, name, "gcp")
        with lock:
            nodes[name] = node

    def boot(name, body):
        starter.submit(_start, name)

    def stop(name):
        with lock:
            node = nodes.pop(name, None)
        if node is not None:
            local_cluster.remove_node(node, graceful=False)

    gcp_fake.on_insert, gcp_fake.on_delete = boot, stop
    noticed = []

    def notice(driver, phase, members):
        if noticed or phase != "inner" or driver.world.outer_step < 1 or len(members) < 2:
            return
        name = driver.world.replicas[members[0]].instance_id
        noticed.append(name)
        watcher.forward(name, {"kind": "notice", "deadline": time.time() + 30, "action": "preempted"})

    recipe = tiny_recipe(**{"resources.clouds": "[gcp]", "resources.head": "local", "resources.accelerators": "L4:1",
                            "resources.regions": "[us-central1]", "resources.join_timeout_s": 60,
                            "world.replicas": 2, "world.max_replicas": 2, "world.capacity_timeout_s": 120,
                            "train.outer_steps": 4})
    # Every inner step takes at least 0.4 s (a slow VM): the 16 steps hold a VM for longer than the
    # driver's HEARTBEAT_S, so one of its beats finds the VMs and labels them, however fast they join.
    monkeypatch.setenv("ELASTIC_FAULT_STEP_DELAY_S", "0.4")
    try:
        status, events = run_attached(recipe, local_cluster, tmp_path / "run", on_phase=notice, run_name="gcp-e2e")
    finally:
        for name in list(nodes):
            stop(name)
        starter.shutdown(wait=True)
    assert status == "completed"
    launched = [e for e in events if e["type"] == "node_launched"]
    assert len(launched) >= 3 and all(e["cloud"] == "gcp" and e["zone"].startswith("us-central1-") for e in launched)
    # The replacement rented at the notice may still be booting when the run completes: then it
    # is recorded as launched but not joined, and released (billed for the seconds it ran).
    joined = [e["instance_id"] for e in launched if e["joined"]]
    assert len(joined) >= 2 and noticed[0] in joined
    assert [e["instance_id"] for e in events if e["type"] == "node_notice"] == noticed
    assert noticed[0] in {e["instance_id"] for e in events if e["type"] == "replica_drained"}
    assert gcp_fake.instances == {}                              # every VM deleted at the end
    # The driver labelled the VMs it held with its heartbeat (what `down --orphans` reads).
    assert set(gcp_fake.label_sets) & set(joined)
    released = {e["instance_id"] for e in events if e["type"] == "node_released"}
    assert released == {e["instance_id"] for e in launched}


# What each REST call the driver makes needs from IAM (Compute, Secret Manager, IAM, Cloud Storage;
# the Billing Catalog needs none). A call not listed here fails the test below: add it, and its
# permission to infra/gcp/main.tf.
_DRIVER_PERMISSIONS = [(m, re.compile(p), perm) for m, p, perm in (
    ("GET", r"/compute/v1/projects/[^/]+/zones", "compute.zones.list"),
    ("GET", r"/compute/v1/projects/[^/]+/regions/[^/]+", "compute.regions.get"),
    ("GET", r"/compute/v1/projects/[^/]+/aggregated/machineTypes", "compute.machineTypes.list"),
    ("GET", r"/compute/v1/projects/[^/]+/aggregated/acceleratorTypes", "compute.acceleratorTypes.list"),
    ("GET", r"/compute/v1/projects/[^/]+/aggregated/instances", "compute.instances.list"),
    ("POST", r"/compute/v1/projects/[^/]+/zones/[^/]+/instances", "compute.instances.create"),
    ("GET", r"/compute/v1/projects/[^/]+/zones/[^/]+/instances/[^/]+", "compute.instances.get"),
    ("GET", r"/compute/v1/projects/[^/]+/zones/[^/]+/instances/[^/]+/serialPort",
     "compute.instances.getSerialPortOutput"),
    ("DELETE", r"/compute/v1/projects/[^/]+/zones/[^/]+/instances/[^/]+", "compute.instances.delete"),
    ("POST", r"/compute/v1/projects/[^/]+/zones/[^/]+/instances/[^/]+/setLabels", "compute.instances.setLabels"),
    ("POST", r"/compute/v1/projects/[^/]+/zones/[^/]+/instances/[^/]+/setIamPolicy",
     "compute.instances.setIamPolicy"),
    ("POST", r"/compute/v1/projects/[^/]+/zones/[^/]+/operations/[^/]+/wait", "compute.zoneOperations.get"),
    ("POST", r"/compute/v1/projects/[^/]+/global/firewalls", "compute.firewalls.create"),
    ("GET", r"/compute/v1/projects/[^/]+/global/firewalls/[^/]+", "compute.firewalls.get"),
    ("DELETE", r"/compute/v1/projects/[^/]+/global/firewalls/[^/]+", "compute.firewalls.delete"),
    ("GET", r"/compute/v1/projects/[^/]+/global/operations/[^/]+", "compute.globalOperations.get"),
    ("POST", r"/v1/projects/[^/]+/secrets", "secretmanager.secrets.create"),
    ("GET", r"/v1/projects/[^/]+/secrets", "secretmanager.secrets.list"),
    ("DELETE", r"/v1/projects/[^/]+/secrets/[^/:]+", "secretmanager.secrets.delete"),
    ("POST", r"/v1/projects/[^/]+/secrets/[^/:]+:addVersion", "secretmanager.versions.add"),
    ("POST", r"/v1/projects/[^/]+/secrets/[^/:]+:setIamPolicy", "secretmanager.secrets.setIamPolicy"),
    ("POST", r"/v1/projects/[^/]+/serviceAccounts", "iam.serviceAccounts.create"),
    ("GET", r"/v1/projects/[^/]+/serviceAccounts/[^/]+", "iam.serviceAccounts.get"),
    ("DELETE", r"/v1/projects/[^/]+/serviceAccounts/[^/]+", "iam.serviceAccounts.delete"),
    ("GET", r"/storage/v1/b/[^/]+/iam", "storage.buckets.getIamPolicy"),
    ("PUT", r"/storage/v1/b/[^/]+/iam", "storage.buckets.setIamPolicy"),
)]


def test_driver_roles_allow_every_call_the_provider_makes(gcp_fake, monkeypatch):
    """A run's whole life against the fake (preflight, prices, a node with its run's account,
    token, key, rule and bucket grants, heartbeat, listing, release, `down`): every request the
    driver sent needs a permission that infra/gcp/main.tf gives elastic-driver's custom roles."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", "tok")
    from tests.providers.test_aws import _join

    p, recipe = _provider(run="run-perm", **{"resources.accelerators": "L4:1", "resources.regions": "[us-central1]",
                                             "checkpoint.uri": "gs://ckpt/runs/p"})
    assert p.preflight(recipe.resources) == []
    offer = _offer(p, recipe)
    join = None
    if __import__("shutil").which("wg"):
        _, join = _join(p, offer, "run-perm")
    inst = p._create(offer, "run-perm", "replica", join=join)
    p._held[inst.instance_id] = inst
    p.heartbeat("run-perm", time.time())
    assert [i.instance_id for i in p.list_instances("run-perm")] == [inst.instance_id]
    assert p.console_tail(inst) == ""   # the fake's VM wrote nothing to its console
    p.terminate(inst.instance_id)
    p.remove_run_resources("run-perm")
    p.close()
    needed = set()
    for r in gcp_fake.requests:
        if "/skus" in r["path"]:
            continue   # the Billing Catalog: any credential may read it
        perms = {perm for method, pattern, perm in _DRIVER_PERMISSIONS
                 if method == r["method"] and pattern.fullmatch(r["path"])}
        assert perms, f"no permission known for {r['method']} {r['path']}: add it here and to main.tf"
        needed |= perms
    assert {"compute.instances.create", "compute.regions.get", "secretmanager.secrets.list",
            "storage.buckets.setIamPolicy", "iam.serviceAccounts.create"} <= needed
    tf = (REPO / "infra" / "gcp" / "main.tf").read_text()
    granted = set()
    for role in re.findall(r'resource "google_project_iam_custom_role" "driver\w*" \{(.*?)\n\}', tf, re.S):
        granted |= set(re.findall(r'"([a-z]+\.[A-Za-z]+\.[A-Za-z]+)"', role.split("permissions", 1)[1]))
    assert needed <= granted, sorted(needed - granted)


def test_missing_credentials_say_gcp_once(tmp_path):
    """`elastic prices` without --cloud asks every cloud and prefixes each one's line with its name:
    the GCP line is not prefixed a second time (it was `gcp: gcp: no Google Cloud credentials`)."""
    env = cli_env(GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / "missing.json"), NO_GCE_CHECK="True",
                  ELASTIC_CACHE=str(tmp_path / "cache"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
                  AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_EC2_METADATA_DISABLED="true")
    for k in ("ELASTIC_GCP_COMPUTE_ENDPOINT", "ELASTIC_GCP_BILLING_ENDPOINT", "AWS_ACCESS_KEY_ID",
              "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        env.pop(k, None)
    r = _cli("prices", "--accelerator", "A100", env=env)
    assert r.returncode == 2 and "gcp: no Google Cloud credentials" in r.stderr, r.stderr
    assert "gcp: gcp:" not in r.stderr and "aws: aws:" not in r.stderr and "Traceback" not in r.stderr
    r = _cli("prices", "--cloud", "gcp", "--accelerator", "A100", env=env)
    assert r.returncode == 2 and r.stderr.count("gcp:") == 1, r.stderr
