"""The driver's rentals: VMs on their way. Launches run in the background; a finished one either
starts a replica on its VM (and measures its link to a node on another site) or is refused (a
capacity error, a VM that failed or never joined: the offer rests). A move's launch remembers the
VM it replaces, which drains once the new replica trains.

A VM whose replica fails its setup is released (the world's loss) and the policy rents another. When
`SETUP_FAILURES_TO_STOP` nodes in a row fail, their boot script (an install that fails: the provider
ends the wait on it at once) or their replica's setup (a recipe this hardware cannot run: a GPU node
where torch sees no CUDA device, a model that does not fit), with none joining the world between,
renting more would repeat the failure until the budget runs out: `failing` says so in one line and
the driver ends the run `failed`. Any replica that joins starts the count again."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from elastic.errors import UserError
from elastic.policy.planner import Move, site
from elastic.record.events import (CapacityRefused, LaunchFailed, LinkMeasured, LossRule, NodeJoinTimeout, NodeLaunched,
                                   NodeReleased, ReplicaJoined, ReplicaLost, ReplicaStarting)

log = logging.getLogger(__name__)

SETUP_FAILURES_TO_STOP = 3   # nodes in a row that failed their boot or setup, none joining between: the run ends


def _cause(boot_log: str) -> str:
    """The line of a failed boot's log that says why: the script's last one before its own failure
    line (`providers.cloud.BOOT_FAILED_MARK`), passing over the machine's (`BOOT_OWN_PREFIXES`)."""
    from providers.cloud import BOOT_FAILED_MARK, BOOT_OWN_PREFIXES

    lines = boot_log.splitlines()
    mark = next((i for i, line in enumerate(lines) if BOOT_FAILED_MARK in line), len(lines))
    said = [line.strip() for line in lines[:mark] if line.strip() and not line.startswith(BOOT_OWN_PREFIXES)]
    return said[-1] if said else "(its boot log says no more)"


class Rentals:
    """Args:
        providers: cloud name -> provider.
        run_name: the run (its VMs are tagged with it).
        ledger: the run's ledger.
        world: the run's world (replicas start on joined VMs).
        prices: the run's `PriceWatch` (a joined VM is watched from its launch price).
        refused: told (offer key, unix time) of each launch refused.
    """

    def __init__(self, providers: dict, run_name: str, ledger, world, prices, refused):
        self._providers, self._run_name, self._ledger, self._world = providers, run_name, ledger, world
        self._prices, self._refused = prices, refused
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="launch")
        self._launching: dict[Future, object] = {}        # launch -> its offer
        self._move_of: dict[Future, str] = {}             # launch of a move -> instance id it replaces
        self._moves: dict[str, str] = {}                  # new instance id -> instance id it replaces
        self._joined_at: dict[str, tuple[str, str]] = {}  # instance id -> (site, Ray node) of nodes that joined
        self._setup_failures: list[str] = []              # boot or setup failures since the last join
        ledger.listeners.append(self._count_setup_failures)

    @property
    def under_way(self) -> list:
        """The offers of the launches under way."""
        return list(self._launching.values())

    @property
    def failing(self) -> str | None:
        """Why the run must stop renting, in one line: `SETUP_FAILURES_TO_STOP` nodes in a row
        failed their boot or their replica's setup, none joined between (the last one's reason);
        None otherwise."""
        if len(self._setup_failures) < SETUP_FAILURES_TO_STOP:
            return None
        return (f"{len(self._setup_failures)} nodes in a row failed their boot or setup and none joined, so no "
                f"more nodes are rented; last: {self._setup_failures[-1]}")

    def _count_setup_failures(self, event) -> None:
        """A ledger listener: a setup failure (`replica_lost`, rule `setup_failed`) or a failed boot
        (`node_join_timeout` with boot_failed) counts, a join (`replica_joined`) starts the count
        again. A node that merely never joined (a slow boot, an unreachable head) does not count."""
        if isinstance(event, ReplicaJoined):
            self._setup_failures.clear()
        elif isinstance(event, ReplicaLost) and event.rule == LossRule.SETUP_FAILED:
            self._setup_failures.append(event.reason)
        elif isinstance(event, NodeJoinTimeout) and event.boot_failed:
            self._setup_failures.append(f"the boot script of {event.instance_id} failed: {_cause(event.boot_log)}")

    def _in_flight(self, offer) -> int:
        """The launches of `offer` (its zone, instance type and spot) asked of its cloud and not
        refused: under way, or granted and not yet collected (not those still queued)."""
        same = (offer.zone, offer.instance_type, offer.spot)
        return sum(1 for f, o in self._launching.items() if (o.zone, o.instance_type, o.spot) == same
                   and (f.running() or f.done() and not f.cancelled() and f.exception() is None))

    def moving(self) -> set[str]:
        """Instance ids a move's replacement is on its way for (launching, or joined and not yet
        training)."""
        return set(self._moves.values()) | set(self._move_of.values())

    def launch(self, offer, move: Move | None = None) -> None:
        """Rent one VM of `offer` in the background (with `move`: it replaces `move.drain`)."""
        fut = self._pool.submit(self._providers[offer.cloud].launch, offer, self._run_name, "replica")
        self._launching[fut] = offer
        if move is not None:
            self._move_of[fut] = move.drain

    def replaced_by(self, instance_id: str) -> str | None:
        """The instance id the VM `instance_id` was rented to replace (forgotten now), or None."""
        return self._moves.pop(instance_id, None)

    def forget_moves(self) -> None:
        """Every VM is released (a pause): no move is under way."""
        self._moves.clear()
        self._move_of.clear()

    def collect(self) -> None:
        """Take in the launches that finished: start a replica on each VM that joined; rest the
        offer of each refused one (ledger: `capacity_error`, `launch_failed`, or a join timeout)."""
        from providers.base import CapacityError, JoinTimeout

        for fut in [f for f in self._launching if f.done()]:
            offer = self._launching.pop(fut)
            replaces = self._move_of.pop(fut, None)
            try:
                inst = fut.result()
            except JoinTimeout as exc:  # rented, never joined, terminated: bill it, rest the offer
                self._refused(offer, time.time())
                self._record_join_timeout(exc, offer)
                continue
            except UserError:   # the recipe or the account setup is wrong: no other offer will do better
                raise
            except Exception as exc:  # no capacity, or a VM that failed to come up: the offer rests
                self._refused(offer, time.time())
                refused = isinstance(exc, CapacityError)
                if refused:
                    self._ledger.append(CapacityRefused(zone=offer.zone, instance_type=offer.instance_type,
                                                        message=str(exc), spot=offer.spot,
                                                        in_flight=self._in_flight(offer)))
                else:
                    self._ledger.append(LaunchFailed(zone=offer.zone, instance_type=offer.instance_type,
                                                     message=f"{type(exc).__name__}: {str(exc)[:200]}"))
                continue
            self._record_launch(inst, offer)
            if replaces is not None:
                self._moves[inst.instance_id] = replaces
            peer = self._link_peer(offer)
            rep = self._world.start_replica(inst.instance_id, inst.ray_node_id)
            self._ledger.append(ReplicaStarting(replica=rep.replica_id, instance_id=inst.instance_id))
            self._joined_at[inst.instance_id] = (site(offer), inst.ray_node_id)
            if peer is not None:
                self._pool.submit(self._measure_link, inst.instance_id, site(offer), inst.ray_node_id, *peer)

    def shutdown(self) -> None:
        """Stop launching (those not started are cancelled) and record the launches that finished
        meanwhile, so their release is priced."""
        from providers.base import JoinTimeout

        self._pool.shutdown(wait=True, cancel_futures=True)
        for fut in list(self._launching):
            offer = self._launching.pop(fut)
            if not fut.done() or fut.cancelled():
                continue
            if fut.exception() is None:
                self._record_launch(fut.result(), offer)
            elif isinstance(fut.exception(), JoinTimeout):
                self._record_join_timeout(fut.exception(), offer)

    def _record_launch(self, inst, offer, joined: bool = True) -> None:
        if joined:
            self._prices.held(inst.instance_id, offer.usd_per_hour)
        self._ledger.append(NodeLaunched.of(offer, instance_id=inst.instance_id, ray_node_id=inst.ray_node_id,
                                            role=inst.role, launched_at=inst.launched_at, joined=joined))

    def _record_join_timeout(self, exc, offer) -> None:
        """A VM that was rented but never joined: launched, timed out, released (billed between)."""
        self._record_launch(exc.instance, offer, joined=False)
        # Not when the run stopped while it was still booting.
        if exc.boot_failed or exc.waited_s >= exc.timeout_s:
            self._ledger.append(NodeJoinTimeout(instance_id=exc.instance.instance_id, timeout_s=exc.timeout_s,
                                                boot_log=exc.console_tail, boot_failed=exc.boot_failed))
        self._ledger.append(NodeReleased(instance_id=exc.instance.instance_id, released_at=exc.released_at))

    def _link_peer(self, offer) -> tuple[str, str, str] | None:
        """The peer a node joining from `offer` measures its link to: (instance id, site, Ray node)
        of a held node on another site (a pair the planner prices); None when every held node sits
        on its own site (a link inside one site costs the planner nothing: not measured)."""
        return next(((iid, at[0], at[1]) for iid, at in self._joined_at.items()
                     if at[0] != site(offer) and self._world.replica_on(iid) is not None), None)

    def _measure_link(self, instance_id: str, node_site: str, node_id: str, peer_id: str, peer_site: str,
                      peer_node: str) -> None:
        """Measure one link (runs in the launch pool: a few seconds beside training) and record it."""
        from elastic.net.linkprobe import measure

        try:
            got = measure(node_id, peer_node)
        except Exception as exc:   # either node went meanwhile: nothing measured, nothing lost
            log.info("link %s -> %s not measured: %s", instance_id, peer_id, exc)
            return
        self._ledger.append(LinkMeasured(instance_id=instance_id, peer_instance_id=peer_id, site=node_site,
                                         peer_site=peer_site, **got))
