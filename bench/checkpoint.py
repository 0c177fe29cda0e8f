"""Checkpoint cost: training stall (phase 1) against time until durable (phase 2), and phase-2
throughput against a plain single-stream boto3 upload of the same bytes.

    python bench/checkpoint.py [--width 384] [--layers 6] [--checkpoints 3] [--local-dir shm]

A real world (1 replica × 1 rank) of a model with >= 100 MB of training state (parameters, inner
AdamW, outer momentum) on the local Ray cluster saves to an S3 server (moto, on 127.0.0.1) while it
keeps training. For each checkpoint: stall_s (the driver waits for phase 1: the snapshot into
host memory; the DCP write to node-local storage runs beside training), durable_s (from the start of the save until the manifest is written), and phase-2 MB/s.
Then the same files go up once with `upload_file` and `TransferConfig(use_threads=False)` (one
stream, no parallel parts). Goal: stall <= 10% of time-to-durable.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--checkpoints", type=int, default=3)
    ap.add_argument("--local-dir", default=None, help="phase-1 directory (a path, or shm); default: temp dir")
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()

    import os

    from tests.servers.object_stores import MotoServer
    server = MotoServer()
    os.environ.update(AWS_ENDPOINT_URL=server.url, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")

    import boto3
    from boto3.s3.transfer import TransferConfig

    from elastic.recipe.model import load_recipe
    from elastic.record.events import CheckpointSaved, CheckpointUploaded
    from elastic.record.ledger import Ledger, read_events
    from elastic.run.cluster import LocalCluster
    from elastic.storage import checkpoint as ckpt
    from elastic.train.world import World

    recipe = load_recipe(REPO / "recipes/local-tiny.yaml", [
        f"model.width={args.width}", f"model.layers={args.layers}", "model.heads=6", "model.context=64",
        "train.batch_size=1", "train.seq_len=32", "train.inner_steps=2", "train.outer_steps=1000",
        "world.replicas=1", "world.min_replicas=1", "world.step_timeout_s=600"])
    cluster = LocalCluster()
    tmp = Path(tempfile.mkdtemp(prefix="elastic-bench-ckpt-"))
    uri = f"s3://bench-{uuid.uuid4().hex[:8]}/run"
    ledger = Ledger(tmp / "events.jsonl")
    staging = ckpt.staging_root(args.local_dir, tmp.name, uri)
    saver = ckpt.Checkpointer(uri, staging, keep_last=args.checkpoints + 1, threads=args.threads, ledger=ledger,
                              run="bench", run_dir=tmp)
    world = World(recipe)
    try:
        node = cluster.add_node(cpus=1, gpus=0, labels={}, resources={}, object_store_bytes=200 * 1024 * 1024)
        world.add_replicas([("vm0", node)])
        world.run_step()
        rows = []
        for _ in range(args.checkpoints):
            t0 = time.monotonic()
            saver.save(world, world.lead_replica(), recipe)
            steps = 0
            while saver.uploading is not None:   # training goes on while phase 2 runs
                world.run_step()
                steps += 1
                saver.poll()
            rows.append({"durable_s": time.monotonic() - t0, "steps_during_upload": steps})
            world.run_step()
        # Once more with training paused: phase 2 alone, for the throughput comparison.
        saver.save(world, world.lead_replica(), recipe)
        saver.wait()
        events = read_events(tmp / "events.jsonl")
        stalls = [e["stall_s"] for e in events if e["type"] == CheckpointSaved.TYPE][:args.checkpoints]
        writes = [e["write_s"] for e in events if e["type"] == CheckpointSaved.TYPE][:args.checkpoints]
        uploads = [e for e in events if e["type"] == CheckpointUploaded.TYPE]
        assert len(uploads) == args.checkpoints + 1, events
        alone = uploads.pop()
        state_bytes = uploads[-1]["bytes"]

        # Baseline: the same files, one stream, one after another, to the same server.
        store = saver.storage
        files = sorted(store.list(ckpt.step_name(alone["step"])).items())
        local = tmp / "baseline"
        local.mkdir()
        for name, _ in files:
            store.read_file(name, local / Path(name).name)
        client = boto3.session.Session().client("s3")
        single = TransferConfig(use_threads=False, multipart_threshold=1 << 40)
        t0 = time.monotonic()
        for name, _ in files:
            client.upload_file(str(local / Path(name).name), store.bucket, f"baseline/{name}", Config=single)
        baseline_s = time.monotonic() - t0
    finally:
        world.shutdown()
        saver.close()   # the run's staging directory, as a run's end removes it
        cluster.shutdown()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"training state per checkpoint: {state_bytes / 1e6:.1f} MB (width {args.width}, layers {args.layers}), "
          f"phase 1 to {staging}")
    print(f"{'#':>2} {'stall_s':>8} {'(write_s)':>9} {'durable_s':>10} {'stall/durable':>14} {'phase2 MB/s':>12} {'steps meanwhile':>16}")
    for i, (row, stall, write, up) in enumerate(zip(rows, stalls, writes, uploads)):
        print(f"{i:>2} {stall:>8.2f} {write:>9.2f} {row['durable_s']:>10.2f} {stall / row['durable_s']:>14.3f} "
              f"{up['mb_per_s']:>12.1f} {row['steps_during_upload']:>16}")
    med_stall = statistics.median(stalls)
    med_durable = statistics.median(r["durable_s"] for r in rows)
    med_phase2 = statistics.median(u["mb_per_s"] for u in uploads)
    base_mbs = state_bytes / 1e6 / baseline_s
    print(f"median stall/durable: {med_stall / med_durable:.3f} (goal <= 0.10)")
    print(f"phase 2 while training: {med_phase2:.1f} MB/s; alone: {alone['mb_per_s']:.1f} MB/s; "
          f"single-stream upload_file: {base_mbs:.1f} MB/s (alone / single-stream = {alone['mb_per_s'] / base_mbs:.2f}; "
          f"phase 2 also hashes every byte)")


if __name__ == "__main__":
    main()
