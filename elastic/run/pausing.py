"""The driver's pause: a policy's `Pause` takes effect at an outer-step boundary (the progress made
durable, every replica VM released) and the run waits, not against world.capacity_timeout_s, until
its `Unpause`; the first joiner then restores the checkpoint (`world_restored`, after `pause`)."""

from __future__ import annotations

import time

from elastic.record.events import LossPhase, LossRule, ReplicaDrained, WorldPaused


class Pauser:
    """Args:
        driver: the run's driver (its world, ledger, checkpoints, VMs and executor).
        draining: the driver's replicas with a notice (replica id -> deadline), emptied by a pause.
    """

    def __init__(self, driver, draining: dict):
        self._driver, self._draining = driver, draining
        self.after_pause = False   # the world is empty because of a pause (its restore says so)
        self._tried_step = -1      # the outer step a pause last tried to checkpoint at

    def take_effect(self, view) -> None:
        """The pending `policy.Pause` takes effect, at an outer-step boundary: the progress not saved
        yet is checkpointed and made durable, then every replica leaves and every replica VM the run
        holds is released. Without a durable checkpoint of this outer step nothing is released:
        training goes on and the pause is tried again at the next step (once per step)."""
        d = self._driver
        w = d.world
        if w.replicas and w.outer_step > 0:
            if self._tried_step == w.outer_step:
                return
            self._tried_step = w.outer_step
            if not self._saved_durably(view):
                d.warn(f"pause put off: no durable checkpoint of outer step {w.outer_step} could be written "
                       "(see checkpoint events in the ledger); training goes on, the pause is tried again "
                       "at the next outer step")
                return
        p = d.executor.state.pause
        self.after_pause = w.outer_step > 0 and bool(w.replicas)
        for rid in list(w.joining):   # none in practice: the policy pauses a world with nothing joining
            w.drop(rid, "the run paused", phase=LossPhase.SETUP, rule=LossRule.PAUSE)
        d.record_world(w.take_events())
        for rid, rep in list(w.replicas.items()):
            w.release(rid)
            d.ledger.append(ReplicaDrained(replica=rid, instance_id=rep.instance_id, outer_step=w.outer_step,
                                           steps_done=None))
            d.terminate(rep.instance_id)
        reclaimed = d.left_to_cloud
        for inst in d.held():     # replica VMs that never joined (a controller stays, as does one its cloud reclaims)
            if inst.role == "replica" and inst.instance_id not in reclaimed:
                d.terminate(inst.instance_id)
        self._draining.clear()
        d.rentals.forget_moves()
        d.ledger.append(WorldPaused(outer_step=w.outer_step, usd_per_mtok=round(p.usd_per_mtok, 6),
                                    threshold_usd_per_mtok=round(p.threshold_usd_per_mtok, 6), need=round(p.need, 4)))
        d.executor.pause_took_effect(time.time())

    def _saved_durably(self, view) -> bool:
        """The world's progress is in a complete checkpoint at `checkpoint.uri`: saved now when the
        checkpoint rule says so, or again when the newest complete one is older (a save or an
        upload of this step failed)."""
        d = self._driver
        step = d.world.outer_step
        d.checkpoint_if_due(view, ending=True)
        d.finish_checkpoints(view)
        for attempt in range(2):
            found, _ = d.ckpt.candidates()
            if found and found[0]["step"] == step:
                return True
            if attempt == 0:
                d.checkpoint(view)
                d.finish_checkpoints(view)
        return False

    @staticmethod
    def line(prices) -> str:
        """The console's phase line while paused: the market's price last seen (`prices`, the
        policy's samples), the price it trains at."""
        last = f"${prices[-1][0]:.4f} per 1M tokens" if prices else "no price yet"
        return f"paused while the market is dear ({last}); every replica VM released, training resumes when it falls"
