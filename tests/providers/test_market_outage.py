"""Prices that stop answering mid-run, through boto3 against moto behind the test proxy (127.0.0.1):
the driver keeps what it holds and says `market_unavailable`; prices that are not numbers >= 0
never rank."""

from __future__ import annotations

import logging
import shutil

from elastic.ledger import Ledger
from tests.conftest import aws_error
from tests.providers.test_aws import aws_recipe, price_rule, spot_history


def test_throttled_and_malformed_price_answers_leave_the_run_going(aws_env, monkeypatch, tmp_path, caplog):
    import providers.aws.provider
    from elastic.driver import Driver
    from providers import build

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
    recipe = aws_recipe(**{"resources.regions": "[us-west-2]"})
    ledger = Ledger(tmp_path / "run" / "events.jsonl")
    driver = Driver(recipe, tmp_path / "run", ledger)
    p = build("aws", recipe, None, "run-outage")
    driver.providers, driver.provider = {"aws": p}, p

    def fresh_offers():
        p._memo = None                                     # the in-memory 30 s reuse
        shutil.rmtree(aws_env.env["ELASTIC_CACHE"], ignore_errors=True)   # the price cache's TTL ran out
        return [(o.zone, o.usd_per_hour) for o in driver._offers()]

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
