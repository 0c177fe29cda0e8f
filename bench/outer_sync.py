"""Final loss and bytes sent of the outer sync's codecs, on the same tokens and seeds.

    python bench/outer_sync.py [--width 128] [--layers 2] [--outer-steps 12] [--inner-steps 20]

Two DiLoCo replicas of local-tiny's model (grown by --width/--layers) train in this process, one
after the other, on disjoint leases of the same data order; their outer sync is the project's own
`OuterState` and codec over a real gloo group on loopback (one thread per replica). Every variant
starts from the same seed and sees the same tokens:

    float32, bfloat16, int8 + error feedback, int8 without, fp8 + error feedback,
    sparse (SparseLoCo: outer lr 1, no momentum) at density 0.03 and 0.01
    (`--only NAME ...` runs some of them).

For each: the loss of θ_outer on held-out samples at the end (and the last inner phase's training
loss), bytes each replica sent over the run, their ratio to float32, and the bytes a data-parallel
run would have sent for the same tokens (DDP: an all-reduce of the whole bfloat16 gradient every
inner step). Prints figures; passes or fails nothing.
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
}
REPLICAS = 2


def recipe(args, overrides: dict):
    from elastic.recipe import load_recipe
    sets = {"model.width": args.width, "model.layers": args.layers, "model.heads": args.width // 32,
            "train.outer_steps": args.outer_steps, "train.inner_steps": args.inner_steps,
            "world.replicas": REPLICAS, **overrides}
    return load_recipe(REPO / "recipes/local-tiny.yaml", [f"{k}={v}" for k, v in sets.items()])


def run(r, data, eval_batches, store_port: int, epoch: int, tag: str) -> dict:
    """Train REPLICAS replicas of recipe `r` with DiLoCo, their outer group keyed by `epoch` (one
    per variant: a group never reads an earlier one's keys); returns losses and bytes sent."""
    from elastic.diloco import OuterState
    from elastic.models import build_model
    from elastic.outer_sync import make_codec
    from elastic.replica import lr_at

    t, w, vocab = r.train, r.world, r.model.vocab_size
    replicas = []
    for _ in range(REPLICAS):
        torch.manual_seed(t.seed)   # every replica starts from the same θ
        model = build_model(r.model)
        params = list(model.parameters())
        opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.inner_weight_decay},
                                 {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                lr=t.inner_lr, betas=t.inner_betas, foreach=True)
        outer = OuterState(params, t.outer_lr, t.outer_momentum, t.outer_nesterov,
                           lambda n: make_codec(n, w.sync, w.sync_dtype, w.error_feedback, w.sync_density, w.sync_decay))
        replicas.append((model, params, opt, outer, dist.TCPStore("127.0.0.1", store_port, is_master=False)))
    total = t.outer_steps * t.inner_steps
    cursor, sent, network_s, last = 0, 0, 0.0, []
    t0 = time.monotonic()
    for step in range(t.outer_steps):
        last = []
        for model, params, opt, outer, _ in replicas:
            lease, cursor = cursor, cursor + t.inner_steps * t.batch_size
            for h in range(t.inner_steps):
                for g in opt.param_groups:
                    g["lr"] = lr_at(step * t.inner_steps + h, t.inner_lr, t.warmup_steps, total)
                batch = data.batch(lease + h * t.batch_size, t.batch_size)
                loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, vocab), batch[:, 1:].reshape(-1))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, t.grad_clip, foreach=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
                last.append(loss.item())
            outer.form_pseudo_gradient()

        def sync(i):
            outer, store = replicas[i][3], replicas[i][4]
            outer.join_group(store, epoch, i, REPLICAS, 60, shard=0)
            outer.all_reduce(i, REPLICAS)

        threads = [threading.Thread(target=sync, args=(i,)) for i in range(REPLICAS)]
        [th.start() for th in threads]
        [th.join() for th in threads]
        for _, _, _, outer, _ in replicas:
            outer.apply()
        sent += replicas[0][3].bytes_sent
        network_s += replicas[0][3].network_s
    train_s = time.monotonic() - t0
    model = replicas[0][0]
    with torch.no_grad():
        held_out = sum(F.cross_entropy(model(b[:, :-1]).reshape(-1, vocab), b[:, 1:].reshape(-1)).item()
                       for b in eval_batches) / len(eval_batches)
    theta = [o.theta.data for *_, o, _ in replicas]
    assert all(torch.equal(theta[0], th) for th in theta[1:]), f"{tag}: replicas disagree on θ"
    params = sum(p.numel() for p in replicas[0][1])
    return {"eval": held_out, "train": sum(last) / len(last), "bytes": sent, "network_s": network_s,
            "train_s": train_s, "params": params, "tokens": cursor * t.seq_len}


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

    from elastic.data import SampleStream, load_tokens

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
          "DDP / this |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        vs = f"{100 * (r['eval'] / ref['eval'] - 1):+.2f} %" if ref else "–"
        ratio = f"{ref['bytes'] / r['bytes']:.1f}×" if ref else "–"
        print(f"| {name} | {r['eval']:.4f} | {vs} | {r['train']:.4f} | {r['bytes']:,} | {ratio} | "
              f"{ddp / r['bytes']:,.0f}× |")


if __name__ == "__main__":
    main()
