"""Prices that stop answering mid-run, through boto3 against moto behind the test proxy (127.0.0.1):
the driver keeps what it holds and says `market_unavailable`, and a whole run on AWS "VMs" completes
through the outages; prices that are not numbers >= 0 never rank."""

from __future__ import annotations

import logging
import shutil
import threading

import pytest

from elastic.record.events import MarketAvailable, MarketUnavailable
from elastic.record.ledger import Ledger
from tests.conftest import aws_error, join_as_vm
from tests.providers.test_aws import aws_recipe, instances, price_rule, spot_history


def feed_on_aws(tmp_path, run: str):
    """The driver's offer feed (no cluster, no world) on one provider, AWS in us-west-2: (the feed,
    its ledger, the provider)."""
    from elastic.run.offerfeed import OfferFeed
    from providers import build

    recipe = aws_recipe(**{"resources.regions": "[us-west-2]"})
    ledger = Ledger(tmp_path / "run" / "events.jsonl")
    p = build("aws", recipe, None, run)
    return OfferFeed({"aws": p}, recipe.resources, ledger), ledger, p


def test_throttled_and_malformed_price_answers_leave_the_run_going(aws_env, monkeypatch, tmp_path, caplog):
    import providers.aws.provider

    monkeypatch.setattr(providers.aws.provider, "MAX_ATTEMPTS", 2)   # the SDK's retries, fewer of them
    mode = ["bad-prices"]

    def market(action, region, params):
        if action != "DescribeSpotPriceHistory":
            return None
        if mode[0] == "throttled":
            return aws_error("RequestLimitExceeded", "Request limit exceeded.", status=503)
        if mode[0] == "malformed":
            return 200, "<DescribeSpotPriceHistoryResponse><spotPriceHistorySet><item>"
        if mode[0] == "bad-prices":
            return spot_history([("us-west-2a", "g5.xlarge", -0.40, "2026-01-01T10:00:00Z"),
                                 ("us-west-2b", "g5.xlarge", "NaN", "2026-01-01T10:00:00Z"),
                                 ("us-west-2c", "g5.2xlarge", 0.42, "2026-01-01T10:00:00Z")])
        return price_rule(action, region, params)

    aws_env.rules.append(market)
    feed, ledger, p = feed_on_aws(tmp_path, "run-outage")

    def fresh_offers():
        p._memo = None                                     # the in-memory 30 s reuse
        shutil.rmtree(aws_env.env["ELASTIC_CACHE"], ignore_errors=True)   # the price cache's TTL ran out
        return [(o.zone, o.usd_per_hour) for o in feed.offers(wait_s=60)]

    with caplog.at_level(logging.WARNING, logger="providers"):
        assert fresh_offers() == [("us-west-2c", 0.42)]    # -0.40 and NaN dropped, not ranked first
    assert sum("dropped the price" in r.getMessage() for r in caplog.records) == 2

    for mode[0] in ("throttled", "malformed", "throttled"):
        assert fresh_offers() == []                         # nothing to rent; nothing raised
    assert aws_env.count("DescribeSpotPriceHistory") >= 1 + 2 + 1 + 2   # the throttled calls were retried
    mode[0] = "ok"
    assert fresh_offers() == [("us-west-2a", 0.40), ("us-west-2c", 0.42)]
    mode[0] = "malformed"
    assert fresh_offers() == []
    events = [(e["type"], e.get("message", "")) for e in ledger.events if e["type"].startswith("market_")]
    assert [t for t, _ in events] == ["market_unavailable", "market_available", "market_unavailable"]
    assert "RequestLimitExceeded" in events[0][1] and events[2][1]
    ledger.close()
    p.close()


def test_a_cloud_slow_to_answer_holds_no_tick(aws_env, tmp_path):
    """The offers are asked on a thread of their own: while the price API is held (an SDK retrying
    a throttled call for seconds, here a request the proxy answers only when the test says), the
    driver's tick goes on at once, without the answer; a later tick takes it, and only one request
    was made meanwhile."""
    import time

    from elastic.run.offerfeed import OFFERS_WAIT_S

    held, arrived, asked = threading.Event(), threading.Event(), []

    def slow_market(action, region, params):
        if action == "DescribeSpotPriceHistory":
            asked.append(time.monotonic())
            arrived.set()
            held.wait(timeout=60)
        return None

    aws_env.rules.append(slow_market)
    feed, ledger, p = feed_on_aws(tmp_path, "run-slow")
    try:
        assert feed.offers() is None                        # asked ...
        assert arrived.wait(timeout=30)                        # ... and held at the cloud
        for _ in range(3):
            started = time.monotonic()
            assert feed.offers() is None                    # not answered yet: the tick goes on
            assert time.monotonic() - started < OFFERS_WAIT_S + 1.0
        assert len(asked) == 1                                 # asked once, not once per tick
    finally:
        held.set()
    assert [o.zone for o in feed.offers(wait_s=60)]          # the answer, taken by a later tick
    assert not [e for e in ledger.events if e["type"].startswith("market_")]
    ledger.close()
    p.close()


@pytest.mark.slow
def test_a_run_on_aws_vms_trains_through_a_price_outage_and_completes(aws_env, local_cluster, monkeypatch, tmp_path):
    """The real driver and world on AWS "VMs" (moto rents each; a raylet labelled with its instance
    id stands in for its boot script joining). Mid-run the price answers are throttled, come back,
    then do not parse: the run keeps training on what it holds, the ledger says so each time, and
    the run completes with every VM terminated. (Spot prices are never reused from the disk cache,
    and the provider's 30 s memory of its offers is dropped at every phase, as the minutes of a
    real run would expire them: the offers are read on a thread of their own, so an answer asked
    before a change may land after it, and must not outlive it.)"""
    import providers.aws.provider
    from elastic.run.driver import run_attached

    monkeypatch.setattr(providers.aws.provider, "MAX_ATTEMPTS", 2)   # the SDK's retries, fewer of them
    cached = providers.aws.provider.cached_json
    monkeypatch.setattr(providers.aws.provider, "cached_json", lambda key, fetch, **kw: cached(
        key, fetch, **({**kw, "ttl_s": 0.0} if key.startswith("aws-spot-") else kw)))
    mode = ["ok"]

    def market(action, region, params):
        if action != "DescribeSpotPriceHistory" or mode[0] == "ok":
            return price_rule(action, region, params)
        if mode[0] == "throttled":
            return aws_error("RequestLimitExceeded", "Request limit exceeded.", status=503)
        return 200, "<DescribeSpotPriceHistoryResponse><spotPriceHistorySet><item>"   # malformed

    aws_env.rules.append(market)
    run = "run-outage-e2e"
    booted: dict[str, str] = {}
    boot_failed: list[Exception] = []
    stop = threading.Event()

    def boot_vms():
        """Each VM moto starts for the run joins as a raylet. Raylets die with the thread that
        started them: this one lives as long as the run."""
        try:
            while not stop.is_set():
                for vm in instances("us-west-2", run):
                    if vm["InstanceId"] not in booted and vm["State"]["Name"] in ("pending", "running"):
                        booted[vm["InstanceId"]] = join_as_vm(local_cluster, vm["InstanceId"], "aws")
                stop.wait(0.2)
        except Exception as exc:   # said by the test below, not lost with the thread
            boot_failed.append(exc)

    # Each change waits until the ledger holds what the one before caused (offers are read at
    # every tick: a re-plan is due at every one): (answers, event type, how many of it first).
    steps = [("throttled", None, 0), ("ok", MarketUnavailable.TYPE, 1), ("malformed", MarketAvailable.TYPE, 1),
             ("ok", MarketUnavailable.TYPE, 2)]
    done = []

    def outages(driver, phase, members):
        driver.providers["aws"]._memo = None
        if len(done) == len(steps) or driver.world.outer_step < 1:
            return
        change, after, count = steps[len(done)]
        if after is not None and sum(e["type"] == after for e in driver.ledger.events) < count:
            # The world trains on while the clouds answer (40 short steps fit in the SDK's retries):
            # while a change waits for its effect, the answer under way lands before it steps on.
            if driver.offer_feed._asking is not None:
                driver.offer_feed._asking.result(timeout=60)
            return
        done.append(change)
        mode[0] = change

    recipe = aws_recipe(**{"resources.regions": "[us-west-2]", "resources.join_timeout_s": 60,
                           "world.replicas": 2, "world.max_replicas": 2, "world.capacity_timeout_s": 60,
                           "planner.replan_every_s": 0.01, "train.outer_steps": 40})
    booter = threading.Thread(target=boot_vms, name="vm-boot", daemon=True)
    booter.start()
    try:
        status, events = run_attached(recipe, local_cluster, tmp_path / run, on_phase=outages, run_name=run)
    finally:
        stop.set()
        booter.join(timeout=30)
        for node_id in booted.values():
            local_cluster.remove_node(node_id, graceful=False)
    assert not boot_failed, boot_failed
    assert status == "completed" and done == [c for c, _, _ in steps]
    market_events = [(e["type"], e.get("message")) for e in events if e["type"] in (MarketUnavailable.TYPE, MarketAvailable.TYPE)]
    assert [t for t, _ in market_events][:3] == [MarketUnavailable.TYPE, MarketAvailable.TYPE, MarketUnavailable.TYPE]
    assert "RequestLimitExceeded" in market_events[0][1] and market_events[2][1]
    assert [e["outer_step"] for e in events if e["type"] == "outer_step"] == list(range(1, 41))
    # It trained on what it held: no VM was lost or added during the outages.
    launched = {e["instance_id"] for e in events if e["type"] == "node_launched"}
    assert len(launched) == 2 and launched == {e["instance_id"] for e in events if e["type"] == "node_released"}
    assert all(vm["State"]["Name"] in ("shutting-down", "terminated") for vm in instances("us-west-2", run))
