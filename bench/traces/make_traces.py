"""Generate the simulator's traces (`bench/traces/*.csv`) from stated assumptions. Seeded: running
it again writes the same files.

    python bench/traces/make_traces.py

Assumptions (per zone and instance type, one row every 5 simulated minutes):
- Offers: AWS p4d.24xlarge (8×A100, on-demand $32.77/h) and p5.48xlarge (8×H100, $98.32/h) in
  us-east-1 (3 zones), us-west-2 (2) and eu-west-1 (1); GCP a2-highgpu-8g (8×A100, $29.39/h) and
  a3-highgpu-8g (8×H100, $88.25/h) in us-central1 (2 zones), europe-west4 (1) and asia-east1 (1).
  On-demand prices are the us list prices, +8 % in Europe and +12 % in Asia; they never move.
- Spot price: a zone's base is 22-45 % of on-demand (uniform; public spot discounts for these
  types are 55-75 %); the log-price follows a mean-reverting walk (reverts over ~2 h) with the
  trace's volatility.
- Preemptions: a zone's hazard is 0.02-0.35 per node-hour (uniform, log-scaled), the same for
  both types in a zone.
- Capacity: 4-24 VMs per zone and type (uniform); 0 during stock-outs.
Traces:
- `calm.csv` (48 h): volatility 0.08 per sqrt(h), no events.
- `volatile.csv` (48 h): volatility 0.25 per sqrt(h), and a market that turns against whatever
  is cheapest per token at the start (8×H100 taken as 2.5× 8×A100): hours 3-9 that zone's spot
  prices climb to 85 % of on-demand (a demand surge); hours 12-16 a preemption storm in its
  region (3 per node-hour); hours 20-26 a stock-out of its whole region; hours 30-34 every spot
  price +40 %.
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
    path = HERE / f"{name}.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        w.writerows(rows)
    return path


if __name__ == "__main__":
    print(make("calm", 48, 0.08, seed=1, events=False))
    print(make("volatile", 48, 0.25, seed=2, events=True))
