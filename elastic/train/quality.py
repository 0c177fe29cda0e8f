"""What DiLoCo costs in model quality: the held-out loss of the product's DiLoCo against synchronous
data-parallel training (torch DDP) on the same tokens, as measured by bench/quality.py.

The figures are measurements, not a model: `MEASURED` holds each one with the run it came from, and
`expected_cost` looks up the nearest for a recipe by its outer momentum (which decides most of the
gap on short runs), how many outer steps the run takes (H relative to the run's length), the replica
count and the sync codec.
`elastic plan` prints it and the report carries it (`expected_quality_cost`). Re-measure with the
command in `SOURCE` and replace the table when the training path changes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

SOURCE = "python bench/quality.py (docs/benchmarks.md, 'Held-out loss against DDP'; 2-core CPU, byte-level GPT)"


@dataclass(frozen=True)
class Measured:
    """One measured run: held-out loss of DiLoCo against DDP at equal tokens.

    Args:
        outer_steps: outer steps the run took (its inner steps per replica ÷ H).
        inner_steps: H.
        replicas: DiLoCo replicas (DDP ranks, at the same global batch).
        sync: `float32`, `int8` (with error feedback) or `sparse`.
        outer_lr: `train.outer_lr`.
        outer_momentum: `train.outer_momentum` (Nesterov; sparse runs take 0, with outer lr 1).
        churn: False: no preemptions; True: one replica preempted every few outer steps and replaced.
        vs_ddp_pct: (DiLoCo's final held-out loss ÷ DDP's − 1) × 100; negative is better than DDP.
    """

    outer_steps: int
    inner_steps: int
    replicas: int
    sync: str
    outer_lr: float
    outer_momentum: float
    churn: bool
    vs_ddp_pct: float


# bench/quality.py, 2 layers × width 128 byte-level GPT, batch 8 × 128 per replica, 160 inner steps per
# replica, inner lr 3e-3; DDP ×4: 2.4006 (2026-11-27, 2-core CPU; docs/benchmarks.md).
_F32, _INT8, _SPARSE = "float32", "int8", "sparse"
MEASURED: tuple[Measured, ...] = (
    # --replicas 4 --inner-steps 5 (the recipe's outer lr 0.7, momentum 0.9): 3.1639
    Measured(32, 5, 4, _F32, 0.7, 0.9, False, 31.80),
    # --quick (40 steps per replica, H = 10): DDP 2.6397, DiLoCo 2.8287
    Measured(4, 10, 4, _F32, 0.7, 0.9, False, 7.16),
    # --replicas 4 --inner-steps 5 10 --outer-momentum 0.5 (churn, int8 and sparse at H = 10)
    Measured(32, 5, 4, _F32, 0.7, 0.5, False, 3.67),
    Measured(16, 10, 4, _F32, 0.7, 0.5, False, 3.06),
    Measured(16, 10, 4, _INT8, 0.7, 0.5, False, 3.00),
    # one replica preempted every 3 outer steps; the worse of notice (+0.95 %) and none (+0.83 %)
    Measured(26, 10, 4, _F32, 0.7, 0.5, True, 0.95),
    Measured(16, 10, 4, _SPARSE, 1.0, 0.0, False, 5.76),
    # --replicas 4 --inner-steps 5 10 --outer-lr 1 --outer-momentum 0 (plain averaging), and
    # --replicas 4 --inner-steps 5 --variants churn codecs --outer-lr 1 --outer-momentum 0
    Measured(32, 5, 4, _F32, 1.0, 0.0, False, 1.52),
    Measured(16, 10, 4, _F32, 1.0, 0.0, False, 2.15),
    # --replicas 4 --inner-steps 20 40 --variants diloco --outer-lr 1 --outer-momentum 0
    Measured(8, 20, 4, _F32, 1.0, 0.0, False, 2.54),
    Measured(4, 40, 4, _F32, 1.0, 0.0, False, 2.95),
    Measured(32, 5, 4, _INT8, 1.0, 0.0, False, 1.52),
    Measured(32, 5, 4, _SPARSE, 1.0, 0.0, False, 4.56),
    # churn: the worse of notice (−2.37 %) and none (−2.30 %); more, smaller outer steps (82 against
    # 32) while replacements started made up for the lost phases on this short run
    Measured(82, 5, 4, _F32, 1.0, 0.0, True, -2.30),
    # --replicas 2 8 --inner-steps 5 --variants ddp diloco --outer-lr 1 --outer-momentum 0: DDP ×2 2.4605,
    # DDP ×8 2.3695
    Measured(32, 5, 2, _F32, 1.0, 0.0, False, 1.41),
    Measured(32, 5, 8, _F32, 1.0, 0.0, False, 1.54),
)


def sync_name(recipe) -> str:
    """The codec a recipe syncs with, as `MEASURED` names it."""
    w = recipe.world
    return "sparse" if w.sync == "sparse" else w.sync_dtype


def run_outer_steps(recipe, replicas: int) -> int:
    """Outer steps the recipe's run takes with `replicas` replicas (`train.outer_steps`, or what
    `train.token_budget` needs)."""
    t = recipe.train
    if t.token_budget is not None:
        return max(1, -(-t.token_budget // (replicas * t.inner_steps * t.batch_size * t.seq_len)))
    return t.outer_steps


def expected_cost(outer_steps: int, replicas: int, sync: str, outer_momentum: float, outer_lr: float,
                  churn: bool = False) -> Measured | None:
    """The measurement nearest to a run of `outer_steps` outer steps over `replicas` replicas with
    codec `sync`, `outer_momentum` and `outer_lr` (nearest in momentum first, then in outer lr,
    then in outer steps on a log scale, then in replicas), or None when that codec (and, with
    `churn`, churn) was never measured. Measured on short runs (tens of outer steps): for a run of hundreds it is an upper
    bound, not a forecast."""
    rows = [m for m in MEASURED if m.sync == sync and m.churn == churn]
    if not rows:
        return None
    return min(rows, key=lambda m: (abs(m.outer_momentum - outer_momentum), abs(m.outer_lr - outer_lr),
                                    abs(math.log(m.outer_steps / outer_steps)), abs(m.replicas - replicas)))


def quality_cost(recipe, replicas: int) -> dict | None:
    """What `elastic plan` and the report state: the expected held-out loss cost against DDP of
    this recipe's H and sync with `replicas` replicas, without and with churn, and the measured run
    each figure comes from. None when the codec was never measured."""
    t = recipe.train
    steps, sync = run_outer_steps(recipe, replicas), sync_name(recipe)
    calm = expected_cost(steps, replicas, sync, t.outer_momentum, t.outer_lr)
    if calm is None:
        return None
    churn = expected_cost(steps, replicas, sync, t.outer_momentum, t.outer_lr, churn=True)
    if churn is not None and (churn.outer_momentum, churn.outer_lr) != (calm.outer_momentum, calm.outer_lr):
        churn = None   # measured under churn only at other outer settings: no figure rather than another's
    # What plain averaging (outer lr 1, no momentum) measured for this run's shape, when the recipe
    # uses other outer settings and they measured worse: the one change that closed the gap here.
    plain = None
    if (t.outer_lr, t.outer_momentum) != (1.0, 0.0):
        other = expected_cost(steps, replicas, sync, 0.0, 1.0)
        if other is not None and (other.outer_lr, other.outer_momentum) == (1.0, 0.0) \
                and other.vs_ddp_pct < calm.vs_ddp_pct - 1.0:
            plain = other.vs_ddp_pct
    return {"outer_steps": steps, "sync": sync, "vs_ddp_pct": calm.vs_ddp_pct,
            "vs_ddp_pct_churn": None if churn is None else churn.vs_ddp_pct,
            "vs_ddp_pct_plain_averaging": plain,
            "measured": asdict(calm), "source": SOURCE}


def describe(cost: dict | None) -> str:
    """One line for `elastic plan`."""
    if cost is None:
        return "quality: this sync was not measured against DDP (bench/quality.py)"
    m = cost["measured"]
    churn = "" if cost["vs_ddp_pct_churn"] is None else f", {cost['vs_ddp_pct_churn']:+.1f} % under churn"
    return (f"quality: expected held-out loss {cost['vs_ddp_pct']:+.1f} % against synchronous DDP on the same "
            f"tokens{churn} ({cost['outer_steps']} outer steps, {cost['sync']}; measured at {m['outer_steps']} outer "
            f"steps, {m['replicas']} replicas, outer lr {m['outer_lr']} momentum {m['outer_momentum']} by "
            f"bench/quality.py)"
            + ("" if cost.get("vs_ddp_pct_plain_averaging") is None else
               f"; plain averaging (train.outer_lr 1, train.outer_momentum 0) measured "
               f"{cost['vs_ddp_pct_plain_averaging']:+.1f} %: docs/guide.md, 'Choosing H, the outer learning rate "
               f"and the sync'"))
