"""Metrics where users look: TensorBoard event files in the run directory, and W&B when
`logging.wandb.project` is set. A view of the ledger like the reports: it listens to the events
as they are appended and writes scalars, keeping no tally of its own beyond what it plots.

Scalars, all against the outer step: `train/loss` (mean over the step's inner steps),
`train/tokens_per_s`, `val/loss`, `val/perplexity`, `world/replicas`, `world/preemptions`
(cumulative), `cost/usd_per_hour` (VMs held now) and `cost/usd` (spent so far).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from elastic.record.events import Event, NodeNotice, NodePreempted, OuterStep, Validation
from elastic.train.event_file import EventFile

log = logging.getLogger(__name__)


class Metrics:
    """Args:
        recipe: the resolved recipe (its `logging` section).
        run_dir: where `tensorboard/` (and W&B's offline files) go.
        ledger: the run's ledger; the metrics follow its appends.
    """

    def __init__(self, recipe, run_dir: Path, ledger):
        self._ledger = ledger
        self._tb = None
        self._tb_lock = threading.Lock()   # the ledger's listeners run on the threads that append
        self._wandb = None
        self._step = 0
        self._preempted: set[str] = set()
        self._run_dir = run_dir
        lg = recipe.logging
        # The event files are written by elastic.train.event_file (no torch, no tensorboard package:
        # viewing them needs TensorBoard, writing them does not), opened at the first scalar.
        self._tensorboard = lg.tensorboard
        if lg.wandb.project:
            try:
                import wandb
            except ImportError:
                log.warning("logging.wandb.project: wandb is not installed (pip install wandb); not logging to W&B")
            else:
                self._wandb = wandb.init(project=lg.wandb.project, entity=lg.wandb.entity, mode=lg.wandb.mode,
                                         dir=str(run_dir), name=run_dir.name, config=recipe.model_dump(mode="json"))
        if self._tensorboard or self._wandb is not None:
            ledger.listeners.append(self.on_event)

    def on_event(self, e: Event) -> None:
        """Write the scalars one ledger event carries."""
        from elastic.record.billing import burn_usd_per_hour, cost_so_far

        if isinstance(e, (NodePreempted, NodeNotice)):
            self._preempted.add(e.instance_id)
            self._write({"world/preemptions": len(self._preempted)})
        elif isinstance(e, OuterStep):
            self._step = e.outer_step
            seconds = e.inner_s + e.sync_s
            events = self._ledger.events
            scalars = {"world/replicas": len(e.replicas), "world/preemptions": len(self._preempted),
                       "cost/usd": cost_so_far(events, e.t), "cost/usd_per_hour": burn_usd_per_hour(events)}
            if e.losses:
                scalars["train/loss"] = sum(e.losses) / len(e.losses)
            if seconds > 0:
                scalars["train/tokens_per_s"] = e.tokens / seconds
            self._write(scalars)
        elif isinstance(e, Validation):
            self._write({"val/loss": e.loss, "val/perplexity": e.perplexity})

    def _write(self, scalars: dict) -> None:
        with self._tb_lock:
            if self._tensorboard:
                if self._tb is None:
                    self._tb = EventFile(self._run_dir / "tensorboard")
                self._tb.scalars(self._step, scalars)
        if self._wandb is not None:
            self._wandb.log(scalars, step=self._step)

    def close(self) -> None:
        if self.on_event in self._ledger.listeners:
            self._ledger.listeners.remove(self.on_event)
        with self._tb_lock:
            self._tensorboard = False   # a late event writes nothing more
            if self._tb is not None:
                self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
