"""How close can a policy that does not see the future come to `elastic/sim/bound.py`'s clairvoyant
bound? The least expected cost of an online (non-anticipating) rental policy over a family of
volatile markets, in bound.py's own relaxed model, set against the mean of bound.py's bound on
traces drawn from the family.

    python bench/online_bound.py [--traces 20] [--seed 0] [--levels 5] [--offers 4] [--spike-every-h 16]
                                 [--policy-seeds 1] [--slopes B ...] [--out DIR]

The argument (docs/benchmarks.md, "An online lower bound over a family of volatile markets"): if on
every trace of a family a policy's expected cost were at most 1.15 × bound.py's bound, its mean over
the family would be at most 1.15 × E[bound]; so a lower bound on the expected cost of every online
policy above 1.15 × E[bound] would show that no policy is within 1.15 on every trace of the family.
On this family it comes out at about 1.0 × E[bound]: no such proof (the doc says what it shows).

The family (`Family`): `make_storms`' on-demand prices, spot bases (22-45 % of on-demand), zone
hazards (0.02-0.35 per node-hour), log-price walk (reverting over 2 h, volatility 0.3 per sqrt(h),
starting at 0) and per-zone price spikes (1 per 16 h, to 85 % of on-demand, the middle of its
70-100 %, for an exponential 1.5 h), with changes that make the least online cost computable
exactly: the walk is the finite Markov chain with the walk's mean, variance and lag-one
autocorrelation (Rouwenhorst's), the family holds four offers, not twenty, its static figures are
fixed (only prices move at random), capacities never bind, and there are no cloud spikes or
preemption waves. Traces are drawn from that very chain (`Family.sample_trace`).

The online side (`online_lower_bound`) is bound.py's Lagrangian relaxation (λ per token; one Markov
decision process per VM slot) with the future replaced by its expectation under the chain: the slot
sees the market's state (every offer's level and spike flag, more than prices) and the chain's law.
It drops, in the online policy's favour: the price cap, capacities, the billing minimum, syncs and
pace, lost work; a boot started anywhere in a row is counted from the next row's start and is
`recovery_s` less one row long; the run's tokens are needed in expectation over the family, not on
every trace. It keeps bound.py's slot structure (at most world.max_replicas VMs, one per slot, a move
forgoing the new VM's boot), which the simulator does not impose on a policy (old and new VMs are
both held during a move): so it is a bound on policies of that shape, not yet on every policy.
`clairvoyant_value` is the same model with the trace foreseen: their ratio is what foresight is
worth in it. `counted_lower_bound` (`--slopes`) is sharper: the token price is set by the whole
trace (its count of cheap rows), so a cheap trace cannot make up for a dear one.
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

from bench.traces.make_traces import write  # noqa: E402
from elastic.policy.planner import run_tokens  # noqa: E402
from elastic.recipe.model import load_recipe  # noqa: E402
from elastic.sim.bound import _expected_min, lower_bound_usd_per_mtok  # noqa: E402

STEP_S = 300.0     # the trace's rows (bench/traces/make_traces.py)


@dataclasses.dataclass(frozen=True)
class Offer:
    """One zone and instance type of the family, with `make_storms`' static figures."""
    cloud: str
    region: str
    zone: str
    instance_type: str
    gpu: str
    tokens_per_s: float
    on_demand_usd_per_hour: float
    base: float                  # spot price / on-demand at a log-deviation of 0
    preempt_per_hour: float
    capacity: int


# The family's offers: four of make_storms' twenty (one 8×A100 and one 8×H100 zone per cloud), bases
# and hazards inside its ranges (22-45 % of on-demand; 0.02-0.35 per node-hour), capacities inside
# its 2-24 and at least world.max_replicas.
OFFERS = (
    Offer("aws", "us-east-1", "us-east-1a", "p4d.24xlarge", "A100", 24_000, 32.77, 0.32, 0.10, 12),
    Offer("gcp", "us-central1", "us-central1-a", "a2-highgpu-8g", "A100", 24_000, 29.39, 0.36, 0.05, 12),
    Offer("aws", "us-east-1", "us-east-1b", "p5.48xlarge", "H100", 60_000, 98.32, 0.30, 0.10, 12),
    Offer("gcp", "us-central1", "us-central1-b", "a3-highgpu-8g", "H100", 60_000, 88.25, 0.34, 0.05, 12),
)


def rouwenhorst(levels: int, rho: float, sd: float) -> tuple[np.ndarray, np.ndarray]:
    """A `levels`-state Markov chain with the stationary sd and lag-one autocorrelation `rho` of an
    AR(1): (grid of values, transition matrix). Rouwenhorst (1995): exact in both moments."""
    p = (1 + rho) / 2
    m = np.array([[1.0]])
    for n in range(2, levels + 1):
        z = np.zeros((n, n))
        z[:-1, :-1] += p * m
        z[:-1, 1:] += (1 - p) * m
        z[1:, :-1] += (1 - p) * m
        z[1:, 1:] += p * m
        z[1:-1] /= 2
        m = z
    half = sd * math.sqrt(levels - 1)
    return np.linspace(-half, half, levels), m


@dataclasses.dataclass(frozen=True)
class Family:
    """The volatile market family: each offer's spot price is a Markov chain of (log-deviation level,
    spike flag), offers independent. Figures as make_storms' (bench/traces/make_traces.py)."""
    offers: tuple[Offer, ...] = OFFERS
    levels: int = 5
    revert_h: float = 2.0          # dev += -dev·dt/revert_h + volatility·sqrt(dt)·N(0, 1)
    volatility: float = 0.3
    spike_every_h: float = 16.0
    spike_mean_h: float = 1.5
    spike_ratio: float = 0.85
    hours: float = 48.0

    @property
    def rows(self) -> int:
        return int(self.hours * 3600 / STEP_S)

    def chain(self, o: Offer) -> tuple[np.ndarray, np.ndarray, int]:
        """One offer's chain: transition matrix over states (spike · levels + level), the spot USD/h
        of each state (rounded as a trace rounds it), and the start state (deviation 0, no spike)."""
        dt_h = STEP_S / 3600
        rho = 1 - dt_h / self.revert_h
        step_sd = self.volatility * math.sqrt(dt_h)
        grid, walk = rouwenhorst(self.levels, rho, step_sd / math.sqrt(1 - rho ** 2))
        on = -math.expm1(-dt_h / self.spike_every_h)
        off = -math.expm1(-dt_h / self.spike_mean_h)
        spike = np.array([[1 - on, on], [off, 1 - off]])
        ratio = o.base * np.exp(grid)
        ratio = np.concatenate([np.minimum(1.0, ratio), np.minimum(1.0, np.maximum(ratio, self.spike_ratio))])
        usd = np.round(ratio * o.on_demand_usd_per_hour, 4)
        return np.kron(spike, walk), usd, self.levels // 2

    def market(self) -> tuple[list[np.ndarray], list[np.ndarray], tuple[int, ...], list[float], list[float]]:
        """Every offer's `chain` as `online_value` takes them: transition matrices, USD/h per state,
        the start state, and each offer's preemptions per node-hour and tokens/s."""
        chains, usd, start = (list(x) for x in zip(*(self.chain(o) for o in self.offers)))
        return (chains, usd, tuple(start), [o.preempt_per_hour for o in self.offers],
                [o.tokens_per_s for o in self.offers])

    def sample_states(self, rng: np.random.Generator) -> np.ndarray:
        """One path of the market's chain: each row's state of each offer, (rows, offers) ints."""
        cols = []
        for o in self.offers:
            p, usd, s = self.chain(o)
            cum = p.cumsum(axis=1)
            states = []
            for _ in range(self.rows):
                states.append(s)
                s = min(int(np.searchsorted(cum[s], rng.random(), side="right")), len(usd) - 1)
            cols.append(states)
        return np.array(cols, dtype=np.int64).T

    def sample_trace(self, rng: np.random.Generator, path: Path) -> Path:
        """One trace of the family, written in bench/traces' CSV format."""
        return self.write_trace(self.sample_states(rng), path)

    def write_trace(self, states: np.ndarray, path: Path) -> Path:
        """The trace of a path of states (`sample_states`), written in bench/traces' CSV format."""
        cols = [self.chain(o)[1][states[:, j]] for j, o in enumerate(self.offers)]
        rows = [[int(i * STEP_S), o.cloud, o.region, o.zone, o.instance_type, o.gpu, 8, round(float(col[i]), 4),
                 o.on_demand_usd_per_hour, o.preempt_per_hour, o.capacity]
                for i in range(self.rows) for o, col in zip(self.offers, cols)]
        return write(path.stem, rows, path.parent)


def _expect(f: np.ndarray, chains: list[np.ndarray]) -> np.ndarray:
    """E[f(next state) | state] for independent chains, one per axis of `f`."""
    for axis, p in enumerate(chains):
        f = np.moveaxis(np.tensordot(p, f, axes=([1], [axis])), 0, axis)
    return f


def online_value(chains: list[np.ndarray], usd: list[np.ndarray], rate_per_h: list[float], tps: list[float],
                 rows: int, row_s: float, boot_s: float, lam, counted: np.ndarray | None = None,
                 record=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One slot's least expected cost − Λ·tokens over `rows` rows, seeing only the market's state,
    from every start state while off: (value, expected tokens of that best schedule, E[Λ]), arrays
    over the joint state (one axis per offer, and with `counted` a last one: rows counted so far).

    The slot MDP is bound.py's `_slot` (at each row start: keep the VM, release it, or boot one of
    any offer; a VM present in a row is preempted at the offer's rate and the slot is then off) with
    the future replaced by its expectation under the chain given the present. `boot_s` is the boot
    as this MDP charges it: tokens forgone for E[min(τ, boot_s)] of the boot row.

    Args:
        chains: each offer's transition matrix (row-stochastic).
        usd: each offer's USD/h in each of its chain's states.
        rate_per_h, tps: each offer's preemptions per node-hour and tokens/s.
        rows, row_s: the horizon in rows of `row_s` seconds.
        boot_s: see above.
        lam: the token price Λ, USD per token: a number, or with `counted` an array over how many
            rows of the whole trace are counted (0..rows): Λ = lam[H_T], known only at the end; a
            token of row t is then priced E[Λ | the market so far] (what a non-anticipating
            schedule's tokens are worth against it).
        counted: 0/1 over the joint market state: which rows H counts.
        record: called at each row t (from the last) as record(t, boot, stay, k_off, k_on): the
            best schedule's decisions and expected tokens from row t on, arrays over the joint
            state: the offer an off slot boots (-1: none), whether a slot on each offer keeps its
            VM, the tokens of a slot off and on each offer (bench/online_policy.py plays them).
    """
    shape = tuple(len(u) for u in usd)
    m = len(usd)
    extra = () if counted is None else (rows + 1,)

    def nxt(f):
        """E[f(next row's state) | this row's state], the count moved on by the next row's."""
        if counted is not None:
            up = np.concatenate([f[..., 1:], f[..., -1:]], axis=-1)
            f = np.where(counted[..., None] == 1, up, f)
        return _expect(f, chains)

    there = [float(_expected_min(r, row_s)) for r in rate_per_h]
    gone = [-math.expm1(-r * row_s / 3600) for r in rate_per_h]
    booting = [float(_expected_min(r, boot_s)) for r in rate_per_h]
    price = []
    for j in range(m):
        axis = [1] * (m + len(extra))
        axis[j] = shape[j]
        price.append(usd[j].reshape(axis))
    price_now = np.asarray(lam, float) if counted is None else np.broadcast_to(lam, shape + extra).copy()
    w_off, w_on = np.zeros(shape + extra), [np.zeros(shape + extra) for _ in range(m)]
    k_off, k_on = np.zeros(shape + extra), [np.zeros(shape + extra) for _ in range(m)]   # expected tokens
    for t in range(rows - 1, -1, -1):
        if counted is not None and t < rows - 1:
            price_now = nxt(price_now)          # E[Λ | this row's state and the count so far]
        e_off, e_koff = nxt(w_off), nxt(k_off)
        keep, ktok = [], []
        for j in range(m):
            run = (price[j] / 3600 - price_now * tps[j]) * there[j]
            keep.append(run + (1 - gone[j]) * nxt(w_on[j]) + gone[j] * e_off)
            ktok.append(tps[j] * there[j] + (1 - gone[j]) * nxt(k_on[j]) + gone[j] * e_koff)
        switch = np.stack([keep[j] + price_now * tps[j] * booting[j] for j in range(m)])
        stok = np.stack([ktok[j] - tps[j] * booting[j] for j in range(m)])
        a = switch.argmin(axis=0)
        best_switch = np.take_along_axis(switch, a[None], 0)[0]
        best_stok = np.take_along_axis(stok, a[None], 0)[0]
        start = best_switch < e_off
        w_off = np.where(start, best_switch, e_off)
        k_off = np.where(start, best_stok, e_koff)
        stays = []
        for j in range(m):
            stay = keep[j] <= w_off
            w_on[j] = np.where(stay, keep[j], w_off)
            k_on[j] = np.where(stay, ktok[j], k_off)
            stays.append(stay)
        if record is not None:
            record(t, np.where(start, a, -1), stays, k_off, k_on)
    return w_off, k_off, np.broadcast_to(price_now, w_off.shape)


def online_lower_bound(family: Family, recipe, iterations: int = 20) -> dict:
    """A lower bound on the expected USD per 1M tokens an online policy of bound.py's slot shape pays
    on the family: max over λ of slots·V(λ) + λ·tokens needed (weak duality), V from `online_value`
    at the start state, boots counted as `recovery_s` less one row (a boot started inside a row,
    counted from the next row's start: billed less, ready no later, decided knowing more). Any λ
    gives a valid bound; bisection on the supergradient (tokens needed − slots·expected tokens)
    finds the best. Returns usd_per_mtok, lam (USD per token) and the slots' expected tokens."""
    chains, usd, start, rates, tps = family.market()
    slots, needed = recipe.world.max_replicas, run_tokens(recipe)
    boot_s = max(0.0, recipe.planner.recovery_s - STEP_S)
    best = {"usd_per_mtok": -math.inf}

    def at(lam):
        v, k, _ = online_value(chains, usd, rates, tps, family.rows, STEP_S, boot_s, lam)
        value = slots * v[start] + lam * needed
        if value / needed * 1e6 > best["usd_per_mtok"]:
            best.update(usd_per_mtok=value / needed * 1e6, lam=lam, tokens=slots * k[start])
        return slots * k[start]

    lo, hi = 0.0, 1e-9
    while at(hi) < needed:
        lo, hi = hi, hi * 2
        if hi > 1e-3:
            raise ValueError("the family cannot train the run's tokens")
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if at(mid) >= needed else (mid, hi)
    return best


def counted_lower_bound(family: Family, recipe, lam: float, slopes: list[float]) -> float:
    """A sharper online bound: the token price set by the whole trace, Λ = max(0, lam·(a + b·(H −
    E[H]) / E[H])), H the trace's rows where some offer trains a token for less than `lam` (a
    cheap trace needs a lower price to train the run), for each slope b in `slopes` and a in
    0.9, 1.0, 1.1: the best slots·V + E[Λ]·tokens needed, USD per 1M tokens (valid for any Λ ≥ 0 that
    depends on the trace: a policy that trains the run's tokens on every trace pays at least it).
    Its state gains the count (0..rows): for a family of one or two offers."""
    chains, usd, start, rates, tps = family.market()
    per_token = [u / 3600 / t for u, t in zip(usd, tps)]
    cheapest = per_token[0]
    for x in per_token[1:]:
        cheapest = np.minimum.outer(cheapest, x)
    counted = (cheapest < lam).astype(int)
    at = start + (int(counted[start]),)
    boot_s = max(0.0, recipe.planner.recovery_s - STEP_S)
    slots, needed, rows = recipe.world.max_replicas, run_tokens(recipe), family.rows
    h = np.arange(rows + 1, dtype=float)
    mean_h = online_value(chains, usd, rates, tps, rows, STEP_S, boot_s, h, counted)[2][at]
    best = -math.inf
    for b in slopes:
        for a in (0.9, 1.0, 1.1):
            v, _, price = online_value(chains, usd, rates, tps, rows, STEP_S, boot_s,
                                       np.maximum(0.0, lam * (a + b * (h - mean_h) / mean_h)), counted)
            best = max(best, (slots * v[at] + needed * price[at]) / needed * 1e6)
    return best


def clairvoyant_value(recipe, path: Path, lam: float) -> float:
    """bound.py's slot MDP on one trace at the token price `lam`, in `online_value`'s model (boots of
    `recovery_s` less one row, no capacity, no price cap, no billing minimum): slots·V + λ·tokens
    needed, in USD per 1M tokens. Set against `online_lower_bound` at the same λ, it is what
    foresight alone is worth in that model."""
    from elastic.sim.bound import _arrays, _slot
    from elastic.sim.simulate import TraceMarket
    from providers.simmarket import read_trace_rows

    uncapped = recipe.model_copy(update={"resources": recipe.resources.model_copy(update={"max_usd_per_hour": None})})
    usd, _, rate, row_s, tps, _ = _arrays(uncapped, TraceMarket(read_trace_rows(path), uncapped), None)
    boot_s = max(0.0, recipe.planner.recovery_s - STEP_S)
    value = _slot(usd, rate, row_s, tps, lam, np.zeros_like(usd), boot_s, np.zeros_like(usd))[0]
    needed = run_tokens(recipe)
    return (recipe.world.max_replicas * value + lam * needed) / needed * 1e6


def _mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % normal interval."""
    half = 1.96 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.inf
    return statistics.fmean(xs), half


def add_family_args(ap: argparse.ArgumentParser) -> None:
    """The family's command-line options (`family_from_args` reads them)."""
    ap.add_argument("--levels", type=int, default=5, help="levels of each offer's price chain")
    ap.add_argument("--offers", type=int, default=len(OFFERS), help="the first N of the family's offers")
    ap.add_argument("--spike-every-h", type=float, default=16.0, help="mean hours between an offer's spikes")


def family_from_args(ap: argparse.ArgumentParser, args) -> Family:
    """The family `add_family_args`' options name (an argparse error when they do not make one)."""
    if args.levels < 1 or args.levels % 2 == 0:
        ap.error("--levels must be odd (the walk starts at its middle level, a deviation of 0)")
    if not 1 <= args.offers <= len(OFFERS):
        ap.error(f"--offers must be 1-{len(OFFERS)}")
    return Family(offers=OFFERS[:args.offers], levels=args.levels, spike_every_h=args.spike_every_h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes/multi-cloud.yaml"))
    ap.add_argument("--traces", type=int, default=20, help="traces drawn from the family for E[bound]")
    ap.add_argument("--seed", type=int, default=0)
    add_family_args(ap)
    ap.add_argument("--policy-seeds", type=int, default=1, help="elastic.sim.simulate runs per trace (0: none)")
    ap.add_argument("--slopes", type=float, nargs="*", default=[],
                    help="also the bound with the token price set by the trace's cheap rows (counted_lower_bound)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/online_bound"), help="folder for the traces")
    args = ap.parse_args()
    family = family_from_args(ap, args)
    recipe = load_recipe(args.recipe, [])
    online = online_lower_bound(family, recipe)
    lam = online["lam"]
    print(f"online, relaxed: {online['usd_per_mtok']:.5f} USD/1M tok (λ {lam * 1e6:.5f} USD per 1M tok; the slots' "
          f"expected tokens {online['tokens'] / 1e9:.3f} B of {run_tokens(recipe) / 1e9:.3f} B)", flush=True)
    if args.slopes:
        sharper = counted_lower_bound(family, recipe, lam, args.slopes)
        print(f"online, token price set by the trace's cheap rows: {sharper:.5f} USD/1M tok", flush=True)

    from elastic.sim.simulate import TraceMarket, simulate
    from providers.simmarket import read_trace_rows

    rng = np.random.default_rng(args.seed)
    bounds, seers, policy = [], [], []
    for i in range(args.traces):
        path = family.sample_trace(rng, args.out / f"family-{args.seed}-{i}.csv")
        bounds.append(lower_bound_usd_per_mtok(recipe, TraceMarket(read_trace_rows(path), recipe)))
        seers.append(clairvoyant_value(recipe, path, lam))
        runs = [simulate(recipe, str(path), ["elastic"], seed=s)[0] for s in range(args.policy_seeds)]
        ours = [r["list_usd_per_mtok"] / bounds[-1] if r["status"] == "completed" else math.inf for r in runs]
        policy.extend(ours)
        print(f"trace {i}: bound.py {bounds[-1]:.5f}, same model foreseen at λ {seers[-1]:.5f}"
              + (f", elastic / bound.py {' '.join(f'{x:.3f}' for x in ours)}" if ours else ""), flush=True)
    mean, half = _mean_ci(bounds)
    seen, seen_half = _mean_ci(seers)
    x = online["usd_per_mtok"]
    print(f"E[bound.py] {mean:.5f} ± {half:.5f} (95 %, {len(bounds)} traces)")
    print(f"online, relaxed / E[bound.py]: {x / mean:.3f} (95 % interval {x / (mean + half):.3f} - "
          f"{x / (mean - half):.3f}); the proof needs > 1.15")
    print(f"foresight's worth at λ: online, relaxed / E[same model foreseen] {x / seen:.3f} "
          f"(95 % interval {x / (seen + seen_half):.3f} - {x / (seen - seen_half):.3f})")
    if policy:
        print(f"elastic / bound.py: mean {statistics.fmean(policy):.3f}, median {statistics.median(policy):.3f}, "
              f"worst {max(policy):.3f} ({len(policy)} runs)")


if __name__ == "__main__":
    main()
