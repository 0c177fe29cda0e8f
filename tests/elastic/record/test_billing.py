"""`elastic.record.billing`: minimum, increment, a price change mid-hold, on-demand, the launch span, a spot VM
its cloud interrupts young."""

from __future__ import annotations

import pytest

from elastic.record import billing
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
    # A cloud that bills by the hour (its facts are what the bill reads).
    from providers.base import BillingTerms
    from providers.gcp import facts
    monkeypatch.setattr(facts, "BILLING", BillingTerms(minimum_s=3600.0, increment_s=3600.0))
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


def test_billing_terms_are_data_read_without_the_provider_classes():
    import subprocess
    import sys

    code = ("import sys; from elastic.record import billing; t = [billing.terms(c) for c in ('aws', 'gcp', 'local')]; "
            "print(sorted(m for m in sys.modules if m.endswith('.provider') and m.startswith('providers.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    # AWS bills nothing for a spot VM EC2 interrupts in its first hour; GCP has no such rule.
    assert billing.terms("aws") == billing.BillingTerms(minimum_s=60.0, increment_s=1.0, interrupted_free_s=3600.0)
    assert billing.terms("gcp") == billing.BillingTerms(minimum_s=60.0, increment_s=1.0)
    assert billing.terms("local") == billing.BillingTerms(minimum_s=0.0, increment_s=1.0)


def test_a_spot_vm_aws_interrupts_in_its_first_hour_bills_nothing_one_the_run_lets_go_bills_its_seconds():
    segments = [(0.0, 0.9), (600.0, 1.8)]
    # EC2 took it after 59 min: nothing, its minimum and the seconds at either price alike.
    assert billing.free("aws", 3540.0, interrupted=True)
    assert billing.vm_usd("aws", segments, stop_s=3540.0, ended=True, interrupted=True) == 0.0
    assert billing.free("aws", 30.0, interrupted=True)
    # Released by the run at the same age, or taken after the hour: its seconds.
    assert billing.vm_usd("aws", segments, stop_s=3540.0, ended=True) == pytest.approx(600 * 0.9 / 3600 + 2940 * 1.8 / 3600)
    assert billing.vm_usd("aws", segments, stop_s=3660.0, ended=True, interrupted=True) == \
        pytest.approx(600 * 0.9 / 3600 + 3060 * 1.8 / 3600)
    # GCP has no such rule: its seconds, and its minimum.
    assert not billing.free("gcp", 30.0, interrupted=True) and billing.billed_s("gcp", 30.0, ended=True) == 60.0
    # What accrued before its end is still shown as accrued (the refund comes when it goes).
    assert billing.vm_usd("aws", segments, stop_s=3540.0, ended=True, until=600.0, interrupted=True) == \
        pytest.approx(600 * 0.9 / 3600)


def test_a_ledger_refunds_only_the_spot_vms_its_cloud_took_young():
    from elastic.record.events import read
    from elastic.views.report import build_report
    from tests.elastic.views.test_report_costs import ended, started, vm
    from tests.elastic.views.test_report_html import T0

    def gone(t, iid, **kw):
        return {"t": t, "type": "node_preempted", "instance_id": iid, "with_notice": False, "replica": None, **kw}

    launched = [vm(T0, iid, usd=1.0, on_demand=3.0, cloud="aws", region="us-east-1")
                for iid in ("taken", "noticed", "released", "lost", "old")]
    records = [started(), *launched,
               gone(T0 + 1800, "taken", reclaimed=True),          # EC2 says it took it (a spot interruption)
               gone(T0 + 1800, "noticed", with_notice=True),      # after EC2's notice: one too
               {"t": T0 + 1800, "type": "node_released", "instance_id": "released"},
               gone(T0 + 1800, "lost"),                           # gone, no word why: billed
               gone(T0 + 5400, "old", reclaimed=True),            # taken after its first hour: billed
               ended(T0 + 5400)]
    vms = billing.holds(read(records), T0 + 5400)
    assert [i for i, h in vms.items() if h.free] == ["taken", "noticed"]
    assert [vms[i].usd() for i in vms] == [0.0, 0.0, pytest.approx(0.5), pytest.approx(0.5), pytest.approx(1.5)]
    # Its time still counts as held and billed by the terms; only what it cost is refunded.
    assert vms["taken"].billed_s() == 1800.0 and vms["taken"].usd_between(T0, T0 + 900) == 0.0
    assert vms["taken"].on_demand_usd() == pytest.approx(1.5)     # on demand, it would have been billed
    r = build_report(records)
    assert r["cost_usd"] == pytest.approx(2.5) and r["refunded_usd"] == pytest.approx(1.0)
    assert r["vm_hours"] == pytest.approx(4 * 0.5 + 1.5)
    from elastic.views.report import headline_rows
    assert dict(headline_rows(r))["cost"] == "$2.5000 (the clouds refunded $1.0000 of spot VMs they took back young)"
    # The cost curve rises with what the VMs accrue and steps down by the refund when they go.
    usd, _ = billing.cumulative(vms, T0, T0 + 5400)
    assert (1800.0, pytest.approx(2.5)) in usd and (1800.0, pytest.approx(1.5)) in usd
    assert usd[-1] == (5400.0, pytest.approx(2.5))
    # On demand the same hold is billed: the same records with the VM rented on demand.
    od = [dict(r, spot=False) if r.get("instance_id") == "taken" and r["type"] == "node_launched" else r for r in records]
    assert build_report(od)["cost_usd"] == pytest.approx(3.0)


def test_a_ledger_is_priced_in_one_place_the_curve_ends_at_the_reports_totals():
    from elastic.record.events import read
    from elastic.views.report import build_report
    from tests.elastic.views.test_report_costs import ended, started, vm
    from tests.elastic.views.test_report_html import T0, richer_run

    gcp_short = [started(), vm(T0 + 10, "g", usd=1.20, on_demand=3.60, cloud="gcp", region="us-central1"),
                 {"t": T0 + 40, "type": "node_preempted", "instance_id": "g"}, ended(T0 + 100)]
    for records in (richer_run(), gcp_short):
        r = build_report(records)
        end = records[-1]["t"]
        usd, od = billing.cumulative(billing.holds(read(records), end), T0, end)
        assert usd[-1] == (end - T0, pytest.approx(r["cost_usd"], abs=1e-5))
        assert od[-1][1] == pytest.approx(r["on_demand_equivalent_usd"], abs=1e-5)
        assert billing.cost_so_far(records, end) == pytest.approx(r["cost_usd"], abs=1e-6)
        assert all(b[1] >= a[1] for a, b in zip(usd, usd[1:]))          # never decreases (nothing refunded)
    # Along the way it is what the VMs had accrued by then.
    records = richer_run()
    usd, _ = billing.cumulative(billing.holds(read(records), records[-1]["t"]), T0, records[-1]["t"])
    x, y = usd[len(usd) // 2]
    assert y == pytest.approx(billing.cost_so_far([e for e in records if e["t"] <= T0 + x], T0 + x), abs=1e-6)
