"""How much the replicas' sparse supports overlap: the figure that decides whether an exchange of
the union of top-k supports could beat the sparse sync's all-gather (docs/benchmarks.md, "Outer
sync codecs").

    python bench/sparse_overlap.py [--replicas 2 4 8] [--outer-steps 8] [--inner-steps 20] [--density 0.03]

n replicas of local-tiny's model start from the same θ, each trains H inner steps on its own lease
of the same data order, and each runs the product's sparse codec (`elastic.train.outer_sync.Sparse`:
chunk-wise top-k of its decayed error-feedback accumulator) on its pseudo-gradient; the average of
their decoded rows is applied with SparseLoCo's outer step (lr 1, no momentum), as the world does.
At every outer step the union U of the n supports is counted: the all-gather moves (n − 1)·k
entries per replica, a union exchange (chunk owners sum and send back) at least (n − 1)/n·|U|, each
entry an index and a sum (6 bytes in float32 against the all-gather's 2.25), so it sends fewer bytes
only while |U| / (n·k) < 0.375. Runs in one process, replicas one after the other (no network: the
supports do not depend on it). Prints figures; passes or fails nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

UNION_BREAK_EVEN = 2.25 / 6   # a union entry's bytes (int16 index + float32 sum) against an all-gathered one's


def supports(codec, delta: torch.Tensor, decay: float, chunk: int) -> torch.Tensor:
    """The flat indices the codec's top-k picks for `delta` (its own rule: top-k of |accumulator| per
    chunk), read before its `reduce` changes anything."""
    n = delta.numel()
    v = torch.zeros(-(-n // chunk) * chunk)
    v[:n] = codec.error * decay + delta
    v = v.view(-1, chunk)
    top = torch.topk(v.abs(), codec.k, dim=1, sorted=False).indices
    return (top + torch.arange(v.shape[0]).unsqueeze(1) * chunk).flatten()


def run(n: int, args) -> list[float]:
    from elastic.models import build_model
    from elastic.recipe.model import load_recipe
    from elastic.train.data import SampleStream, load_tokens
    from elastic.train.outer_sync import CHUNK, Sparse

    r = load_recipe(REPO / "recipes/local-tiny.yaml", [f"train.inner_steps={args.inner_steps}"])
    t, vocab = r.train, r.model.vocab_size
    data = SampleStream(load_tokens(r.data.path, r.data.corpus_bytes), t.seq_len, t.seed)
    torch.manual_seed(t.seed)
    model = build_model(r.model)
    params = list(model.parameters())
    theta = torch.cat([p.detach().flatten() for p in params]).clone()
    codecs = [Sparse(theta.numel(), args.density, r.world.sync_decay) for _ in range(n)]
    shares = []
    for step in range(args.outer_steps):
        rows, picked = [], []
        for i in range(n):
            torch.nn.utils.vector_to_parameters(theta.clone(), params)   # the parameters become views of it
            opt = torch.optim.AdamW(params, lr=t.inner_lr, betas=t.inner_betas)
            lease = (step * n + i) * t.inner_steps * t.batch_size   # disjoint leases, as the world's
            for h in range(t.inner_steps):
                batch = data.batch(lease + h * t.batch_size, t.batch_size)
                loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, vocab), batch[:, 1:].reshape(-1))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
            delta = theta - torch.nn.utils.parameters_to_vector(params).detach()
            picked.append(supports(codecs[i], delta, r.world.sync_decay, CHUNK))
            own, _, _ = codecs[i].reduce(None, delta, i, 1)
            rows.append(own.clone())
            codecs[i].commit()
        theta -= torch.stack(rows).mean(dim=0)   # SparseLoCo: outer lr 1, no momentum
        union = torch.unique(torch.cat(picked)).numel()
        shares.append(union / sum(p.numel() for p in picked))
        print(f"  n={n} outer step {step + 1}: |U| / (n·k) = {shares[-1]:.3f} (last inner loss {loss.item():.3f})",
              flush=True)
    return shares


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--outer-steps", type=int, default=8)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--density", type=float, default=0.03)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"| replicas n | mean |U| / (n·k), outer steps 2-{args.outer_steps} | union exchange pays "
          f"(below {UNION_BREAK_EVEN:.3f}) |\n| --- | ---: | --- |")
    for n in args.replicas:
        shares = run(n, args)
        mean = sum(shares[1:]) / max(1, len(shares) - 1)
        print(f"| {n} | {mean:.3f} | {'yes' if mean < UNION_BREAK_EVEN else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
