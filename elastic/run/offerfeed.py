"""The driver's offer feed: every provider's offers, asked in the background so a slow cloud holds
no tick, with the ledger told when a cloud's market goes down and comes back."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from elastic.errors import UserError, described
from elastic.record.events import MarketAvailable, MarketUnavailable

log = logging.getLogger(__name__)

OFFERS_WAIT_S = 0.2      # a tick waits this long for the clouds' offers, then goes on (asked in the background)
OFFERS_FRESH_S = 10.0    # an answer older than this when next wanted is asked again


class OfferFeed:
    """Args:
        providers: cloud name -> provider.
        resources: the recipe's resources section (what the providers offer).
        ledger: the run's ledger (`market_unavailable`, `market_available`).
        on_demand_too: with a spot `resources`, ask for the on-demand offers as well (the deadline
            rule's fallback, `policy.on_demand_need`).
    """

    def __init__(self, providers: dict, resources, ledger, on_demand_too: bool = False):
        self._providers, self._resources, self._ledger = providers, resources, ledger
        self._on_demand = resources.model_copy(update={"spot": False}) if on_demand_too and resources.spot else None
        self._seen: set[str] = set()      # clouds whose offers answered at least once
        self._down: set[str] = set()      # clouds whose offers fail now (market_unavailable)
        self._asking: Future | None = None
        self._offered = False             # the clouds offered something the recipe allows, once

    def offers(self, wait_s: float = OFFERS_WAIT_S) -> list | None:
        """Every provider's offers, cheapest per GPU-hour first (per VM-hour for CPU-only VMs); None
        while the clouds have not answered within `wait_s`. They are asked on a thread of their own
        (`_ask`): a cloud that is slow to answer (its SDK retrying a throttled call for seconds)
        holds no tick, so notices and preemptions are still handled meanwhile, and a later tick
        takes the answer. A cloud that answered before but fails now (the SDK's retries spent, or an
        answer that does not parse) offers nothing until it answers again: the run trains on what
        it holds, and the ledger says `market_unavailable` once per outage."""
        if self._asking is None:
            self._asking = self._ask()
        try:
            answers, answered_at = self._asking.result(timeout=wait_s)
        except FutureTimeout:
            return None
        self._asking = None
        if time.monotonic() - answered_at > OFFERS_FRESH_S:   # left unread while nothing was due
            return self.offers(wait_s)
        every = []
        for name, offers in answers.items():
            if isinstance(offers, Exception):
                if name not in self._seen:
                    raise offers   # never answered: the setup is wrong, and the run says so
                if name not in self._down:
                    self._down.add(name)
                    message = described(offers)
                    log.warning("%s prices and capacity unavailable: %s", name, message)
                    self._ledger.append(MarketUnavailable(cloud=name, message=message))
                continue
            self._seen.add(name)
            if name in self._down:
                self._down.discard(name)
                self._ledger.append(MarketAvailable(cloud=name))
            every += offers
        return sorted(every, key=lambda o: (o.usd_per_hour / max(1, o.gpus), o.usd_per_hour))

    def to_decide_on(self) -> list | None:
        """The offers a decision reads now; None when there is nothing to decide on yet: the clouds
        are still answering, a cloud is unreachable, or every offer it had left the recipe's
        filters (a price above resources.max_usd_per_hour): the run trains on what it holds. A
        UserError when no offer ever matched the recipe."""
        every = self.offers()
        if every is None or (not every and (self._down or self._offered)):
            return None
        if not every:
            raise UserError(f"resources: no offer from {', '.join(self._providers)} matches resources.accelerators / "
                            "resources.regions / resources.max_usd_per_hour")
        self._offered = True
        return every

    def _ask(self) -> Future:
        """Ask every provider for its offers on a daemon thread (one a hung cloud cannot keep the
        process from exiting): a future of ({cloud: offers, or the exception it raised}, when)."""
        asked: Future = Future()

        def ask() -> None:
            answers: dict = {}
            for name, p in self._providers.items():
                try:
                    answers[name] = p.offers(self._resources) + (p.offers(self._on_demand) if self._on_demand else [])
                except Exception as exc:
                    answers[name] = exc
            asked.set_result((answers, time.monotonic()))

        threading.Thread(target=ask, name="offers", daemon=True).start()
        return asked
