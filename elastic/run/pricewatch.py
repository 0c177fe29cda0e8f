"""The driver's price and spend watch: the price in effect for each held VM (a `node_price` event
when it moves), the run's spend so far, and the budget check a price rise calls for mid-step."""

from __future__ import annotations

import time

from elastic.record.billing import cost_so_far
from elastic.record.events import NodePrice

PRICE_POLL_S = 1.0       # real seconds between reads of the held VMs' current prices


class PriceWatch:
    """Args:
        ledger: the run's ledger (its events are priced; `node_price` is appended).
    """

    def __init__(self, ledger):
        self._ledger = ledger
        self._usd_per_hour: dict[str, float] = {}   # held instance id -> USD/h last recorded
        self._poll_at = 0.0
        self._spent_memo = (-1, 0.0, 0.0)           # (ledger events, unix time, USD)

    def held(self, instance_id: str, usd_per_hour: float) -> None:
        """A VM joined at this price: watched from now."""
        self._usd_per_hour[instance_id] = round(usd_per_hour, 6)

    def gone(self, instance_id: str) -> None:
        """The VM is released or preempted: no longer watched."""
        self._usd_per_hour.pop(instance_id, None)

    def usd_per_hour(self, instance_id: str, default: float) -> float:
        """The price last recorded for a held VM (`default` when not watched)."""
        return self._usd_per_hour.get(instance_id, default)

    def poll(self, providers) -> bool:
        """Read the held VMs' prices (at most every PRICE_POLL_S) and record each that changed
        (`node_price`); True when one rose (the budget is then checked for the rest of the step)."""
        now = time.monotonic()
        if now < self._poll_at or not self._usd_per_hour:
            return False
        self._poll_at = now + PRICE_POLL_S
        rose = False
        for p in providers:
            for iid, usd in p.prices(list(self._usd_per_hour)).items():
                if iid in self._usd_per_hour and round(usd, 6) != self._usd_per_hour[iid]:
                    rose |= round(usd, 6) > self._usd_per_hour[iid]
                    self._usd_per_hour[iid] = round(usd, 6)
                    self._ledger.append(NodePrice(instance_id=iid, usd_per_hour=round(usd, 6)))
        return rose

    def spent_usd(self, now: float) -> float:
        """USD spent so far (the ledger priced up to `now`). Rebuilt only when the ledger grew or a
        second passed: the policy asks on every 0.1 s tick while it wants a node."""
        n, at, usd = self._spent_memo
        if n != len(self._ledger.events) or now - at >= 1.0:
            usd = cost_so_far(self._ledger.events, now)
            self._spent_memo = (len(self._ledger.events), now, usd)
        return usd

    @staticmethod
    def stop_mid_step(policy, snapshot, step_started_s: float, step_s: float, outer_step: int) -> str | None:
        """After a price rose during an inner phase: why the run must stop at this step's end, when
        the rest of the step (the last step's length `step_s` less the time it has run) would cross
        the budget (`Policy.stop_for_budget`); else None."""
        left_s = max(0.0, step_started_s + step_s - snapshot.time_s)
        stop = policy.stop_for_budget(snapshot, left_s)
        return f"{stop.reason}: a price rose during outer step {outer_step + 1}" if stop else None
