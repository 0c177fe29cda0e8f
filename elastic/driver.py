"""The driver: rents nodes from a provider, runs the world's outer loop, checkpoints, keeps the
budget, and records everything in the ledger. `elastic.launch` wraps it with signals and the report.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from elastic import checkpoint as ckpt
from elastic.errors import UserError
from elastic.ledger import Ledger
from elastic.recipe import Recipe
from elastic.report import cost_so_far

log = logging.getLogger(__name__)


class Driver:
    """Args:
        recipe: the resolved recipe.
        run_dir: the run directory (exists).
        ledger: the run's ledger.
        console: rich console for progress.
    """

    def __init__(self, recipe: Recipe, run_dir: Path, ledger: Ledger, console=None):
        self.recipe = recipe
        self.run_dir = run_dir
        self.run_name = run_dir.name
        self.ledger = ledger
        self.console = console
        self.cluster = None
        self.provider = None
        self.world = None
        self._metrics = None
        self._t0 = time.time()
        self._ckpt_root = ckpt.checkpoint_dir(recipe.checkpoint.uri, run_dir)

    # -- setup -----------------------------------------------------------------------------------

    def start_cluster(self, address: str | None) -> None:
        """Start (or join) the Ray cluster, the provider and the world."""
        from elastic.cluster import LocalCluster
        from elastic.world import World
        from providers import provider_class

        self.cluster = LocalCluster(address=address)
        self.provider = provider_class("local")(self.recipe.local, self.cluster, self.recipe.world.ranks_per_replica)
        self.world = World(self.recipe)

    def rent(self, count: int, view) -> list[tuple[str, str]]:
        """Rent `count` nodes at the cheapest matching offer; returns (instance_id, ray node id)."""
        offers = self.provider.offers(self.recipe.resources)
        if not offers:
            raise UserError("resources: no offer in the local market matches resources.regions / "
                            "resources.max_usd_per_hour")
        placements = []
        for i in range(count):
            offer = offers[0]
            view.phase(f"renting node {i + 1}/{count} ({offer.instance_type} in {offer.region} "
                       f"@ ${offer.usd_per_hour:.3f}/h)")
            inst = self.provider.launch(offer, self.run_name, role="replica")
            self.ledger.append("node_launched", instance_id=inst.instance_id, ray_node_id=inst.ray_node_id,
                               role=inst.role, **{k: v for k, v in offer.to_dict().items() if k != "read_at"})
            placements.append((inst.instance_id, inst.ray_node_id))
        return placements

    # -- the run ---------------------------------------------------------------------------------

    def run(self, view) -> str:
        """Train until done or out of budget; returns the run status."""
        recipe, world, ledger = self.recipe, self.world, self.ledger
        placements = self.rent(recipe.world.replicas, view)
        view.phase(f"starting {len(placements)} replica(s) × {recipe.world.ranks_per_replica} rank(s)")
        for rep in world.add_replicas(placements):
            ledger.append("replica_joined", replica=rep.replica_id, instance_id=rep.instance_id,
                          outer_step=rep.joined_step, epoch=world.epoch)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        every = recipe.checkpoint.every_outer_steps
        train_s, last_step_s = 0.0, 0.0
        try:
            while not world.done():
                reason = self._over_budget(last_step_s)
                if reason:
                    ledger.append("budget_exhausted", reason=reason, outer_step=world.outer_step)
                    if world.outer_step > 0:
                        self.checkpoint(view)
                    return "budget_exhausted"
                res = world.step()
                last_step_s = res.inner_s + res.sync_s
                train_s += last_step_s
                ledger.append("outer_step", outer_step=res.outer_step, inner_step=world.inner_step,
                              epoch=world.epoch, replicas=res.replicas, losses=[round(x, 6) for x in res.losses],
                              tokens=res.tokens, tokens_total=world.tokens, inner_s=round(res.inner_s, 4),
                              sync_s=round(res.sync_s, 4), bytes_sent=res.bytes_sent, data_cursor=world.cursor)
                self._write_metrics(res)
                view.step(res, world, world.tokens / train_s if train_s else 0.0,
                          cost_so_far(ledger.events, time.time()))
                if (every and world.outer_step % every == 0) or world.done():
                    self.checkpoint(view)
        finally:
            self._metrics.close()
        return "completed"

    def _write_metrics(self, res) -> None:
        """Training curves: one line per inner step (mean loss over the world)."""
        h = self.recipe.train.inner_steps
        first = self.world.inner_step - h
        for i, loss in enumerate(res.losses):
            self._metrics.write(json.dumps({"inner_step": first + i + 1, "outer_step": res.outer_step,
                                            "loss": round(loss, 6), "replicas": len(res.replicas)}) + "\n")
        self._metrics.flush()

    def _over_budget(self, next_step_s: float) -> str | None:
        """Why the next outer step must not start (it would cross a hard limit), or None."""
        b = self.recipe.budget
        now = time.time()
        if b.max_hours is not None and (now - self._t0 + next_step_s) > b.max_hours * 3600:
            return f"budget.max_hours ({b.max_hours} h) would be passed by the next outer step"
        if b.max_usd is not None:
            spent = cost_so_far(self.ledger.events, now)
            rate_usd_per_s = sum(i.offer.usd_per_hour for i in self.provider.list_instances(self.run_name)) / 3600
            if spent + rate_usd_per_s * next_step_s > b.max_usd:
                return (f"budget.max_usd (${b.max_usd:.2f}) would be passed by the next outer step "
                        f"(spent ${spent:.4f})")
        return None

    def checkpoint(self, view) -> None:
        view.phase(f"checkpoint at outer step {self.world.outer_step}")
        info = ckpt.save(self.world, self._ckpt_root, self.recipe.digest())
        self.ledger.append("checkpoint_saved", **info)
        for step in ckpt.prune(self._ckpt_root, self.recipe.checkpoint.keep_last):
            self.ledger.append("checkpoint_deleted", step=step)

    # -- teardown --------------------------------------------------------------------------------

    def release_all(self) -> None:
        """Release every node the run holds and stop what it started; each part tolerates the others failing."""
        if self.world is not None:
            try:
                self.world.shutdown()
            except Exception:
                log.exception("world shutdown")
        if self.provider is not None:
            for inst in self.provider.list_instances(self.run_name):
                try:
                    self.provider.terminate(inst.instance_id)
                    self.ledger.append("node_released", instance_id=inst.instance_id)
                except Exception as exc:
                    self.ledger.append("error", message=f"could not release {inst.instance_id}: {exc}")
        if self.cluster is not None:
            try:
                self.cluster.shutdown()
            except Exception:
                log.exception("cluster shutdown")
