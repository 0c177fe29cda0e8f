"""Data delivery: tokens/s one replica receives from token shards on an S3 server (moto, on
127.0.0.1) against the same shards memory-mapped from local disk (`file://`), cold and warm cache.

    python bench/data.py [--shards 8] [--shard-mtok 4] [--seq-len 2048] [--batch 16] [--inner-steps 50]

The replica's loop without the model: per inner phase `fetch` the lease's shards (downloading what
the node cache lacks), prefetch the next lease's in the background, then read every batch of the
phase into the int64 buffer the rank trains from. Cold: an empty cache; warm: the same leases
again with the shards cached. Tokens/s = trained tokens delivered / wall seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def deliver(stream, leases: list[int], lease: int, batch: int) -> float:
    """Seconds to deliver `leases` (each `lease` samples, read `batch` at a time) as a replica does."""
    import torch

    buf = torch.empty(batch, stream._seq_len + 1, dtype=torch.int64)
    t0 = time.perf_counter()
    for i, start in enumerate(leases):
        stream.fetch(start, lease)
        if i + 1 < len(leases):
            stream.prefetch(leases[i + 1], lease)
        for b in range(start, start + lease, batch):
            stream.batch(b, batch, out=buf)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--shard-mtok", type=float, default=4.0, help="million tokens per shard")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--leases", type=int, default=6, help="inner phases (leases) to deliver")
    ap.add_argument("--replicas", type=int, default=4, help="replicas the leases are spread over (this one reads every Nth)")
    args = ap.parse_args()

    import numpy as np

    from elastic.train.data import SampleStream, ShardIndex, ShardSource, upload_shards
    from tests.servers.object_stores import MotoServer

    server = MotoServer()
    os.environ.update(AWS_ENDPOINT_URL=server.url, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    work = Path(tempfile.mkdtemp(prefix="elastic-bench-data-"))
    try:
        n = int(args.shard_mtok * 1e6)
        rng = np.random.default_rng(0)
        files = {}
        for i in range(args.shards):
            f = work / "src" / f"train/{i:05d}.bin"
            f.parent.mkdir(parents=True, exist_ok=True)
            rng.integers(0, 150_000, n, dtype=np.uint32).tofile(f)
            files[f"train/{i:05d}.bin"] = f
        index = ShardIndex("uint32", 150_000, {"train": [(name, n) for name in files]}, {})
        s3 = f"s3://bench-{uuid.uuid4().hex[:8]}/tokens"
        t0 = time.perf_counter()
        upload_shards(s3, files, index)
        upload_s = time.perf_counter() - t0
        upload_shards(f"file://{work / 'src'}", {}, index)   # the index beside the local files
        lease = args.inner_steps * args.batch
        leases = [i * args.replicas * lease for i in range(args.leases)]
        tokens = len(leases) * lease * args.seq_len
        total_mb = args.shards * n * 4 / 1e6
        print(f"{args.shards} shards × {n:,} uint32 tokens ({total_mb:,.0f} MB) on moto S3 "
              f"(uploaded in {upload_s:.1f} s); {args.leases} leases of {args.inner_steps} × {args.batch} "
              f"sequences of {args.seq_len}, every {args.replicas}th lease of the run")

        def run(uri: str, cache: Path) -> tuple[float, int]:
            src = ShardSource(uri, "train", 1e12, cache_root=cache)
            stream = SampleStream(src, args.seq_len, seed=0)
            return deliver(stream, leases, lease, args.batch), len(src.downloaded)

        local_s, _ = run(f"file://{work / 'src'}", work / "cache-local")
        cold_s, fetched = run(s3, work / "cache-s3")
        warm_s, refetched = run(s3, work / "cache-s3")
        print(f"{'source':<32}{'seconds':>9}{'tokens/s':>14}{'vs memmap':>11}{'shards fetched':>16}")
        for name, secs, k in (("local memmap (file://)", local_s, 0), ("S3, cold cache", cold_s, fetched),
                              ("S3, warm cache", warm_s, refetched)):
            print(f"{name:<32}{secs:>9.2f}{tokens / secs:>14,.0f}{local_s / secs:>11.2f}{k:>16}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        server.stop()


if __name__ == "__main__":
    main()
