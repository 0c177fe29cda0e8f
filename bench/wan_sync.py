"""How long replicas wait on the outer sync over a WAN link: fragments 1 vs 4, float32 vs int8.

The product path end to end: recipes/local-two-regions.yaml run by the real driver
(`run_attached`) over its network lab (providers/local/localnet.py), one replica of one rank in
each region, the two joined only by the WireGuard overlay, each region's uplink shaped to
`--rate-mbit` with `--delay-ms` one way (netem where the kernel has it, else the lab's userspace
delay relay on the overlay's UDP: said in the output). The model is the recipe's GPT grown to
`--width` × `--layers` (≥ 100 M parameters by default), trained on one CPU core per replica.

Per variant, from the run's ledger: the training phase's wall time (the first `world_formed` to
the last `outer_step`), the seconds replicas waited on the outer sync (`outer_step.wait_s`, summed)
and their share of it, the seconds a streamed sync ran beside inner steps (`overlapped_s`), bytes
a replica sent, and data-parallel's bytes per token over this run's (the report's figure). Shares
are given over all outer steps and without the first (whose inner phase also holds the first
steps' warm-up: allocator, thread pools, the first handshakes over the long link).

    sudo python bench/wan_sync.py [--variants f1-fp32 f4-int8] [--inner-steps 48] [--outer-steps 2]

Each variant runs in a process of its own (Ray starts and stops once per variant).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = {
    "f1-fp32": {"world.fragments": 1, "world.sync_dtype": "float32"},
    "f4-int8": {"world.fragments": 4, "world.sync_dtype": "int8"},
    "f1-int8": {"world.fragments": 1, "world.sync_dtype": "int8"},
    "f4-fp32": {"world.fragments": 4, "world.sync_dtype": "float32"},
}


def overrides(args, variant: str) -> dict:
    """The recipe overrides of one variant: the model, the schedule, the links, no preemptions."""
    out = {"model.width": args.width, "model.layers": args.layers, "model.heads": args.width // 64,
           "model.context": args.seq_len, "train.seq_len": args.seq_len, "train.batch_size": args.batch,
           "train.inner_steps": args.inner_steps, "train.outer_steps": args.outer_steps,
           "train.warmup_steps": 1, "world.min_replicas": 2, "checkpoint.every_outer_steps": 0,
           "local.market.preempt_per_hour": 0, "budget.max_usd": 100}
    for region in ("region-a", "region-b"):
        out[f"local.network.links.{region}.rate_mbit"] = args.rate_mbit
        out[f"local.network.links.{region}.delay_ms"] = args.delay_ms
    return {**out, **VARIANTS[variant]}


def run_variant(run_dir: str, overrides_: dict) -> dict:
    """One run (in this process); the figures of its ledger."""
    from elastic.recipe.model import load_recipe
    from elastic.record.events import LinkMeasured, OuterStep, WorldFormed
    from elastic.run.cluster import LocalCluster
    from elastic.run.driver import run_attached
    from elastic.views.report import build_report
    from providers.local.provider import LocalProvider

    recipe = load_recipe(REPO / "recipes" / "local-two-regions.yaml", [f"{k}={v}" for k, v in overrides_.items()])
    network = LocalProvider.start_network(recipe)
    delay_by = network.lab.delay_by
    cluster = LocalCluster(node_ip=network.head_ip, network=network)
    try:
        status, events = run_attached(recipe, cluster, Path(run_dir), run_name="wan-sync")
    finally:
        cluster.shutdown()
    formed = next(e for e in events if e["type"] == WorldFormed.TYPE)
    steps = [e for e in events if e["type"] == OuterStep.TYPE]
    links = [e for e in events if e["type"] == LinkMeasured.TYPE]
    sync = build_report(events)["sync"]
    return {"status": status, "delay_by": delay_by, "params": formed["params"],
            "start_t": formed["t"], "steps": [{k: e[k] for k in ("t", "inner_s", "sync_s", "wait_s", "overlapped_s",
                                                                  "network_s", "bytes_sent", "tokens")}
                                              for e in steps],
            "vs_ddp": sync["vs_ddp"], "bytes_per_token": sync["bytes_per_token"],
            "ddp_bytes_per_token": sync["ddp_bytes_per_token"],
            "link": [{"rtt_ms": e["rtt_ms"], "mbit_s": e["mbit_s"]} for e in links]}


def share(res: dict, skip_first: bool) -> tuple[float, float, float]:
    """(wall s, waited s, overlapped s) of the training phase, without the first outer step if asked."""
    steps = res["steps"]
    start = steps[0]["t"] if skip_first else res["start_t"]
    kept = steps[1:] if skip_first else steps
    return steps[-1]["t"] - start, sum(s["wait_s"] for s in kept), sum(s["overlapped_s"] for s in kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="*", default=["f1-fp32", "f4-int8"], choices=list(VARIANTS))
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--inner-steps", type=int, default=48)
    ap.add_argument("--outer-steps", type=int, default=2)
    ap.add_argument("--rate-mbit", type=float, default=200)
    ap.add_argument("--delay-ms", type=float, default=50, help="one way, each region's uplink")
    ap.add_argument("--out", help="where the runs' directories go (default: a new temporary directory)")
    ap.add_argument("--worker", nargs=2, metavar=("RUN_DIR", "OVERRIDES_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(run_variant(args.worker[0], json.loads(args.worker[1]))), flush=True)
        return

    results = {}
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="wan-sync-"))
    print(f"run directories (ledgers) under {out_dir}", flush=True)
    for name in args.variants:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, __file__, "--worker", str(out_dir / name),
                               json.dumps(overrides(args, name))], capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0 or not proc.stdout.strip():
            sys.exit(f"{name}: the run failed:\n{proc.stderr[-3000:]}")
        res = results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"  {name}: {res['status']}, {time.monotonic() - t0:.0f} s", flush=True)

    first = next(iter(results.values()))
    print(f"\nmodel {first['params']:,} parameters ({args.layers} layers × width {args.width}), 2 replicas "
          f"(one per region, 1 rank, 1 CPU core each), H = {args.inner_steps}, {args.outer_steps} outer steps, "
          f"batch {args.batch} × {args.seq_len} tokens; links {args.rate_mbit:g} Mbit/s + {args.delay_ms:g} ms "
          f"one way per region (delay by {first['delay_by']}); measured by the joiners over the overlay: "
          + ", ".join(f"{m['mbit_s']:.0f} Mbit/s RTT {m['rtt_ms']:.0f} ms" for m in first["link"]) + "\n")
    for name, res in results.items():
        print(f"{name} per outer step (inner s, blocking sync s, waited s, overlapped s): "
              + "; ".join(f"{s['inner_s']:.0f}, {s['sync_s']:.1f}, {s['wait_s']:.1f}, {s['overlapped_s']:.1f}"
                          for s in res["steps"]))
    print()
    print("| variant | inner phase s / step | wall s | waited s | waited / wall | waited / wall (steps 2+) | "
          "overlapped s | sync s (blocking, per step) | bytes sent per replica per step | DDP / this (bytes/token) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, res in results.items():
        wall, waited, overlapped = share(res, skip_first=False)
        wall2, waited2, _ = share(res, skip_first=True)
        steps = res["steps"]
        per_step = sum(s["inner_s"] for s in steps) / (len(steps) * args.inner_steps)
        print(f"| {name} | {per_step:.2f} | {wall:.0f} | {waited:.1f} | {100 * waited / wall:.1f} % | "
              + (f"{100 * waited2 / wall2:.1f} %" if len(steps) > 1 else "–")
              + f" | {overlapped:.1f} | {sum(s['sync_s'] for s in steps) / len(steps):.1f} | "
              f"{sum(s['bytes_sent'] for s in steps) // len(steps):,} | {res['vs_ddp']:,.0f}× |")


if __name__ == "__main__":
    main()
