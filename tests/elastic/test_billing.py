"""`elastic.billing`: minimum, increment, a price change mid-hold, on-demand, the launch span."""

from __future__ import annotations

import pytest

from elastic import billing


def test_minimum_applies_once_a_vm_is_gone_and_never_while_held():
    assert billing.billed_s("gcp", 30.0, ended=True) == 60.0
    assert billing.billed_s("aws", 30.0, ended=True) == 60.0
    assert billing.billed_s("local", 30.0, ended=True) == 30.0
    assert billing.billed_s("gcp", 30.0, ended=False) == 30.0     # still held: the seconds so far
    assert billing.billed_s("gcp", 0.0, ended=True) == 0.0        # never held: nothing
    assert billing.vm_usd("gcp", [(100.0, 3.6)], stop_s=130.0, ended=True) == pytest.approx(60 * 3.6 / 3600)
    assert billing.vm_usd("gcp", [(100.0, 3.6)], stop_s=130.0, ended=False) == pytest.approx(30 * 3.6 / 3600)


def test_increment_rounds_a_finished_hold_up_to_whole_increments(monkeypatch):
    assert billing.billed_s("local", 61.2, ended=True) == 62.0
    assert billing.billed_s("aws", 120.0, ended=True) == 120.0    # a whole number is not rounded up
    # A cloud that bills by the hour (its provider's figures are what the bill reads).
    from providers import provider_class
    monkeypatch.setattr(provider_class("gcp"), "billing_minimum_s", 3600.0)
    monkeypatch.setattr(provider_class("gcp"), "billing_increment_s", 3600.0)
    assert billing.billed_s("gcp", 3601.0, ended=True) == 7200.0
    # The seconds short of the increment bill at the last price.
    assert billing.vm_usd("gcp", [(0.0, 1.0), (1800.0, 3.0)], stop_s=3601.0, ended=True) == \
        pytest.approx(0.5 + 1801 * 3 / 3600 + 3599 * 3 / 3600)


def test_a_price_change_mid_hold_bills_each_interval_at_its_price():
    segments = [(0.0, 2.0), (600.0, 8.0), (1200.0, 1.0)]
    # 10 min at $2/h + 10 min at $8/h + 5 min at $1/h.
    assert billing.vm_usd("aws", segments, stop_s=1500.0, ended=True) == pytest.approx(2 / 6 + 8 / 6 + 1 / 12)
    # A window inside the hold: [300, 900] = 5 min at $2/h + 5 min at $8/h.
    assert billing.usd_between(segments, 1500.0, 300.0, 900.0) == pytest.approx(2 / 12 + 8 / 12)
    # Up to `until` only: no minimum yet.
    assert billing.vm_usd("aws", segments, stop_s=1500.0, ended=True, until=600.0) == pytest.approx(2 / 6)


def test_on_demand_prices_the_same_billed_seconds():
    assert billing.vm_on_demand_usd("gcp", 0.0, 30.0, True, 7.2) == pytest.approx(60 * 7.2 / 3600)
    assert billing.vm_on_demand_usd("local", 0.0, 30.0, True, 7.2) == pytest.approx(30 * 7.2 / 3600)
    assert billing.vm_on_demand_usd("gcp", 0.0, 300.0, False, 7.2, until=120.0) == pytest.approx(120 * 7.2 / 3600)


def test_a_launch_commits_the_budget_to_the_clouds_minimum():
    assert billing.launch_span_s("aws") == 60.0
    assert billing.launch_span_s("local") == 1.0
    assert billing.launch_span_s("gcp", override_s=3600.0) == 3600.0
    assert billing.terms("some-new-cloud") == billing.DEFAULT_TERMS
