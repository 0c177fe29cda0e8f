"""Convert real, public AWS spot availability traces into the simulator's market CSV
(`bench/traces/real/*.csv`). Deterministic: running it again writes the same files.

    python bench/traces/convert_real.py [--sources DIR] [--out DIR]

Inputs (copied unchanged into `bench/traces/sources/`; their origin in bench/traces/README.md; each
file's git blob id is checked against the one it has at the source commit, so a changed input fails):
- `sources/spot-traces/...json`: the traces published with "Can't Be Late" (Wu et al., NSDI'24),
  github.com/skypilot-org/spot-traces at commit 221da1ab9bdfe7966da296265d7694d52dc0c5a6. Each is
  `{"metadata": {"gap_seconds": G}, "data": [n0, n1, ...]}`: every G seconds, how many VMs of one
  instance type the probe could hold in one zone (at most 1 for the 1-node traces, 4 or 16 for the
  multi-node ones).
- `sources/aws-spot-prices-2022-05-31-p3.tsv`: the AWS spot prices of p3.2xlarge and p3.16xlarge
  (Linux/UNIX, by AZ id) in us-east-1, us-east-2 and us-west-2 on 2022-05-31 18:20-24:00 UTC, the
  rows of `prices/2022/05.tsv.zst` in github.com/ericpauley/aws-spot-price-history at commit
  99042f7b01c979f36cc5cbbb07ed522952693cdd (the `describe-spot-price-history` archive; no later
  month of it can be fetched from GitHub any more).

Mapping, per (zone, instance type), one trace tick k at a time (t_k = k x gap_seconds):
- capacity at t_k = the published count n_k (VMs the zone gave the probe then).
- preempt_per_hour over [t_k, t_k+1) = the hazard under which each VM held at t_k survives the
  tick with probability n_k+1 / n_k when the count drops (n_k+1 < n_k), so a drop of availability
  takes its share of the held VMs in the tick it happened in: ln(n_k / n_k+1) / (gap_seconds / 3600),
  and, when it drops to 0 (or the hazard would exceed it), `providers.simmarket.TRACE_MAX`'s 60 per
  node-hour (95 % of held VMs gone in a 3-minute tick, 99 % in 5 minutes); the same 60 while the
  count is 0 (n_k = 0: the zone gave the probe no VM, so none is held there: a VM the simulator
  still holds, launched late in the tick of the drop or drawn a long life through it, goes too).
  0 when the count does not drop: these traces record no preemption apart from a drop.
- spot_usd_per_hour: constant. The only real price series reachable for p3 (the 2022-05-31 snapshot
  above) shows p3.2xlarge at $0.918/h in every AZ of the three regions that offers it below
  on-demand (one AZ of us-east-1 stands at the $3.06 on-demand price), i.e. 0.300 x on-demand;
  AWS prices spot "gradually" (about 5 % a week, Can't Be Late): the trace takes each region's
  median of the snapshot's p3.2xlarge prices ($0.918/h in all three); p3.16xlarge (8 x V100) in
  us-west-2, the median of its three AZs ($8.12, $9.79, $10.15): $9.79/h = 0.400 x on-demand.
  Zone names (us-east-1a) are mapped to AZ ids (use1-az2) per AWS account, so a zone's own price
  cannot be told.
- on_demand_usd_per_hour: $3.06/h for p3.2xlarge and $24.48/h for p3.16xlarge in us-east-1,
  us-east-2 and us-west-2 (AWS EC2 On-Demand pricing, Linux; the same in SkyPilot's public
  catalog, skypilot-org/skypilot-catalog).
- Time: 0 is the start of the collection; every zone of one trace is cut at the shortest zone's end
  (past the last row the simulator holds it for ever). A row is written at 0 and whenever the
  capacity or the hazard changes (a row holds until the next, so this is the same market as a row
  every tick, at a fraction of the size).

Traces written (AWS; p3.2xlarge, 1 x V100, but for the one named v100x8):
- `aws-v100-3zones.csv`: availability/16-node/aws-08-27-2023 (us-east-2b, us-west-2a, us-west-2c;
  up to 16 VMs each, 5-minute ticks, 11.3 days from 2023-08-27).
- `aws-v100-9zones.csv`: availability/1-node/aws-02-15-2023 (all 9 zones of us-east-1, us-east-2
  and us-west-2 it probed; 1 VM each, 195-second ticks, 45.5 days from 2023-02-15).
- `aws-v100-2zones-2022.csv`: availability/1-node/aws-10-26-2022, the p3.2xlarge files (us-west-2a,
  us-west-2b; 1 VM each, 10-minute ticks, 27 days from 2022-10-26).
- `aws-v100x8-2zones-2022.csv`: availability/1-node/aws-10-26-2022, the p3.16xlarge (8 x V100)
  files (us-west-2a, us-west-2b; 1 VM each, 10-minute ticks, 27 days from 2022-10-26).
- `aws-v100-3zones-4node.csv`: preemption/4-node/aws-08-03-2023 (us-east-1f, us-east-2a,
  us-west-2c; a probe holding 4 VMs per zone and relaunching the lost ones: the count running is
  read as the capacity, as above; 5-minute ticks, 12.7 days from 2023-08-03).
- `aws-v100-4zones.csv`: preemption/1-node/aws-04-22-2023, the V100 files (us-east-1c, us-east-1f,
  us-west-2b, us-west-2c; a probe holding one VM per zone and relaunching it when lost, read as the
  4-node one is; 32-second ticks, 7.4 days from 2023-04-22). A tick is short beside the 60-per-hour
  hazard: a VM survives a one-tick outage 59 % of the time, but 3 of the 206 outages last one tick
  (median 18-32 minutes by zone), and one held through 5 minutes of a zone at 0 survives 0.7 %.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from providers.simmarket import TRACE_COLUMNS, TRACE_MAX, read_trace_rows  # noqa: E402

HERE = Path(__file__).resolve().parent
SPOT_TRACES_COMMIT = "221da1ab9bdfe7966da296265d7694d52dc0c5a6"
PRICES_FILE = "aws-spot-prices-2022-05-31-p3.tsv"
ON_DEMAND_USD_PER_HOUR = {"p3.2xlarge": 3.06, "p3.16xlarge": 24.48}
GPUS = {"p3.2xlarge": ("V100", 1), "p3.16xlarge": ("V100", 8)}

# Output file -> (instance type, [(zone, source path, git blob id at SPOT_TRACES_COMMIT)]).
TRACES = {
    "aws-v100-3zones.csv": ("p3.2xlarge", [
        ("us-east-2b", "availability/16-node/aws-08-27-2023/us-east-2b_v100_1.json",
         "c5a9098f07acdfcbd57dd0550313195297333658"),
        ("us-west-2a", "availability/16-node/aws-08-27-2023/us-west-2a_v100_1.json",
         "919451ad076299f2afe71664df1a24ce8f7a863a"),
        ("us-west-2c", "availability/16-node/aws-08-27-2023/us-west-2c_v100_1.json",
         "1fae202fc59352828bf6060c953e4879c1dc1609"),
    ]),
    "aws-v100-9zones.csv": ("p3.2xlarge", [
        (zone, f"availability/1-node/aws-02-15-2023/{zone}_v100_1.json", blob) for zone, blob in [
            ("us-east-1a", "3a9d6f1c15463fc5e230bdfd64349b8ff915b5b6"),
            ("us-east-1c", "51c1ce9d59a17a83e3f37453e711d59130de838b"),
            ("us-east-1d", "4c847dcff3eca6532610d086c6809c601affb4d9"),
            ("us-east-1f", "2b6a6f7c30491024e0c3fb8664daa21a835b8f58"),
            ("us-east-2a", "e474798c60f7d36045dba4df97007612da389aee"),
            ("us-east-2b", "bfd2c7898c6131eb4633a0d36ddcc8ac14b275d6"),
            ("us-west-2a", "bd09a7f4472eb5552496be119e254a7f67e05180"),
            ("us-west-2b", "4a3a3871ca8cbca56988b4faca85c94a31077df1"),
            ("us-west-2c", "857bd63a5e978d9ec69d0247c661c2c7b2020565"),
        ]]),
    "aws-v100-2zones-2022.csv": ("p3.2xlarge", [
        ("us-west-2a", "availability/1-node/aws-10-26-2022/us-west-2a_v100_1.json",
         "2fd913237e2591aac2a84582cc90f0b18c29a935"),
        ("us-west-2b", "availability/1-node/aws-10-26-2022/us-west-2b_v100_1.json",
         "ba17906d1d53a41f6b545f75dae0144064c13443"),
    ]),
    "aws-v100x8-2zones-2022.csv": ("p3.16xlarge", [
        ("us-west-2a", "availability/1-node/aws-10-26-2022/us-west-2a_v100_8.json",
         "22d42b3a8ad65ab4e7d6664e61d809edc38da77f"),
        ("us-west-2b", "availability/1-node/aws-10-26-2022/us-west-2b_v100_8.json",
         "437f1dc50e20dd12fbdee57d6665b18c6c94a875"),
    ]),
    "aws-v100-3zones-4node.csv": ("p3.2xlarge", [
        ("us-east-1f", "preemption/4-node/aws-08-03-2023/us-east-1f_v100_1.json",
         "4c3176a8367acc412208bc1591f753a2438bdf91"),
        ("us-east-2a", "preemption/4-node/aws-08-03-2023/us-east-2a_v100_1.json",
         "77934e9013dd1716d35af89b6e6a5d502ed7b91e"),
        ("us-west-2c", "preemption/4-node/aws-08-03-2023/us-west-2c_v100_1.json",
         "3ecc7939a031497f3c8971401347197e4f1a35bb"),
    ]),
    "aws-v100-4zones.csv": ("p3.2xlarge", [
        (zone, f"preemption/1-node/aws-04-22-2023/{zone}_v100_1.json", blob) for zone, blob in [
            ("us-east-1c", "db2f6b8aa5ea5de105dabbae191b8a715b2530da"),
            ("us-east-1f", "2c2ce080fa908bf418315fb96b2311907f035688"),
            ("us-west-2b", "19ee46a13f02344091893c904062f935e350f6e8"),
            ("us-west-2c", "c5505b242b1b181d26943025c29970c2e6881622"),
        ]]),
}

_AZ_ID_REGION = {"use1": "us-east-1", "use2": "us-east-2", "usw2": "us-west-2"}


def git_blob_id(data: bytes) -> str:
    """The id git gives a file of these bytes (so a copy can be checked against the source commit)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def read_series(path: Path, blob: str) -> tuple[float, list[int]]:
    """(gap_seconds, counts) of one spot-traces file, checked against its blob id at the source commit."""
    data = path.read_bytes()
    if git_blob_id(data) != blob:
        raise SystemExit(f"{path}: not the file of skypilot-org/spot-traces@{SPOT_TRACES_COMMIT[:7]} "
                         f"(blob {git_blob_id(data)}, expected {blob})")
    doc = json.loads(data)
    return float(doc["metadata"]["gap_seconds"]), [int(n) for n in doc["data"]]


def spot_usd_per_hour(prices_path: Path, instance_type: str) -> dict[str, float]:
    """Per region: the median of the snapshot's spot prices of `instance_type` (USD per hour)."""
    by_region: dict[str, list[float]] = {}
    with open(prices_path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f, delimiter="\t"):
            if row["instance_type"] == instance_type and row["product"] == "Linux/UNIX":
                region = _AZ_ID_REGION[row["az_id"].split("-")[0]]
                by_region.setdefault(region, []).append(float(row["spot_usd_per_hour"]))
    return {region: statistics.median(usd) for region, usd in by_region.items()}


def hazard_per_hour(n_now: int, n_next: int, gap_s: float) -> float:
    """Preemptions per node-hour over one tick in which the count goes from n_now to n_next: each
    held VM survives the tick with probability n_next / n_now (0 when the count does not drop);
    `TRACE_MAX`'s 60 when it drops to 0 and while it stays at 0 (no VM is held where the zone gives
    the probe none)."""
    cap = TRACE_MAX["preempt_per_hour"]
    if n_now == 0:
        return cap
    if n_next >= n_now:
        return 0.0
    if n_next == 0:
        return cap
    return round(min(cap, math.log(n_now / n_next) / (gap_s / 3600)), 4)


def zone_rows(zone: str, gap_s: float, counts: list[int], ticks: int) -> list[tuple[float, int, float]]:
    """(timestamp_s, capacity, preempt_per_hour) at 0 and at each change, over the first `ticks` ticks."""
    out: list[tuple[float, int, float]] = []
    for k in range(ticks):
        rate = hazard_per_hour(counts[k], counts[k + 1], gap_s) if k + 1 < len(counts) else 0.0
        if not out or (counts[k], rate) != out[-1][1:]:
            out.append((round(k * gap_s, 1), counts[k], rate))
    return out


def convert(name: str, sources: Path, out_dir: Path) -> tuple[Path, float]:
    """Write one trace; returns its path and its length in seconds (the shortest zone's)."""
    instance_type, zones = TRACES[name]
    spot = spot_usd_per_hour(sources / PRICES_FILE, instance_type)
    od = ON_DEMAND_USD_PER_HOUR[instance_type]
    gpu, gpus = GPUS[instance_type]
    series = {zone: read_series(sources / "spot-traces" / path, blob) for zone, path, blob in zones}
    end_s = min(gap * len(counts) for gap, counts in series.values())   # the shortest zone's end
    rows = []
    for zone, (gap, counts) in series.items():
        region = zone[:-1]
        for t, capacity, rate in zone_rows(zone, gap, counts, math.ceil(end_s / gap - 1e-9)):
            rows.append((t, "aws", region, zone, instance_type, gpu, gpus, spot[region], od, rate, capacity))
    rows.sort(key=lambda r: (r[0], r[3]))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(TRACE_COLUMNS)
        for r in rows:
            w.writerow([f"{r[0]:g}", *r[1:7], f"{r[7]:g}", f"{r[8]:g}", f"{r[9]:g}", r[10]])
    read_trace_rows(path)   # the simulator's reader accepts it (raises TraceError otherwise)
    return path, end_s


def describe(path: Path, end_s: float) -> str:
    """One line: zones, duration, share of time each zone had capacity, mean capacity, drops
    (`end_s`: the trace's length in seconds)."""
    rows = read_trace_rows(path)
    by_zone: dict[str, list] = {}
    for r in rows:
        by_zone.setdefault(r.zone, []).append(r)
    parts = []
    for zone, rs in sorted(by_zone.items()):
        spans = [(b.t if b is not None else end_s) - a.t for a, b in zip(rs, rs[1:] + [None])]
        up = sum(s for s, r in zip(spans, rs) if r.state.capacity) / end_s
        mean_cap = sum(s * r.state.capacity for s, r in zip(spans, rs)) / end_s
        drops = sum(1 for r in rs if r.state.preempt_per_hour > 0 and r.state.capacity)
        parts.append(f"{zone} {up:.0%} (mean {mean_cap:.1f} VMs, {drops} drops)")
    return f"{path.name}: {len(by_zone)} zones, {end_s / 86400:.1f} days, {len(rows)} rows; " + ", ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sources", type=Path, default=HERE / "sources", help="folder of the inputs")
    ap.add_argument("--out", type=Path, default=HERE / "real", help="where the traces go")
    args = ap.parse_args()
    for name in TRACES:
        print(describe(*convert(name, args.sources, args.out)))


if __name__ == "__main__":
    main()
