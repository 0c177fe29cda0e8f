"""Generate the simulator's traces (`bench/traces/*.csv`) from stated assumptions. Seeded: running
it again writes the same files.

    python bench/traces/make_traces.py
    python bench/traces/make_traces.py --storms-seed 7 --out /tmp/t   # one more storms trace, unseen

Traces (`bench/policies.py` runs every policy over each; issue 7's goals apply to all):

`scarce.csv` (48 h) — the 8-GPU spot market as published measurements describe it. Sources are
listed in bench/traces/README.md; what no source pins down is marked "assumed".
- Offers and prices: every zone of a real price snapshot (`sources/catalog-snapshot.csv`: SkyPilot's
  public catalog, AWS p4d.24xlarge / p5.48xlarge in us-east-1, us-west-2, eu-west-1 by AZ id; GCP
  a2-highgpu-8g / a3-highgpu-8g in us-central1, us-east4, europe-west4, asia-east1), spot prices
  as they stand there. GCP on-demand: $29.39/h (a2) and $87.83/h (a3, us-east4) from the same
  snapshot, +8 % in Europe and +12 % in Asia (the snapshot's other GCP on-demand figures are
  inconsistent across regions).
- Price moves: AWS spot prices "adjust gradually" (AWS docs), about 5 % over a week (Can't Be
  Late, NSDI'24): a log-price random walk of 0.004 per sqrt(h). GCP spot prices change at most
  once every 30 days (GCP pricing page): constant over the 48 h.
- Availability: each zone and type alternates between available and out of stock; periods of
  unavailability "can last for hours or even days" and a zone's available share ranges from
  about 40 % to most of the time (Can't Be Late; skypilot-org/spot-traces, 8×V100). Assumed:
  available spells exponential with a per-series mean of 2-24 h, stock-outs exponential with a
  mean of 0.5-8 h (both log-uniform).
- Capacity while available: assumed 1-8 VMs per zone and type (no per-zone figure is published;
  8×A100 spot is reported "unavailable" often: SkyPilot issue #831).
- Preemptions: when a zone and type runs out, the VMs held there are reclaimed together
  (co-interruptions in one type and zone within 3 minutes in over 92 % of 2,635 events,
  Spot-and-Scoot 2026; all-or-none in over 94 % of the time, Can't Be Late): 36 per node-hour for
  the first 5 minutes of a stock-out (95 % gone). Between stock-outs, assumed 0.02-0.2 per
  node-hour per zone (log-uniform). Together about 0.06-0.7 per node-hour, the upper end near the
  0.61 per instance-hour of Parcae's 32-instance p3 trace (NSDI'24).

`volatile.csv` (48 h) — a stress scenario: a market that turns against whatever is cheapest.
- Offers: AWS p4d.24xlarge (8×A100, on-demand $32.77/h) and p5.48xlarge (8×H100, $98.32/h) in
  us-east-1 (3 zones), us-west-2 (2) and eu-west-1 (1); GCP a2-highgpu-8g (8×A100, $29.39/h) and
  a3-highgpu-8g (8×H100, $88.25/h) in us-central1 (2 zones), europe-west4 (1) and asia-east1 (1).
  On-demand prices are the us list prices, +8 % in Europe and +12 % in Asia; they never move.
- Spot price: a zone's base is 22-45 % of on-demand (uniform); the log-price follows a
  mean-reverting walk (reverts over ~2 h) with volatility 0.25 per sqrt(h).
- Preemptions: a zone's hazard is 0.02-0.35 per node-hour (uniform, log-scaled).
- Capacity: 4-24 VMs per zone and type (uniform).
- Events, hitting whatever is cheapest per token at the start (8×H100 taken as 2.5× 8×A100):
  hours 3-9 that zone's spot prices climb to 85 % of on-demand (a demand surge); hours 12-16 a
  preemption storm in its region (3 per node-hour); hours 20-26 a stock-out of its whole region;
  hours 30-34 every spot price +40 %.

`calm.csv` (48 h) — a benign market: the volatile trace's offers and price model with volatility
0.08 per sqrt(h), no events, capacity 4-24 VMs in every zone at all times and hazards of 0.02-0.35
per node-hour. A whole-job restart is cheap there once it sits in a quiet zone: it is the market
where elasticity has least to win (`bench/policies.py` prints the least any policy could pay).

`spikes.csv` and `waves.csv` (48 h each, `make_storms`, seeds 21 and 22; `--storms-seed N` writes
another of the same family for a policy to be judged on a market it was not tuned on) — volatile
markets whose events strike at random times and places, not at whatever was cheapest:
- Offers, on-demand prices, base spot prices and zone hazards as in `volatile.csv`; capacity 2-24
  VMs per zone and type; the log-price walk reverts over ~2 h with volatility 0.3 per sqrt(h).
- Price spikes: each zone and type, at 1 per 16 h (`spikes`: 1 per 8 h), jumps to 70-100 % of
  on-demand for an exponential 1.5 h; each cloud, at 1 per 24 h, all its spot prices ×1.5-2 for
  an exponential 2 h.
- Preemption waves, correlated: each region, at 1 per 24 h (`waves`: 1 per 10 h), 2-8 per
  node-hour for an exponential 1 h, its capacity cut to 0-2 VMs half the time; each cloud, at 1 per
  48 h (`waves`: 1 per 20 h), every region at once, 2-5 per node-hour for an exponential 45 min.
- Assumed, as spot markets are said to behave (demand shows in the price before capacity runs
  out): a wave's region sees its spot prices climb steadily to +60 % over the 45 min before it.
"""

from __future__ import annotations

import csv
import math
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEP_S = 300
COLUMNS = ["timestamp_s", "cloud", "region", "zone", "instance_type", "gpu", "gpus", "spot_usd_per_hour",
           "on_demand_usd_per_hour", "preempt_per_hour", "capacity"]
TYPES = {"aws": [("p4d.24xlarge", "A100", 32.77), ("p5.48xlarge", "H100", 98.32)],
         "gcp": [("a2-highgpu-8g", "A100", 29.39), ("a3-highgpu-8g", "H100", 88.25)]}
ZONES = [("aws", "us-east-1", "us-east-1a", 1.0), ("aws", "us-east-1", "us-east-1b", 1.0),
         ("aws", "us-east-1", "us-east-1c", 1.0), ("aws", "us-west-2", "us-west-2a", 1.0),
         ("aws", "us-west-2", "us-west-2b", 1.0), ("aws", "eu-west-1", "eu-west-1a", 1.08),
         ("gcp", "us-central1", "us-central1-a", 1.0), ("gcp", "us-central1", "us-central1-b", 1.0),
         ("gcp", "europe-west4", "europe-west4-a", 1.08), ("gcp", "asia-east1", "asia-east1-a", 1.12)]


def make(name: str, hours: float, volatility: float, seed: int, events: bool) -> Path:
    """The volatile and calm traces (synthetic offers and prices)."""
    rng = random.Random(seed)
    series = []
    for cloud, region, zone, mult in ZONES:
        hazard = math.exp(rng.uniform(math.log(0.02), math.log(0.35)))
        for it, gpu, od in TYPES[cloud]:
            series.append({"cloud": cloud, "region": region, "zone": zone, "it": it, "gpu": gpu,
                           "od": round(od * mult, 2), "base": rng.uniform(0.22, 0.45), "hazard": hazard,
                           "cap": rng.randint(4, 24), "dev": 0.0})
    # The events hit whatever is cheapest per token at the start (8×H100 trains 2.5× 8×A100).
    speed = {"A100": 1.0, "H100": 2.5}
    surge = min(series, key=lambda s: s["base"] * s["od"] / speed[s["gpu"]])
    rows = []
    dt_h = STEP_S / 3600
    for i in range(int(hours * 3600 / STEP_S)):
        t, h = i * STEP_S, i * dt_h
        for s in series:
            s["dev"] += -s["dev"] * dt_h / 2 + volatility * math.sqrt(dt_h) * rng.gauss(0, 1)
            ratio = min(0.95, s["base"] * math.exp(s["dev"]))
            hazard, cap = s["hazard"], s["cap"]
            if events:
                if s["zone"] == surge["zone"] and 3 <= h < 9:
                    ratio = max(ratio, 0.85)
                if s["region"] == surge["region"] and 12 <= h < 16:
                    hazard = 3.0
                if s["region"] == surge["region"] and 20 <= h < 26:
                    cap = 0
                if 30 <= h < 34:
                    ratio = min(0.95, ratio * 1.4)
            rows.append([t, s["cloud"], s["region"], s["zone"], s["it"], s["gpu"], 8, round(ratio * s["od"], 4),
                         s["od"], round(hazard, 4), cap])
    return write(name, rows)


GCP_ON_DEMAND = {"a2-highgpu-8g": 29.39, "a3-highgpu-8g": 87.83}   # us list prices, USD/h
REGION_MULT = {"europe": 1.08, "asia": 1.12}


def make_scarce(name: str, hours: float, seed: int) -> Path:
    """The measured-market trace (see the module docstring for every figure and its source)."""
    rng = random.Random(seed)
    with open(HERE / "sources" / "catalog-snapshot.csv", newline="", encoding="utf-8") as f:
        snapshot = list(csv.DictReader(f))
    gpu = {"p4d.24xlarge": "A100", "p5.48xlarge": "H100", "a2-highgpu-8g": "A100", "a3-highgpu-8g": "H100"}
    zone_hazard: dict[str, float] = {}
    series = []
    for r in snapshot:
        zone, cloud, it = r["zone"], r["cloud"], r["instance_type"]
        if zone not in zone_hazard:
            zone_hazard[zone] = math.exp(rng.uniform(math.log(0.02), math.log(0.2)))
        od = float(r["on_demand_usd_per_hour"])
        if cloud == "gcp":
            od = round(GCP_ON_DEMAND[it] * REGION_MULT.get(r["region"].split("-")[0], 1.0), 2)
        up_h = math.exp(rng.uniform(math.log(2), math.log(24)))
        down_h = math.exp(rng.uniform(math.log(0.5), math.log(8)))
        series.append({"cloud": cloud, "region": r["region"], "zone": zone, "it": it, "gpu": gpu[it], "od": od,
                       "spot": float(r["spot_usd_per_hour"]), "log_dev": 0.0, "up_h": up_h, "down_h": down_h,
                       "cap": rng.randint(1, 8),
                       "available": rng.random() < up_h / (up_h + down_h),
                       "switch_at_h": 0.0, "out_since_h": -math.inf})
    for s in series:
        s["switch_at_h"] = rng.expovariate(1 / (s["up_h"] if s["available"] else s["down_h"]))
    rows = []
    dt_h = STEP_S / 3600
    for i in range(int(hours * 3600 / STEP_S)):
        t, h = i * STEP_S, i * dt_h
        for s in series:
            while h >= s["switch_at_h"]:
                s["available"] = not s["available"]
                s["out_since_h"] = None if s["available"] else s["switch_at_h"]
                s["switch_at_h"] += rng.expovariate(1 / (s["up_h"] if s["available"] else s["down_h"]))
            if s["cloud"] == "aws":
                s["log_dev"] += 0.004 * math.sqrt(dt_h) * rng.gauss(0, 1)
            spot = min(s["od"], s["spot"] * math.exp(s["log_dev"]))
            if s["available"]:
                hazard, cap = zone_hazard[s["zone"]], s["cap"]
            else:   # reclaimed together in the first 5 minutes of a stock-out, then nothing to hold
                hazard, cap = (36.0 if h - s["out_since_h"] < dt_h else zone_hazard[s["zone"]]), 0
            rows.append([t, s["cloud"], s["region"], s["zone"], s["it"], s["gpu"], 8, round(spot, 4), s["od"],
                         round(hazard, 4), cap])
    return write(name, rows)


def _spells(rng: random.Random, hours: float, per_h: float, mean_h: float) -> list[tuple[float, float]]:
    """Poisson event starts at `per_h` over `hours`, each lasting an exponential `mean_h`:
    [(start_h, end_h)]."""
    out, h = [], rng.expovariate(per_h)
    while h < hours:
        out.append((h, h + rng.expovariate(1 / mean_h)))
        h += rng.expovariate(per_h)
    return out


def make_storms(name: str, hours: float, seed: int, spike_every_h: float = 16.0, wave_every_h: float = 24.0,
                cloud_wave_every_h: float = 48.0, out: Path = HERE) -> Path:
    """A volatile market with price spikes and correlated preemption waves at random (see the
    module docstring for every figure)."""
    rng = random.Random(seed)
    series, hazard_of = [], {}
    for cloud, region, zone, mult in ZONES:
        hazard_of[zone] = math.exp(rng.uniform(math.log(0.02), math.log(0.35)))
        for it, gpu, od in TYPES[cloud]:
            series.append({"cloud": cloud, "region": region, "zone": zone, "it": it, "gpu": gpu,
                           "od": round(od * mult, 2), "base": rng.uniform(0.22, 0.45), "cap": rng.randint(2, 24),
                           "dev": 0.0, "spikes": _spells(rng, hours, 1 / spike_every_h, 1.5)})
    clouds = sorted(TYPES)
    regions = sorted({z[1] for z in ZONES})
    cloud_spikes = {c: [(a, b, rng.uniform(1.5, 2.0)) for a, b in _spells(rng, hours, 1 / 24, 2.0)] for c in clouds}
    waves = {r: [(a, b, rng.uniform(2, 8), rng.randint(0, 2) if rng.random() < 0.5 else None)
                 for a, b in _spells(rng, hours, 1 / wave_every_h, 1.0)] for r in regions}
    cloud_waves = {c: [(a, b, rng.uniform(2, 5)) for a, b in _spells(rng, hours, 1 / cloud_wave_every_h, 0.75)]
                   for c in clouds}
    rows = []
    dt_h = STEP_S / 3600
    for i in range(int(hours * 3600 / STEP_S)):
        t, h = i * STEP_S, i * dt_h
        for s in series:
            s["dev"] += -s["dev"] * dt_h / 2 + 0.3 * math.sqrt(dt_h) * rng.gauss(0, 1)
            ratio = s["base"] * math.exp(s["dev"])
            hazard, cap = hazard_of[s["zone"]], s["cap"]
            for a, b in s["spikes"]:
                if a <= h < b:
                    ratio = max(ratio, 0.7 + 0.3 * rng.random())
            for a, b, x in cloud_spikes[s["cloud"]]:
                if a <= h < b:
                    ratio *= x
            region_waves = [(a, b, x, None) for a, b, x in cloud_waves[s["cloud"]]] + waves[s["region"]]
            for a, b, rate, cut in region_waves:
                if a - 0.75 <= h < a:          # demand shows in the price first
                    ratio *= 1 + 0.6 * (h - a + 0.75) / 0.75
                if a <= h < b:
                    hazard = max(hazard, rate)
                    cap = cap if cut is None else min(cap, cut)
            ratio = min(1.0, ratio)
            rows.append([t, s["cloud"], s["region"], s["zone"], s["it"], s["gpu"], 8, round(ratio * s["od"], 4),
                         s["od"], round(hazard, 4), cap])
    return write(name, rows, out)


def write(name: str, rows: list, out: Path = HERE) -> Path:
    path = out / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        w.writerows(rows)
    return path


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--storms-seed", type=int, help="write only storms-SEED.csv, another trace of the storms family")
    ap.add_argument("--out", type=Path, default=HERE, help="folder to write into (default: bench/traces)")
    args = ap.parse_args()
    if args.storms_seed is not None:
        print(make_storms(f"storms-{args.storms_seed}", 48, seed=args.storms_seed, out=args.out))
    else:
        print(make_scarce("scarce", 48, seed=3))
        print(make("volatile", 48, 0.25, seed=2, events=True))
        print(make("calm", 48, 0.08, seed=1, events=False))
        print(make_storms("spikes", 48, seed=21, spike_every_h=8.0))
        print(make_storms("waves", 48, seed=22, wave_every_h=10.0, cloud_wave_every_h=20.0))
