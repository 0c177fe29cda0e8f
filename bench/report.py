"""Cost of the report views on a long ledger, against reading the ledger itself, in the same run.

    python bench/report.py [--hours 24] [--vms 4] [--repeat 3]

Writes a synthetic ledger of a long run (`--vms` spot VMs held at once, each replaced every
simulated half hour, a `node_price` every 10 s per VM, an outer step every 30 s, a checkpoint every
10 outer steps), then times, best of `--repeat`: read_events (the baseline), build_report,
render_html, and cost_so_far (what the driver and `elastic status` call each outer step / refresh).
Prints seconds and ratios to read_events; passes or fails nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def synthetic_ledger(path: Path, hours: float, vms: int) -> int:
    rng = random.Random(0)
    t0, end = 1_700_000_000.0, 1_700_000_000.0 + hours * 3600
    events = [{"t": t0, "type": "run_started", "run": "bench", "recipe": "bench", "recipe_digest": "0" * 16,
               "target_replicas": vms, "ranks_per_replica": 1}]
    n = 0
    for slot in range(vms):
        t = t0 + slot
        while t < end:
            n += 1
            iid, life = f"i-{n:06d}", 1800.0
            price = 1.0 + rng.random()
            events.append({"t": t, "type": "node_launched", "instance_id": iid, "ray_node_id": iid, "role": "replica",
                           "cloud": rng.choice(["aws", "gcp"]), "region": f"r{slot % 2}", "zone": f"r{slot % 2}a",
                           "instance_type": "g5.xlarge", "gpu": "A10G", "gpus": 1, "cpus": 4, "spot": True,
                           "usd_per_hour": price, "on_demand_usd_per_hour": 3.0})
            events.append({"t": t + 60, "type": "replica_joined", "replica": n, "instance_id": iid, "outer_step": 1})
            for k in range(1, int(life / 10)):
                price *= 1 + rng.gauss(0, 0.01)
                events.append({"t": t + 10 * k, "type": "node_price", "instance_id": iid, "usd_per_hour": round(price, 6)})
            events.append({"t": min(t + life, end), "type": "node_preempted", "instance_id": iid})
            events.append({"t": min(t + life, end), "type": "replica_lost", "replica": n, "instance_id": iid,
                           "reason": "preempted", "phase": "inner", "lost_inner_steps": 100})
            t += life
    step, t = 0, t0 + 90
    while t < end:
        step += 1
        events.append({"t": t, "type": "outer_step", "outer_step": step, "inner_step": 100 * step, "epoch": 0,
                       "replicas": list(range(vms)), "losses": [3.0] * 100, "tokens": 10_000,
                       "tokens_total": 10_000 * step, "inner_s": 28.0, "sync_s": 2.0, "bytes_sent": 10**8})
        if step % 10 == 0:
            events.append({"t": t + 1, "type": "checkpoint_saved", "step": step, "path": f"/c/{step}",
                           "bytes": 10**9, "stall_s": 1.0})
        t += 30
    events.sort(key=lambda e: e["t"])
    events.append({"t": end, "type": "run_ended", "status": "completed", "wall_s": end - t0})
    path.write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")
    return len(events)


def best(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hours", type=float, default=24)
    p.add_argument("--vms", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()

    from elastic.ledger import read_events
    from elastic.report import build_report, cost_so_far
    from elastic.report_html import render_html

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "events.jsonl"
        n = synthetic_ledger(path, args.hours, args.vms)
        events = read_events(path)
        report = build_report(events)
        html = render_html(events, report)
        base = best(lambda: read_events(path), args.repeat)
        rows = [("read_events (baseline)", base),
                ("build_report", best(lambda: build_report(events), args.repeat)),
                ("render_html", best(lambda: render_html(events, report), args.repeat)),
                ("cost_so_far", best(lambda: cost_so_far(events, events[-1]["t"]), args.repeat))]
        print(f"ledger: {n:,} events, {path.stat().st_size / 1e6:.1f} MB; {len(report['instances'])} VMs; "
              f"report.html {len(html) / 1e3:.0f} kB")
        for name, s in rows:
            print(f"{name:24s} {s:8.3f} s   × {s / base:5.2f}")


if __name__ == "__main__":
    main()
