"""What does an online policy that must finish the run on every trace pay, in `elastic/sim/bound.py`'s own
slot model, with the market's law known exactly? The other side of `bench/online_bound.py`'s
lower bound: a policy played on traces of the same family, against bound.py's bound on each.

    python bench/online_policy.py [--traces 20] [--seed 0] [--seeds 5] [--safety 1.0 1.1 1.2]
                                  [--offers 4] [--spike-every-h 16] [--lams 16] [--stride 3] [--simulate N]
                                  [--learned-h H [--history-seed K]] [--price-states]

The policy (a certainty-equivalent, model-predictive rule; a heuristic, not the optimum):
- **DP per token price.** For each λ of a grid (`--lams` values log-spaced over 0.5-3 × the λ of
  `online_lower_bound`, plus one of 30 × as a last resort), `online_value`'s backward recursion over
  (row, market state, slot state) with the recipe's own boot (`planner.recovery_s`) and price cap
  (resources.max_usd_per_hour: an offer above it cannot be kept or booted), keeping per row the
  decisions (an off slot: which offer to boot, or none; a slot on an offer: keep or release) and,
  every `--stride` rows, the expected tokens from there on of a slot off and on each offer.
- **Adaptive λ.** Every `--stride` rows it takes the least λ of the grid whose slots' expected tokens
  from their present states (less what a booting VM has still to boot) are at least the tokens
  still needed × the safety factor, and acts on every slot with that λ's decisions until the next.
  The market's state (each offer's level and spike flag) is known exactly: the traces are drawn
  from the chain and the drawn states are kept.

The play (`play`) is bound.py's model on the trace, with the preemptions drawn: world.max_replicas
slots; decisions at row starts; a VM billed at each row's price from its launch, `recovery_s` of
boot (billed, no tokens), preempted after an exponential time at its offer's rate (the slot is then
off until the next row start, and a restart boots again), the seconds short of its cloud's billing
minimum billed when preempted early; tokens = tokens/s × seconds trained. The run ends when
run_tokens(recipe) are trained (billing stops there, mid-row) or at the trace's end (48 h,
budget.max_hours: failed). The ratio is its USD per 1M tokens over bound.py's
`lower_bound_usd_per_mtok` on the trace. Differences from bound.py's `_slot`, and whose favour:
- a VM let go during its boot: `_slot` charges the whole boot's tokens, this play only forgoes
  those of the seconds it was there (for the policy; the DP here rarely does it);
- the billing minimum: `_slot` charges its expectation at the boot row's price, the play the actual
  shortfall at the row's price where the VM went (even in expectation over preemption seeds);
- the state seen: the chain's state tells a spike from a high level at the same price (for the
  policy); bound.py sees every price of the trace (for the bound).

`--learned-h H`: the policy is not given the chain's law nor its states. Before the runs it sees the
prices of one earlier trace of H hours (a separate draw from the family) and fits, per offer
(`fit_offer`): the spike regime (`spike_threshold`: a jump up of more than 2.5 typical walk steps
enters it; the family's spike ratio is not used), the spike start and end chances per row (counts,
with ½ added), the spike price (median seen), and outside spikes the AR(1) of log(price /
on-demand) (sample mean, sd, lag-one correlation at the trace's rows); `FittedFamily` builds the
chains from them as `Family.chain` does (Rouwenhorst, same levels), and the λ grid and the plan are
made on it. While playing it reads each row's state from the trace's prices (`seen_states`: the
nearest fitted level in log price, the spike flag from the fitted threshold). The play's bill, the
preemptions and bound.py's bound are on the true trace as without it. Still given: the model's
shape (AR(1) + spikes, offers independent), on-demand prices, preemption rates and tokens/s.
`--price-states`: the chain's law known (`FittedFamily.exact`), the states read from prices as above.

`--simulate N` plays the same plan inside the simulator (`PlanPolicy`, a `policy.Policy` handed to
`simulate`, the recipe's own pause rule off: the plan pauses itself) on the first N traces, with the project's
policy beside it.
There the slots are the VMs held, decisions come whenever the simulator asks (each outer step's end,
each preemption), a released replica leaves at its step boundary, and the world's pace, syncs,
world.min_replicas, notices and lost work are the simulator's; `--margin-h` brings the deadline
forward when λ is chosen (slack for the simulator's slower pace).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.online_bound import (  # noqa: E402
    STEP_S, Family, Offer, add_family_args, family_from_args, online_lower_bound, online_value, rouwenhorst)
from elastic.policy.planner import Move, run_tokens  # noqa: E402
from elastic.policy.rules import Policy, Release, Rent  # noqa: E402
from elastic.recipe.model import load_recipe  # noqa: E402
from elastic.record import billing  # noqa: E402
from elastic.sim.bound import lower_bound_usd_per_mtok  # noqa: E402

BARRED_USD_PER_HOUR = 1e6     # an offer above the recipe's price cap: never kept or booted
LAST_RESORT = 30.0            # a grid's last λ, × the online bound's: train as much as possible


@dataclasses.dataclass
class Plan:
    """The DP's decisions and expected tokens for a grid of token prices (arrays over the joint market
    state, one axis per offer, after the leading ones).

    Args:
        lams: the grid's token prices, USD per token, ascending.
        boot: (lams, rows, *market): the offer an off slot boots at that row start, -1 none.
        stay: (lams, rows, *market): bit j set when a slot holding offer j keeps it.
        k_off: (lams, rows / stride, *market): expected tokens from that row on of a slot off.
        k_on: (lams, rows / stride, offers, *market): the same for a slot holding each offer.
        stride: rows between two kept token arrays (and between two choices of λ).
    """
    lams: np.ndarray
    boot: np.ndarray
    stay: np.ndarray
    k_off: np.ndarray
    k_on: np.ndarray
    stride: int


def capped_usd(family: Family, recipe) -> list[np.ndarray]:
    """Each offer's USD/h per chain state, the states above resources.max_usd_per_hour barred."""
    cap = recipe.resources.max_usd_per_hour
    out = []
    for o in family.offers:
        usd = family.chain(o)[1]
        out.append(np.where(usd > cap, BARRED_USD_PER_HOUR, usd) if cap is not None else usd)
    return out


JUMP_STEPS = 2.5   # an upward move this many typical walk steps or more enters the spike regime


def spike_threshold(log_ratio: np.ndarray) -> float:
    """The log(price / on-demand) at and above which a row is in the spike regime, from prices alone:
    a typical walk step is the median nonzero |row-to-row change|; a move up of more than JUMP_STEPS of
    them is a jump into a spike, and the threshold lies half a step below the lowest price such a jump
    reached (the lowest but a tenth of the jumps: one odd move of the walk does not set it). Inf (no
    spike regime) when the history shows no jump. Made for the family's chain, whose
    walk moves a level at a time; on a continuous walk, its large ordinary moves would count as jumps."""
    steps = np.diff(log_ratio)
    moves = np.abs(steps[steps != 0])
    if not len(moves):
        return math.inf
    step = float(np.median(moves))
    up = np.flatnonzero(steps > JUMP_STEPS * step)
    return float(np.quantile(log_ratio[up + 1], 0.1, method="lower") - step / 2) if len(up) else math.inf


@dataclasses.dataclass(frozen=True)
class FittedOffer:
    """One offer's chain as estimated from a history of its prices (`fit_offer`).

    Args:
        threshold: log(price / on-demand) at and above which a row is a spike (inf: none seen).
        mean, rho, sd: the AR(1) of log(price / on-demand) outside spikes: mean, lag-one
            autocorrelation at the history's rows, stationary sd (innovation sd = sd·sqrt(1 − rho²)).
        p_on, p_off: per row, the chance a spike starts (outside one) and ends (inside one).
        spike_usd_per_hour: the median price seen in spikes (on-demand when none was seen).
    """
    threshold: float
    mean: float
    rho: float
    sd: float
    p_on: float
    p_off: float
    spike_usd_per_hour: float


def fit_offer(usd_per_hour: np.ndarray, on_demand_usd_per_hour: float) -> FittedOffer:
    """Estimate an offer's chain from its history of prices, one per row (module docstring, --learned):
    the spike regime by `spike_threshold`; p_on = (spikes begun + ½) / (rows outside a spike + 1) and
    p_off = (spikes ended + ½) / (rows inside one + 1) (rows before the last; the ½ keeps a history with
    no spike from ruling spikes out); outside spikes, the sample mean and sd of the log ratio and the
    correlation of the pairs of consecutive rows both outside a spike (clipped to 0-0.999)."""
    x = np.log(np.asarray(usd_per_hour, float) / on_demand_usd_per_hour)
    threshold = spike_threshold(x)
    spike = x >= threshold
    calm = x[~spike]
    both = ~spike[:-1] & ~spike[1:]
    rho = float(np.corrcoef(x[:-1][both], x[1:][both])[0, 1]) if both.sum() > 2 and calm.std() > 0 else 0.0
    begun, ended = int((~spike[:-1] & spike[1:]).sum()), int((spike[:-1] & ~spike[1:]).sum())
    return FittedOffer(threshold, float(calm.mean()), min(max(rho, 0.0), 0.999), float(calm.std()),
                       (begun + 0.5) / ((~spike[:-1]).sum() + 1), (ended + 0.5) / (spike[:-1].sum() + 1),
                       float(np.median(np.asarray(usd_per_hour)[spike])) if spike.any() else on_demand_usd_per_hour)


@dataclasses.dataclass(frozen=True)
class FittedFamily:
    """A `Family` as the policy learns it from one history of prices (what `make_plan`,
    `online_lower_bound` and `play` read of a family): each offer's chain built from its `FittedOffer`
    as `Family.chain` builds the true one (Rouwenhorst levels of the AR(1), ⊗ the spike on/off chain;
    a spike state's price the larger of its level's and the spike price), same levels and rows.
    The offers' static figures (on-demand price, preemption rate, tokens/s) are taken as known."""
    offers: tuple[Offer, ...]
    fits: tuple[FittedOffer, ...]
    levels: int
    hours: float

    @classmethod
    def from_history(cls, family: Family, states: np.ndarray, hours: float) -> "FittedFamily":
        """Fitted on the prices of a path of `family`'s states (a history drawn from the true family;
        only its prices are read), for runs of `hours`."""
        fits = tuple(fit_offer(family.chain(o)[1][states[:, j]], o.on_demand_usd_per_hour)
                     for j, o in enumerate(family.offers))
        return cls(family.offers, fits, family.levels, hours)

    @classmethod
    def exact(cls, family: Family) -> "FittedFamily":
        """The family's own figures as a fit (its chain as `Family.chain`'s; the threshold just below
        the spike ratio): to play the known law with the state read from prices."""
        dt_h = STEP_S / 3600
        rho = 1 - dt_h / family.revert_h
        sd = family.volatility * math.sqrt(dt_h) / math.sqrt(1 - rho ** 2)
        fits = tuple(FittedOffer(math.log(family.spike_ratio) - 1e-6, math.log(o.base), rho, sd,
                                 -math.expm1(-dt_h / family.spike_every_h), -math.expm1(-dt_h / family.spike_mean_h),
                                 family.spike_ratio * o.on_demand_usd_per_hour) for o in family.offers)
        return cls(family.offers, fits, family.levels, family.hours)

    @property
    def rows(self) -> int:
        return int(self.hours * 3600 / STEP_S)

    def grid(self, o: Offer) -> np.ndarray:
        """The fitted levels of log(price / on-demand), ascending."""
        f = self.fits[self.offers.index(o)]
        return f.mean + rouwenhorst(self.levels, f.rho, f.sd)[0]

    def chain(self, o: Offer) -> tuple[np.ndarray, np.ndarray, int]:
        f = self.fits[self.offers.index(o)]
        _, walk = rouwenhorst(self.levels, f.rho, f.sd)
        spike = np.array([[1 - f.p_on, f.p_on], [f.p_off, 1 - f.p_off]])
        level = np.minimum(1.0, np.exp(self.grid(o))) * o.on_demand_usd_per_hour
        usd = np.round(np.concatenate([level, np.minimum(o.on_demand_usd_per_hour,
                                                         np.maximum(level, f.spike_usd_per_hour))]), 4)
        return np.kron(spike, walk), usd, self.levels // 2

    market = Family.market


def seen_states(fitted: FittedFamily, usd_per_hour: np.ndarray) -> np.ndarray:
    """The fitted chain's state of each row of a trace's prices ((rows, offers) USD/h): the spike flag
    from the fitted threshold, the level the nearest fitted one in log price (in a spike, the level
    of the last row outside one; the middle level before any)."""
    out = np.zeros(usd_per_hour.shape, np.int64)
    for j, o in enumerate(fitted.offers):
        grid, f = fitted.grid(o), fitted.fits[j]
        level = fitted.levels // 2
        for t, p in enumerate(usd_per_hour[:, j]):
            x = math.log(p / o.on_demand_usd_per_hour)
            if x >= f.threshold:
                out[t, j] = fitted.levels + level
            else:
                level = int(np.abs(grid - x).argmin())
                out[t, j] = level
    return out


def make_plan(family: Family, recipe, lams, stride: int = 3) -> Plan:
    """`online_value`'s schedule for each λ in `lams`, with the recipe's boot and price cap."""
    chains, _, _, rates, tps = family.market()
    usd = capped_usd(family, recipe)
    shape = tuple(len(u) for u in usd)
    m, rows, n = len(usd), family.rows, len(lams)
    kept = (rows + stride - 1) // stride
    plan = Plan(np.asarray(lams, float), np.full((n, rows) + shape, -1, np.int8), np.zeros((n, rows) + shape, np.uint8),
                np.zeros((n, kept) + shape, np.float32), np.zeros((n, kept, m) + shape, np.float32), stride)
    for i, lam in enumerate(plan.lams):
        def record(t, boot, stays, k_off, k_on, i=i):
            plan.boot[i, t] = boot
            plan.stay[i, t] = sum(s.astype(np.uint8) << j for j, s in enumerate(stays))
            if t % stride == 0:
                plan.k_off[i, t // stride] = k_off
                plan.k_on[i, t // stride] = np.stack(k_on)
        online_value(chains, usd, rates, tps, rows, STEP_S, recipe.planner.recovery_s, lam, record=record)
    return plan


def play(plan: Plan, family: Family, states: np.ndarray, recipe, rng: np.random.Generator,
         safety: float, seen: np.ndarray | None = None) -> dict:
    """The plan played on one path of market states (`Family.sample_states`) with preemptions drawn
    from `rng`, in bound.py's slot model (module docstring). The bill is at `states`' prices; the
    decisions are the plan's at `seen` (the plan's own states, e.g. `seen_states` for a plan made on
    a `FittedFamily`), at `states` if None. Returns usd, tokens, finished,
    hours (the run's end), boots, preemptions, released_booting (VMs let go before their boot
    ended) and the mean index of λ on the grid."""
    offers = family.offers
    m, slots, needed = len(offers), recipe.world.max_replicas, run_tokens(recipe)
    boot_s = recipe.planner.recovery_s
    usd_states = [family.chain(o)[1] for o in offers]
    tps = np.array([o.tokens_per_s for o in offers], float)
    rates = [o.preempt_per_hour for o in offers]
    minimum_s = [billing.terms(o.cloud).minimum_s for o in offers]
    held = [-1] * slots              # the offer each slot holds, -1 off
    launch = [0.0] * slots
    gone = [math.inf] * slots        # when its VM is preempted
    usd = tokens = 0.0
    boots = preemptions = early = 0
    lam_i, chosen = len(plan.lams) - 1, []
    for t in range(family.rows):
        s = tuple(int(x) for x in states[t])
        d = s if seen is None else tuple(int(x) for x in seen[t])
        t0, t1 = t * STEP_S, (t + 1) * STEP_S
        if t % plan.stride == 0:
            r = t // plan.stride
            lam_i = _choose(plan, r, d, [(j, max(0.0, launch[x] + boot_s - t0)) for x, j in enumerate(held)],
                            tps, (needed - tokens) * safety)
            chosen.append(lam_i)
        stay_bits, boot_to = int(plan.stay[(lam_i, t) + d]), int(plan.boot[(lam_i, t) + d])
        for x in range(slots):
            if held[x] >= 0 and not stay_bits >> held[x] & 1:
                early += launch[x] + boot_s > t0
                held[x] = -1                              # released at the row start: no minimum
            if held[x] < 0 and boot_to >= 0:
                held[x], launch[x] = boot_to, t0
                gone[x] = t0 + rng.exponential(3600 / rates[boot_to]) if rates[boot_to] > 0 else math.inf
                boots += 1
        # The row: each VM billed while there, training once booted, until preempted or the row ends.
        there = [(min(gone[x], t1) - t0) if j >= 0 else 0.0 for x, j in enumerate(held)]
        train = [(max(t0, launch[x] + boot_s), min(gone[x], t1)) if j >= 0 else (t1, t1) for x, j in enumerate(held)]
        row_tokens = sum(tps[j] * max(0.0, b - a) for (a, b), j in zip(train, held) if j >= 0)
        end = t1
        if tokens + row_tokens >= needed:                 # done inside this row: when?
            def by(e):
                return sum(tps[j] * max(0.0, min(b, e) - a) for (a, b), j in zip(train, held) if j >= 0)
            lo, hi = t0, t1
            for _ in range(60):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if tokens + by(mid) < needed else (lo, mid)
            end, row_tokens = hi, needed - tokens
            there = [min(d, end - t0) for d in there]
        tokens += row_tokens
        for x, j in enumerate(held):
            if j < 0:
                continue
            usd += usd_states[j][s[j]] * there[x] / 3600
            if gone[x] <= end:
                preemptions += 1
                usd += usd_states[j][s[j]] * max(0.0, minimum_s[j] - (gone[x] - launch[x])) / 3600
                held[x] = -1
        if tokens >= needed:
            return dict(usd=usd, tokens=tokens, finished=True, hours=end / 3600, boots=boots,
                        preemptions=preemptions, released_booting=early, lam_index=statistics.fmean(chosen))
    return dict(usd=usd, tokens=tokens, finished=False, hours=family.rows * STEP_S / 3600, boots=boots,
                preemptions=preemptions, released_booting=early, lam_index=statistics.fmean(chosen))


def _choose(plan: Plan, r: int, s: tuple, held: list[tuple[int, float]], tps, left: float) -> int:
    """The least λ of the grid whose slots' expected tokens from kept row `r` (market state `s`;
    `held`: each slot's offer, -1 off, and its boot seconds still to go) reach `left`; else the last."""
    for i in range(len(plan.lams)):
        k = sum(plan.k_off[(i, r) + s] if j < 0 else plan.k_on[(i, r, j) + s] - tps[j] * booting_s
                for j, booting_s in held)
        if k >= left:
            return i
    return len(plan.lams) - 1


class PlanPolicy(Policy):
    """The plan as a rental policy for `elastic.sim.simulate` (`simulate(recipe, trace, [PlanPolicy(...)])`):
    the slots are the VMs held (not leaving) and world.max_replicas less them off; each call acts on
    them with the decisions of the present row (the trace's rows are the chain's states, known
    exactly) and the λ chosen at its last kept row: a VM whose offer is not kept is released (at the
    next step boundary), and every off slot rents the offer an off slot boots. Pausing is releasing
    every VM. Not pure: the λ chosen is kept here between calls (a benchmark's policy, never
    registered)."""

    name = "plan"

    def __init__(self, plan: Plan, family: Family, states: np.ndarray, safety: float, margin_h: float = 0.0):
        self.plan, self.family, self.states, self.safety = plan, family, states, safety
        self.margin = int(margin_h * 3600 / STEP_S) // plan.stride     # kept rows the deadline is brought forward
        self.keys = [(o.cloud, o.region, o.zone, o.instance_type) for o in family.offers]
        self.tps = [o.tokens_per_s for o in family.offers]
        self.lam_i, self.at = len(plan.lams) - 1, -1

    def decide(self, snap):
        r = snap.recipe
        t = min(int((snap.time_s - snap.started_s) // STEP_S), self.family.rows - 1)
        s = tuple(int(x) for x in self.states[t])
        live = [n for n in snap.nodes if not n.leaving]
        slots = r.world.max_replicas
        if t // self.plan.stride != self.at:
            self.at = t // self.plan.stride
            held = [(self.keys.index(n.quote.key), max(0.0, n.launched_at_s + r.planner.recovery_s - snap.time_s))
                    for n in live][:slots]
            held += [(-1, 0.0)] * (slots - len(held))
            left = (run_tokens(r) - snap.progress.tokens) * self.safety
            self.lam_i = _choose(self.plan, min(self.at + self.margin, len(self.plan.k_off[0]) - 1), s, held,
                                 self.tps, left)
        bits, boot_to = int(self.plan.stay[(self.lam_i, t) + s]), int(self.plan.boot[(self.lam_i, t) + s])
        out, kept = [], len(snap.pending)
        for n in live:
            if bits >> self.keys.index(n.quote.key) & 1:
                kept += 1
            else:
                out.append(Release(n.instance_id, Move(n.quote, n.instance_id, 0.0, 0.0)))
        quote = next((q for q in snap.quotes if boot_to >= 0 and q.key == self.keys[boot_to]), None)
        if quote is not None:
            out += [Rent(quote)] * max(0, slots - kept)
        return out


def simulate_plan(plan: Plan, family: Family, states: np.ndarray, path: Path, recipe, seed: int,
                  safety: float, margin_h: float = 0.0) -> dict:
    """`elastic.sim.simulate.simulate` on the trace at `path` (drawn as `states`) with `PlanPolicy` as its
    policy; the recipe's world.capacity_timeout_s lifted (a pause of the plan's holds no replica)
    and its own pause rule off (`planner.pauses`)."""
    from elastic.sim.simulate import simulate

    recipe = recipe.model_copy(update={"planner": recipe.planner.model_copy(update={"pauses": False})})
    return simulate(recipe, str(path), [PlanPolicy(plan, family, states, safety, margin_h)], seed=seed)[0]


def _summary(ratios: list[float]) -> str:
    done = [r for r in ratios if math.isfinite(r)]
    within = sum(r <= 1.15 for r in ratios)
    if not done:
        return f"none finished of {len(ratios)}"
    return (f"mean {statistics.fmean(done):.3f}, median {statistics.median(ratios):.3f}, worst "
            f"{max(ratios):.3f}, finished {len(done)}/{len(ratios)}, within 1.15 {within}/{len(ratios)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes/multi-cloud.yaml"))
    ap.add_argument("--traces", type=int, default=20, help="traces drawn from the family")
    ap.add_argument("--seed", type=int, default=0, help="the traces' seed (online_bound.py's: the same traces)")
    ap.add_argument("--seeds", type=int, default=5, help="preemption seeds per trace")
    ap.add_argument("--safety", type=float, nargs="+", default=[1.0, 1.1, 1.2],
                    help="tokens still needed are counted this many times over when λ is chosen")
    add_family_args(ap)
    ap.add_argument("--lams", type=int, default=16, help="token prices on the grid over 0.5-3 × the online bound's")
    ap.add_argument("--stride", type=int, default=3, help="rows between two choices of λ")
    ap.add_argument("--simulate", type=int, default=0,
                    help="also play the plan in elastic.sim.simulate on the first N traces (each safety, each seed), "
                    "and the project's policy (`elastic`) beside it")
    ap.add_argument("--margin-h", type=float, default=0.0,
                    help="in elastic.sim.simulate, λ is chosen as if the deadline came this many hours sooner")
    ap.add_argument("--learned-h", type=float, default=0.0,
                    help="the policy learns the market: it plans on a chain fitted to the prices of one earlier "
                    "trace of this many hours (a separate draw from the family), and sees each row's state only "
                    "through the trace's prices (seen_states); 0: the chain's law and states are known")
    ap.add_argument("--price-states", action="store_true",
                    help="the chain's law known, but each row's state read from the trace's prices (seen_states)")
    ap.add_argument("--history-seed", type=int, default=0, help="with --learned-h: which history is drawn")
    ap.add_argument("--out", type=Path, default=Path("/tmp/online_policy"), help="folder for the traces")
    args = ap.parse_args()
    family = family_from_args(ap, args)
    recipe = load_recipe(args.recipe, [])
    planned, what = family, "online lower bound L"
    if args.price_states:
        planned = FittedFamily.exact(family)
    if args.learned_h:
        history = dataclasses.replace(family, hours=args.learned_h)
        past = history.sample_states(np.random.default_rng([args.seed, 10**6 + args.history_seed]))
        planned = FittedFamily.from_history(history, past, family.hours)
        what = f"the chain fitted on {args.learned_h:g} h of history: its online bound"
        for o, f in zip(planned.offers, planned.fits):
            print(f"fitted {o.zone} {o.instance_type}: spike at ≥ {math.exp(f.threshold):.3f} × on-demand, "
                  f"spikes every {STEP_S / 3600 / f.p_on:.1f} h for {STEP_S / 3600 / f.p_off:.2f} h at "
                  f"{f.spike_usd_per_hour / o.on_demand_usd_per_hour:.3f} × on-demand; log(price / on-demand) mean "
                  f"{f.mean:.3f} (true {math.log(o.base):.3f}), lag-one correlation {f.rho:.4f}, sd {f.sd:.3f}",
                  flush=True)
    online = online_lower_bound(planned, recipe, iterations=8 if args.learned_h else 20)
    lam = online["lam"]
    print(f"{what}: {online['usd_per_mtok']:.5f} USD/1M tok at λ {lam * 1e6:.5f} USD per 1M tok", flush=True)
    lams = np.append(np.geomspace(0.5 * lam, 3 * lam, args.lams), LAST_RESORT * lam)
    plan = make_plan(planned, recipe, lams, args.stride)
    held_mb = sum(a.nbytes for a in (plan.boot, plan.stay, plan.k_off, plan.k_on)) / 1e6
    print(f"plan: {len(lams)} token prices, {held_mb:.0f} MB", flush=True)

    from elastic.sim.simulate import TraceMarket
    from providers.simmarket import read_trace_rows

    rng = np.random.default_rng(args.seed)
    bounds = []
    ratios = {f: [] for f in args.safety}
    played = {f: [] for f in args.safety}
    sim = {f: [] for f in args.safety}
    ours = []
    sim_recipe = load_recipe(args.recipe, ["world.capacity_timeout_s=1e9"])
    for i in range(args.traces):
        states = family.sample_states(rng)
        path = family.write_trace(states, args.out / f"family-{args.seed}-{i}.csv")
        bound = lower_bound_usd_per_mtok(recipe, TraceMarket(read_trace_rows(path), recipe))
        bounds.append(bound)
        seen = None
        if args.learned_h or args.price_states:
            prices = np.stack([family.chain(o)[1][states[:, j]] for j, o in enumerate(family.offers)], axis=1)
            seen = seen_states(planned, prices)
        line = [f"trace {i}: bound.py {bound:.5f}"]
        for f in args.safety:
            runs = [play(plan, family, states, recipe, np.random.default_rng([args.seed, i, k]), f, seen)
                    for k in range(args.seeds)]
            rs = [r["usd"] / r["tokens"] * 1e6 / bound if r["finished"] else math.inf for r in runs]
            ratios[f].extend(rs)
            played[f].extend(runs)
            line.append(f"safety {f}: {' '.join(f'{r:.3f}' for r in rs)}")
        print(", ".join(line), flush=True)
        if i < args.simulate:
            line = [f"trace {i} in elastic.sim.simulate"]
            for f in args.safety:
                runs = [simulate_plan(plan, planned, states if seen is None else seen, path, sim_recipe, k, f,
                                      args.margin_h)
                        for k in range(args.seeds)]
                rs = [x["list_usd_per_mtok"] / bound if x["status"] == "completed" else math.inf for x in runs]
                sim[f].extend(rs)
                line.append(f"safety {f}: {' '.join(f'{r:.3f}' for r in rs)} "
                            "(hours " + " ".join(f"{x['wall_h']:.1f}" for x in runs) + ")")
            from elastic.sim.simulate import simulate
            runs = [simulate(sim_recipe, str(path), ["elastic"], seed=k)[0] for k in range(args.seeds)]
            rs = [x["list_usd_per_mtok"] / bound if x["status"] == "completed" else math.inf for x in runs]
            ours.extend(rs)
            line.append(f"elastic {' '.join(f'{r:.3f}' for r in rs)}")
            print(", ".join(line), flush=True)
    mean = statistics.fmean(bounds)
    half = 1.96 * statistics.stdev(bounds) / math.sqrt(len(bounds)) if len(bounds) > 1 else math.inf
    x = online["usd_per_mtok"]
    print(f"E[bound.py] {mean:.5f} ± {half:.5f} (95 %, {len(bounds)} traces); "
          f"{'fitted chain ' if args.learned_h else ''}L / E[bound.py] {x / mean:.3f}")
    for f in args.safety:
        per_trace = [statistics.median(ratios[f][k * args.seeds:(k + 1) * args.seeds]) for k in range(len(bounds))]
        hours = [r["hours"] for r in played[f]]
        print(f"safety {f}: runs: {_summary(ratios[f])}; trace medians: worst {max(per_trace):.3f}, within 1.15 "
              f"{sum(r <= 1.15 for r in per_trace)}/{len(per_trace)}; hours median {statistics.median(hours):.1f}, "
              f"max {max(hours):.1f}; per run: boots {statistics.fmean(r['boots'] for r in played[f]):.1f}, "
              f"preemptions {statistics.fmean(r['preemptions'] for r in played[f]):.1f}, let go while booting "
              f"{statistics.fmean(r['released_booting'] for r in played[f]):.2f}; mean λ index "
              f"{statistics.fmean(r['lam_index'] for r in played[f]):.1f} of 0-{len(lams) - 1}")
        if sim[f]:
            print(f"safety {f} in elastic.sim.simulate ({args.simulate} traces): {_summary(sim[f])}")
    if ours:
        print(f"elastic (the project's policy) in elastic.sim.simulate: {_summary(ours)}")


if __name__ == "__main__":
    main()
