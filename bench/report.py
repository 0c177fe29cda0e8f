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
    from elastic.record.events import (CheckpointSaved, NodeLaunched, NodePreempted, NodePrice, OuterStep, ReplicaJoined,
                                ReplicaLost, RunEnded, RunStarted)

    rng = random.Random(0)
    t0, end = 1_700_000_000.0, 1_700_000_000.0 + hours * 3600
    events = [RunStarted(run="bench", recipe="bench", recipe_digest="0" * 16, target_replicas=vms,
                         ranks_per_replica=1).record(t0)]
    n = 0
    for slot in range(vms):
        t = t0 + slot
        while t < end:
            n += 1
            iid, life = f"i-{n:06d}", 1800.0
            price = 1.0 + rng.random()
            events.append(NodeLaunched(instance_id=iid, ray_node_id=iid, role="replica", launched_at=t, joined=True,
                                       cloud=rng.choice(["aws", "gcp"]), region=f"r{slot % 2}", zone=f"r{slot % 2}a",
                                       instance_type="g5.xlarge", gpu="A10G", gpus=1, cpus=4, spot=True,
                                       usd_per_hour=price, on_demand_usd_per_hour=3.0).record(t))
            events.append(ReplicaJoined(replica=n, instance_id=iid, outer_step=1, epoch=n, source="replica 0",
                                        setup_s=60.0).record(t + 60))
            for k in range(1, int(life / 10)):
                price *= 1 + rng.gauss(0, 0.01)
                events.append(NodePrice(instance_id=iid, usd_per_hour=round(price, 6)).record(t + 10 * k))
            gone = min(t + life, end)
            events.append(NodePreempted(instance_id=iid, with_notice=False, replica=n).record(gone))
            events.append(ReplicaLost(replica=n, instance_id=iid, reason="preempted", rule="preempted", phase="inner",
                                      lost_inner_steps=100, outer_step=0).record(gone))
            t += life
    step, t = 0, t0 + 90
    while t < end:
        step += 1
        events.append(OuterStep(outer_step=step, inner_step=100 * step, epoch=0, replicas=list(range(vms)),
                                losses=[3.0] * 100, tokens=10_000, tokens_total=10_000 * step, inner_s=28.0,
                                sync_s=2.0, bytes_sent=10**8, network_s=1.0, data_cursor=100 * step, steps_done={},
                                inner_s_by_replica={}).record(t))
        if step % 10 == 0:
            events.append(CheckpointSaved(step=step, stall_s=1.0, write_s=1.0, local=f"/c/{step}",
                                          replica=0).record(t + 1))
        t += 30
    events.sort(key=lambda e: e["t"])
    events.append(RunEnded(status="completed", wall_s=end - t0).record(end))
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

    from elastic.record.billing import cost_so_far
    from elastic.record.ledger import read_events
    from elastic.views.report import build_report
    from elastic.views.report_html import render_html

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
