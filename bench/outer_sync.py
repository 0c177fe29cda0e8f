"""Final loss and bytes sent of the outer sync's codecs, on the same tokens and seeds.

    python bench/outer_sync.py [--width 128] [--layers 2] [--outer-steps 12] [--inner-steps 20]

Two DiLoCo replicas of local-tiny's model (grown by --width/--layers) train in this process at the
same time, on disjoint leases of the same data order; their outer sync is the project's own
`Fragments` (OuterState and codec per fragment) over a real gloo group on loopback (one thread per
replica, training concurrently, so a fragment's background sync meets its peer's). Every variant
starts from the same seed and sees the same tokens:

    float32, bfloat16, int8 + error feedback, int8 without, fp8 + error feedback,
    sparse (SparseLoCo: outer lr 1, no momentum) at density 0.03 and 0.01,
    fragments 4 (Streaming DiLoCo, float32 and int8)
    (`--only NAME ...` runs some of them).

For each: the loss of θ_outer on held-out samples at the end (and the last inner phase's training
loss), bytes each replica sent over the run, their ratio to float32, and the bytes a data-parallel
run would have sent for the same tokens (DDP: an all-reduce of the whole bfloat16 gradient every
inner step), and the seconds a replica spent in the sync's collectives: waited for by training,
or overlapped with inner steps (streamed fragments). Prints figures; passes or fails nothing.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = {
    "float32": {"world.sync_dtype": "float32"},
    "bfloat16": {"world.sync_dtype": "bfloat16"},
    "int8 + EF": {"world.sync_dtype": "int8"},
    "int8, no EF": {"world.sync_dtype": "int8", "world.error_feedback": False},
    "fp8 + EF": {"world.sync_dtype": "fp8"},
    # SparseLoCo: the accumulator stands in for outer momentum.
    "sparse 0.03": {"world.sync": "sparse", "world.sync_density": 0.03, "train.outer_momentum": 0.0,
                    "train.outer_lr": 1.0},
    "sparse 0.01": {"world.sync": "sparse", "world.sync_density": 0.01, "train.outer_momentum": 0.0,
                    "train.outer_lr": 1.0},
    # Streaming DiLoCo: the same bytes, synced a quarter at a time while training goes on.
    "fragments 4": {"world.fragments": 4},
    "fragments 4 + int8": {"world.fragments": 4, "world.sync_dtype": "int8"},
}
REPLICAS = 2


def recipe(args, overrides: dict):
    from elastic.recipe.model import load_recipe
    sets = {"model.width": args.width, "model.layers": args.layers, "model.heads": args.width // 32,
            "train.outer_steps": args.outer_steps, "train.inner_steps": args.inner_steps,
            "world.replicas": REPLICAS, **overrides}
    return load_recipe(REPO / "recipes/local-tiny.yaml", [f"{k}={v}" for k, v in sets.items()])


def run(r, data, eval_batches, store_port: int, epoch: int, tag: str) -> dict:
    """Train REPLICAS replicas of recipe `r` with DiLoCo, one thread each (a fragment's sync in the
    background needs its peers training at the same time), their outer group keyed by `epoch` (one
    per variant: a group never reads an earlier one's keys); returns losses, bytes sent and the
    seconds in the sync's collectives, waited for and overlapped."""
    from elastic.models import build_model
    from elastic.train.diloco import Fragments, OuterState
    from elastic.train.outer_sync import make_codec
    from elastic.train.replica import Schedule

    t, w, vocab = r.train, r.world, r.model.vocab_size
    schedule = Schedule.for_recipe(r)
    step_tokens = REPLICAS * t.batch_size * t.seq_len
    replicas = []
    for _ in range(REPLICAS):
        torch.manual_seed(t.seed)   # every replica starts from the same θ
        model = build_model(r.model)
        params = list(model.parameters())
        opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.inner_weight_decay},
                                 {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                lr=t.inner_lr, betas=t.inner_betas, foreach=True)
        outer = Fragments(params, w.fragments, t.inner_steps,
                          lambda ps: OuterState(ps, t.outer_lr, t.outer_momentum, t.outer_nesterov,
                                                lambda n: make_codec(n, w.sync, w.sync_dtype, w.error_feedback,
                                                                     w.sync_density, w.sync_decay)))
        replicas.append((model, params, opt, outer, dist.TCPStore("127.0.0.1", store_port, is_master=False)))
    per_replica = t.inner_steps * t.batch_size
    loopback = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    tally = [{"bytes": 0, "network_s": 0.0, "wait_s": 0.0, "overlapped_s": 0.0, "last": []} for _ in range(REPLICAS)]
    errors = []

    def train(i: int) -> None:
        model, params, opt, outer, store = replicas[i]
        try:
            for step in range(t.outer_steps):
                lease = (step * REPLICAS + i) * per_replica   # disjoint leases, as the world's
                outer.begin_phase(store, f"bench/{epoch}/{step}", (epoch, i, REPLICAS), 60, 0, loopback)
                last = tally[i]["last"] = []
                for h in range(t.inner_steps):
                    for g in opt.param_groups:
                        g["lr"] = schedule.lr((step * t.inner_steps + h) * step_tokens, step_tokens)
                    batch = data.batch(lease + h * t.batch_size, t.batch_size)
                    loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, vocab), batch[:, 1:].reshape(-1))
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(params, t.grad_clip, foreach=True)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    last.append(loss.item())
                    outer.after_inner_step(h + 1)
                outer.end_phase()
                if outer.pending:
                    outer.join_group(store, epoch, i, REPLICAS, 60, shard=0, device=loopback)
                outer.all_reduce(i, REPLICAS)
                outer.apply()
                tally[i]["bytes"] += outer.bytes_sent
                tally[i]["network_s"] += outer.network_s
                tally[i]["wait_s"] += outer.wait_s
                tally[i]["overlapped_s"] += outer.overlapped_s
        except BaseException as exc:
            errors.append(exc)
            raise

    t0 = time.monotonic()
    threads = [threading.Thread(target=train, args=(i,)) for i in range(REPLICAS)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    if errors:
        raise errors[0]
    train_s = time.monotonic() - t0
    model = replicas[0][0]
    with torch.no_grad():
        held_out = sum(F.cross_entropy(model(b[:, :-1]).reshape(-1, vocab), b[:, 1:].reshape(-1)).item()
                       for b in eval_batches) / len(eval_batches)
    theta = [o.theta.data for *_, o, _ in replicas]
    assert all(torch.equal(theta[0], th) for th in theta[1:]), f"{tag}: replicas disagree on θ"
    params = sum(p.numel() for p in replicas[0][1])
    last = [x for tl in tally for x in tl["last"]]
    return {"eval": held_out, "train": sum(last) / len(last), "bytes": tally[0]["bytes"],
            "network_s": max(tl["network_s"] for tl in tally), "wait_s": max(tl["wait_s"] for tl in tally),
            "overlapped_s": max(tl["overlapped_s"] for tl in tally),
            "train_s": train_s, "params": params, "tokens": REPLICAS * t.outer_steps * per_replica * t.seq_len}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--outer-steps", type=int, default=12)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="variant names to run (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from elastic.train.data import SampleStream, load_tokens

    base = recipe(args, {})
    t = base.train
    data = SampleStream(load_tokens(base.data.path, base.data.corpus_bytes), t.seq_len, t.seed)
    # Held out: samples past every lease of the run (the same for every variant).
    first = 2 * REPLICAS * t.outer_steps * t.inner_steps * t.batch_size
    eval_batches = [data.batch(first + i * 32, 32) for i in range(8)]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    results = {}
    for i, (name, overrides) in enumerate(VARIANTS.items()):
        if args.only and name not in args.only:
            continue
        res = results[name] = run(recipe(args, overrides), data, eval_batches, store.port, i, name)
        print(f"  {name}: eval {res['eval']:.4f}, {res['bytes']:,} bytes, {res['train_s']:.0f} s", flush=True)

    ref = results.get("float32")
    p = next(iter(results.values()))
    ddp = t.outer_steps * t.inner_steps * 2 * (REPLICAS - 1) * p["params"] * 2 // REPLICAS
    print(f"\nmodel {p['params']:,} parameters ({args.layers} layers × width {args.width}), {REPLICAS} replicas, "
          f"H = {t.inner_steps}, {t.outer_steps} outer steps, {p['tokens']:,} tokens; "
          f"data-parallel would send {ddp:,} bytes per replica\n")
    print("| sync | held-out loss | vs float32 | last train loss | bytes sent per replica | float32 / this | "
          "DDP / this | sync s | waited s | overlapped s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        vs = f"{100 * (r['eval'] / ref['eval'] - 1):+.2f} %" if ref else "–"
        ratio = f"{ref['bytes'] / r['bytes']:.1f}×" if ref else "–"
        print(f"| {name} | {r['eval']:.4f} | {vs} | {r['train']:.4f} | {r['bytes']:,} | {ratio} | "
              f"{ddp / r['bytes']:,.0f}× | {r['network_s']:.2f} | {r['wait_s']:.2f} | "
              f"{r['overlapped_s']:.2f} |")


if __name__ == "__main__":
    main()
