"""The pause rule run by the real driver on the local simulated-spot provider: a price spike mid-run
pauses the world (a durable checkpoint, every VM released, no capacity clock), and when the price
falls the world is rented again and restarts from that checkpoint, losing no step; a paused run
with no price to go by ends at its deadline."""

from __future__ import annotations

import threading

import pytest

from elastic.policy.rules import MIN_SAMPLES
from elastic.record.events import WorldPaused
from elastic.run.driver import run_attached
from elastic.views.report import build_report
from tests.conftest import TRACE_HEADER, tiny_recipe

pytestmark = pytest.mark.slow

SPIKE_S, CALM_S = 5.0, 10.0   # trace seconds: r1a costs 100 times more from SPIKE_S to CALM_S
COMPRESSION = 0.001           # the market's clock barely moves by itself: the test moves it


def scenario(tmp_path, prices: list[tuple[float, float]], **overrides):
    """A one-zone trace ((trace second, USD/h) rows, capacity 8) and a recipe for it: an hour to
    train a few seconds' worth (the run needs a sliver of the time left and can wait out a dear
    market), the pause rule on, prices sampled every 50 ms (the rule needs MIN_SAMPLES of them)."""
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_HEADER
                     + "".join(f"{t:g},local,r1,r1a,cpu,,0,{usd:g},9000,0,8\n" for t, usd in prices))
    return tiny_recipe(**{
        "world.replicas": 1, "world.max_replicas": 2, "train.outer_steps": 60, "train.inner_steps": 4,
        "checkpoint.every_outer_steps": 0, "budget.max_hours": 1, "planner.pauses": "true",
        "planner.price_sample_s": 0.05, "planner.recovery_s": 1,
        "local.market.time_compression": COMPRESSION, "local.market.trace": str(trace),
        "local.instance_types": "[{name: cpu, region: r1, zone: r1a}]", **overrides})


class Market:
    """Moves the local market's clock (its trace) from the driver's hooks, and says where to."""

    def __init__(self):
        self.moved: list[float] = []

    def move(self, driver, to_s: float) -> None:
        with driver.provider._lock:
            market = driver.provider.market
            market.advance((to_s - market.sim_time_s) / COMPRESSION)
        self.moved.append(to_s)

    def spike_once_trained(self, driver, phase: str, then) -> None:
        """Once the world trains with MIN_SAMPLES prices seen, the market turns dear (SPIKE_S);
        `then(driver)` is called at the pause's ledger event."""
        if not self.moved and phase == "inner" and driver.world.outer_step >= 2 and len(driver.executor.state.prices) >= MIN_SAMPLES:
            self.move(driver, SPIKE_S)
            driver.ledger.listeners.append(lambda e: then(driver) if isinstance(e, WorldPaused) else None)


def test_a_price_spike_pauses_the_run_and_it_resumes_from_the_pause_checkpoint(local_cluster, tmp_path, monkeypatch):
    recipe = scenario(tmp_path, [(0, 10), (SPIKE_S, 1000), (CALM_S, 10)], **{"world.capacity_timeout_s": 5})
    market, timers = Market(), []

    def calm_later(driver) -> None:
        # 7 s after the pause took effect, longer than world.capacity_timeout_s, it turns cheap again.
        timers.append(threading.Timer(7.0, market.move, (driver, CALM_S)))
        timers[-1].start()

    def spike(driver, phase, members):
        market.spike_once_trained(driver, phase, calm_later)

    # Every inner step takes at least 40 ms (fault injection: a slow VM): the world trains long
    # enough, whatever this machine's speed, for the driver to sample MIN_SAMPLES prices at its
    # measured pace (every 50 ms) before the spike.
    monkeypatch.setenv("ELASTIC_FAULT_STEP_DELAY_S", "0.04")
    try:
        status, events = run_attached(recipe, local_cluster, tmp_path / "run", on_phase=spike, run_name="pause")
    finally:
        for t in timers:
            t.cancel()
    assert status == "completed" and market.moved == [SPIKE_S, CALM_S]
    kinds = [e["type"] for e in events]
    # (A failure shows every pause and unpause with its reading of the market: price, θ, need.)
    assert kinds.count("world_paused") == kinds.count("world_unpaused") == 1, \
        [e for e in events if e["type"] in ("world_paused", "world_unpaused")]
    paused = next(e for e in events if e["type"] == "world_paused")
    unpaused = next(e for e in events if e["type"] == "world_unpaused")
    assert paused["usd_per_mtok"] > 50 * paused["threshold_usd_per_mtok"] and paused["need"] < 0.1
    # The progress was saved before any node went (the pause's checkpoint, durable), and no node was
    # held while paused: nothing billed, nothing rented.
    at = events.index(paused)
    saves = [e for e in events[:at] if e["type"] == "checkpoint_uploaded"]
    assert saves and saves[-1]["step"] == paused["outer_step"] > 0
    held = set()
    for e in events[:at]:
        if e["type"] == "node_launched":
            held.add(e["instance_id"])
        elif e["type"] in ("node_released", "node_preempted"):
            held.discard(e["instance_id"])
    assert held == set() and len([k for k in kinds[:at] if k == "node_launched"]) == 2   # world.max_replicas
    between = kinds[at:events.index(unpaused)]
    assert "node_launched" not in between
    # Neither the pause nor the boot after it is a capacity wait.
    assert "capacity_wait_started" not in kinds
    # Rented again (both), restored from the pause's checkpoint, and every outer step trained once.
    after = events[events.index(unpaused):]
    assert sum(e["type"] == "node_launched" for e in after) == 2
    restored = next(e for e in after if e["type"] == "world_restored")
    assert restored["after"] == "pause" and restored["from_step"] == paused["outer_step"]
    steps = [e["outer_step"] for e in events if e["type"] == "outer_step"]
    assert steps == list(range(1, 61))
    assert not any(e["type"] == "capacity_wait_ended" and e["gave_up"] for e in events)
    report = build_report(events)
    assert report["pauses"] == 1 and report["paused_s"] == pytest.approx(unpaused["paused_s"])
    assert unpaused["paused_s"] >= 6.9 > recipe.world.capacity_timeout_s   # a pause is no capacity shortage


def test_a_paused_run_that_no_offer_can_price_ends_at_its_deadline(local_cluster, tmp_path, monkeypatch):
    # Paused in a spike, then every offer passes resources.max_usd_per_hour (no price to unpause
    # on): the run stays paused, holds nothing, and ends budget_exhausted at budget.max_hours (43 s),
    # not later, and not with an error.
    # 30 outer steps of at least 160 ms each: the run needs well under the 43 s even on a loaded
    # machine (at 0.25 s a step and a 13 s setup, 200 steps needed all the time left, and a run
    # that needs GO_ON_NEED of it trains whatever the price: it never paused).
    gone_s = 20.0
    recipe = scenario(tmp_path, [(0, 10), (SPIKE_S, 1000), (gone_s, 5000)], **{
        "train.outer_steps": 30, "budget.max_hours": 0.012, "resources.max_usd_per_hour": 2000})
    market = Market()

    def spike(driver, phase, members):
        market.spike_once_trained(driver, phase, lambda d: market.move(d, gone_s))

    monkeypatch.setenv("ELASTIC_FAULT_STEP_DELAY_S", "0.04")
    status, events = run_attached(recipe, local_cluster, tmp_path / "run", on_phase=spike, run_name="stuck")
    assert status == "budget_exhausted" and market.moved == [SPIKE_S, gone_s]
    kinds = [e["type"] for e in events]
    assert kinds.count("world_paused") == 1 and "world_unpaused" not in kinds and "error" not in kinds
    paused = next(e for e in events if e["type"] == "world_paused")
    assert not any(e["type"] == "node_launched" and e["t"] > paused["t"] for e in events)
    stop = next(e for e in events if e["type"] == "budget_exhausted")
    assert "budget.max_hours" in stop["reason"] and "while paused" in stop["reason"]
    started = next(e for e in events if e["type"] == "run_started")["t"]
    assert 0.012 * 3600 <= stop["t"] - started < 0.012 * 3600 + 5
    assert not any(e["type"] == "capacity_wait_ended" and e["gave_up"] for e in events)
